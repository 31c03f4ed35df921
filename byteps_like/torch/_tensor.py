"""How byteps_like sees a torch tensor: a numpy view of its memory (zero-copy on CPU), its wire
dtype, and a staging copy for tensors on a device."""
from __future__ import annotations

import numpy as np
import torch

from ..worker.sync import GradBuffer
from ._dtypes import wire_dtype

_copy_streams: dict = {}


def copy_stream(device: torch.device, purpose: str) -> torch.cuda.Stream:
    """The copy stream of ``device`` for ``purpose`` (made once): the pipeline's partition
    copies and the fused buckets' copies each have their own, so neither queues behind the
    other's waits."""
    s = _copy_streams.get((device, purpose))
    if s is None:
        s = _copy_streams[(device, purpose)] = torch.cuda.Stream(device)
    return s


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy array sharing ``t``'s memory (``t`` must be a contiguous CPU tensor)."""
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def stage(t: torch.Tensor, what: str = "tensor", copy_in: bool = True) -> GradBuffer:
    """A host buffer for ``t``: ``t`` itself when it is a contiguous CPU tensor, otherwise a
    (pinned, for devices) copy with a write-back into ``t``. ``copy_in=False`` skips filling
    the copy (for an output buffer)."""
    dtype = wire_dtype(t, what)
    if t.device.type == "cpu" and t.is_contiguous():
        return GradBuffer(as_numpy(t), dtype)
    host = torch.empty(t.shape, dtype=t.dtype, device="cpu",
                       pin_memory=t.device.type == "cuda" and torch.cuda.is_available())
    if copy_in:
        host.copy_(t.detach())
    def writeback() -> None:
        t.detach().copy_(host)

    return GradBuffer(as_numpy(host), dtype, writeback)


class CudaCopier:
    """Stages a CUDA tensor through a pinned host buffer, one partition at a time, on a copy
    stream of its own: the pipeline calls ``d2h`` just before pushing a partition and ``h2d``
    as soon as its sum is pulled, so copies overlap the network (byteps_like.worker.runtime's
    ``DeviceCopier``). ``finish()`` orders the caller's stream after every copy back.

    The copy stream first waits for an event recorded on the caller's stream when the copier
    is made, so the copies see every kernel queued before the push_pull."""

    def __init__(self, src: torch.Tensor, out: torch.Tensor, host: torch.Tensor):
        self.device = src.device
        self.src = src.detach().reshape(-1).view(torch.uint8)
        self.out = out.detach().reshape(-1).view(torch.uint8)
        self.host = host.reshape(-1).view(torch.uint8)
        self.stream = copy_stream(self.device, "partitions")
        self.ready = torch.cuda.Event()
        self.ready.record(torch.cuda.current_stream(self.device))

    def d2h(self, offset: int, nbytes: int) -> None:
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(self.ready)
            self.host[offset:offset + nbytes].copy_(self.src[offset:offset + nbytes],
                                                   non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        done.synchronize()  # the push reads the host bytes right after this returns

    def h2d(self, offset: int, nbytes: int) -> None:
        with torch.cuda.stream(self.stream):
            self.out[offset:offset + nbytes].copy_(self.host[offset:offset + nbytes],
                                                  non_blocking=True)

    def finish(self) -> None:
        torch.cuda.current_stream(self.device).wait_stream(self.stream)


_pinned: dict = {}


def pinned_buffer(key, like: torch.Tensor) -> torch.Tensor:
    """A pinned host buffer shaped like ``like``, reused across rounds for the same ``key``
    (a tensor name): staging memory is registered once, not per push_pull."""
    buf = _pinned.get(key)
    if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
        buf = torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=True)
        if key is not None:
            _pinned[key] = buf
    return buf


def grad_buffer(grad: torch.Tensor, name: str, compression, average: bool = True) -> GradBuffer:
    """The GradBuffer of a gradient: zero-copy on CPU; for CUDA gradients partition-wise
    staging through the pipeline where the job allows it (not with a cast compressor such as
    fp16, which converts whole host arrays; codec compressors run in the pipeline after the
    device copy), else a whole-tensor host copy. ``average``: False where the gradients are
    summed (``op=Sum``)."""
    from ..compression import Compression, split
    from ..worker.runtime import default_runtime
    from . import nccl
    rt = default_runtime()
    if compression is Compression.none and nccl.available(rt, grad):
        return nccl.NcclPushPull(rt, grad, grad, "Gradient." + name, average, 0).buffer()
    if split(compression)[0] is Compression.none:
        staged = device_stage(grad, grad, "Gradient." + name, "gradient")
        if staged is not None:
            buf, copier = staged
            buf.device = copier
            return buf
    return stage(grad, "gradient")


def device_pipelined(t: torch.Tensor, out: torch.Tensor, rt) -> bool:
    """Whether ``t`` (into ``out``) is a CUDA tensor the job stages through the host itself:
    both contiguous, and a job that pipelines device copies (not standalone, one local rank)."""
    return (t.device.type == "cuda" and t.is_contiguous() and out.is_contiguous()
            and rt.device_pipeline)


def device_stage(t: torch.Tensor, out: torch.Tensor, name, what: str):
    """(host GradBuffer, CudaCopier) for a CUDA tensor staged through the pipeline, or None when
    the job cannot pipeline device copies (standalone, or several local ranks)."""
    from ..worker.runtime import default_runtime
    if not device_pipelined(t, out, default_runtime()):
        return None
    dtype = wire_dtype(t, what)
    host = pinned_buffer(name, t)
    copier = CudaCopier(t, out, host)
    return GradBuffer(as_numpy(host), dtype, copier.finish), copier
