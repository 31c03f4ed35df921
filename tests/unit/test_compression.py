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
