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

A gradient of at least ``BYTEPS_FUSION_BYTES`` that travels as it is (no cast compressor) is
not a device bucket: it goes through the pipeline's partition-by-partition staging
(:class:`._tensor.CudaCopier`), whose copies overlap its own network transfer; one copy of the
whole would make the push wait for all of it first.

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
from ..worker.runtime import Runtime
from ..worker.sync import Bucket, GradBuffer
from . import nccl
from ._tensor import TORCH_DTYPE, WIRE_DTYPE, as_numpy, copy_stream

log = logging.getLogger("byteps_like.torch")

#: a bucket's data where there is none on the host (NCCL, one process): never read
_NO_HOST = np.empty(0, np.uint8)


def wire_torch_dtype(dtype: torch.dtype, compression: Compressor) -> torch.dtype:
    """The dtype a gradient of ``dtype`` travels as under ``compression`` (a cast compressor
    halves floats; the others leave it)."""
    return TORCH_DTYPE[compression.wire_dtype(WIRE_DTYPE[dtype])]


class DeferredHandle:
    """The handle of a bucket whose push_pull the stager starts later: ``wait`` waits for the
    stager to start it, then for the push_pull itself."""

    def __init__(self, name: str, timeout: float):
        self.name = name
        self.default_timeout = timeout
        self._started = threading.Event()
        self._inner: Handle | None = None
        self._error: BaseException | None = None

    def _set(self, inner: Handle | None, error: BaseException | None = None) -> None:
        self._inner, self._error = inner, error
        self._started.set()

    def wait(self, timeout: float | None = None) -> Any:
        timeout = self.default_timeout if timeout is None else timeout
        if not self._started.wait(timeout):
            from ..errors import CommTimeoutError
            raise CommTimeoutError(f"push_pull of {self.name!r}: its device-to-host copy did "
                                   f"not finish within {timeout:g} s")
        if self._error is not None:
            raise self._error
        assert self._inner is not None
        return self._inner.wait(timeout)


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


