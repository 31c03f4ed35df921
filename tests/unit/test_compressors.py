"""Codec compressors of byteps_like.compression: round trips against numpy references, the
wrappers' state, random-k agreement between workers and servers, specs, hostile input, the
registry (Python and C through ctypes) and the benchmark's smoke run."""
from __future__ import annotations

import ctypes
import io
import json
import shutil
import struct
import subprocess
from contextlib import redirect_stdout

import numpy as np
import pytest

from byteps_like import _core
from byteps_like.compression import (
    HEADER_BYTES,
    Codec,
    CodecCompressor,
    Compression,
    CompressionError,
    Compressor,
    ErrorFeedback,
    NesterovMomentum,
    OneBit,
    from_spec,
    register,
    unregister,
)
from byteps_like.errors import BytePSError

N = 1001
ALL = {
    "onebit": Compression.onebit(),
    "onebit-noscale": Compression.onebit(scaling=False),
    "topk-frac": Compression.topk(0.05),
    "topk-count": Compression.topk(17),
    "randomk": Compression.randomk(0.1, seed=9),
    "dither-lin": Compression.dithering(16),
    "dither-nat-l2": Compression.dithering(6, "natural", "l2", seed=3),
    "ef-topk": Compression.topk(0.05, error_feedback=True),
    "nesterov-ef-onebit": Compression.onebit(error_feedback=True, momentum=0.9),
    "nesterov-randomk": Compression.randomk(20, momentum=0.5),
}


