"""SyncBatchNorm: batch normalisation over the global batch (all workers' samples together).

A drop-in for ``torch.nn.SyncBatchNorm`` and Horovod's ``hvd.SyncBatchNorm``. In training mode
the forward pass sums each worker's per-channel statistics (sample count, sum, sum of squares)
across workers through one push_pull, so every worker normalises with the mean and variance of
the global batch and updates its running statistics with them; the backward pass sums the two
per-channel reductions the input gradient needs (sum of the output gradient, and of the output
gradient times the normalised input) the same way. The result equals ``BatchNorm`` on the
concatenation of every worker's batch. The weight and bias gradients stay local, as in torch:
the optimizer (DistributedOptimizer, DistributedDataParallel) averages them like any other.

In eval mode (running statistics), with one worker, or before ``init()``, it is plain batch
norm and nothing travels.

Names on the wire: each SyncBatchNorm gets a number when it is built, in creation order
(``SyncBatchNorm.<n>.stats`` in forward, ``SyncBatchNorm.<n>.grad`` in backward). Every worker
must therefore build its SyncBatchNorm layers in the same order (building the same model, or
``convert_sync_batchnorm`` on the same model, does), and run their forward and backward passes in
the same order; each call of a layer is the next round of its name.
"""
from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - torch's own spelling
from torch.nn.modules.batchnorm import _BatchNorm

from ..reduce_op import Sum
from ..worker.runtime import default_runtime
from .ops import push_pull_inplace

# a forward or backward pass waits on these: they go ahead of queued gradient traffic
_PRIORITY = 1 << 24

