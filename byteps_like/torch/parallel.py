"""DistributedDataParallel: a module wrapper that averages gradients during backward."""
from __future__ import annotations

import contextlib

import torch

from ..reduce_op import Average, resolve_average
from ..worker.runtime import default_runtime
from ..worker.sync import GradBuffer, GradientSynchronizer, model_signature_check
from . import fusion
from ._tensor import wire_dtype
from .broadcast import broadcast_parameters
from .fusion import grad_buffer


class DistributedDataParallel(torch.nn.Module):
    """Wraps ``module``: parameters are broadcast from ``root_rank`` at construction, and every
    backward pass averages the gradients across workers before it returns (each gradient's
    push_pull starts as soon as it is accumulated). Inside ``no_sync()`` backward passes only
    accumulate locally; the first backward after it averages the accumulated gradients."""

    def __init__(self, module: torch.nn.Module, device_ids=None, *, root_rank: int = 0,
                 broadcast_buffers: bool = True, broadcast: bool = True, compression=None,
                 op=Average):
        """``device_ids`` and ``broadcast_buffers`` are accepted for compatibility with BytePS's
        and torch's wrappers: the module already lives on its device, and buffers are
        broadcast with the parameters at construction. ``op=Sum`` sums the gradients instead
        of averaging them."""
        super().__init__()
        from ..compression import Compression
        self._average = resolve_average(op, None, "DistributedDataParallel")
        self.module = module
        rt = default_runtime()
        rt.check()
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        for n, p in named:
            wire_dtype(p, f"parameter {n!r}")
        self._ddp_params = [p for _, p in named]
        if rt.size() > 1:
            model_signature_check(rt, [(n, tuple(p.shape), str(p.dtype)) for n, p in named],
                                  "model")
            if broadcast:
                state = (module.state_dict() if broadcast_buffers
                         else dict(module.named_parameters()))
                broadcast_parameters(state, root_rank=root_rank,
                                     prefix="DDP.Parameter.")
        self._sync = GradientSynchronizer(rt, [n for n, _ in named], self._grad_buffer,
                                          compression=compression or Compression.none,
                                          average=self._average, prefix="DDP.Gradient.",
                                          layout=fusion.layout(self._ddp_params, compression,
                                                               rt.cfg))
        self._sync.fuse = fusion.TorchFuser(rt, self._ddp_params, self._sync.compression,
                                            self._average, self._sync.buckets)
        self._callback_queued = False
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook(i))
                       for i, p in enumerate(self._ddp_params)]

    def _grad_buffer(self, index: int) -> GradBuffer:
        p = self._ddp_params[index]
        if p.grad is None:
            p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
        return grad_buffer(p.grad, "DDP." + self._sync.names[index], self._sync.compression,
                           self._average)

    def _make_hook(self, index: int):
        def hook(_param: torch.Tensor) -> None:
            if not self._sync.enabled:  # inside no_sync()
                return
            if not self._callback_queued:
                self._callback_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._sync.ready(index)
        return hook

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        self._sync.synchronize()

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Backward passes inside accumulate gradients without any push_pull."""
        return self._sync.disabled()
