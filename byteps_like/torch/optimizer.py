"""DistributedOptimizer: wraps the user's optimizer (composition) and averages gradients across
workers, each gradient starting its push_pull as soon as backward has accumulated it."""
from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch

from ..compression import Compression, Compressor
from ..errors import BytePSError
from ..reduce_op import Average, resolve_average
from ..worker.runtime import default_runtime
from ..worker.sync import GradBuffer, GradientSynchronizer, check_names, model_signature_check
from . import fusion
from ._tensor import grad_buffer, wire_dtype


def _named_params(optimizer: torch.optim.Optimizer, named_parameters) -> list[tuple[str, Any]]:
    opt_params = [p for g in optimizer.param_groups for p in g["params"]]
    if named_parameters is None:
        # BytePS names them by position when no names are given
        return [(f"allreduce.noname.{i}", p) for i, p in enumerate(opt_params)]
    named = list(named_parameters)
    if any(not (isinstance(x, tuple) and len(x) == 2) for x in named):
        raise ValueError("named_parameters must be (name, parameter) pairs, e.g. "
                         "model.named_parameters()")
    check_names([n for n, _ in named])
    by_id = {id(p): n for n, p in named}
    missing = [i for i, p in enumerate(opt_params) if id(p) not in by_id]
    if missing:
        shapes = [tuple(opt_params[i].shape) for i in missing[:5]]
        raise ValueError(f"{len(missing)} parameters of the optimizer are not in "
                         f"named_parameters (first shapes: {shapes}); pass "
                         "model.named_parameters() of the model the optimizer trains")
    # forward order: the order of named_parameters, restricted to what the optimizer trains
    opt_ids = {id(p) for p in opt_params}
    return [(n, p) for n, p in named if id(p) in opt_ids]


def _grad_buffer(p: torch.Tensor, name: str, compression: Compressor,
                 average: bool) -> GradBuffer:
    if p.grad is None:
        p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
    return grad_buffer(p.grad, name, compression, average)


class DistributedOptimizer(torch.optim.Optimizer):
    """``DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
    backward_passes_per_step=1, op=Average)``, as in BytePS (and Horovod: ``op=Sum`` sums the
    gradients instead of averaging them).

    It is a ``torch.optim.Optimizer`` (learning-rate schedulers accept it) that delegates
    everything to the optimizer it wraps: ``param_groups``, ``state``, ``state_dict`` are the
    wrapped optimizer's. ``step()`` waits for the averaged gradients, then steps.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, named_parameters=None,
                 compression: Compressor = Compression.none, backward_passes_per_step: int = 1,
                 op=Average):
        # deliberately not calling Optimizer.__init__: the wrapped optimizer owns the state
        self._opt = optimizer
        self._optimizer_step_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict = OrderedDict()
        average = resolve_average(op, None, "DistributedOptimizer")
        rt = default_runtime()
        rt.check()
        named = [(n, p) for n, p in _named_params(optimizer, named_parameters)
                 if p.requires_grad]  # frozen parameters have no gradient to average
        for n, p in named:
            wire_dtype(p, f"parameter {n!r}")
        self._params = [p for _, p in named]
        self._names = [n for n, _ in named]
        if rt.size() > 1:  # before declaring anything: declarations must match across workers
            model_signature_check(rt, [(n, tuple(p.shape), str(p.dtype)) for n, p in named],
                                  "model")
        self._sync = GradientSynchronizer(
            rt, self._names,
            lambda i: _grad_buffer(self._params[i], self._names[i], self._sync.compression,
                                   average),
            backward_passes_per_step=backward_passes_per_step, compression=compression,
            average=average, layout=fusion.layout(self._params))
        self._sync.fuse = fusion.TorchFuser(rt, self._params, self._sync.compression, average,
                                            self._sync.buckets)
        self._should_sync = True
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook(i))
                       for i, p in enumerate(self._params)]

    def _make_hook(self, index: int):
        def hook(_param: torch.Tensor) -> None:
            self._sync.ready(index)
        return hook

    # -- delegation -----------------------------------------------------------------------
    @property
    def param_groups(self):
        return self._opt.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self._opt.param_groups = value

    @property
    def state(self):
        return self._opt.state

    @state.setter
    def state(self, value):
        self._opt.state = value

    @property
    def defaults(self):
        return self._opt.defaults

    @defaults.setter
    def defaults(self, value):
        self._opt.defaults = value

    def state_dict(self):
        return self._opt.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self._opt.load_state_dict(state_dict)

    def add_param_group(self, param_group) -> None:
        raise BytePSError("add_param_group after wrapping in DistributedOptimizer is not "
                          "supported: add the group to the optimizer before wrapping it")

    def __getstate__(self):
        raise TypeError("a DistributedOptimizer cannot be pickled; save state_dict() instead")

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self._opt!r})"

    # -- BytePS API -------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Wait until every gradient is averaged across workers (called by step()). Each call
        is one training step for traces, metrics and the status view."""
        self._sync.synchronize()

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """step() inside does not synchronize: use after calling synchronize() yourself, e.g.
        to clip the averaged gradients before the update."""
        self._should_sync = False
        try:
            yield
        finally:
            self._should_sync = True

    def step(self, closure=None):
        if self._should_sync:
            self.synchronize()
        return self._opt.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._sync.in_flight:
            raise BytePSError("optimizer.zero_grad() was called after loss.backward() but "
                              "before optimizer.step() or optimizer.synchronize(): the "
                              "gradients are still being averaged")
        self._opt.zero_grad(set_to_none=set_to_none)
