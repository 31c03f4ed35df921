"""Cast compressors (``Compression.fp16``, ``bf16``) in the worker: the cast travels with the
transfer.

A float tensor pushed with a cast compressor travels, and is summed by the servers, in the
narrower dtype (float16 or bfloat16), exactly as if the caller had converted it first. A
host tensor of several partitions in a distributed job of one local rank converts partition by
partition. A float32 one is a single native operation: the native client narrows each
partition before its push and widens the sum after its pull on its codec threads
(``_core.NativeCast``; ``Rounds.start``, :mod:`.dataplane`), and nothing here runs for it. For
another float dtype (float64; bfloat16 under fp16) the conversion is part of each partition's
itinerary in the pipeline: COMPRESS narrows the partition of the caller's input into its slice
of the tensor's wire buffer just before its push, and DECOMPRESS widens the pulled (and
averaged) sum into the caller's output, on the codec thread pool (``BYTEPS_CODEC_THREADS``). So
partition i converts while partition i-1 is on the wire, and nothing is converted in the
caller's thread. The conversion is elementwise, so the bits are those of a whole-tensor
conversion.

Elsewhere (a tensor of one partition, which has nothing to overlap; a standalone job; several
local ranks per machine, whose local reduction sums the narrowed tensors) the tensor is
converted whole before the push and back in ``wait()`` (``Handle.convert``), with
:func:`cast_threads` threads.

Who calls it: ``Rounds.push_pull`` (:func:`cast_of`, :func:`check_host`,
:func:`spans_partitions`, :func:`push_pull_whole`), ``Rounds.start`` (:func:`wire_buffer`,
:func:`element_slice`) and the COMPRESS / DECOMPRESS stages (:func:`narrow`, :func:`widen`).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ..wire import ITEMSIZE

if TYPE_CHECKING:
    from ..compression import _CastCompressor
    from .handle import Handle
    from .pipeline import Task
    from .tensors import TensorState

#: the most threads one whole-tensor conversion takes (the kernel also keeps >= 256 KiB each)
MAX_CAST_THREADS = 8


def cast_of(compression: Any, dtype: str) -> _CastCompressor | None:
    """The cast compressor that applies to a tensor of ``dtype``: ``compression`` when it is a
    cast compressor that converts ``dtype`` (floats; never integers), else None."""
    if getattr(compression, "kind", None) != "cast":
        return None
    return compression if compression.wire_dtype(dtype) != dtype else None


def check_host(cast: _CastCompressor, name: str | None, device: Any, prereduced: bool) -> None:
    """A cast compressor converts host tensors: ValueError for ``device=`` or ``prereduced=``."""
    if device is not None or prereduced:
        what = f"push_pull of {name!r}" if name else "push_pull"
        raise ValueError(f"{what}: compression={cast!r} takes a host tensor, not device= or "
                         "prereduced=; cast the tensor first (byteps_like.torch casts CUDA "
                         "tensors on the device)")


def spans_partitions(cast: _CastCompressor, dtype: str, count: int, partition_bytes: int) -> bool:
    """Whether a tensor of ``count`` elements of ``dtype`` is more than one partition on the
    wire (``partition.partition_bounds``' cut), so that converting it partition by partition
    overlaps something. One partition is converted whole in the caller's thread: nothing to
    overlap, and the hand-offs to and from the codec threads cost more (measured on the 2-core
    machine, 1 worker + 1 server: a 4 KiB push_pull 60 us whole, 180 us through the stages;
    2 MiB 1.2 ms against 1.5 ms)."""
    isz = ITEMSIZE[cast.wire_dtype(dtype)]
    return count * isz > max(isz, partition_bytes - partition_bytes % isz)


def cast_threads() -> int:
    """Threads of a whole-tensor conversion: the usable CPUs, at most :data:`MAX_CAST_THREADS`."""
    from ..transport.native import usable_cpus
    return max(1, min(MAX_CAST_THREADS, usable_cpus()))


def wire_buffer(st: TensorState) -> np.ndarray:
    """The wire bytes of a cast tensor (``st.nbytes``, its bound wire size), kept with the
    tensor: one round of a name is in flight at a time, so its rounds share it."""
    buf = st.cast_wire
    if buf is None or buf.nbytes != st.nbytes:
        buf = st.cast_wire = np.empty(st.nbytes, np.uint8)
    return buf


def element_slice(arr: np.ndarray, wire_itemsize: int, off: int, nbytes: int) -> np.ndarray:
    """The elements of the caller's flat array ``arr`` that wire bytes ``off .. off+nbytes``
    (of ``wire_itemsize``-byte elements) hold."""
    return arr[off // wire_itemsize:(off + nbytes) // wire_itemsize]


def narrow(task: Task) -> None:
    """COMPRESS of a cast partition: the caller's elements into the partition's wire bytes."""
    cast = task.cast
    assert cast is not None and task.cast_src is not None
    cast.narrow_into(task.push_src.view(cast.wire_np), task.cast_src, task.cast_dtype)


def widen(task: Task) -> None:
    """DECOMPRESS of a cast partition: the pulled (averaged) sum into the caller's output."""
    cast = task.cast
    assert cast is not None and task.cast_dst is not None
    cast.widen_into(task.cast_dst, task.pull_dst.view(cast.wire_np), task.cast_dtype)


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
