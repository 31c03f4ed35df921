"""A tensor's route, decided once: :func:`plan_route` is the one place that chooses how a
push_pull travels.

It is a pure function of what the tensor is (:class:`TensorFacts`: device, dtype, size, name,
layout, whether the plugin can reduce it with NCCL), what the job is (:class:`JobFacts`: the
topology and the settings that matter) and the compressor the tensor travels with. It returns
a frozen :class:`RoutePlan`:

* ``staging``: where the bytes are while they travel (:data:`HOST`: the caller's host memory or
  a host copy; :data:`DEVICE_PARTITIONS`: a pinned host buffer filled and emptied partition by
  partition by the pipeline's device copies; :data:`DEVICE_CHUNKS`: a flat device buffer moved
  in chunks of at most ``chunk_bytes``, one push_pull each; :data:`NCCL`: reduced among the
  machine's GPUs first; :data:`IDENTITY`: a job of one process, the sum is the input);
* ``cast``: where and how an fp16/bf16 compressor converts (:class:`Cast`), in one place per
  side: on the device (the plugin's copy into its flat buffer, :data:`ON_DEVICE`), or on the
  host, either by the native client's codec threads partition by partition (:data:`NATIVE`: a
  float32 tensor of several partitions on the native plane) or whole, before the push and back
  in ``wait()`` (:data:`WHOLE`: everything else);
* ``codec``: the codec compressor (onebit, top-k, ...) that runs on the host partitions, or
  None (too small, not a float, standalone); where it runs (the native client for a compiled
  codec, else the pipeline) is :meth:`RoutePlan.submit`'s answer once the name's codecs exist;
* ``local_reduce``: how the machine's ranks are summed first (:data:`SHM` or :data:`NCCL`);
* ``itinerary``: the pipeline stages of each partition (:func:`.pipeline.itinerary`).

The executors only follow the plan: :class:`~.rounds.Rounds` for the host side (binding,
the cast, and the native operation or pipeline tasks the plan names), and a framework plugin
for the device side (``byteps_like/torch/ops.py`` and ``fusion.py``: memory, streams,
events). Nothing else chooses a route. The codec is an input (``compression``): a per-tensor
choice of codec (automatic compression) is made before :func:`plan_route` and handed to it.

Who calls it: ``Rounds.push_pull`` (every host push_pull, :meth:`~.rounds.Rounds.plan`; it
converts a :data:`WHOLE` cast itself), the PyTorch plugin (``torch/ops.py``,
``torch/fusion.py``) through ``Runtime.plan``, and the gradient synchronizer (``sync.py``:
:func:`fuses`). tests/unit/test_route.py covers the table.
"""
from __future__ import annotations

from typing import Any, NamedTuple

from ..wire import ITEMSIZE
from .pipeline import COMPRESS, DECOMPRESS, PULL, PUSH, Stage, itinerary
from .tensors import COMPRESSIBLE

# -- staging ------------------------------------------------------------------------------------
HOST = "host"
DEVICE_PARTITIONS = "device-partitions"
DEVICE_CHUNKS = "device-chunks"
NCCL = "nccl"
IDENTITY = "identity"

# -- where and how a cast converts --------------------------------------------------------------
ON_DEVICE = "device"     # the plugin's copy into its flat wire-dtype buffer, and back
NATIVE = "native"        # host: the native client's codec threads, partition by partition
WHOLE = "whole"          # host: the whole tensor before the push, back in wait()

# -- local reduction ----------------------------------------------------------------------------
SHM = "shm"              # the machine's shared reduction buffer (REDUCE / BROADCAST stages)

# -- how the host side submits a round (RoutePlan.submit) ---------------------------------------
COPY = "copy"                  # no servers: the sum is the input
NATIVE_WHOLE = "native"        # one native operation for the whole tensor
NATIVE_CAST = "native-cast"    # one native operation, cast on the client's codec threads
NATIVE_CODED = "native-coded"  # one native operation, a compiled codec on its codec threads
PIPELINE = "pipeline"          # one pipeline task per partition

_CODED = (COMPRESS, PUSH, PULL, DECOMPRESS)


