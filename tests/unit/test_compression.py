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
