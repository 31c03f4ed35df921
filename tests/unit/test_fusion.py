"""Tensor fusion's bookkeeping (byteps_like.worker.sync): which gradients share a bucket, when a
bucket starts, its name and priority, and the host gather/scatter, against a recording runtime
(no sockets). The distributed, bit-for-bit check is tests/integration/test_fusion.py."""
from __future__ import annotations

import numpy as np
import pytest

from byteps_like.config import Config
from byteps_like.worker.handle import Handle
from byteps_like.worker.sync import GradBuffer, GradientSynchronizer, plan_buckets


def test_buckets_follow_backward_order_and_cap():
    # parameters 0..5 in forward order; backward produces 5 first
    assert plan_buckets([4, 4, 4, 4, 4, 4], [0] * 6, 8) == [[5, 4], [3, 2], [1, 0]]
    # a gradient at least the cap goes alone; the open bucket stays open around it
    assert plan_buckets([4, 100, 4, 4], [0] * 4, 10) == [[3, 2], [1], [0]]
    # fusion off: one bucket per gradient
    assert plan_buckets([4, 4, 4], [0] * 3, 0) == [[2], [1], [0]]


def test_buckets_never_mix_groups():
    sizes, groups = [4] * 6, ["f32", "f16", "f32", "f16", "f32", "f16"]
    buckets = plan_buckets(sizes, groups, 1 << 20)
    assert sorted(map(sorted, buckets)) == [[0, 2, 4], [1, 3, 5]]
    for b in buckets:
        assert len({groups[i] for i in b}) == 1


def test_buckets_cover_every_parameter_once_and_are_deterministic():
    rng = np.random.default_rng(0)
    sizes = [int(x) for x in rng.integers(1, 5000, 300)]
    groups = [int(x) for x in rng.integers(0, 3, 300)]
    a = plan_buckets(sizes, groups, 8192)
    assert sorted(i for b in a for i in b) == list(range(300))
    assert a == plan_buckets(sizes, groups, 8192)
    for b in a:
        assert len(b) == 1 or sum(sizes[i] for i in b) <= 8192
        assert b == sorted(b, reverse=True)  # backward order inside a bucket


class Recorder:
    """A runtime that records push_pulls and completes them at once with a known sum."""

    cfg = Config()  # the defaults: no compressor from the environment

    def __init__(self, size: int = 2):
        self.size = size
        self.declared: list[str] = []
        self.calls: list[tuple[str, int, int]] = []   # (name, priority, elements)
        self.steps = 0

    def declare(self, name: str) -> int:
        self.declared.append(name)
        return len(self.declared) - 1

    def push_pull_async(self, arr, name, average, priority, out, dtype, device=None,
                        compression=None):
        self.calls.append((name, priority, arr.size))
        out[...] = arr * self.size / (self.size if average else 1)  # every worker alike
        h = Handle(name, arr, out, 0, default_timeout=1.0)
        return h

    def note_step(self, group: str) -> None:
        self.steps += 1


def make_sync(rt, grads, fusion_bytes, **kw):
    names = [f"p{i}" for i in range(len(grads))]
    return GradientSynchronizer(rt, names, lambda i: GradBuffer(grads[i]),
                                layout=[(g.nbytes, g.dtype.str) for g in grads],
                                fusion_bytes=fusion_bytes, **kw)


def test_a_bucket_starts_when_its_last_gradient_is_ready():
    rt = Recorder()
    grads = [np.full(4, float(i + 1), np.float32) for i in range(6)]
    sync = make_sync(rt, grads, 32)  # 16-byte gradients, two per bucket
    assert [b.members for b in sync.buckets] == [[1, 0], [3, 2], [5, 4]]
    # declared first layer first, so keys follow the forward order as unfused gradients did
    assert rt.declared == ["Gradient.Fused.p1+1", "Gradient.Fused.p3+1", "Gradient.Fused.p5+1"]
    sync.ready(5)
    assert rt.calls == []
    sync.ready(4)
    assert rt.calls == [("Gradient.Fused.p5+1", -4, 8)]  # its most urgent member's priority
    sync.ready(3)
    sync.ready(2)
    sync.ready(1)
    assert len(rt.calls) == 2
    sync.synchronize()   # starts what is left (parameter 0 had no gradient), waits, scatters
    assert [c[0] for c in rt.calls][-1] == "Gradient.Fused.p1+1"
    for i, g in enumerate(grads):
        assert np.array_equal(g, np.full(4, float(i + 1), np.float32))  # averaged: unchanged
    assert sync.in_flight == 0 and rt.steps == 1