_ids = itertools.count()


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the arithmetic runs in (half precision computes in float32, as torch does)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class _SyncBatchNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None,
                bias: torch.Tensor | None, running_mean: torch.Tensor | None,
                running_var: torch.Tensor | None, eps: float, momentum: float,
                name: str) -> torch.Tensor:
        c = x.shape[1]
        dims = [0, *range(2, x.dim())]
        shape = [1, c] + [1] * (x.dim() - 2)
        acc = _acc_dtype(x.dtype)
        xa = x.to(acc)
        n = x.numel() // c
        # this worker's count, sum and sum of squares, in float64. The squares are taken about
        # the local mean (rounded to ``acc``) and shifted back in float64, so that a channel
        # whose mean is large against its spread loses no precision to cancellation
        s = xa.sum(dims, dtype=torch.float64)
        shift = (s / n).to(acc) if n else torch.zeros(c, dtype=acc, device=x.device)
        d = xa - shift.view(shape)
        shift64 = shift.to(torch.float64)
        sumsq = (d * d).sum(dims, dtype=torch.float64) + shift64 * (2 * s - n * shift64)
        stats = torch.cat([s.new_full((1,), float(n)), s, sumsq])
        push_pull_inplace(stats, name=f"{name}.stats", priority=_PRIORITY, op=Sum)
        total = float(stats[0].item())
        if total <= 1:
            raise ValueError(f"SyncBatchNorm: expected more than 1 value per channel when "
                             f"training, got {int(total)} over all workers (input size "
                             f"{list(x.shape)} here)")
        mean = stats[1:c + 1] / total
        var = (stats[c + 1:] / total - mean * mean).clamp_min(0)
        invstd = torch.rsqrt(var + eps)
        with torch.no_grad():
            if running_mean is not None:
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype),
                                                     alpha=momentum)
            if running_var is not None:   # the unbiased variance, as torch's BatchNorm
                unbiased = var * (total / (total - 1))
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype),
                                                    alpha=momentum)
        m, inv = mean.to(acc), invstd.to(acc)
        y = (xa - m.view(shape)) * inv.view(shape)
        if weight is not None:
            y = y * weight.to(acc).view(shape)
        if bias is not None:
            y = y + bias.to(acc).view(shape)
        ctx.save_for_backward(x, weight, m, inv)
        ctx.total, ctx.name, ctx.shape, ctx.dims = total, name, shape, dims
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y.to(x.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, dy: torch.Tensor):
        x, weight, m, inv = ctx.saved_tensors
        shape, dims = ctx.shape, ctx.dims
        c = x.shape[1]
        acc = m.dtype
        dya = dy.to(acc)
        xhat = (x.to(acc) - m.view(shape)) * inv.view(shape)
        sum_dy = dya.sum(dims, dtype=torch.float64)
        sum_dy_xhat = (dya * xhat).sum(dims, dtype=torch.float64)
        # the parameters' gradients are this worker's (the optimizer averages them)
        grad_w = (sum_dy_xhat.to(weight.dtype)
                  if weight is not None and ctx.needs_input_grad[1] else None)
        grad_b = sum_dy.to(ctx.bias_dtype) if ctx.needs_input_grad[2] else None
        grad_x = None
        if ctx.needs_input_grad[0]:
            red = torch.cat([sum_dy, sum_dy_xhat])
            push_pull_inplace(red, name=f"{ctx.name}.grad", priority=_PRIORITY, op=Sum)
            mean_dy = (red[:c] / ctx.total).to(acc)
            mean_dy_xhat = (red[c:] / ctx.total).to(acc)
            scale = inv if weight is None else inv * weight.to(acc)
            grad_x = ((dya - mean_dy.view(shape) - xhat * mean_dy_xhat.view(shape))
                      * scale.view(shape)).to(x.dtype)
        return grad_x, grad_w, grad_b, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """Batch normalisation whose training-mode statistics are those of the global batch (see
    the module docstring). Arguments as ``torch.nn.SyncBatchNorm``; ``process_group`` must be
    None (byteps_like synchronises over all workers). Input of 2 or more dimensions, channels
    on dimension 1 (``N, C, ...``)."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 process_group: Any = None, device=None, dtype=None, *, bias: bool = True):
        if process_group is not None:
            raise ValueError("SyncBatchNorm: process_group is not supported; byteps_like "
                             "synchronises the statistics over all workers")
        kwargs: dict[str, Any] = {"device": device, "dtype": dtype}
        if not bias:  # torch >= 2.6: an affine weight without a bias
            kwargs["bias"] = False
        super().__init__(num_features, eps, momentum, affine, track_running_stats, **kwargs)
        self.process_group = None
        #: this layer's number: its tensors' names on the wire
        self.sync_id = next(_ids)

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if input.size(1) == 0:
            raise ValueError("SyncBatchNorm number of input channels should be non-zero")
        eaf = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            assert self.num_batches_tracked is not None
            self.num_batches_tracked.add_(1)
            eaf = (1.0 / float(self.num_batches_tracked) if self.momentum is None
                   else self.momentum)
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        running_mean = self.running_mean if not self.training or self.track_running_stats \
            else None
        running_var = self.running_var if not self.training or self.track_running_stats \
            else None
        rt = default_runtime()
        if not (self.training and bn_training and rt.initialized and rt.size() > 1):
            return F.batch_norm(input, running_mean, running_var, self.weight, self.bias,
                                bn_training, eaf, self.eps)
        return _SyncBatchNormFn.apply(input, self.weight, self.bias, running_mean, running_var,
                                      self.eps, eaf, f"SyncBatchNorm.{self.sync_id}")

    @classmethod
    def convert_sync_batchnorm(cls, module: torch.nn.Module,
                               process_group: Any = None) -> torch.nn.Module:
        """``module`` with every ``BatchNorm*D`` (and ``torch.nn.SyncBatchNorm``) layer replaced
        by a :class:`SyncBatchNorm` sharing its parameters and running statistics, as
        ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``; a batch-norm ``module`` itself comes
        back replaced. Layers are numbered in the module's traversal order, the same on every
        worker."""
        out = module
        if isinstance(module, _BatchNorm) and not isinstance(module, cls):
            out = cls(module.num_features, module.eps, module.momentum, module.affine,
                      module.track_running_stats, process_group,
                      bias=module.bias is not None or not module.affine)
            if module.affine:
                with torch.no_grad():
                    out.weight = module.weight
                    out.bias = module.bias
            out.running_mean = module.running_mean
            out.running_var = module.running_var
            out.num_batches_tracked = module.num_batches_tracked
            out.training = module.training
            if hasattr(module, "qconfig"):
                out.qconfig = module.qconfig
        for name, child in module.named_children():
            out.add_module(name, cls.convert_sync_batchnorm(child, process_group))
        return out