class DeviceBucket:
    """The device side of one bucket of CUDA gradients (see the module docstring)."""

    def __init__(self, rt: Runtime, bucket: Bucket, params: Sequence[torch.Tensor],
                 wire_dtype: torch.dtype, average: bool):
        self.rt, self.bucket, self.average = rt, bucket, average
        self.params = list(params)
        self.device = self.params[0].device
        self.wire = wire_dtype
        counts = [p.numel() for p in self.params]
        self.flat = torch.empty(sum(counts), dtype=wire_dtype, device=self.device)
        self.views: list[torch.Tensor] = []
        off = 0
        for p, n in zip(self.params, counts):
            self.views.append(self.flat[off:off + n].view(p.shape))
            off += n
        self.nccl = nccl.available(rt, self.flat)
        self.direct = rt.alone  # one process, no server: the sum is the input
        self.host: torch.Tensor | None = None
        if not self.nccl and not self.direct:
            self.host = torch.empty(self.flat.shape, dtype=wire_dtype, device="cpu",
                                    pin_memory=True)
            self.host_np = as_numpy(self.host)
        self.stream = copy_stream(self.device, "buckets")
        self.ready = torch.cuda.Event()     # the gather is done (producing stream)
        self.copied = torch.cuda.Event()    # the D2H copy is done (copy stream)
        self.h2d_done = torch.cuda.Event()  # the sum is back on the device (copy stream)
        self._h2d_lock = threading.Lock()
        self._h2d_issued = False
        self._nccl_op: nccl.NcclPushPull | None = None
        self._grads: list[torch.Tensor] = []

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
        return GradBuffer(self.host_np if self.host is not None else _NO_HOST,
                          WIRE_DTYPE[self.wire], self.finish, start=self.start)

    # -- on the training thread ---------------------------------------------------------------
    def start(self, priority: int) -> Any:
        self._grads = grads = self._gradients()
        if self.direct:
            return Handle(self.bucket.name, _NO_HOST, _NO_HOST, 0,
                          default_timeout=self.rt.config.timeouts.op_timeout)
        torch._foreach_copy_(self.views, grads)  # gather (and cast) on the caller's stream
        if self.nccl:
            self._nccl_op = op = nccl.NcclPushPull(self.rt, self.flat, self.flat,
                                                   self.bucket.name, self.average, priority)
            return op.start(priority)
        assert self.host is not None
        producer = torch.cuda.current_stream(self.device)
        ready, copied = self.ready, self.copied  # reused: the last round is over by now
        ready.record(producer)
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            self.host.copy_(self.flat, non_blocking=True)
            copied.record(self.stream)
        with self._h2d_lock:
            self._h2d_issued = False
        deferred = DeferredHandle(self.bucket.name, self.rt.config.timeouts.op_timeout)
        stager().submit(lambda: self._push(copied, priority, deferred))
        return deferred

    # -- on the stager thread -----------------------------------------------------------------
    def _push(self, copied: torch.cuda.Event, priority: int, deferred: DeferredHandle) -> None:
        try:
            copied.synchronize()
            h = self.rt.push_pull_async(self.host_np, name=self.bucket.name,
                                        average=self.average, priority=priority,
                                        out=self.host_np, dtype=WIRE_DTYPE[self.wire])
        except BaseException as exc:  # noqa: BLE001 - the waiter raises it
            deferred._set(None, exc)
            return
        h.add_done_callback(self._copy_back)
        deferred._set(h)

    # -- when the sum has landed (completion thread or waiter) --------------------------------
    def _copy_back(self, h: Handle) -> None:
        """Queue the host-to-device copy as soon as the sum is in the pinned buffer. Runs on
        the thread that completed the handle, which may be after the waiter returned: whoever
        comes first (this, or :meth:`finish`) issues the copy, once a round."""
        if h.exception() is not None:
            return
        self._issue_h2d()

    def _issue_h2d(self) -> None:
        with self._h2d_lock:
            if self._h2d_issued:
                return
            self._h2d_issued = True
            assert self.host is not None
            with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
                self.flat.copy_(self.host, non_blocking=True)
                self.h2d_done.record(self.stream)

    # -- step(): the synchronizer's write-back ------------------------------------------------
    def finish(self) -> None:
        if self.direct:
            return
        if self._nccl_op is not None:
            self._nccl_op.finish()  # leaves the result in flat, ordered on this stream
            self._nccl_op = None
        else:
            self._issue_h2d()  # unless the completion already did
            torch.cuda.current_stream(self.device).wait_event(self.h2d_done)
        torch._foreach_copy_(self._grads, self.views)  # scatter (and cast back)
        self._grads = []


class TorchFuser:
    """The PyTorch plugin's ``fuse`` for the synchronizer: CUDA buckets as flat device buffers
    (:class:`DeviceBucket`, made once per bucket); CPU buckets are left to the synchronizer's
    host fusion (None)."""

    def __init__(self, rt: Runtime, params: Sequence[torch.Tensor], compression: Compressor,
                 average: bool = True):
        self.rt, self.params, self.average = rt, list(params), average
        self.compression = compression
        self._buckets: dict[int, DeviceBucket] = {}

    def __call__(self, bucket: Bucket) -> GradBuffer | None:
        first = self.params[bucket.members[0]]
        if first.device.type != "cuda" or self.compression.kind == "codec":
            return None  # host fusion; codecs compress each gradient in the pipeline
        wire = wire_torch_dtype(first.dtype, self.compression)
        if (not bucket.fused and wire == first.dtype and self.rt.device_pipeline
                and bucket.nbytes >= self.rt.config.partition.fusion_bytes):
            # a gradient of at least a bucket's size, travelling as it is: the pipeline
            # stages it partition by partition (copy, push, copy back overlap), where one
            # copy of the whole would wait for all of it (VGG-16's 411 MB classifier weight:
            # 7.5 ms each way). The synchronizer takes the gradient's own grad_buffer.
            return None
        db = self._buckets.get(bucket.index)
        if db is None:  # its members share dtype and device (layout()'s groups)
            db = self._buckets[bucket.index] = DeviceBucket(
                self.rt, bucket, [self.params[i] for i in bucket.members], wire, self.average)
        return db.buffer()


def layout(params: Sequence[torch.Tensor]) -> list[tuple[int, Any]]:
    """The synchronizer's ``layout``: each parameter's bytes, and what must match to share a
    bucket (dtype and device)."""
    return [(p.numel() * p.element_size(), (str(p.dtype), str(p.device))) for p in params]