def rand(n: int = N, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def codec(c: Compressor, n: int = N, role: str = "worker", key: int = 3) -> Codec:
    return c.make_codec(n, role=role, key=key)


# ---- reference round trips ---------------------------------------------------------------------

def test_onebit_reference():
    x = rand()
    out = np.empty(N, np.float32)
    w = codec(Compression.onebit())
    assert w.decode(w.encode(x, 5), out) == 5
    scale = np.float32(np.mean(np.abs(x), dtype=np.float64))
    np.testing.assert_allclose(out, np.where(x < 0, -scale, scale), rtol=1e-6)
    w = codec(Compression.onebit(scaling=False))
    w.decode(w.encode(x, 0), out)
    assert np.array_equal(out, np.where(x < 0, -1, 1).astype(np.float32))
    assert w.max_bytes == HEADER_BYTES + (N + 7) // 8


@pytest.mark.parametrize("k,count", [(0.05, 50), (17, 17), (5000, N), (1e-9, 1)])
def test_topk_reference(k, count):
    x = rand()
    w = codec(Compression.topk(k))
    out = np.empty(N, np.float32)
    w.decode(w.encode(x, 1), out)
    keep = np.argsort(-np.abs(x), kind="stable")[:count]
    want = np.zeros(N, np.float32)
    want[keep] = x[keep]
    assert np.array_equal(out, want)
    assert w.max_bytes == HEADER_BYTES + 8 * count


def test_dithering_unbiased_and_bounded():
    x = rand()
    w = codec(Compression.dithering(4))
    out = np.empty(N, np.float32)
    total = np.zeros(N)
    for step in range(300):
        w.decode(w.encode(x, step), out)
        assert np.all(np.abs(out - x) <= np.abs(x).max() / 4 + 1e-6)
        total += out
    assert np.abs(total / 300 - x).max() < 0.25


@pytest.mark.parametrize("name", list(ALL))
def test_decode_add_is_decode_plus_add_and_encode_keeps_x(name):
    x = rand()
    x0 = x.copy()
    w = codec(ALL[name])
    p = bytes(w.encode(x, 7))
    assert np.array_equal(x, x0) and len(p) <= w.max_bytes
    server = codec(ALL[name], role="server")
    out = np.empty(N, np.float32)
    assert server.decode(p, out) == 7
    acc = rand(seed=1)
    want = acc + out
    assert server.decode_add(memoryview(p), acc) == 7
    assert np.array_equal(acc, want)


# ---- wrappers -----------------------------------------------------------------------------------

@pytest.mark.parametrize("inner", [OneBit(), Compression.topk(0.02), Compression.dithering(2)])
def test_error_feedback_residual_is_carried(inner):
    w = codec(ErrorFeedback(inner))
    decoded_sum = np.zeros(N, np.float64)
    input_sum = np.zeros(N, np.float64)
    out = np.empty(N, np.float32)
    for step in range(6):
        x = rand(seed=step)
        input_sum += x
        w.decode(w.encode(x, step), out)
        decoded_sum += out
    # sum of decoded = sum of inputs - final residual (up to float32 rounding of y = x + r)
    np.testing.assert_allclose(decoded_sum, input_sum - w.residual, atol=1e-4)
    assert np.abs(w.residual).max() > 0


def test_error_feedback_on_server_and_exact_codecs_leave_no_residual():
    s = codec(Compression.randomk(N, error_feedback=True), role="server")
    s.encode(rand(), 0)
    assert not s.residual.any()  # k = n: random-k is exact


def test_nesterov_matches_reference():
    mu = 0.9
    w = codec(NesterovMomentum(Compression.topk(N), mu=mu))  # exact inner: decode == y
    m = np.zeros(N, np.float32)
    out = np.empty(N, np.float32)
    for step in range(5):
        x = rand(seed=step)
        m = np.float32(mu) * m + x
        w.decode(w.encode(x, step), out)
        np.testing.assert_allclose(out, x + np.float32(mu) * m, rtol=1e-6, atol=1e-6)
    server = codec(NesterovMomentum(Compression.topk(N)), role="server")
    x = rand()
    server.decode(server.encode(x, 0), out)
    assert np.array_equal(out, x)  # pass-through on servers


# ---- random-k agreement -------------------------------------------------------------------------

def test_randomk_workers_and_server_agree_and_reencode_is_exact():
    comp = from_spec(json.loads(json.dumps(Compression.randomk(0.1, seed=123).spec())))
    w1, w2 = codec(comp, key=11), codec(Compression.randomk(0.1, seed=123), key=11)
    server = codec(comp, role="server", key=11)
    x1, x2 = rand(seed=1), rand(seed=2)
    p1, p2 = bytes(w1.encode(x1, 4)), bytes(w2.encode(x2, 4))
    idx = w1.indices(4)
    assert np.array_equal(idx, w2.indices(4)) and np.array_equal(idx, server.indices(4))
    acc = np.zeros(N, np.float32)
    assert server.decode_add(p1, acc) == 4 and server.decode_add(p2, acc) == 4
    assert np.array_equal(np.nonzero(acc)[0], idx)
    np.testing.assert_array_equal(acc[idx], x1[idx] + x2[idx])
    pull = server.encode(acc, 4)
    out = np.empty(N, np.float32)
    assert w1.decode(pull, out) == 4
    assert np.array_equal(out, acc)
    other = codec(comp, key=12)
    assert not np.array_equal(other.indices(4), idx)
    assert not np.array_equal(w1.indices(5), idx)


# ---- specs ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("comp", [*ALL.values(), Compression.none, Compression.fp16,
                                  Compression.bf16], ids=[*ALL, "none", "fp16", "bf16"])
def test_spec_round_trip(comp):
    spec = comp.spec()
    assert json.loads(json.dumps(spec)) == spec
    again = from_spec(json.loads(json.dumps(spec)))
    assert again == comp and again.spec() == spec and again.kind == comp.kind


def test_compressors_are_immutable_and_codec_kind_refuses_cast_api():
    c = Compression.topk(0.1)
    with pytest.raises(AttributeError):
        c.k = 0.2  # type: ignore[misc]
    with pytest.raises(CompressionError, match="codec compressor"):
        c.compress(rand(), "float32")
    with pytest.raises(CompressionError, match="not a codec"):
        Compression.fp16.make_codec(4, role="worker", key=0)
    assert issubclass(CompressionError, BytePSError) and issubclass(CompressionError, ValueError)


