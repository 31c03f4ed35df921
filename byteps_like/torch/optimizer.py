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
from ._tensor import wire_dtype
from .fusion import grad_buffer


def _delegated(name: str) -> property:
    """An attribute of the wrapped optimizer (``self._opt``), read and written through."""
    return property(lambda self: getattr(self._opt, name),
                    lambda self, value: setattr(self._opt, name, value))


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
            average=average,
            layout=fusion.layout(self._params, compression, rt.cfg))
        self._sync.fuse = fusion.TorchFuser(rt, self._params, self._sync.compression, average,
                                            self._sync.buckets)
        self._should_sync = True
        self._cross: _Crossing | None = None  # CrossBarrier(model, optimizer)
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook(i))
                       for i, p in enumerate(self._params)]

    def _make_hook(self, index: int):
        def hook(_param: torch.Tensor) -> None:
            if self._cross is not None and self._cross.waiting:
                self._cross.check_not_waiting(index)
            self._sync.ready(index)
        return hook

    # -- delegation -----------------------------------------------------------------------
    param_groups = _delegated("param_groups")
    state = _delegated("state")
    defaults = _delegated("defaults")

    def state_dict(self):
        if self._cross is not None:
            self._cross.flush()
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
        if self._cross is not None:
            self._cross.flush()
        self._sync.synchronize()

    def flush(self) -> None:
        """With :func:`~byteps_like.torch.cross_barrier.CrossBarrier`: apply every update still
        waiting for the next forward pass now (nothing to do without it)."""
        if self._cross is not None:
            self._cross.flush()

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
        if self._cross is not None and self._should_sync:
            return self._cross.step(closure)
        if self._should_sync:
            self.synchronize()
        return self._opt.step(closure)

    def close(self) -> None:
        """Stop averaging: remove the hooks this optimizer put on the parameters (and on the
        model, with CrossBarrier), so that another DistributedOptimizer can wrap them, e.g. a
        second ``Trainer.fit`` of the same model. Gradients still in flight are forgotten, not
        waited for. Idempotent; the wrapped optimizer stays usable on its own."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._cross is not None:
            for h in self._cross.hooks:
                h.remove()
            self._cross.hooks = []
            self._cross = None
        self._sync.reset()

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._cross is not None:
            self._cross.zero_grad(set_to_none)
            return
        if self._sync.in_flight:
            raise BytePSError("optimizer.zero_grad() was called after loss.backward() but "
                              "before optimizer.step() or optimizer.synchronize(): the "
                              "gradients are still being averaged")
        self._opt.zero_grad(set_to_none=set_to_none)


class _Crossing:
    """Crossing the barrier between steps (:func:`byteps_like.torch.cross_barrier.CrossBarrier`).

    ``step()`` starts what backward left unstarted and returns at once. The sums land during
    the next forward pass: before a module runs, the buckets holding its parameters (and every
    other bucket already back) are waited for, their sums written back and the wrapped optimizer
    steps on just those parameters (as param groups of their own, each with its group's
    current hyperparameters). The first layers' buckets, urgent by priority, come back first, so the
    next forward starts while the last ones are still on the wire. Whatever a forward pass has
    not used is applied when the model's forward returns (so before the next backward), before
    ``state_dict()`` (model or optimizer), and by ``synchronize()``/``flush()``."""

    def __init__(self, model: torch.nn.Module, dopt: DistributedOptimizer):
        self.dopt, self.sync, self.opt = dopt, dopt._sync, dopt._opt
        params = dopt._params
        index = {id(p): i for i, p in enumerate(params)}
        self.params_of = {b.index: [params[i] for i in b.members] for b in self.sync.buckets}
        self.waiting: set[int] = set()   # buckets whose sums the next forward applies
        self.set_to_none = True
        self.hooks = []
        for module in model.modules():
            own = sorted({self.sync.bucket_of[index[id(p)]]
                          for p in module.parameters(recurse=False) if id(p) in index})
            if own:
                self.hooks.append(module.register_forward_pre_hook(self._pre_hook(own)))
        self.hooks.append(model.register_forward_hook(lambda *_: self.flush()))
        self.hooks.append(model.register_state_dict_pre_hook(lambda *_, **__: self.flush()))

    def _pre_hook(self, buckets: list[int]):
        needed = set(buckets)

        def hook(_module, _inputs) -> None:
            if self.waiting and not needed.isdisjoint(self.waiting):
                # with them, every bucket already back: one optimizer step for all of them
                pending = self.sync.pending
                self._apply(sorted(k for k in self.waiting
                                   if k in needed or pending[k].handle.done()))
        return hook

    def step(self, closure=None):
        if closure is not None:
            raise BytePSError("CrossBarrier: step(closure) is not supported (the update of "
                              "each layer happens during the next forward pass)")
        self.flush()
        self.sync.launch_rest()
        self.waiting = set(self.sync.pending)
        self.sync.restart_counts()
        self.sync.end_step()

    def _apply(self, buckets: list[int]) -> None:
        """Wait for ``buckets``, write their sums back and step on their parameters."""
        self.waiting.difference_update(buckets)
        try:
            for k in buckets:
                self.sync.finish_bucket(k)
        except BaseException:
            self.waiting.clear()
            self.sync.reset()
            raise
        params = [p for k in buckets for p in self.params_of[k]]
        ids = {id(p) for p in params}
        with self._groups_of(lambda p: id(p) in ids):
            self.opt.step()
        for p in params:  # the gradient is used up: the next backward starts from nothing
            if self.set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def check_not_waiting(self, index: int) -> None:
        """A gradient backward accumulated must not belong to a bucket whose sum from the last
        step is still to be applied (its gradient would mix with the new one)."""
        if self.sync.bucket_of[index] in self.waiting:
            self.waiting.clear()
            self.sync.reset()
            raise BytePSError(
                f"CrossBarrier: parameter {self.dopt._names[index]!r} got a gradient before "
                "its update from the last step was applied: the forward pass must go through "
                "the model given to CrossBarrier (model(...), not one of its submodules or "
                "its parameters directly), or call optimizer.flush() before it")

    def flush(self) -> None:
        """Apply every bucket still waiting."""
        if self.waiting:
            self._apply(sorted(self.waiting))

    def zero_grad(self, set_to_none: bool) -> None:
        """The wrapped optimizer's zero_grad, except for the gradients still waiting for their
        sums (they are cleared once applied)."""
        if any(k not in self.waiting for k in self.sync.pending):
            raise BytePSError("optimizer.zero_grad() was called after loss.backward() but "
                              "before optimizer.step(): the gradients are still being averaged")
        self.set_to_none = set_to_none
        if not self.waiting:
            self.opt.zero_grad(set_to_none=set_to_none)
            return
        busy = {id(p) for k in self.waiting for p in self.params_of[k]}
        with self._groups_of(lambda p: id(p) not in busy):
            self.opt.zero_grad(set_to_none=set_to_none)

    @contextlib.contextmanager
    def _groups_of(self, keep) -> Iterator[None]:
        """The wrapped optimizer sees only the parameters ``keep`` accepts, each in its own
        group with that group's current hyperparameters."""
        saved = self.opt.param_groups
        self.opt.param_groups = [dict(g, params=[p for p in g["params"] if keep(p)])
                                 for g in saved]
        try:
            yield
        finally:
            self.opt.param_groups = saved
