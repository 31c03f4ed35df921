"""Tensor fusion on the GPU: a bucket of CUDA gradients as one flat device buffer.

The core's :class:`~byteps_like.worker.sync.GradientSynchronizer` decides the buckets (gradients
of one dtype and device, in backward order, up to ``BYTEPS_FUSION_BYTES``). For a bucket of
CUDA gradients this module does the device side, once per bucket and with no Python per
partition:

1. on the training thread, when the bucket's last gradient is ready: one gather kernel into the
   bucket's flat device buffer (``torch._foreach_copy_``, which also casts to the wire dtype of
   a cast compressor: fp16/bf16 halve the PCIe and wire bytes), an event on the producing
   stream, and one device-to-host copy into the bucket's pinned host buffer on a copy stream
   that waits for that event: all asynchronous, so the training thread goes straight back to
   backward;
2. on the stager thread (one per process): wait for the copy's event (the GIL released), then
   hand the pinned buffer to the core (``push_pull_async``): on the native data plane the whole
   bucket is one operation, its partitions pushed, summed, pulled in place and averaged in C++;
3. when the sum has landed (the handle's completion, on whichever thread completes it): one
   host-to-device copy on the copy stream and an event;
4. ``step()`` (the synchronizer's write-back): the caller's stream waits for that event and one
   scatter kernel copies the bucket back into the gradients (casting back).

Pinned host buffers and flat device buffers are made once per bucket and reused every step.

A gradient larger than ``BYTEPS_FUSION_BYTES`` is a bucket of its own cut into chunks of at
most that size (a key, a copy each way and a push_pull per chunk), so its copies overlap its own
network transfer; one copy of the whole would make the push wait for all of it first. With
fusion off (``BYTEPS_FUSION_BYTES=0``) a gradient travelling as it is goes through the
pipeline's partition-by-partition staging (:class:`._tensor.CudaCopier`).

With several local ranks (one GPU each) the flat buffer goes through the NCCL local reduction
(:mod:`.nccl`) as one tensor. With one worker process and no server the sum is the input: no
copy at all.
"""
from __future__ import annotations

import functools
import logging
import os
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from ..compression import Compressor
from ..worker.handle import Handle
from ..worker.route import DEVICE_CHUNKS, DEVICE_PARTITIONS, HOST, IDENTITY, NCCL, RoutePlan
from ..worker.runtime import Runtime, default_runtime
from ..worker.sync import Bucket, GradBuffer, dtype_layout
from . import nccl
from ._dtypes import TORCH_DTYPE, WIRE_DTYPE
from ._tensor import as_numpy, copy_stream, device_stage, facts, stage

log = logging.getLogger("byteps_like.torch")

#: a bucket's data where there is none on the host (NCCL, one process): never read
_NO_HOST = np.empty(0, np.uint8)


