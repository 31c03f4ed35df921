"""convert between float32 and float16 / bfloat16 against numpy."""
from __future__ import annotations

import numpy as np
import pytest

from byteps_like import _core

SIZES = (0, 1, 7, 31, 33, 1000, 4097, (1 << 20) + 3)


def _random_f32(n: int, rng: np.random.Generator) -> np.ndarray:
    """Random bit patterns (every class) mixed with values in the float16 range."""
    bits = rng.integers(0, 1 << 32, n, dtype=np.uint32).view(np.float32)
    near = (rng.standard_normal(n) * 10.0 ** rng.integers(-9, 6, n)).astype(np.float32)
    return np.where(rng.random(n) < 0.5, bits, near).astype(np.float32)


def _narrowing(make_unaligned, seed: int, src_skew: int, dst_np, dst_dtype: str, nthreads: int,
               check) -> None:
    """float32 -> ``dst_dtype`` over SIZES and every alignment of source (``src_skew`` elements
    from the destination's) and destination; ``check(dst, x)`` against numpy."""
    rng = np.random.default_rng(seed)
    for n in SIZES:
        for off in range(8) if n < 10_000 else (0, 5):
            x = _random_f32(n, rng)
            src = make_unaligned(n, np.float32, (off + src_skew) % 8)
            src[...] = x
            dst = make_unaligned(n, dst_np, off)
            _core.convert(dst, dst_dtype, src, "float32", nthreads=nthreads)
            check(dst, x)


@pytest.mark.parametrize("nthreads", [1, 2])
def test_float32_to_float16(nthreads, isa, make_unaligned, same_bits):
    def check(dst, x):
        with np.errstate(all="ignore"):
            same_bits(dst, x.astype(np.float16))
    _narrowing(make_unaligned, 1, 3, np.float16, "float16", nthreads, check)


@pytest.mark.parametrize("nthreads", [1, 2])
def test_float16_to_float32_all_patterns(nthreads, isa, make_unaligned, same_bits):
    h = np.tile(np.arange(1 << 16, dtype=np.uint16).view(np.float16), 5)[: (1 << 18) + 3]
    for off in (0, 1):
        src = make_unaligned(h.size, np.float16, off)
        src[...] = h
        dst = make_unaligned(h.size, np.float32, 3 - off)
        _core.convert(dst, "float32", src, "float16", nthreads=nthreads)
        same_bits(dst, h.astype(np.float32))


@pytest.mark.parametrize("nthreads", [1, 2])
def test_float32_to_bfloat16(nthreads, isa, make_unaligned, bf16_round):
    def check(dst, x):
        np.testing.assert_array_equal(dst, bf16_round(x))  # NaN: quietened, payload kept
    _narrowing(make_unaligned, 2, 1, np.uint16, "bfloat16", nthreads, check)


@pytest.mark.parametrize("nthreads", [1, 2])
def test_bfloat16_to_float32_all_patterns(nthreads, isa, make_unaligned, bf16_widen, same_bits):
    h = np.tile(np.arange(1 << 16, dtype=np.uint16), 5)[: (1 << 18) + 3]
    src = make_unaligned(h.size, np.uint16, 1)
    src[...] = h
    dst = make_unaligned(h.size, np.float32, 2)
    _core.convert(dst, "float32", src, "bfloat16", nthreads=nthreads)
    same_bits(dst, bf16_widen(h), nan_payload=True)


def test_bfloat16_rounding_cases(isa, bf16_widen):
    x = np.array([1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-8 + 2**-20, 3.3895e38, 3.4e38,
                  -3.4e38, np.inf, 1e-40, -0.0], dtype=np.float32)
    dst = np.empty(x.size, np.uint16)
    _core.convert(dst, "bfloat16", x, "float32")
    got = bf16_widen(dst)
    np.testing.assert_array_equal(got[:3], np.array([1.0, 1.0 + 2**-6, 1.0 + 2**-7], np.float32))
    assert got[3] == np.float32(3.3895314e38) and np.isposinf(got[4]) and np.isneginf(got[5])
    assert np.isposinf(got[6]) and got[7] > 0 and dst[8] == 0x8000


def test_convert_roundtrip_in_place_overlap():
    x = np.linspace(-100, 100, 1001, dtype=np.float32)
    raw = bytearray(x.tobytes())
    # narrow into the front of the same buffer (dst overlaps src)
    _core.convert(memoryview(raw)[: 2 * x.size], "float16", raw, "float32")
    np.testing.assert_array_equal(np.frombuffer(raw, np.float16, count=x.size), x.astype(np.float16))


def test_convert_errors():
    f32 = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match=r"convert: float64 -> float16 is not supported; "
                                         r"supported: float32 -> float16"):
        _core.convert(np.zeros(4, np.float16), "float16", np.zeros(4), "float64")
    with pytest.raises(ValueError, match="convert: float32 -> float32 is not supported"):
        _core.convert(f32, "float32", f32.copy(), "float32")
    with pytest.raises(ValueError, match=r"convert: dst has 6 bytes \(float16, itemsize 2\) and "
                                         r"src has 16 bytes \(float32, itemsize 4\)"):
        _core.convert(np.zeros(3, np.float16), "float16", f32, "float32")
    with pytest.raises(ValueError, match="convert: unknown src_dtype 'half'"):
        _core.convert(np.zeros(4, np.float16), "float16", f32, "half")
    with pytest.raises(ValueError, match="convert: dst is read-only"):
        _core.convert(bytes(8), "float16", f32, "float32")
