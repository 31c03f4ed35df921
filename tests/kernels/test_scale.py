"""scale_into (in-place averaging) against numpy."""
from __future__ import annotations

import numpy as np
import pytest

from byteps_like import _core

SIZES = (0, 1, 7, 31, 33, 1000, 4097, (1 << 20) + 3)
DIVISORS = (1, 2, 3, 4, 7, 8, 1000)


def _random(dtype: str, n: int, rng: np.random.Generator) -> np.ndarray:
    if dtype in ("float16", "bfloat16"):
        return rng.integers(0, 1 << 16, n, dtype=np.uint16).view(
            np.float16 if dtype == "float16" else np.uint16)
    if dtype in ("int32", "int64"):
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
    x = (rng.standard_normal(n) * 1e3).astype(dtype)
    if n >= 8:
        x[:6] = [np.inf, -np.inf, np.nan, -0.0, np.finfo(dtype).smallest_subnormal, np.finfo(dtype).max]
    return x


@pytest.mark.parametrize("nthreads", [1, 2])
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16", "int32", "int64"])
def test_scale_into_matches_numpy(dtype, nthreads, isa, make_unaligned, same_bits, bf16_round,
                                  bf16_widen):
    rng = np.random.default_rng(nthreads)
    for n in SIZES:
        for d in DIVISORS if n < 10_000 else (3, 8):
            x = _random(dtype, n, rng)
            buf = make_unaligned(n, x.dtype, int(rng.integers(0, 8)))
            buf[...] = x
            _core.scale_into(buf, dtype, d, nthreads=nthreads)
            with np.errstate(all="ignore"):
                if dtype in ("float32", "float64"):
                    same_bits(buf, x / x.dtype.type(d))
                elif dtype == "float16":
                    same_bits(buf, (x.astype(np.float32) / np.float32(d)).astype(np.float16))
                elif dtype == "bfloat16":
                    same_bits(bf16_widen(buf), bf16_widen(bf16_round(bf16_widen(x) / np.float32(d))))
                else:
                    np.testing.assert_array_equal(buf, np.floor_divide(x, d))


@pytest.mark.parametrize("dtype", ["int32", "int64"])
def test_scale_into_int_floor_division_edge_cases(dtype, isa):
    info = np.iinfo(dtype)
    x = np.array([info.min, info.min + 1, -7, -6, -1, 0, 1, 6, 7, info.max], dtype=dtype)
    for d in (2, 3, 5, 16, 2**31 - 1, 2**31, 2**31 + 1, 2**40 + 3, 2**62, 2**63 - 1):
        buf = x.copy()
        _core.scale_into(buf, dtype, d)
        want = np.array([v // d for v in x.tolist()], dtype=dtype)  # Python ints: exact floor
        np.testing.assert_array_equal(buf, want, err_msg=f"divisor {d}")


def test_scale_into_rejects_bad_divisors():
    buf = np.ones(4, np.float32)
    for bad in (0, -1):
        with pytest.raises(ValueError, match=r"scale_into: divisor must be >= 1, got -?\d"):
            _core.scale_into(buf, "float32", bad)
    with pytest.raises(TypeError):
        _core.scale_into(buf, "float32", 2.5)
    with pytest.raises(ValueError, match=r"scale_into: buf has 6 bytes, not a multiple of the "
                                         r"float32 itemsize \(4\)"):
        _core.scale_into(bytearray(6), "float32", 2)
    with pytest.raises(ValueError, match="scale_into: buf is read-only"):
        _core.scale_into(bytes(8), "float32", 2)