def device_cast(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """The device side's one conversion: each of ``src`` into the same-sized ``dst``, cast to
    ``dst``'s dtype (a cast compressor's narrowing into a flat wire-dtype buffer, and the
    widening back), one kernel on the caller's stream."""
    torch._foreach_copy_(list(dst), list(src))


class DeferredHandle:
    """The handle of a bucket whose push_pulls (one per chunk) the stager starts later:
    ``wait`` waits for the stager to start them, then for each."""

    def __init__(self, name: str, timeout: float):
        self.name = name
        self.default_timeout = timeout
        self._started = threading.Event()
        self._inner: list[Handle] = []
        self._error: BaseException | None = None

    def _set(self, inner: list[Handle], error: BaseException | None = None) -> None:
        self._inner, self._error = inner, error
        self._started.set()

    def done(self) -> bool:
        return self._started.is_set() and (self._error is not None
                                           or all(h.done() for h in self._inner))

    def wait(self, timeout: float | None = None) -> Any:
        timeout = self.default_timeout if timeout is None else timeout
        if not self._started.wait(timeout):
            from ..errors import CommTimeoutError
            raise CommTimeoutError(f"push_pull of {self.name!r}: its device-to-host copy did "
                                   f"not finish within {timeout:g} s")
        if self._error is not None:
            raise self._error
        for h in self._inner:
            h.wait(timeout)


class _Stager:
    """One thread per process that waits for buckets' device-to-host copies and starts their
    push_pulls, in the order the buckets became ready."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="byteps_like-stager",
                                        daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        self._q.put(job)

    def _run(self) -> None:
        while True:
            job = self._q.get()
            try:
                job()
            except BaseException:  # noqa: BLE001 - each job reports its own errors
                log.exception("bucket staging failed")


@functools.cache
def stager() -> _Stager:
    """The process's stager (made at first use; a forked child makes its own)."""
    return _Stager()


os.register_at_fork(after_in_child=stager.cache_clear)


class ChunkedCopy:
    """One flat region of device memory through the native plane, chunk by chunk: the part of
    a device bucket (and of a named CUDA ``push_pull``) that moves bytes.

    The region travels as chunks of at most ``chunk_bytes`` (near-equal, :func:`chunk_ranges`),
    each its own device-to-host copy into a pinned host buffer (made once), its own push_pull
    (its own key: ``<name>.<i>`` after the first, declared here, so every worker that makes
    the same objects in the same order declares the same keys) and its own host-to-device
    copy, so copies, network and the copies back overlap. Copies to the host and back run on
    two streams, so one region's copies back do not queue behind the next region's copies out.
    No Python runs per partition: the native plane cuts and moves each chunk."""

    def __init__(self, rt: Runtime, name: str, count: int, wire_dtype: torch.dtype,
                 device: torch.device, average: bool, chunk_bytes: int):
        self.rt, self.name, self.average, self.device = rt, name, average, device
        self.wire = wire_dtype
        self.host = torch.empty(count, dtype=wire_dtype, device="cpu", pin_memory=True)
        self.host_np = as_numpy(self.host)
        self.chunks = chunk_ranges(count, self.host.element_size(), chunk_bytes)
        self.names = [name] + [f"{name}.{i}" for i in range(1, len(self.chunks))]
        for chunk_name in self.names[1:]:
            rt.declare(chunk_name)
        self.d2h_stream = copy_stream(device, "buckets")
        self.h2d_stream = copy_stream(device, "buckets-h2d")
        self.ready = torch.cuda.Event()  # the source is written (producing stream)
        n = len(self.chunks)
        self.copied = [torch.cuda.Event() for _ in range(n)]    # a chunk is on the host
        self.h2d_done = [torch.cuda.Event() for _ in range(n)]  # a chunk's sum is back
        self._h2d_lock = threading.Lock()
        self._h2d_issued = [False] * n
        self._dst: torch.Tensor | None = None

    # -- on the caller's thread -----------------------------------------------------------------
    def start(self, src: torch.Tensor, dst: torch.Tensor, priority: int) -> DeferredHandle:
        """Copy flat ``src`` out after everything queued on the current stream, start the
        push_pulls; the sums land in flat ``dst`` (may be ``src``) once :meth:`finish` ran."""
        self.ready.record(torch.cuda.current_stream(self.device))  # events are reused: the
        with torch.cuda.stream(self.d2h_stream):                    # last round is over
            self.d2h_stream.wait_event(self.ready)
            for (lo, hi), copied in zip(self.chunks, self.copied):
                self.host[lo:hi].copy_(src[lo:hi], non_blocking=True)
                copied.record(self.d2h_stream)
        with self._h2d_lock:
            self._dst = dst
            self._h2d_issued = [False] * len(self.chunks)
        deferred = DeferredHandle(self.name, self.rt.config.timeouts.op_timeout)
        stager().submit(lambda: self._push(priority, deferred))
        return deferred

    # -- on the stager thread -----------------------------------------------------------------
    def _push(self, priority: int, deferred: DeferredHandle) -> None:
        handles = []
        try:
            for i, ((lo, hi), copied) in enumerate(zip(self.chunks, self.copied)):
                copied.synchronize()  # without the GIL
                part = self.host_np[lo:hi]
                h = self.rt.push_pull_async(part, name=self.names[i], average=self.average,
                                            priority=priority, out=part,
                                            dtype=WIRE_DTYPE[self.wire])
                h.add_done_callback(functools.partial(self._copy_back, i))
                handles.append(h)
        except BaseException as exc:  # noqa: BLE001 - the waiter raises it
            deferred._set(handles, exc)
            return
        deferred._set(handles)

    # -- when a chunk's sum has landed (completion thread or waiter) --------------------------
    def _copy_back(self, i: int, h: Handle) -> None:
        """Queue chunk ``i``'s host-to-device copy as soon as its sum is in the pinned buffer.
        Runs on the thread that completed the handle, which may be after the waiter returned:
        whoever comes first (this, or :meth:`finish`) issues the copy, once a round."""
        if h.exception() is not None:
            return
        self._issue_h2d(i)

    def _issue_h2d(self, i: int) -> None:
        with self._h2d_lock:
            if self._h2d_issued[i] or self._dst is None:
                return
            self._h2d_issued[i] = True
            lo, hi = self.chunks[i]
            with torch.cuda.device(self.device), torch.cuda.stream(self.h2d_stream):
                self._dst[lo:hi].copy_(self.host[lo:hi], non_blocking=True)
                self.h2d_done[i].record(self.h2d_stream)

    # -- after the handle's wait ----------------------------------------------------------------
    def finish(self) -> None:
        """Order the current stream after every chunk's copy back."""
        consumer = torch.cuda.current_stream(self.device)
        for i, done in enumerate(self.h2d_done):
            self._issue_h2d(i)  # unless the completion already did
            consumer.wait_event(done)
        with self._h2d_lock:
            self._dst = None


class DeviceBucket:
    """The device side of one bucket of CUDA gradients (see the module docstring): a flat
    device buffer the members are gathered into (cast to the wire dtype), moved as its route
    plan says (``plan.staging``): by a :class:`ChunkedCopy`, by the NCCL local reduction with
    several local ranks, or not at all in a job of one process; then scattered back.

    A bucket larger than ``chunk_bytes`` (a single large gradient: VGG-16's 411 MB classifier
    weight) travels as chunks, so its copies overlap its own network transfer."""

    def __init__(self, rt: Runtime, bucket: Bucket, params: Sequence[torch.Tensor],
                 plan: RoutePlan, average: bool):
        self.rt, self.bucket, self.average = rt, bucket, average
        self.params = list(params)
        self.device = self.params[0].device
        self.wire = wire_dtype = TORCH_DTYPE[plan.wire_dtype]
        counts = [p.numel() for p in self.params]
        self.flat = torch.empty(sum(counts), dtype=wire_dtype, device=self.device)
        self.views: list[torch.Tensor] = []
        off = 0
        for p, n in zip(self.params, counts):
            self.views.append(self.flat[off:off + n].view(p.shape))
            off += n
        self.nccl = plan.staging == NCCL
        self.direct = plan.staging == IDENTITY  # one process, no server: the sum is the input
        self.mover: ChunkedCopy | None = None
        if plan.staging == DEVICE_CHUNKS:
            self.mover = ChunkedCopy(rt, bucket.name, self.flat.numel(), wire_dtype, self.device,
                                     average, plan.chunk_bytes)
        self._nccl_op: nccl.NcclPushPull | None = None
        self._targets: list[torch.Tensor] = []

    @property
    def names(self) -> list[str]:
        """The keys' names of the bucket (one per chunk)."""
        return self.mover.names if self.mover is not None else [self.bucket.name]

    def _gradients(self) -> list[torch.Tensor]:
        grads = []
        for p in self.params:
            if p.grad is None:  # no gradient this step: it counts as zeros
                p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
            grads.append(p.grad)
        return grads

    def buffer(self) -> GradBuffer:
        """What the synchronizer launches: ``start`` gathers and starts, ``writeback``
        scatters the sum back."""
        return GradBuffer(self.mover.host_np if self.mover is not None else _NO_HOST,
                          WIRE_DTYPE[self.wire], self.finish, start=self.start)

    # -- on the training thread ---------------------------------------------------------------
    def start(self, priority: int) -> Any:
        self._targets = grads = self._gradients()
        if self.direct:
            return Handle(self.bucket.name, _NO_HOST, _NO_HOST, 0,
                          default_timeout=self.rt.config.timeouts.op_timeout)
        device_cast(self.views, grads)  # gather (and cast) on the caller's stream
        if self.nccl:
            self._nccl_op = op = nccl.NcclPushPull(self.rt, self.flat, self.flat,
                                                   self.bucket.name, self.average, priority)
            return op.start(priority)
        assert self.mover is not None
        return self.mover.start(self.flat, self.flat, priority)

    # -- step(): the synchronizer's write-back ------------------------------------------------
    def finish(self) -> None:
        if self.direct:
            return
        if self._nccl_op is not None:
            self._nccl_op.finish()  # leaves the result in flat, ordered on this stream
            self._nccl_op = None
        else:
            assert self.mover is not None
            self.mover.finish()
        device_cast(self._targets, self.views)  # scatter (and cast back)
        self._targets = []


class DeviceTensor:
    """A named CUDA ``push_pull`` on the native plane without Python per partition: the tensor
    is copied out (and the sum back) in chunks by a :class:`ChunkedCopy`, straight from and
    into the caller's tensors; under a cast compressor (fp16/bf16) the cast happens on the
    device into a flat buffer of the wire dtype first, so PCIe and the wire carry half the
    bytes. Made once per name (:func:`device_push_pull`), its pinned buffer reused."""

    def __init__(self, rt: Runtime, name: str, like: torch.Tensor, wire_dtype: torch.dtype,
                 average: bool, chunk_bytes: int):
        self.signature = self.signature_of(like, wire_dtype, average)
        self.flat = (torch.empty(like.numel(), dtype=wire_dtype, device=like.device)
                     if wire_dtype != like.dtype else None)
        self.mover = ChunkedCopy(rt, name, like.numel(), wire_dtype, like.device, average,
                                 chunk_bytes)
        self._held: tuple[torch.Tensor, torch.Tensor] | None = None

    @staticmethod
    def signature_of(t: torch.Tensor, wire_dtype: torch.dtype, average: bool) -> tuple:
        """What a push_pull of ``t`` must share with the one this object was made for."""
        return (tuple(t.shape), t.dtype, t.device, wire_dtype, average)

    def buffer(self) -> GradBuffer:
        """The pinned host buffer as the core sees it; ``writeback`` is :meth:`finish`."""
        return GradBuffer(self.mover.host_np, WIRE_DTYPE[self.mover.wire], self.finish)

    def start(self, tensor: torch.Tensor, out: torch.Tensor, priority: int) -> DeferredHandle:
        self._held = (tensor, out)  # both stay alive until finish: the copies read and write them
        src = tensor.detach().reshape(-1)
        dst = out.detach().reshape(-1)
        if self.flat is not None:
            device_cast([self.flat], [src])  # cast on the device, on the caller's stream
            src = dst = self.flat
        return self.mover.start(src, dst, priority)

    def finish(self) -> None:
        self.mover.finish()
        if self._held is not None and self.flat is not None:
            device_cast([self._held[1].detach().reshape(-1)], [self.flat])  # cast back
        self._held = None


def device_push_pull(rt: Runtime, plan: RoutePlan, tensor: torch.Tensor, out: torch.Tensor,
                     name: str, average: bool,
                     priority: int) -> tuple[DeviceTensor, DeferredHandle]:
    """Start a named CUDA ``push_pull`` whose plan is ``DEVICE_CHUNKS`` as a
    :class:`DeviceTensor` (see there; made once per name and signature)."""
    wire = TORCH_DTYPE[plan.wire_dtype]
    dt = _device_tensors.get(name)
    if (dt is None or dt.mover.rt is not rt
            or dt.signature != DeviceTensor.signature_of(tensor, wire, average)):
        dt = _device_tensors[name] = DeviceTensor(rt, name, tensor, wire, average,
                                                  plan.chunk_bytes)
    return dt, dt.start(tensor, out, priority)


#: the named CUDA push_pulls of this process (their pinned buffers are registered once; one made
#: by an earlier runtime, before a shutdown and init, is replaced)
_device_tensors: dict[str, DeviceTensor] = {}


def chunk_ranges(count: int, itemsize: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """Element ranges of at most ``chunk_bytes`` covering ``count`` elements (one range when
    ``chunk_bytes`` is 0 or the whole fits); the ranges are near-equal, so no chunk is a
    sliver."""
    if chunk_bytes <= 0 or count * itemsize <= chunk_bytes:
        return [(0, count)]
    n = -(-count * itemsize // chunk_bytes)
    bounds = [count * k // n for k in range(n + 1)]
    return [(bounds[k], bounds[k + 1]) for k in range(n)]


class TorchFuser:
    """The PyTorch plugin's ``fuse`` for the synchronizer: CUDA buckets as flat device buffers
    (:class:`DeviceBucket`, made once per bucket); CPU buckets are left to the synchronizer's
    host fusion (None).

    ``buckets`` (the synchronizer's): make every CUDA bucket now, in bucket order, so the keys
    of large buckets' chunks are declared in the same order on every worker and no buffer is
    allocated during the first backward pass."""

    def __init__(self, rt: Runtime, params: Sequence[torch.Tensor], compression: Compressor,
                 average: bool = True, buckets: Sequence[Bucket] = ()):
        self.rt, self.params, self.average = rt, list(params), average
        self.compression = compression
        self._buckets: dict[int, DeviceBucket | None] = {}
        for b in buckets:
            self._device_bucket(b)

    def _device_bucket(self, bucket: Bucket) -> DeviceBucket | None:
        if bucket.index in self._buckets:
            return self._buckets[bucket.index]
        members = [self.params[i] for i in bucket.members]  # one dtype and device (layout())
        first = members[0]
        plan = self.rt.plan(facts(first, first, bucket.name, f"gradient bucket {bucket.name!r}",
                                  count=sum(p.numel() for p in members)),
                            self.compression, bucket=True)
        # a bucket the plan gathers into a flat device buffer; else (CPU, a codec, fusion off
        # with nothing to cast) the synchronizer's host fusion or grad_buffer
        db = DeviceBucket(self.rt, bucket, members, plan, self.average) if plan.gathered else None
        self._buckets[bucket.index] = db
        return db

    def __call__(self, bucket: Bucket) -> GradBuffer | None:
        db = self._device_bucket(bucket)
        return db.buffer() if db is not None else None


def grad_buffer(grad: torch.Tensor, name: str, compression: Compressor,
                average: bool = True) -> GradBuffer:
    """The GradBuffer of a gradient that travels alone (its bucket is not gathered on the
    device, :class:`TorchFuser`), staged as its route plan says: zero-copy on CPU, the NCCL
    local reduction, the pipeline's partition-wise device staging (a codec compressor runs in
    the pipeline after the device copy), or a whole host copy. ``average``: False where the
    gradients are summed (``op=Sum``)."""
    rt = default_runtime()
    plan = rt.plan(facts(grad, grad, name, "gradient"), compression, bucket=True)
    if plan.staging == NCCL and not plan.gathered:
        return nccl.NcclPushPull(rt, grad, grad, "Gradient." + name, average, 0).buffer()
    if plan.staging == DEVICE_PARTITIONS:
        buf, copier = device_stage(grad, grad, "Gradient." + name, "gradient")
        buf.device = copier
        return buf
    if plan.staging == HOST:
        return stage(grad, "gradient")
    raise ValueError(f"gradient {name!r} travels in a bucket gathered on the device "
                     f"({plan.staging}); TorchFuser moves it, not grad_buffer")


def layout(params: Sequence[torch.Tensor], compression: Compressor | None = None,
           cfg: Any = None) -> list[tuple[int, Any, int]]:
    """The synchronizer's ``layout``: :func:`~byteps_like.worker.sync.dtype_layout`'s bytes and
    wire bytes of each parameter, grouped by dtype and device (only those share a flat
    buffer)."""
    entries = dtype_layout([(p.numel() * p.element_size(), WIRE_DTYPE[p.dtype]) for p in params],
                           compression, cfg)
    return [(n, (str(p.dtype), str(p.device)), w) for (n, _, w), p in zip(entries, params)]
