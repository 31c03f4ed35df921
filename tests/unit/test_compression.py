"""Compressors written once in the core: none and fp16."""
from __future__ import annotations

import numpy as np
import pytest

from byteps_like.compression import Compression


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_fp16_halves_the_bytes_and_round_trips(dtype):
    x = (np.arange(1000) / 8).astype(dtype)
    wire, wdtype, ctx = Compression.fp16.compress(x, dtype)
    assert wdtype == "float16" and wire.nbytes == x.size * 2
    out = np.empty_like(x)
    Compression.fp16.decompress(wire, ctx, out, dtype)
    assert np.array_equal(out, x)  # multiples of 1/8 below 128 are exact in half precision


def test_fp16_leaves_integers_alone_and_none_is_identity():
    x = np.arange(10, dtype=np.int64)
    wire, wdtype, ctx = Compression.fp16.compress(x, "int64")
    assert wire is x and wdtype == "int64"
    wire, wdtype, _ = Compression.none.compress(x, "int64")
    assert wire is x
    out = np.zeros_like(x)
    Compression.none.decompress(x, None, out, "int64")
    assert np.array_equal(out, x)


def test_cast_kinds_and_engine_helpers():
    from types import SimpleNamespace

    from byteps_like.compression import resolve, split
    assert [c.kind for c in (Compression.none, Compression.fp16, Compression.bf16)] == \
        ["none", "cast", "cast"]
    assert Compression.fp16.spec() == {"name": "fp16"}
    topk = Compression.topk(0.1)
    assert split(topk) == (Compression.none, topk)
    assert split(Compression.fp16) == (Compression.fp16, None)

    def cfg(**kw):
        base = dict(compressor="", k=0.01, error_feedback=False, momentum=0.0, seed=0,
                    onebit_scaling=True, levels=16, partition="linear", normalize="max")
        return SimpleNamespace(compression=SimpleNamespace(**{**base, **kw}))
    assert resolve(Compression.none, cfg()) is Compression.none
    assert resolve(Compression.fp16, cfg(compressor="onebit")) is Compression.fp16
    assert resolve(Compression.none, cfg(compressor="topk", k=5.0, error_feedback=True,
                                         momentum=0.9)).spec() == \
        {"name": "nesterov", "mu": 0.9, "inner": {"name": "ef",
                                                  "inner": {"name": "topk", "k": 5}}}
    assert resolve(None, cfg(compressor="bf16")) is Compression.bf16


def _cast_input(dtype: str, n: int) -> np.ndarray:
    x = np.random.default_rng(5).standard_normal(n) * 3000.0
    if dtype == "bfloat16":
        return (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return x.astype(dtype)


@pytest.mark.parametrize("name,dtype", [("fp16", "float32"), ("fp16", "float64"),
                                        ("fp16", "bfloat16"), ("bf16", "float32"),
                                        ("bf16", "float64")])
def test_casting_partition_by_partition_gives_the_whole_tensor_bits(name, dtype):
    """What the native client does per partition (worker/route.py's NATIVE cast) equals
    one whole-tensor conversion, with any number of threads."""
    c = getattr(Compression, name)
    x = _cast_input(dtype, 300_001)
    whole, wdt, ctx = c.compress(x, dtype)
    assert wdt == c.wire_dtype(dtype) and whole.dtype == c.wire_np
    threaded, _, _ = c.compress(x, dtype, nthreads=4)
    parts = np.empty_like(whole)
    bounds = [*range(0, x.size, 77_777), x.size]
    for a, b in zip(bounds, bounds[1:]):
        c.narrow_into(parts[a:b], x[a:b], dtype)
    assert whole.tobytes() == threaded.tobytes() == parts.tobytes()
    back, back4, back_parts = (np.empty_like(x) for _ in range(3))
    c.decompress(whole, ctx, back, dtype)
    c.decompress(whole, ctx, back4, dtype, nthreads=4)
    for a, b in zip(bounds, bounds[1:]):
        c.widen_into(back_parts[a:b], whole[a:b], dtype)
    assert back.tobytes() == back4.tobytes() == back_parts.tobytes()
    if dtype != "bfloat16":   # (bfloat16's 8 bits fit in float16's 11)
        assert not np.array_equal(back, x)   # lossy here: the test can tell them apart


def test_a_standalone_cast_push_pull_is_the_round_trip():
    """One process: the sum is the input, narrowed and widened back (what it travels as in a
    job); integers are never cast; a cast takes no prereduced (shared) buffer."""
    from byteps_like.worker.runtime import Runtime
    rt = Runtime()
    rt.init()
    try:
        x = _cast_input("float32", 5000)
        out = np.empty_like(x)
        h = rt.push_pull_async(x, name="w", out=out, compression=Compression.fp16)
        assert h.wait() is out and h.wait() is out
        assert np.array_equal(out, x.astype(np.float16).astype(np.float32))
        assert rt.tensors()["w"].dtype == "float16"
        ints = np.arange(10, dtype=np.int64)
        assert np.array_equal(rt.push_pull_async(ints, name="i", average=False,
                                                 compression=Compression.bf16).wait(), ints)
        with pytest.raises(ValueError, match=r"push_pull of 'p': compression=Compression.bf16 "
                                             r"takes a host tensor, not device= or prereduced="):
            rt.push_pull_async(x, name="p", average=False, prereduced=True,
                               compression=Compression.bf16)
    finally:
        rt.shutdown()
