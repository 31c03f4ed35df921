"""Cast compressors (``Compression.fp16``, ``bf16``) on the host: the whole-tensor conversion.

A float tensor pushed with a cast compressor travels, and is summed by the servers, in the
narrower dtype (float16 or bfloat16), exactly as if the caller had converted it first. Where the
conversion happens is the route plan's choice (:mod:`.route`, :class:`~.route.Cast`), one place
per side:

* on the device: a plugin copies a CUDA tensor into its flat wire-dtype buffer
  (``byteps_like/torch/fusion.py``), and no host code converts it;
* on the host, a float32 tensor of several partitions in a distributed job of one local rank on
  the native data plane: the native client narrows each partition before its push and widens
  the sum after its pull on its codec threads (``_core.NativeCast``; ``Rounds.start``,
  :mod:`.dataplane`), so partition i converts while partition i-1 is on the wire;
* on the host, everything else (one partition, which has nothing to overlap; float64 or
  bfloat16 under fp16; a standalone job; several local ranks, whose local reduction sums the
  narrowed tensors): here, :func:`push_pull_whole`, the tensor narrowed whole before the push
  and widened back in ``wait()`` (``Handle.convert``), with :func:`cast_threads` threads.

The conversion is elementwise, so the bits do not depend on where it runs.

Who calls it: ``Rounds.push_pull`` (:func:`push_pull_whole`).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from ..compression import _CastCompressor
    from .handle import Handle

#: the most threads one whole-tensor conversion takes (the kernel also keeps >= 256 KiB each)
MAX_CAST_THREADS = 8


def cast_threads() -> int:
    """Threads of a whole-tensor conversion: the usable CPUs, at most :data:`MAX_CAST_THREADS`."""
    from ..transport.native import usable_cpus
    return max(1, min(MAX_CAST_THREADS, usable_cpus()))


def push_pull_whole(start: Callable[[np.ndarray, str], Handle], cast: _CastCompressor,
                    arr: np.ndarray, out: np.ndarray, dtype: str) -> Handle:
    """A cast push_pull converted whole: narrow ``arr`` (threads), ``start(wire, wire_dtype)``
    the push_pull of the wire array in place, widen into ``out`` in the handle's first
    ``wait()`` (:attr:`Handle.convert <byteps_like.worker.handle.Handle.convert>`)."""
    nthreads = cast_threads()
    wire, wdtype, ctx = cast.compress(arr, dtype, nthreads=nthreads)
    h = start(wire, wdtype)
    h.input, h.output = arr, out
    h.convert = lambda: cast.decompress(wire, ctx, out, dtype, nthreads=nthreads)
    return h
