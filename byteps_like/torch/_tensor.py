"""How byteps_like sees a torch tensor: a numpy view of its memory (zero-copy on CPU), its wire
dtype, the facts the route planner reads (:func:`facts`), and the staging copies of tensors
on a device (a whole host copy, or a pinned buffer the pipeline fills partition by partition).
Nothing here chooses a route: ``torch/ops.py`` and ``torch/fusion.py`` run the plan."""
from __future__ import annotations

import numpy as np
import torch

from ..worker.route import TensorFacts
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


def facts(t: torch.Tensor, out: torch.Tensor, name: str | None, what: str,
          count: int | None = None) -> TensorFacts:
    """What the route planner (:func:`byteps_like.worker.route.plan_route`) needs of ``t``
    (into ``out``): its wire dtype (TypeError for one push_pull cannot sum), size, device,
    name, layout, and whether this process can reduce it with NCCL. ``count``: the elements
    of the flat buffer a bucket of gradients like ``t`` gathers into."""
    nccl = (t.device.type == "cuda" and torch.distributed.is_available()
            and torch.distributed.is_nccl_available())
    return TensorFacts(wire_dtype(t, what), t.numel() if count is None else count,
                       device=t.device.type, name=name,
                       contiguous=t.is_contiguous() and out.is_contiguous(), nccl=nccl)


def device_stage(t: torch.Tensor, out: torch.Tensor, name, what: str):
    """(host GradBuffer, CudaCopier) for a CUDA tensor the pipeline stages partition by
    partition (the route plan's ``DEVICE_PARTITIONS``)."""
    dtype = wire_dtype(t, what)
    host = pinned_buffer(name, t)
    copier = CudaCopier(t, out, host)
    return GradBuffer(as_numpy(host), dtype, copier.finish), copier
