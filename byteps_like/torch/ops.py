"""Tensor operations: push_pull (differentiable), the async and in-place forms, poll/synchronize."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..compression import Compression, Compressor
from ..reduce_op import resolve_average
from ..worker.route import DEVICE_CHUNKS, DEVICE_PARTITIONS, NCCL
from ..worker.runtime import default_runtime
from . import nccl
from ._tensor import device_stage, facts, stage
from .fusion import device_push_pull


class TorchHandle:
    """What ``push_pull_async`` returns: pass it to ``poll`` or ``synchronize``."""

    def __init__(self, core, out: torch.Tensor, out_buf):
        self.core, self.out, self.out_buf = core, out, out_buf
        self._finished = False

    def done(self) -> bool:
        return self.core.done()

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        if not self._finished:
            self.core.wait(timeout)
            if self.out_buf.writeback is not None:
                self.out_buf.writeback()
            self._finished = True
        return self.out

    def __repr__(self) -> str:
        return f"<TorchHandle {self.core!r}>"


def _average(average: Any, op: Any, name: str | None) -> bool:
    """``average`` (BytePS's bool) or ``op`` (Horovod's Average/Sum) as one bool."""
    what = f"push_pull of {name!r}" if isinstance(name, str) else "push_pull"
    if average is not None and not isinstance(average, (bool, np.bool_)):
        raise TypeError(f"{what}: average must be a bool, got {average!r}; the order is BytePS's "
                        "push_pull(tensor, average=True, name=None, ...): pass the name as "
                        "name=...")
    return resolve_average(op, average, what)


def _start(tensor: torch.Tensor, out: torch.Tensor, average: bool, name: str | None,
           priority: int, compression: Compressor) -> TorchHandle:
    """Run the route plan of a push_pull of ``tensor`` into ``out`` (:mod:`byteps_like.worker.
    route` chooses; this adapts the tensor's memory, streams and events to it)."""
    rt = default_runtime()
    rt.check()
    what = f"push_pull of {name!r}" if name else "push_pull"
    if name is not None and not isinstance(name, str):
        raise TypeError(f"push_pull: name must be a str, got {name!r}")
    plan = rt.plan(facts(tensor, out, name, what), compression)
    if plan.staging == NCCL:  # the machine's GPUs reduce first
        op = nccl.NcclPushPull(rt, tensor, out, name or rt.auto_name(), average, priority)
        return TorchHandle(op.start(), out, op.buffer())
    if plan.staging == DEVICE_CHUNKS:  # named CUDA: chunks copied on the device side
        assert name is not None
        dt, chunks = device_push_pull(rt, plan, tensor, out, name, average, priority)
        return TorchHandle(chunks, out, dt.buffer())
    if plan.staging == DEVICE_PARTITIONS:  # CUDA: partition-wise copies on their own stream
        buf, copier = device_stage(tensor, out, name, what)
        core = rt.push_pull_async(buf.array, name=name, average=average, priority=priority,
                                  out=buf.array, dtype=buf.dtype, device=copier,
                                  compression=compression)
        return TorchHandle(core, out, buf)
    src = stage(tensor, what)
    dst = src if out is tensor else stage(out, what, copy_in=False)
    # the sum lands straight in the output's memory (no copy on CPU); a cast compressor (fp16)
    # converts where the plan says, on the host
    core = rt.push_pull_async(src.array, name=name, average=average, priority=priority,
                              out=dst.array, dtype=src.dtype, compression=compression)
    return TorchHandle(core, out, dst)


def push_pull_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    version: int = 0, priority: int = 0,
                    compression: Compressor = Compression.none, op=None) -> TorchHandle:
    """Start averaging (or summing: ``average=False`` or ``op=Sum``) ``tensor`` over all
    workers into a new tensor. ``average`` and ``op`` are exclusive; neither: average.

    ``version`` is accepted for BytePS compatibility and has no effect. Larger ``priority``
    goes first. Wait with ``synchronize(handle)``."""
    avg = _average(average, op, name)
    return _start(tensor, torch.empty_like(tensor, memory_format=torch.contiguous_format),
                  avg, name, priority, compression)


def push_pull_async_inplace(tensor: torch.Tensor, average: bool | None = None,
                            name: str | None = None, version: int = 0, priority: int = 0,
                            compression: Compressor = Compression.none, op=None) -> TorchHandle:
    """Like ``push_pull_async`` but the result overwrites ``tensor``."""
    return _start(tensor, tensor, _average(average, op, name), name, priority, compression)


def push_pull_inplace(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                      version: int = 0, priority: int = 0,
                      compression: Compressor = Compression.none, op=None) -> torch.Tensor:
    return synchronize(push_pull_async_inplace(tensor, average, name, version, priority,
                                               compression, op))


class _PushPull(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, average, name, priority, compression):
        ctx.average, ctx.name, ctx.priority, ctx.compression = average, name, priority, compression
        return synchronize(push_pull_async(tensor, average, name, 0, priority, compression))

    @staticmethod
    def backward(ctx, grad):
        name = f"{ctx.name}.grad" if ctx.name is not None else None
        g = synchronize(push_pull_async(grad.contiguous(), ctx.average, name, 0, ctx.priority,
                                        ctx.compression))
        return g, None, None, None, None


def push_pull(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              version: int = 0, priority: int = 0,
              compression: Compressor = Compression.none, op=None) -> torch.Tensor:
    """Average (or sum: ``average=False`` or ``op=Sum``) ``tensor`` over all workers;
    differentiable: the gradient of the result is reduced the same way in the backward pass,
    as in BytePS."""
    return _PushPull.apply(tensor, _average(average, op, name), name, priority, compression)


def poll(handle: TorchHandle) -> bool:
    """True once the operation behind ``handle`` has finished."""
    return handle.done()


def synchronize(handle: TorchHandle, timeout: float | None = None) -> Any:
    """Wait for ``handle`` and return its output tensor."""
    return handle.wait(timeout)