class TensorFacts(NamedTuple):
    """What the planner needs of a tensor. ``dtype``: its wire name (``wire.ITEMSIZE``'s);
    ``device``: ``"cpu"`` for host memory, else the device's type (``"cuda"``);
    ``contiguous``: the input and the output both are; ``nccl``: the plugin can reduce it among
    the machine's GPUs (torch.distributed with NCCL); ``staged``: a host buffer whose partitions
    the pipeline copies from and to a device (``push_pull_async(device=...)``);
    ``prereduced``: the machine's sum already in its shared reduction buffer."""
    dtype: str
    elements: int
    device: str = "cpu"
    name: str | None = "tensor"
    contiguous: bool = True
    nccl: bool = False
    staged: bool = False
    prereduced: bool = False

    @property
    def named(self) -> bool:
        """A named tensor (an unnamed push_pull takes a new key each call)."""
        return self.name is not None


class JobFacts(NamedTuple):
    """What the planner needs of the job (``Rounds.job``)."""
    distributed: bool = False      # a scheduler (not standalone)
    single_machine: bool = False   # one worker machine: nothing leaves it
    local_size: int = 1
    local_root: bool = True        # the rank that talks to the servers
    native: bool = False           # the native data plane's client is connected
    partition_bytes: int = 4096000
    fusion_bytes: int = 0          # BYTEPS_FUSION_BYTES: a device buffer's chunk size
    min_compress_bytes: int = 0

    @property
    def alone(self) -> bool:
        """One process on one machine: a push_pull is the identity."""
        return self.single_machine and self.local_size == 1

    @property
    def device_pipeline(self) -> bool:
        """The pipeline stages device partitions (a distributed job, one local rank)."""
        return self.distributed and self.local_size == 1 and not self.alone


class Cast(NamedTuple):
    """A cast compressor's conversion: ``dtype`` -> ``wire_dtype`` at ``where`` (:data:`ON_DEVICE`,
    :data:`NATIVE`, :data:`WHOLE`)."""
    compressor: Any
    dtype: str
    wire_dtype: str
    where: str


class RoutePlan(NamedTuple):
    """How one push_pull travels (see the module docstring)."""
    staging: str
    wire_dtype: str
    cast: Cast | None = None
    codec: Any = None
    local_reduce: str | None = None
    chunk_bytes: int = 0
    itinerary: tuple[Stage, ...] = ()
    servers: bool = True           # the round reaches the servers (not standalone, not alone)
    gathered: bool = False         # a bucket the plugin gathers into a flat device buffer

    def submit(self, *, compiled: bool = False, native: bool = True) -> str:
        """How the host side starts a round: :data:`COPY`, :data:`NATIVE_WHOLE`,
        :data:`NATIVE_CAST`, :data:`NATIVE_CODED` or :data:`PIPELINE`. ``compiled``: the name's
        codecs (bound at its first round) are all compiled, so the native client runs them;
        ``native``: the native client is connected (when the round starts)."""
        if not self.servers:
            return COPY
        if self.cast is not None and self.cast.where == NATIVE:
            return NATIVE_CAST
        if native and self.itinerary == (PUSH, PULL):
            return NATIVE_WHOLE
        if native and compiled and self.itinerary == _CODED:
            return NATIVE_CODED
        return PIPELINE


def fuses(compression: Any) -> bool:
    """Whether gradients under ``compression`` may travel fused in buckets: not with a codec
    (onebit, top-k, ...), whose scale, error feedback and selection are per tensor."""
    return getattr(compression, "kind", "none") != "codec"


def spans_partitions(wire_dtype: str, count: int, partition_bytes: int) -> bool:
    """Whether ``count`` elements of ``wire_dtype`` are more than one partition on the wire
    (``partition.partition_bounds``' cut), so that converting them partition by partition
    overlaps something. One partition converts whole: nothing to overlap, and the hand-offs
    cost more than they save."""
    isz = ITEMSIZE[wire_dtype]
    return count * isz > max(isz, partition_bytes - partition_bytes % isz)


def _cast_for(compression: Any, dtype: str) -> tuple[Any, str]:
    """(the cast compressor that converts ``dtype`` or None, the wire dtype)."""
    if getattr(compression, "kind", None) != "cast":
        return None, dtype
    wire = compression.wire_dtype(dtype)
    return (compression, wire) if wire != dtype else (None, dtype)


def _what(name: str | None) -> str:
    return f"push_pull of {name!r}" if name else "push_pull"


