"""Fixtures of the native-kernel tests: kernel levels and numpy reference helpers."""
from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest

from byteps_like import _core

LEVELS = ("scalar", "avx2", "avx512")
_ORDER = {name: i for i, name in enumerate(LEVELS)}


@pytest.fixture(params=LEVELS)
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """Runs the test once per kernel level this CPU supports, capping the dispatch to it."""
    level = request.param
    if _ORDER[level] > _ORDER[_core.cpu_features()["detected_isa"]]:
        pytest.skip(f"CPU lacks {level}")
    _core._set_isa(level)
    try:
        yield level
    finally:
        _core._set_isa("auto")


def bf16_from_f32(x: np.ndarray) -> np.ndarray:
    """Reference float32 -> bfloat16 bits (uint16): round to nearest even, NaN -> quiet NaN."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    quiet_nan = ((u >> 16) | np.uint32(0x40)).astype(np.uint16)
    return np.where(np.isnan(x), quiet_nan, rounded)


def bf16_to_f32(h: np.ndarray) -> np.ndarray:
    """Reference bfloat16 bits (uint16) -> float32 (exact)."""
    return (np.asarray(h, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


@pytest.fixture
def bf16_round() -> Callable[[np.ndarray], np.ndarray]:
    return bf16_from_f32


@pytest.fixture
def bf16_widen() -> Callable[[np.ndarray], np.ndarray]:
    return bf16_to_f32


def unaligned(n: int, dtype: np.dtype | str, offset: int) -> np.ndarray:
    """A writable array of n elements whose data starts `offset` bytes into a bytearray."""
    dt = np.dtype(dtype)
    raw = bytearray(n * dt.itemsize + offset)
    return np.frombuffer(raw, dtype=dt, count=n, offset=offset)


@pytest.fixture
def make_unaligned() -> Callable[[int, np.dtype | str, int], np.ndarray]:
    return unaligned


def assert_same_bits(got: np.ndarray, want: np.ndarray, *, nan_payload: bool = False) -> None:
    """Bitwise equality of two float arrays; NaN payloads are only compared when asked."""
    assert got.shape == want.shape and got.dtype == want.dtype
    got_nan, want_nan = np.isnan(got), np.isnan(want)
    np.testing.assert_array_equal(got_nan, want_nan, err_msg="NaN positions differ")
    uint = np.dtype(f"u{got.dtype.itemsize}")
    mask = slice(None) if nan_payload else ~want_nan
    gb, wb = got.view(uint)[mask], want.view(uint)[mask]
    if not np.array_equal(gb, wb):
        bad = np.nonzero(gb != wb)[0][:5]
        raise AssertionError(f"bits differ at {bad.tolist()}: got {[hex(v) for v in gb[bad]]}, "
                             f"want {[hex(v) for v in wb[bad]]}")


@pytest.fixture
def same_bits() -> Callable[..., None]:
    return assert_same_bits
