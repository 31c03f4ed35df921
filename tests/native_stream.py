"""Raw streams of the native data plane for the tests that play a hostile or foreign peer
(tests/unit/test_native_dataplane.py, tests/faults/test_hostile.py)."""
from __future__ import annotations

import socket
import struct

#: the wire header (byteps_like/wire.py): magic, version, type, dtype, role, rank, flags, job,
#: key, round, count, nbytes
HDR = struct.Struct("<4sBBBBiIIQqQQ")


def closed_by_peer(s: socket.socket, timeout: float = 10.0) -> bool:
    """True when the other end closes the stream (an orderly close or a reset) within
    ``timeout``; closes ``s`` in any case."""
    s.settimeout(timeout)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True
    finally:
        s.close()


def recv_exact(s: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes from a socket (MSG_WAITALL may return less on a socket with a
    timeout); AssertionError when the peer closes first."""
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        assert chunk, f"stream closed after {len(buf)} of {n} bytes"
        buf += chunk
    return bytes(buf)


class RawUcx:
    """A bare UCX stream to a server's UCX listener with the few socket methods the tests use
    (sendall, recv with MSG_WAITALL, settimeout, close), so a test that plays a hostile peer
    runs over either stream (_core.UcxRawStream)."""

    def __init__(self, port: int, host: str = "127.0.0.1", timeout: float = 10.0):
        from byteps_like import _core
        self._s = _core.UcxRawStream(host, port)
        self._timeout = timeout

    def settimeout(self, timeout: float) -> None:
        self._timeout = timeout

    def sendall(self, data: bytes) -> None:
        self._s.send(bytes(data), self._timeout)

    def recv(self, n: int, flags: int = 0) -> bytes:
        try:
            return self._s.recv(n, self._timeout, bool(flags & socket.MSG_WAITALL))
        except RuntimeError as exc:
            if "timed out" in str(exc):
                raise TimeoutError(str(exc)) from None
            raise

    def close(self) -> None:
        self._s.close()


UCX_EXTRA = ("libucx (the `ucx` extra, which scripts/setup.sh installs into .venv) is "
             "installed in this environment")


def ucx_skip_reason(monkeypatch) -> str:
    """Why the native plane's UCX streams cannot be tested here ("" when they can). UCX runs
    on loopback TCP (UCX_TLS=tcp UCX_NET_DEVICES=lo) unless the environment says otherwise;
    UCX reads it when the process first loads UCX."""
    import os

    from byteps_like.transport import ucx_native
    for k, v in {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo",
                 "UCX_WARN_UNUSED_ENV_VARS": "n"}.items():
        if k not in os.environ:
            monkeypatch.setenv(k, v)
    return ucx_native.load()


def require_ucx(monkeypatch) -> None:
    """Skip a UCX test only in an environment without the `ucx` extra (nothing asked for UCX
    there); where the extra is installed, UCX streams that cannot load are a broken setup (a
    _core built before the extra arrived, or shared with another environment), and the test
    fails naming it instead of skipping."""
    import importlib.util

    import pytest
    why = ucx_skip_reason(monkeypatch)
    if not why:
        return
    if importlib.util.find_spec("libucx") is None:
        pytest.skip(f"UCX streams unavailable, no `ucx` extra here: {why}")
    pytest.fail(f"{UCX_EXTRA}, but the native plane's UCX streams are unavailable: {why}. "
                "Build _core again in this environment: `pip install --no-deps -e .`")