def plan_route(t: TensorFacts, job: JobFacts, compression: Any = None, *,
               bucket: bool = False) -> RoutePlan:
    """The route of one push_pull (the module docstring says what a plan holds).
    ``compression``: the compressor the tensor travels with (None or ``Compression.none``:
    none); ``bucket``: the tensor is a bucket of gradients that a plugin may gather into a flat
    device buffer itself (``torch/fusion.py``). Pure: no job is needed. ValueError for a cast
    of a tensor the pipeline stages from a device or that arrives prereduced."""
    kind = getattr(compression, "kind", "none")
    cast, wire = _cast_for(compression, t.dtype)
    codec = compression if kind == "codec" else None
    if t.device != "cpu":
        plan = _device_plan(t, job, kind, cast, wire, codec, bucket)
        if plan is not None:
            return plan
        # else the device tensor travels through host memory: as staged pipeline partitions,
        # or as a host copy (the plugin stages it)
        if kind != "cast" and t.contiguous and t.device == "cuda" and job.device_pipeline:
            return _host_plan(t, job, None, t.dtype, codec, staging=DEVICE_PARTITIONS)
        return _host_plan(t, job, cast, wire, codec, staging=HOST)
    if cast is not None and (t.staged or t.prereduced):
        raise ValueError(f"{_what(t.name)}: compression={compression!r} takes a host tensor, "
                         "not device= or prereduced=; cast the tensor first (byteps_like.torch "
                         "casts CUDA tensors on the device)")
    return _host_plan(t, job, cast, wire, codec,
                      staging=DEVICE_PARTITIONS if t.staged else HOST)


def _device_plan(t: TensorFacts, job: JobFacts, kind: str, cast: Any, wire: str, codec: Any,
                 bucket: bool) -> RoutePlan | None:
    """A device tensor's route where it stays on the device until its bytes move (NCCL, a flat
    buffer in chunks, or nothing to move); None where it goes through host memory."""
    nccl = t.nccl and t.device == "cuda" and job.distributed and job.local_size > 1
    on_device = Cast(cast, t.dtype, wire, ON_DEVICE) if cast is not None else None
    chunks = t.device == "cuda" and kind != "codec"
    # fusion off (BYTEPS_FUSION_BYTES=0) with nothing to cast: the pipeline's partition-wise
    # staging moves the tensor as it is
    as_is = job.fusion_bytes == 0 and cast is None and job.device_pipeline
    if bucket and chunks and not as_is:  # a bucket of gradients, a flat device buffer
        if nccl:
            return RoutePlan(NCCL, wire, on_device, local_reduce=NCCL, gathered=True)
        if job.alone:  # one process, no server: the sum is the input, no copy at all
            return RoutePlan(IDENTITY, t.dtype, servers=False, gathered=True)
        return RoutePlan(DEVICE_CHUNKS, wire, on_device, chunk_bytes=job.fusion_bytes,
                         gathered=True)
    if kind == "none" and nccl:
        return RoutePlan(NCCL, t.dtype, local_reduce=NCCL)
    if (not bucket and chunks and t.named and t.contiguous and job.device_pipeline
            and not (job.fusion_bytes == 0 and cast is None)):
        # a named CUDA push_pull: chunks copied on the device side (cast there), no Python per
        # partition; an unnamed one takes a new key each call, so no buffer is kept for it
        return RoutePlan(DEVICE_CHUNKS, wire, on_device, chunk_bytes=job.fusion_bytes)
    return None


def _host_plan(t: TensorFacts, job: JobFacts, cast: Any, wire: str, codec: Any, *,
               staging: str) -> RoutePlan:
    """The host side's route: the cast on the host, the codec, the local reduction and each
    partition's itinerary."""
    servers = job.distributed and not job.alone
    host_cast = None
    if cast is not None:
        native = (servers and job.local_size == 1 and job.native and t.dtype == "float32"
                  and spans_partitions(wire, t.elements, job.partition_bytes))
        host_cast = Cast(cast, t.dtype, wire, NATIVE if native else WHOLE)
    nbytes = t.elements * ITEMSIZE[wire]
    if not (servers and codec is not None and wire in COMPRESSIBLE
            and nbytes >= job.min_compress_bytes):
        codec = None  # too small to gain, not a float tensor, or nothing to push
    stages: tuple[Stage, ...] = ()
    if servers:
        stages = itinerary(distributed=not job.single_machine, local_size=job.local_size,
                           local_root=job.local_root, on_device=staging == DEVICE_PARTITIONS,
                           compressed=codec is not None or (host_cast is not None
                                                            and host_cast.where == NATIVE))
    return RoutePlan(staging, wire, host_cast, codec,
                     local_reduce=SHM if servers and job.local_size > 1 else None,
                     itinerary=stages, servers=servers)
