"""Crossing the global barrier between training steps, as BytePS's ``byteps.torch.cross_barrier``.

``import byteps_like.torch.cross_barrier as bps`` gives the whole ``byteps_like.torch`` API plus
:func:`CrossBarrier`::

    optimizer = bps.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    optimizer = bps.CrossBarrier(model, optimizer)

Without it, ``optimizer.step()`` waits for every averaged gradient, then updates every
parameter: the step's last push_pulls are a barrier the next forward pass waits behind. With
it, ``step()`` returns at once and each layer is updated just before the next forward pass
needs it, so the exchange overlaps the next forward as well as backward (the first layers'
gradients, produced last, travel first by priority). The updates are the same as without: the
wrapped optimizer steps on each bucket's parameters with their groups' hyperparameters.

What changes for the training loop: after ``step()`` the parameters are updated lazily (by the
next forward pass, ``model.state_dict()``, ``optimizer.state_dict()``, ``optimizer.synchronize()``
or ``optimizer.flush()``); the gradients are cleared as each bucket is applied. Not for loops
that read the averaged gradients before the update (clipping, ``GradScaler``): call
``optimizer.synchronize()`` and step inside ``optimizer.skip_synchronize()`` there, which works
as without CrossBarrier. ``step(closure)`` is refused.
"""
from __future__ import annotations

from typing import Any

import torch

from . import *  # noqa: F401,F403 - the byteps_like.torch API, as byteps.torch.cross_barrier has
from . import __all__ as _torch_all
from .optimizer import DistributedOptimizer, _Crossing

__all__ = [*_torch_all, "CrossBarrier"]


def CrossBarrier(model: torch.nn.Module, optimizer: DistributedOptimizer,  # noqa: N802 - BytePS's name
                 num_steps: Any = None) -> DistributedOptimizer:
    """Turn on barrier crossing for ``optimizer`` (a :class:`DistributedOptimizer` of
    ``model``'s parameters) and return it. ``num_steps`` is accepted for BytePS compatibility and
    has no effect."""
    if not isinstance(optimizer, DistributedOptimizer):
        raise TypeError(f"CrossBarrier(model, optimizer): optimizer must be a "
                        f"byteps_like.torch.DistributedOptimizer, got {type(optimizer).__name__}")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"CrossBarrier(model, optimizer): model must be a torch.nn.Module, got "
                        f"{type(model).__name__}")
    if optimizer._cross is None:
        optimizer._cross = _Crossing(model, optimizer)
    return optimizer
