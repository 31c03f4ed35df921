"""Top-k selection at partition sizes (compress_topk.cc): the sampled threshold, the histogram
fallback when the sample's guess fails either way, and the error-feedback fusion, each against
numpy's stable sort (ties to the lower index; keys are the bits without the sign, so NaN ranks
above inf), bit for bit, on every kernel level."""
from __future__ import annotations

import numpy as np
import pytest

from byteps_like import _core
from byteps_like import compression as C

from .test_compress_kernels import mix64_np, topk_ref

N = 1 << 20  # one 4 MiB partition: above the size where the sampled path starts (65536)
SAMPLE, RUN = 8192, 8  # compress_topk.cc's kSample and kRun, for the planted-sample case


def select(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    idx, val = np.empty(k, np.uint32), np.empty(k, np.float32)
    _core.topk_select(x, idx, val)
    return idx, val


def check_select(x: np.ndarray, k: int) -> None:
    idx, val = select(x, k)
    want = topk_ref(x, k)
    assert np.array_equal(idx, want)
    assert np.array_equal(val.view(np.uint32), x[want].view(np.uint32))


def ef_ref(x: np.ndarray, r: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """y = x + r; the top k of y; r = y with y[idx] - val at the chosen entries."""
    y = x + r
    idx = topk_ref(y, k)
    val = y[idx]
    res = y.copy()
    with np.errstate(invalid="ignore"):
        res[idx] = y[idx] - val
    return idx, val, res


def check_ef(x: np.ndarray, r: np.ndarray, k: int) -> None:
    want_idx, want_val, want_r = ef_ref(x, r, k)
    idx, val = np.empty(k, np.uint32), np.empty(k, np.float32)
    _core.topk_ef_encode(x, r, idx, val)
    assert np.array_equal(idx, want_idx)
    assert np.array_equal(val.view(np.uint32), want_val.view(np.uint32))
    assert np.array_equal(r.view(np.uint32), want_r.view(np.uint32))


def randn(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


@pytest.mark.parametrize("k", [1, 2, 10, N // 1000, N // 100, N // 20, N // 2, N - 1, N])
def test_select_random(isa, k):
    check_select(randn(N), k)


def test_select_negative_and_mixed_signs(isa):
    x = randn(N, 1)
    check_select(-np.abs(x), N // 100)  # every entry negative: magnitude decides, not value
    x[::3] *= -1e3
    check_select(x, N // 100)


@pytest.mark.parametrize("k", [1, N // 100, N - 1])
def test_select_all_equal(isa, k):
    """Every key ties: the k lowest indices (the sample's guess admits everything, past its
    bound, so the histogram decides)."""
    for v in (2.5, -2.5, 0.0):
        x = np.full(N, v, np.float32)
        idx, val = select(x, k)
        assert np.array_equal(idx, np.arange(k, dtype=np.uint32))
        assert np.array_equal(val.view(np.uint32), x[:k].view(np.uint32))


def test_select_ties_at_the_threshold(isa):
    """Few distinct magnitudes, both signs, so the k-th key has thousands of ties around it."""
    rng = np.random.default_rng(2)
    x = rng.integers(-6, 7, N).astype(np.float32)
    for k in (1, 1000, N // 100, N // 7 + 3, N // 2):
        check_select(x, k)
    x = np.zeros(N, np.float32)  # almost all zero: the k-th key is 0 (a sparse gradient)
    x[rng.choice(N, 500, replace=False)] = rng.standard_normal(500)
    check_select(x, N // 100)


@pytest.mark.parametrize("nonzero", [0, 1, 500, N // 100 - 1, N // 100, N // 100 + 7, N // 40])
def test_select_sparse(isa, nonzero):
    """A server's sum of top-k pushes is mostly zeros: with fewer than k nonzero entries the
    k-th key is 0 and the lowest-index zeros (+0.0 and -0.0 alike, their sign kept) fill up."""
    rng = np.random.default_rng(nonzero)
    x = np.zeros(N, np.float32)
    x[rng.choice(N, N // 3, replace=False)] = -0.0
    x[rng.choice(N, nonzero, replace=False)] = rng.standard_normal(nonzero) + np.float32(3)
    check_select(x, N // 100)
    r = np.zeros(N, np.float32)
    r[rng.choice(N, 50, replace=False)] = -0.0
    check_ef(x, r, N // 100)
    x[-1] = 9.0  # a nonzero entry after every zero that is taken
    check_select(x, N // 100)


def test_select_nonfinite(isa):
    """NaN (either sign, any payload) ranks above inf, inf above every finite value."""
    x = randn(N, 3)
    rng = np.random.default_rng(3)
    spots = rng.choice(N, 4000, replace=False)
    x[spots[:1000]] = np.inf
    x[spots[1000:2000]] = -np.inf
    x[spots[2000:3000]] = np.nan
    x.view(np.uint32)[spots[3000:]] = np.uint32(0xFFC00001) + np.arange(1000, dtype=np.uint32)
    for k in (1, 500, 2500, N // 100, N // 2):
        check_select(x, k)


def test_select_when_the_sample_guesses_too_high(isa):
    """Large values planted exactly where the sampler looks (fewer than k of them): its guess
    admits fewer than k candidates, and the histogram path must still find the true top k."""
    x = randn(N, 4)
    runs, stride = SAMPLE // RUN, N // (SAMPLE // RUN)
    at = (np.arange(runs, dtype=np.uint64) * np.uint64(stride)
          + mix64_np(np.arange(runs, dtype=np.uint64)) % np.uint64(stride - RUN + 1))
    planted = (at[:, None] + np.arange(RUN, dtype=np.uint64)).reshape(-1).astype(np.int64)
    x[planted] = 100.0 + np.arange(planted.size, dtype=np.float32)
    k = planted.size + N // 200  # more than was planted: the rest are ordinary values
    check_select(x, k)


def test_select_when_the_sample_guesses_too_low(isa):
    """Values the sampler never sees are the top k: its guess admits far more candidates."""
    x = np.full(N, 1.0, np.float32)
    x[N // 2:N // 2 + 40] = 5.0  # one contiguous run between sample runs is possible
    x[::2] = 0.5
    check_select(x, N // 100)


@pytest.mark.parametrize("k", [1, N // 100, N // 3, N - 1, N])
def test_ef_encode_matches_the_three_steps(isa, k):
    x, r = randn(N, 5), randn(N, 6) * np.float32(0.1)
    r[::97] = np.inf  # an inf residual chosen at the top: y - val there is NaN
    for _ in range(3):  # the residual carried over steps
        check_ef(x, r, k)


def test_ef_encode_small_and_errors(isa):
    for n, k in ((1, 1), (7, 3), (1000, 10), (70001, 700)):
        check_ef(randn(n, n), randn(n, n + 1), k)
    with pytest.raises(ValueError, match="topk_ef_encode: k = 5 exceeds n = 4"):
        _core.topk_ef_encode(np.zeros(4, np.float32), np.zeros(4, np.float32),
                             np.zeros(5, np.uint32), np.zeros(5, np.float32))
    with pytest.raises(ValueError, match="topk_ef_encode: r has 8 bytes, expected 16"):
        _core.topk_ef_encode(np.zeros(4, np.float32), np.zeros(2, np.float32),
                             np.zeros(1, np.uint32), np.zeros(1, np.float32))


def test_ef_codec_payload_and_residual_are_the_reference():
    """The worker codec (Python) and the server's (C++) give the reference's payload and
    residual at a partition's size, step after step."""
    comp = C.from_spec({"name": "ef", "inner": {"name": "topk", "k": 0.01}})
    py = comp.make_codec(N, role="worker", key=3)
    native = _core.NativeCodec(C.native_params(comp, N), 3, N)
    out = np.empty(native.max_bytes, np.uint8)
    k = py.inner.k
    r = np.zeros(N, np.float32)
    for step in range(3):
        x = randn(N, 10 + step)
        want_idx, want_val, r_next = ef_ref(x, r, k)
        payload = np.array(py.encode(x, step), copy=True)
        body = payload[C.HEADER_BYTES:]
        assert np.array_equal(body[:4 * k].view(np.uint32), want_idx)
        assert np.array_equal(body[4 * k:].view(np.uint32), want_val.view(np.uint32))
        assert np.array_equal(py.residual.view(np.uint32), r_next.view(np.uint32))
        native.encode(x, step, out)
        assert np.array_equal(out, payload)
        r = r_next