@pytest.mark.parametrize("spec,match", [
    ([], "must be a dict"),
    ({}, "'name' must be a string"),
    ({"name": "zstd"}, "unknown name 'zstd'"),
    ({"name": "topk", "k": 0}, "k: a count must be in"),
    ({"name": "topk", "k": 1.5}, "k: must be a fraction"),
    ({"name": "topk", "k": True}, "k: must be a fraction"),
    ({"name": "topk", "k": float("nan")}, "k: must be"),
    ({"name": "topk", "k": 1 << 40}, "k: a count must be"),
    ({"name": "topk", "k": 0.1, "extra": 1}, "bad fields"),
    ({"name": "randomk", "k": 0.1, "seed": -1}, "seed: must be"),
    ({"name": "dithering", "levels": 0}, "levels: must be"),
    ({"name": "dithering", "levels": 200, "partition": "natural"}, r"levels: must be .*\[1, 127\]"),
    ({"name": "dithering", "partition": "log"}, "partition: must be"),
    ({"name": "dithering", "normalize": "l1"}, "normalize: must be"),
    ({"name": "onebit", "scaling": "yes"}, "scaling: must be a bool"),
    ({"name": "ef", "inner": {"name": "fp16"}}, "inner: must be a codec"),
    ({"name": "ef", "inner": {"name": "topk", "k": -1}}, "inner: .*k:"),
    ({"name": "nesterov", "inner": {"name": "onebit"}, "mu": 2.0}, "mu: must be in"),
    ({"name": "ef", "inner": [1, 2]}, "value of type list"),
    ({"name": "onebit", 1: 2}, "is not a string"),
])
def test_hostile_specs(spec, match):
    with pytest.raises(CompressionError, match=match):
        from_spec(spec)


def test_deep_spec_is_refused():
    spec: dict = {"name": "onebit"}
    for _ in range(50):
        spec = {"name": "ef", "inner": spec}
    with pytest.raises(CompressionError, match="nested deeper"):
        from_spec(spec)


@pytest.mark.parametrize("n,role,key", [(0, "worker", 0), (1 << 32, "worker", 0),
                                        (10, "client", 0), (10, "worker", -1)])
def test_make_codec_arguments(n, role, key):
    with pytest.raises(CompressionError):
        Compression.onebit().make_codec(n, role=role, key=key)


# ---- hostile payloads ----------------------------------------------------------------------------

def _bad_payloads(name: str, good: bytes) -> list[bytes]:
    head = bytearray(good)
    wrong_id = bytearray(good)
    wrong_id[3] = (wrong_id[3] % 4) + 1
    wrong_n = bytearray(good)
    struct.pack_into("<I", wrong_n, 4, 0xFFFFFFFF)
    wrong_magic = bytearray(good)
    wrong_magic[0] = 0
    out = [good[:-1], good + b"\0", b"", good[:HEADER_BYTES], bytes(wrong_id), bytes(wrong_n),
           bytes(wrong_magic)]
    if name.startswith("topk") or name == "randomk":
        wrong_k = bytearray(good)
        struct.pack_into("<I", wrong_k, 16, 2)
        out.append(bytes(wrong_k))
    del head
    return out


@pytest.mark.parametrize("name", ["onebit", "topk-count", "randomk", "dither-lin"])
def test_hostile_payloads(name):
    w = codec(ALL[name])
    good = bytes(w.encode(rand(), 1))
    acc = np.ones(N, np.float32)
    for bad in _bad_payloads(name, good):
        with pytest.raises(CompressionError):
            w.decode_add(bad, acc)
    assert np.array_equal(acc, np.ones(N, np.float32))
    with pytest.raises(CompressionError, match="contiguous bytes-like"):
        w.decode(object(), acc)
    with pytest.raises(CompressionError, match="writable C-contiguous float32"):
        w.decode(good, np.empty(N, np.float64))


