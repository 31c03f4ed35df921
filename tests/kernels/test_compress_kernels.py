"""Compression kernels of _core (onebit, top-k, random-k, gather/scatter, dithering) against
numpy / pure-Python references.

NaN/inf policy checked here: onebit takes the sign *bit* (-0.0 and negative NaNs are negative)
and its scale (mean |x|) propagates NaN/inf; top-k ranks by the magnitude bits, so NaN ranks
above inf and both travel as they are; dithering with a non-finite or zero norm encodes every
element as level 0, which decodes to norm * 0 (NaN for a non-finite norm, 0 for a zero norm).
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from byteps_like import _core

SIZES = (1, 7, 1000, 70001)
M64 = (1 << 64) - 1
G = 0x9E3779B97F4A7C15


# ---- references -------------------------------------------------------------------------------

def mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def stream_base(seed: int, key: int, step: int, domain: int) -> int:
    h = mix64((seed + G) & M64)
    h = mix64(h ^ ((key + 2 * G) & M64))
    h = mix64(h ^ ((step + 3 * G) & M64))
    return mix64(h ^ ((domain * G) & M64))


def mix64_np(z: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def uniforms(base: int, n: int) -> np.ndarray:
    with np.errstate(over="ignore"):
        ctr = np.uint64(base) + (np.arange(1, n + 1, dtype=np.uint64) * np.uint64(G))
    return (mix64_np(ctr) >> np.uint64(40)).astype(np.float32) * np.float32(1 / 16777216)


def randomk_ref(n: int, k: int, seed: int, key: int, step: int) -> np.ndarray:
    """Floyd's algorithm driven by xoshiro256** with Lemire's bounded draws, in pure Python."""
    s, z = [], stream_base(seed, key, step, 1)
    for _ in range(4):
        z = (z + G) & M64
        s.append(mix64(z))

    def nxt() -> int:
        rot = lambda x, r: ((x << r) | (x >> (64 - r))) & M64  # noqa: E731
        result = (rot((s[1] * 5) & M64, 7) * 9) & M64
        t = (s[1] << 17) & M64
        s[2] ^= s[0]; s[3] ^= s[1]; s[1] ^= s[2]; s[0] ^= s[3]; s[2] ^= t  # noqa: E702
        s[3] = rot(s[3], 45)
        return result

    def below(r: int) -> int:
        m = (nxt() >> 32) * r
        if (m & 0xFFFFFFFF) < r:
            thr = ((1 << 32) - r) % r
            while (m & 0xFFFFFFFF) < thr:
                m = (nxt() >> 32) * r
        return m >> 32

    comp = k > n // 2
    m = n - k if comp else k
    chosen: set[int] = set()
    for j in range(n - m, n):
        t = below(j + 1)
        chosen.add(j if t in chosen else t)
    if comp:
        chosen = set(range(n)) - chosen
    return np.array(sorted(chosen), dtype=np.uint32)


def topk_ref(x: np.ndarray, k: int) -> np.ndarray:
    keys = (x.view(np.uint32) & np.uint32(0x7FFFFFFF)).astype(np.int64)
    return np.sort(np.argsort(-keys, kind="stable")[:k]).astype(np.uint32)


def dither_ref(x: np.ndarray, s: int, natural: bool, norm: np.float32, seed: int, key: int,
               step: int) -> np.ndarray:
    """Level codes (q << 1 | sign) of the C++ quantiser, computed with numpy float32 ops."""
    n = x.size
    if not (norm > 0 and np.isfinite(norm)):
        return np.zeros(n, np.uint32)
    u = uniforms(stream_base(seed, key, step, 2), n)
    a = np.minimum(np.abs(x) / norm, np.float32(1))
    if not natural:
        t = a * np.float32(s)
        lo = np.floor(t)
        q = lo.astype(np.uint32) + (u < t - lo)
    else:
        m, e = np.frexp(a)
        ql = e - 1 + s
        q = np.where(ql >= 1, ql + (u < np.float32(2) * m - np.float32(1)),
                     (u < np.ldexp(a, s - 1)).astype(np.int64))
        q = np.where(a >= 1, s, np.where(a == 0, 0, q)).astype(np.uint32)
    sign = (x.view(np.uint32) >> np.uint32(31)).astype(np.uint32)
    return np.where(q > 0, (q << np.uint32(1)) | sign, 0).astype(np.uint32)


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    planes = ((codes[:, None] >> np.arange(bits, dtype=np.uint32)) & 1).astype(np.uint8)
    return np.packbits(planes.reshape(-1), bitorder="little")


def dither_table(norm: np.float32, s: int, natural: bool) -> np.ndarray:
    q = np.arange(s + 1)
    if not natural:
        return (np.float64(norm) * q / s).astype(np.float32)
    t = np.ldexp(np.full(s + 1, norm, np.float32), (q - s).astype(np.int32))
    t[0] = norm * np.float32(0)
    return t.astype(np.float32)


def bits_of(n: int, s: int) -> int:
    return 1 + s.bit_length()


# ---- onebit -----------------------------------------------------------------------------------

@pytest.mark.parametrize("n", SIZES)
def test_onebit_round_trip(n, isa, make_unaligned):
    rng = np.random.default_rng(n)
    x = make_unaligned(n, np.float32, 3)
    x[...] = rng.standard_normal(n).astype(np.float32)
    x[0] = -0.0
    bits = np.zeros((n + 7) // 8, np.uint8)
    scale = _core.onebit_encode(x, bits, True)
    assert np.array_equal(bits, np.packbits(np.signbit(x), bitorder="little"))
    np.testing.assert_allclose(scale, np.mean(np.abs(x), dtype=np.float64), rtol=1e-6)
    assert _core.onebit_encode(x, bits, False) == 1.0
    want = np.where(np.signbit(x), -np.float32(scale), np.float32(scale)).astype(np.float32)
    out = make_unaligned(n, np.float32, 1)
    _core.onebit_decode(bits, scale, out)
    assert np.array_equal(out, want)
    acc = rng.standard_normal(n).astype(np.float32)
    ref = acc + want
    _core.onebit_decode(bits, scale, acc, add=True)
    assert np.array_equal(acc, ref)


def test_onebit_nonfinite_and_errors():
    x = np.array([1.0, -2.0, np.nan, 3.0], np.float32)
    bits = np.zeros(1, np.uint8)
    assert np.isnan(_core.onebit_encode(x, bits, True))
    out = np.empty(4, np.float32)
    _core.onebit_decode(bits, float("nan"), out)
    assert np.isnan(out).all()
    with pytest.raises(ValueError, match="onebit_encode: bits has 2 bytes, expected 1"):
        _core.onebit_encode(x, np.zeros(2, np.uint8), True)
    with pytest.raises(ValueError, match="onebit_decode: bits has 0 bytes, expected 1"):
        _core.onebit_decode(b"", 1.0, out)
    with pytest.raises(ValueError, match="not a whole number of float32"):
        _core.onebit_encode(bytes(5), bits, True)


# ---- top-k, gather, scatter -------------------------------------------------------------------

@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("frac", [None, 0.001, 0.01, 0.5, 1.0])
def test_topk_select(n, frac):
    rng = np.random.default_rng(n)
    x = rng.standard_normal(n).astype(np.float32)
    k = 3 if frac is None else max(1, min(n, int(frac * n)))
    k = min(k, n)
    idx, val = np.empty(k, np.uint32), np.empty(k, np.float32)
    _core.topk_select(x, idx, val)
    want = topk_ref(x, k)
    assert np.array_equal(idx, want)
    assert np.array_equal(val, x[want])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from([0.0, -0.0, 1.0, -1.0, 2.5, -2.5, np.inf, -np.inf, np.nan,
                                 1e-30, 3.0]), min_size=1, max_size=300), st.data())
def test_topk_ties_and_nonfinite(values, data):
    x = np.array(values, np.float32)
    k = data.draw(st.integers(1, x.size))
    idx, val = np.empty(k, np.uint32), np.empty(k, np.float32)
    _core.topk_select(x, idx, val)
    want = topk_ref(x, k)
    assert np.array_equal(idx, want)
    assert np.array_equal(val.view(np.uint32), x[want].view(np.uint32))


def test_topk_errors():
    with pytest.raises(ValueError, match="k = 5 exceeds n = 4"):
        _core.topk_select(np.zeros(4, np.float32), np.zeros(5, np.uint32), np.zeros(5, np.float32))
    with pytest.raises(ValueError, match="topk_select: idx has 8 bytes, expected 12"):
        _core.topk_select(np.zeros(4, np.float32), np.zeros(2, np.uint32), np.zeros(3, np.float32))


@pytest.mark.parametrize("n", SIZES)
def test_gather_scatter(n):
    rng = np.random.default_rng(n)
    x = rng.standard_normal(n).astype(np.float32)
    idx = rng.integers(0, n, max(1, n // 3)).astype(np.uint32)  # duplicates allowed
    val = np.empty(idx.size, np.float32)
    _core.gather(x, idx, val)
    assert np.array_equal(val, x[idx])
    out = np.full(n, 7.0, np.float32)
    _core.scatter(idx, val, out)
    ref = np.zeros(n, np.float32)
    ref[idx] = val
    assert np.array_equal(out, ref)
    acc = rng.standard_normal(n).astype(np.float32)
    ref = acc.copy()
    np.add.at(ref, idx, val)
    _core.scatter(idx, val, acc, add=True)
    assert np.array_equal(acc, ref)


def test_gather_scatter_bounds():
    out = np.ones(10, np.float32)
    idx = np.array([1, 10, 2], np.uint32)
    with pytest.raises(IndexError, match="scatter: index 10 at position 1 is out of range for 10"):
        _core.scatter(idx, np.ones(3, np.float32), out, add=True)
    assert np.array_equal(out, np.ones(10, np.float32))  # checked before any write
    with pytest.raises(IndexError, match="gather: index 4294967295"):
        _core.gather(out, np.array([0xFFFFFFFF], np.uint32), np.empty(1, np.float32))
    with pytest.raises(ValueError, match="scatter: idx has 8 bytes, expected 12"):
        _core.scatter(np.zeros(2, np.uint32), np.zeros(3, np.float32), out)


# ---- random-k ---------------------------------------------------------------------------------

@pytest.mark.parametrize("n,k", [(1, 1), (7, 3), (7, 5), (1000, 10), (1000, 999), (1000, 1000),
                                 (70001, 700), (5, 0)])
def test_randomk_indices_match_reference(n, k):
    idx = np.empty(k, np.uint32)
    _core.randomk_indices(n, 42, 7, 3, idx)
    assert np.array_equal(idx, randomk_ref(n, k, 42, 7, 3))


def test_randomk_properties():
    n, k = 70001, 7000
    a, b, c = (np.empty(k, np.uint32) for _ in range(3))
    _core.randomk_indices(n, 1, 2, 3, a)
    _core.randomk_indices(n, 1, 2, 3, b)
    _core.randomk_indices(n, 1, 2, 4, c)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    assert np.all(np.diff(a.astype(np.int64)) > 0) and a[-1] < n
    # roughly uniform: each tenth of the range gets about k/10 picks
    counts = np.bincount(a // (n // 10 + 1), minlength=10)
    assert np.all(np.abs(counts - k / 10) < 5 * np.sqrt(k / 10))
    with pytest.raises(ValueError, match="k = 8 exceeds n = 7"):
        _core.randomk_indices(7, 0, 0, 0, np.empty(8, np.uint32))


# ---- dithering --------------------------------------------------------------------------------

CASES = [(s, nat, l2) for s, nat in [(1, False), (3, False), (16, False), (255, False),
                                     (1, True), (4, True), (8, True)] for l2 in (False, True)]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("s,natural,l2", CASES)
def test_dither_matches_reference(n, s, natural, l2, isa):
    # every kernel level (the AVX-512 path and the scalar fallback) gives the same bits
    rng = np.random.default_rng(n + s)
    x = (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 2, n)).astype(np.float32)
    body = np.empty(_core.dither_bytes(n, s), np.uint8)
    assert body.size == (n * bits_of(n, s) + 7) // 8
    norm = np.float32(_core.dither_encode(x, body, s, natural, l2, 5, 6, 7))
    if l2:
        np.testing.assert_allclose(norm, np.sqrt(np.sum(x.astype(np.float64) ** 2)), rtol=1e-6)
    else:
        assert norm == np.max(np.abs(x))
    codes = dither_ref(x, s, natural, norm, 5, 6, 7)
    assert np.array_equal(body, pack_codes(codes, bits_of(n, s)))
    table = dither_table(norm, s, natural)
    want = table[codes >> 1]
    want = np.where(codes & 1, -want, want).astype(np.float32)
    out = np.empty(n, np.float32)
    _core.dither_decode(body, norm, out, s, natural)
    assert np.array_equal(out, want)
    acc = np.ones(n, np.float32)
    _core.dither_decode(body, norm, acc, s, natural, add=True)
    assert np.array_equal(acc, np.float32(1) + want)


def test_dither_is_unbiased():
    x = np.linspace(-1, 1, 1001, dtype=np.float32)
    total = np.zeros_like(x, dtype=np.float64)
    body = np.empty(_core.dither_bytes(x.size, 4), np.uint8)
    out = np.empty_like(x)
    for step in range(400):
        norm = _core.dither_encode(x, body, 4, False, False, 0, 0, step)
        _core.dither_decode(body, norm, out, 4, False)
        total += out
    assert np.abs(total / 400 - x).max() < 0.1


def test_dither_nonfinite_and_errors():
    body = np.empty(_core.dither_bytes(3, 4), np.uint8)
    out = np.empty(3, np.float32)
    for x, check in ((np.array([1, np.nan, 2], np.float32), np.isnan),
                     (np.array([1, np.inf, 2], np.float32), np.isnan),
                     (np.zeros(3, np.float32), lambda v: v == 0)):
        norm = _core.dither_encode(x, body, 4, False, False, 0, 0, 0)
        assert not body.any()
        _core.dither_decode(body, norm, out, 4, False)
        assert check(out).all()
    with pytest.raises(ValueError, match="levels must be in"):
        _core.dither_encode(np.zeros(3, np.float32), np.empty(_core.dither_bytes(3, 200), np.uint8),
                            200, True, False, 0, 0, 0)
    with pytest.raises(ValueError, match="dither_decode: body has 3 bytes"):
        _core.dither_decode(bytes(3), 1.0, out, 4, False)
    bad = bytes([0b11101110, 0b1110, 0])[:_core.dither_bytes(3, 4)]
    with pytest.raises(ValueError, match="level 7 of element 0 exceeds levels = 4"):
        _core.dither_decode(bad, 1.0, out, 4, False)
    with pytest.raises(ValueError, match="nonzero padding bits"):
        _core.dither_decode(bytes([0, 0b00010000]), 1.0, out, 4, False)
