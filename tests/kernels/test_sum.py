"""add_into and copy_into against numpy, per dtype, size, alignment, thread count and level."""
from __future__ import annotations

import numpy as np
import pytest

from byteps_like import _core

SIZES = (0, 1, 7, 31, 33, 1000, 4097, (1 << 20) + 3)
OFFSETS = range(8)
DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64")
# numpy dtype holding each kernel dtype (bfloat16 travels as its uint16 bits)
STORAGE = {"float32": np.float32, "float64": np.float64, "float16": np.float16,
           "bfloat16": np.uint16, "int32": np.int32, "int64": np.int64}


def random_values(dtype: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """Values of every class: for 16-bit types all bit patterns (subnormal, inf, NaN)."""
    if dtype in ("float16", "bfloat16"):
        return rng.integers(0, 1 << 16, n, dtype=np.uint16).view(STORAGE[dtype])
    if dtype in ("int32", "int64"):
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
    x = (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, n)).astype(dtype)
    if n >= 16:
        tiny = np.finfo(dtype).smallest_subnormal
        x[rng.integers(0, n, 8)] = [np.inf, -np.inf, np.nan, -0.0, tiny, -tiny * 3,
                                     np.finfo(dtype).max, np.finfo(dtype).min]
    return x


def reference_add(dtype: str, a: np.ndarray, b: np.ndarray, bf16_round, bf16_widen) -> np.ndarray:
    with np.errstate(all="ignore"):
        if dtype == "bfloat16":
            return bf16_round(bf16_widen(a) + bf16_widen(b))
        return a + b  # float16: numpy adds in float32 and rounds to nearest even; ints wrap


def check_equal(dtype: str, got: np.ndarray, want: np.ndarray, same_bits) -> None:
    """Bit equality; NaN only has to stay NaN (its payload and sign may differ, as in numpy)."""
    if dtype in ("float32", "float64", "float16"):
        same_bits(got, want)
    elif dtype == "bfloat16":
        # a bfloat16 is the top half of a float32: compare as float32 with zero low bits
        same_bits((got.astype(np.uint32) << 16).view(np.float32),
                  (want.astype(np.uint32) << 16).view(np.float32))
    else:
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("nthreads", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_into_matches_numpy(dtype, nthreads, isa, make_unaligned, same_bits, bf16_round,
                                bf16_widen):
    rng = np.random.default_rng([DTYPES.index(dtype), nthreads])
    for n in SIZES:
        # every offset for small sizes; the large one at an aligned and an odd offset
        offsets = OFFSETS if n < 10_000 else (0, 3)
        for off in offsets:
            a = random_values(dtype, n, rng)
            b = random_values(dtype, n, rng)
            dst = make_unaligned(n, STORAGE[dtype], off)
            src = make_unaligned(n, STORAGE[dtype], (off * 5 + 1) % 8)
            dst[...] = a
            src[...] = b
            _core.add_into(dst, src, dtype, nthreads)
            check_equal(dtype, dst, reference_add(dtype, a, b, bf16_round, bf16_widen), same_bits)
            np.testing.assert_array_equal(src.view(np.uint8), b.view(np.uint8))  # src untouched


def test_float16_special_values_bit_exact(isa, same_bits):
    h = np.float16
    with np.errstate(over="ignore"):
        specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 65504.0, -65504.0, 65520.0,
                             6.1035156e-05, 5.9604645e-08, -5.9604645e-08, 6.0975552e-05,
                             1.0, -1.0, 2048.0, 1.0009766, 0.33325195, 1e-4, 3e-7],
                            dtype=np.float32).astype(h)
    a = np.repeat(specials, specials.size)  # every ordered pair
    b = np.tile(specials, specials.size)
    # overflow, the tie just below inf (rounds to even: inf), just under it, ties at 2048,
    # subnormal + subnormal, subnormal + normal crossing into the normal range
    extra = [(65504, 65504, np.inf), (65504, 16, np.inf), (65504, 15, 65504), (2048, 1, 2048),
             (2048, 3, 2052), (5.9604645e-08, 5.9604645e-08, 1.1920929e-07),
             (6.0975552e-05, 5.9604645e-08, 6.1035156e-05)]
    a = np.concatenate([a, np.array([e[0] for e in extra], dtype=h)])
    b = np.concatenate([b, np.array([e[1] for e in extra], dtype=h)])
    with np.errstate(all="ignore"):
        want = a + b
    np.testing.assert_array_equal(want[-len(extra):], np.array([e[2] for e in extra], dtype=h))
    for nthreads in (1, 2):
        dst = a.copy()
        _core.add_into(dst, b, "float16", nthreads)
        same_bits(dst, want)


def test_float16_all_bit_patterns(isa, same_bits):
    a = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    rng = np.random.default_rng(16)
    for _ in range(3):
        b = rng.permutation(a)
        with np.errstate(all="ignore"):
            want = a + b
        dst = a.copy()
        _core.add_into(dst, b, "float16")
        same_bits(dst, want)


