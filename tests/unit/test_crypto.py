"""The data plane's HMAC-SHA256 (its authenticated hello) comes from OpenSSL's libcrypto,
loaded at run time (csrc/crypto.cc): RFC 4231's test vectors through the module, and the
error a job with a secret gets where libcrypto cannot be loaded (what to install)."""
from __future__ import annotations

import pytest

from byteps_like import _core

# RFC 4231, test cases 1-7: (key, data, HMAC-SHA-256; case 5 truncated to 128 bits)
RFC4231 = [
    (b"\x0b" * 20, b"Hi There",
     "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"),
    (b"Jefe", b"what do ya want for nothing?",
     "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"),
    (b"\xaa" * 20, b"\xdd" * 50,
     "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe"),
    (bytes(range(1, 26)), b"\xcd" * 50,
     "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b"),
    (b"\x0c" * 20, b"Test With Truncation", "a3b6167473100ee06e0c796c2955552b"),
    (b"\xaa" * 131, b"Test Using Larger Than Block-Size Key - Hash Key First",
     "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"),
    (b"\xaa" * 131, b"This is a test using a larger than block-size key and a larger than "
     b"block-size data. The key needs to be hashed before being used by the HMAC algorithm.",
     "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2"),
]


@pytest.mark.parametrize("key,data,mac", RFC4231, ids=[f"case{i + 1}" for i in range(7)])
def test_hmac_sha256_gives_rfc4231s_vectors(key, data, mac):
    assert _core.crypto_available() == (True, "")
    assert _core.hmac_sha256(key, data).hex().startswith(mac)
    assert len(_core.hmac_sha256(key, data)) == 32


@pytest.fixture
def no_libcrypto():
    """libcrypto made unloadable for this process, restored after."""
    old = _core._crypto_set_names("libcrypto-not-here.so.99")
    try:
        yield
    finally:
        _core._crypto_set_names(old)
        assert _core.crypto_available()[0]


def test_a_secret_without_libcrypto_is_a_clear_error_naming_what_to_install(no_libcrypto):
    ok, why = _core.crypto_available()
    assert not ok
    for part in ("libcrypto-not-here.so.99", "OpenSSL's libcrypto", "libssl3",
                 "BYTEPS_AUTH_SECRET"):
        assert part in why, why
    with pytest.raises(RuntimeError, match="apt-get install libssl3"):
        _core.hmac_sha256(b"k", b"m")
    with pytest.raises(RuntimeError, match="libcrypto"):   # at once, not at a stream's hello
        _core.DataServer(1, 0, 7, 1, 1 << 20, 1 << 24, 8, auth_key=b"k" * 32)
    with pytest.raises(RuntimeError, match="libcrypto"):
        _core.DataClient(0, 7, 1, 1 << 20, 1 << 20, auth_key=b"k" * 32)
    # a job without a secret never needs it
    srv = _core.DataServer(1, 0, 7, 1, 1 << 20, 1 << 24, 8)
    cli = _core.DataClient(0, 7, 1, 1 << 20, 1 << 20)
    cli.close()
    srv.close()