def test_topk_bad_index_is_refused_before_any_write():
    w = codec(Compression.topk(3))
    p = bytearray(w.encode(rand(), 0))
    struct.pack_into("<I", p, HEADER_BYTES + 4, N)  # second index out of range
    acc = np.ones(N, np.float32)
    with pytest.raises(CompressionError, match=f"index {N} at position 1 is out of range"):
        w.decode_add(bytes(p), acc)
    assert np.array_equal(acc, np.ones(N, np.float32))


def test_dithering_bad_level_is_refused():
    w = codec(Compression.dithering(4))
    p = bytearray(w.encode(rand(), 0))
    p[HEADER_BYTES] = 0xFF  # level 7 > 4
    with pytest.raises(CompressionError, match="exceeds levels"):
        w.decode(bytes(p), np.empty(N, np.float32))


# ---- casts ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_bf16_cast(dtype):
    x = (np.arange(1000) % 256 - 128).astype(dtype)
    wire, wdtype, ctx = Compression.bf16.compress(x, dtype)
    assert wdtype == "bfloat16" and wire.dtype == np.uint16 and wire.nbytes == x.size * 2
    out = np.empty_like(x)
    Compression.bf16.decompress(wire, ctx, out, dtype)
    assert np.array_equal(out, x)  # integers of magnitude <= 256 fit bfloat16's 8 bits
    y = np.float32(1 + 2 ** -9)
    w, _, c = Compression.bf16.compress(np.full(3, y), "float32")
    Compression.bf16.decompress(w, c, got := np.empty(3, np.float32), "float32")
    assert np.all(got == 1)
    ints = np.arange(4)
    assert Compression.bf16.compress(ints, "int64")[0] is ints
    assert Compression.bf16.kind == "cast" and Compression.none.kind == "none"


# ---- registry -------------------------------------------------------------------------------------

class _Negate(CodecCompressor):
    """A toy Python codec: the payload is -x as raw float32."""
    name = "test-negate"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Negate)

    __hash__ = object.__hash__

    def _make(self, n: int, role: str, key: int) -> Codec:
        class C(Codec):
            def __init__(self) -> None:
                self.n, self.max_bytes = n, 4 * n

            def encode(self, x: np.ndarray, step: int) -> np.ndarray:
                return (-x).view(np.uint8)

            def decode(self, payload, out):  # type: ignore[no-untyped-def]
                p = np.frombuffer(payload, np.float32)
                if p.size != n:
                    raise CompressionError("test-negate: bad length")
                np.negative(p, out=out)
                return 0

        return C()


def test_python_registry():
    register("test-negate", lambda: _Negate())
    try:
        with pytest.raises(CompressionError, match="already registered"):
            register("test-negate", _Negate)
        with pytest.raises(CompressionError, match="already registered"):
            register("topk", _Negate)
        comp = from_spec(_Negate().spec())
        w, s = comp.make_codec(N, role="worker", key=0), comp.make_codec(N, role="server", key=0)
        x = rand()
        acc = np.ones(N, np.float32)
        s.decode_add(bytes(w.encode(x, 0)), acc)  # the default decode_add
        assert np.array_equal(acc, 1 + x)
        wrapped = from_spec({"name": "ef", "inner": {"name": "test-negate"}})
        assert isinstance(wrapped, ErrorFeedback)
    finally:
        unregister("test-negate")
    with pytest.raises(CompressionError, match="unknown name"):
        from_spec({"name": "test-negate"})
    with pytest.raises(CompressionError, match="register: name"):
        register("bad name!", _Negate)


C_SOURCE = r"""
#include <stdint.h>
#include <string.h>
/* int8 quantisation: payload = scale (float32) + n int8 values of round(x / scale). */
int q8_encode(const float* x, uint32_t n, uint8_t* out) {
  float m = 0;
  for (uint32_t i = 0; i < n; ++i) { float a = x[i] < 0 ? -x[i] : x[i]; if (a > m) m = a; }
  float scale = m > 0 ? m / 127.0f : 1.0f;
  memcpy(out, &scale, 4);
  for (uint32_t i = 0; i < n; ++i) {
    float v = x[i] / scale;
    out[4 + i] = (uint8_t)(int8_t)(v < 0 ? v - 0.5f : v + 0.5f);
  }
  return 0;
}
int q8_decode(const uint8_t* p, uint64_t len, uint32_t n, float* out, int add) {
  if (len != 4 + (uint64_t)n) return -1;
  float scale;
  memcpy(&scale, p, 4);
  for (uint32_t i = 0; i < n; ++i) {
    float v = (float)(int8_t)p[4 + i] * scale;
    out[i] = add ? out[i] + v : v;
  }
  return 0;
}
"""