def test_bfloat16_special_values(isa, bf16_round, bf16_widen):
    vals = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -1.0, 3.0e38, -3.0e38, 1e-40,
                     1.00390625, 1.0078125, 256.0], dtype=np.float32)
    bits = (vals.view(np.uint32) >> 16).astype(np.uint16)
    a = np.repeat(bits, bits.size)
    b = np.tile(bits, bits.size)
    with np.errstate(all="ignore"):
        want = bf16_round(bf16_widen(a) + bf16_widen(b))
    dst = a.copy()
    _core.add_into(dst, b, "bfloat16")
    nan = np.isnan(bf16_widen(want))
    np.testing.assert_array_equal(np.isnan(bf16_widen(dst)), nan)
    np.testing.assert_array_equal(dst[~nan], want[~nan])
    # round to nearest even: 256 + 1 -> 256 (tie, even), 256 + 3 -> 260 (tie, up to even)
    one, three, c256 = (np.array([v], np.float32).view(np.uint32) >> 16 for v in (1.0, 3.0, 256.0))
    for addend, result in ((one, 256.0), (three, 260.0)):
        d = c256.astype(np.uint16)
        _core.add_into(d, addend.astype(np.uint16), "bfloat16")
        assert bf16_widen(d)[0] == result


@pytest.mark.parametrize("dtype", ["int32", "int64"])
def test_int_overflow_wraps(dtype, isa):
    info = np.iinfo(dtype)
    a = np.array([info.max, info.min, info.max, -1, 0] * 9, dtype=dtype)
    b = np.array([1, -1, info.max, info.min, info.min] * 9, dtype=dtype)
    want = a + b  # numpy arrays wrap silently
    _core.add_into(a, b, dtype)
    np.testing.assert_array_equal(a, want)
    assert a[0] == info.min and a[1] == info.max


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_into_accepts_any_buffer(dtype, same_bits, bf16_round, bf16_widen):
    rng = np.random.default_rng(7)
    a = random_values(dtype, 37, rng)
    b = random_values(dtype, 37, rng)
    want = reference_add(dtype, a, b, bf16_round, bf16_widen)
    sources = {
        "bytes": lambda raw: raw,
        "memoryview": memoryview,
        "readonly memoryview": lambda raw: memoryview(bytearray(raw)).toreadonly(),
        "memoryview at offset 3": lambda raw: memoryview(b"xyz" + raw)[3:],
    }
    for _name, make_src in sources.items():
        for make_dst in (bytearray, lambda raw: memoryview(bytearray(b"q" + raw))[1:]):
            dst = make_dst(a.tobytes())
            _core.add_into(dst, make_src(b.tobytes()), dtype)
            check_equal(dtype, np.frombuffer(dst, dtype=a.dtype), want, same_bits)


def test_add_into_accepts_zmq_frames(same_bits):
    zmq = pytest.importorskip("zmq")
    a = np.arange(100, dtype=np.float32)
    b = np.linspace(-3, 3, 100, dtype=np.float32)
    dst = a.copy()
    _core.add_into(dst, zmq.Frame(b.tobytes()), "float32")
    _core.add_into(dst, zmq.Frame(b.tobytes()).buffer, "float32")
    same_bits(dst, (a + b) + b)


def test_add_into_same_and_overlapping_buffers():
    a = np.arange(1000, dtype=np.int64)
    _core.add_into(a, a, "int64")
    np.testing.assert_array_equal(a, 2 * np.arange(1000))
    base = np.arange(1001, dtype=np.float64)
    want = base[:-1] + base[1:]
    _core.add_into(base[:-1], base[1:], "float64")  # src overlaps dst shifted by one element
    np.testing.assert_array_equal(base[:-1], want)


@pytest.mark.parametrize("nthreads", [1, 2, 7])
def test_copy_into(nthreads, make_unaligned):
    rng = np.random.default_rng(nthreads)
    for n in (0, 1, 7, 33, 4097, (3 << 20) + 5):
        for off in (0, 1, 6):
            src = rng.integers(0, 256, n, dtype=np.uint8)
            dst = make_unaligned(n, np.uint8, off)
            _core.copy_into(dst, src, nthreads)
            np.testing.assert_array_equal(dst, src)
    raw = bytearray(range(200))
    mv = memoryview(raw)
    _core.copy_into(mv[0:150], mv[50:200])  # overlapping: behaves like memmove
    assert raw[:150] == bytes(range(50, 200))
    dst = bytearray(4)
    _core.copy_into(dst, b"abcd")
    assert dst == b"abcd"


def test_many_threads_and_concurrent_callers(same_bits):
    import threading

    n = (1 << 21) + 17
    base = np.random.default_rng(3).standard_normal(n).astype(np.float32)
    results = {}

    def worker(k: int) -> None:
        dst = np.full(n, float(k), dtype=np.float32)
        for _ in range(3):
            _core.add_into(dst, base, "float32", nthreads=8)
        results[k] = dst

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k in range(4):
        want = np.full(n, float(k), dtype=np.float32)
        for _ in range(3):
            want += base
        same_bits(results[k], want)