def test_sums_land_in_each_gradient_and_strided_gradients_work():
    rt = Recorder()
    base = np.arange(24, dtype=np.float64).reshape(4, 6)
    strided = base[:, ::2]          # not contiguous: gathered and scattered through numpy
    grads = [np.ones(3), strided, np.full((2, 2), 3.0)]
    sync = make_sync(rt, grads, 1 << 20, average=False)
    assert len(sync.buckets) == 1 and sync.buckets[0].fused
    want = [g * 2 for g in grads]
    sync.synchronize()
    for g, w in zip(grads, want):
        assert np.array_equal(g, w)
    assert np.array_equal(base[:, ::2], want[1])  # written through the view


def test_backward_passes_per_step_and_fusion_off():
    rt = Recorder()
    grads = [np.ones(4, np.float32) for _ in range(3)]
    sync = make_sync(rt, grads, 0, backward_passes_per_step=2)
    assert [b.name for b in sync.buckets] == ["Gradient.p0", "Gradient.p1", "Gradient.p2"]
    sync.ready(2)
    assert rt.calls == []
    sync.ready(2)
    assert rt.calls == [("Gradient.p2", -2, 4)]
    with pytest.raises(Exception, match="backward_passes_per_step"):
        sync.ready(2)


def test_codec_compression_travels_unfused():
    from byteps_like.compression import Compression
    rt = Recorder()
    grads = [np.ones(4, np.float32) for _ in range(3)]
    sync = make_sync(rt, grads, 1 << 20, compression=Compression.onebit())
    assert all(not b.fused for b in sync.buckets)


def test_chunk_ranges_cover_a_large_bucket_in_near_equal_pieces():
    from byteps_like.torch.fusion import chunk_ranges
    assert chunk_ranges(1000, 4, 0) == [(0, 1000)]          # no chunking
    assert chunk_ranges(1000, 4, 4000) == [(0, 1000)]       # fits exactly
    r = chunk_ranges(1001, 4, 4000)                         # one element over: two halves
    assert r == [(0, 500), (500, 1001)]
    big = chunk_ranges(102_760_448, 4, 16 << 20)             # VGG-16's classifier weight
    assert len(big) == 25 and big[0][0] == 0 and big[-1][1] == 102_760_448
    assert all(a[1] == b[0] for a, b in zip(big, big[1:]))  # contiguous, no gap or overlap
    sizes = [hi - lo for lo, hi in big]
    assert max(sizes) * 4 <= 16 << 20 and max(sizes) - min(sizes) <= 1


def test_torch_layout_counts_wire_bytes():
    """A bucket holds BYTEPS_FUSION_BYTES of wire bytes: under a cast compressor a float32
    gradient counts half (else fp16 buckets would be half the size on the wire, twice as many
    operations); codecs and integer tensors count as they are."""
    import torch

    from byteps_like.compression import Compression
    from byteps_like.torch.fusion import layout
    ps = [torch.zeros(10), torch.zeros(3, dtype=torch.float64), torch.zeros(4, dtype=torch.int64)]
    assert [(n, w) for n, _, w in layout(ps)] == [(40, 40), (24, 24), (32, 32)]
    assert [w for _, _, w in layout(ps, Compression.fp16)] == [20, 6, 32]
    assert [w for _, _, w in layout(ps, Compression.bf16)] == [20, 6, 32]
    assert [w for _, _, w in layout(ps, Compression.topk(0.01))] == [40, 24, 32]
    assert layout(ps)[0][1] == ("torch.float32", "cpu")


def test_dtype_layout_counts_wire_bytes_under_a_cast_compressor():
    """TensorFlow, Keras and MXNet describe gradients as (bytes, dtype): the cap of a bucket
    counts their wire bytes, as the PyTorch layout does."""
    from byteps_like.compression import Compression
    from byteps_like.worker.sync import dtype_layout
    entries = [(40, "float32"), (24, "float64"), (32, "int64"), (20, "bfloat16")]
    assert dtype_layout(entries, None, None) == [(40, "float32", 40), (24, "float64", 24),
                                                 (32, "int64", 32), (20, "bfloat16", 20)]
    assert [w for _, _, w in dtype_layout(entries, Compression.fp16, None)] == [20, 6, 32, 20]
    assert [w for _, _, w in dtype_layout(entries, Compression.bf16, None)] == [20, 6, 32, 20]
    cfg = Config()  # no BYTEPS_COMPRESSOR: the code's choice stands
    assert [w for _, _, w in dtype_layout(entries, Compression.topk(0.01), cfg)] == [40, 24, 32,
                                                                                     20]