def test_c_compressor_through_ctypes(tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler")
    (tmp_path / "q8.c").write_text(C_SOURCE)
    lib_path = tmp_path / "libq8.so"
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(lib_path), str(tmp_path / "q8.c")],
                   check=True, capture_output=True)
    lib = ctypes.CDLL(str(lib_path))
    f32p, u8p = ctypes.POINTER(ctypes.c_float), ctypes.POINTER(ctypes.c_uint8)
    lib.q8_encode.argtypes = [f32p, ctypes.c_uint32, u8p]
    lib.q8_decode.argtypes = [u8p, ctypes.c_uint64, ctypes.c_uint32, f32p, ctypes.c_int]

    class Q8Codec(Codec):
        def __init__(self, n: int):
            self.n, self.max_bytes = n, 4 + n
            self._buf = np.empty(4 + n, np.uint8)

        def encode(self, x: np.ndarray, step: int) -> np.ndarray:
            lib.q8_encode(x.ctypes.data_as(f32p), self.n, self._buf.ctypes.data_as(u8p))
            return self._buf

        def _dec(self, payload, out: np.ndarray, add: int) -> int:  # type: ignore[no-untyped-def]
            p = np.frombuffer(payload, np.uint8)
            if lib.q8_decode(p.ctypes.data_as(u8p), p.size, self.n, out.ctypes.data_as(f32p), add):
                raise CompressionError(f"q8 payload has {p.size} bytes, expected {4 + self.n}")
            return 0

        def decode(self, payload, out):  # type: ignore[no-untyped-def]
            return self._dec(payload, out, 0)

        def decode_add(self, payload, acc):  # type: ignore[no-untyped-def]
            return self._dec(payload, acc, 1)

    class Q8(CodecCompressor):
        name = "test-q8"

        def _make(self, n: int, role: str, key: int) -> Codec:
            return Q8Codec(n)

    register("test-q8", Q8)
    try:
        comp = from_spec({"name": "test-q8"})
        assert comp.spec() == {"name": "test-q8"}
        w = comp.make_codec(N, role="worker", key=0)
        s = from_spec(comp.spec()).make_codec(N, role="server", key=0)
        x = rand()
        out = np.empty(N, np.float32)
        s.decode(bytes(w.encode(x, 0)), out)
        scale = np.abs(x).max() / np.float32(127)
        assert np.abs(out - x).max() <= scale / 2 + 1e-6
        ef = from_spec({"name": "ef", "inner": {"name": "test-q8"}}).make_codec(N, role="worker",
                                                                             key=0)
        ef.encode(x, 0)
        with pytest.raises(CompressionError, match="q8 payload"):
            s.decode(b"abc", out)
    finally:
        unregister("test-q8")


# ---- benchmark smoke ------------------------------------------------------------------------------

def test_benchmark_smoke():
    from byteps_like.bench import compress as bench
    from byteps_like.bench.__main__ import COMMANDS
    assert "compress" in COMMANDS
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert bench.main(["--sizes", "64KiB", "--repeats", "1"]) == 0
    lines = buf.getvalue().splitlines()
    rows = [line[9:25].strip() for line in lines[3:]]
    assert rows == list(bench.compressors())
    assert _core is not None


def test_benchmark_help_renders():
    from byteps_like.bench import compress as bench
    buf = io.StringIO()
    with redirect_stdout(buf), pytest.raises(SystemExit) as exc:
        bench.main(["--help"])
    assert exc.value.code == 0
    assert "topk 1%" in buf.getvalue()
