"""DistributedOptimizer (wraps an ``mx.optimizer.Optimizer``) and DistributedTrainer (a Gluon
``Trainer`` that averages gradients across workers before the update), as in BytePS.

Both are static subclasses of MXNet classes, so importing this module imports MXNet: the package
loads it on first use of either name.
"""
from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from ..compression import Compression, Compressor
from ..worker.runtime import default_runtime
from ..worker.sync import (
    GradBuffer,
    GradientSynchronizer,
    check_names,
    dtype_layout,
    model_signature_check,
)
from ._mx import mx
from .ops import broadcast_arrays, byteps_push_pull

_mx: Any = mx()  # MXNet is untyped: its classes are Any to the type checker


_BYTEPS_KEYS = {"compressor", "fp16", "ef", "momentum", "mu", "scaling", "k", "seed",
                "partition", "normalize"}


def _compressor(compression_params: dict | None,
                optimizer_params: dict | None = None) -> Compressor:
    """BytePS's ``compression_params``: ``{"compressor": "onebit" | "topk" | "randomk" |
    "dithering" | "fp16" | "bf16", "ef": "vanilla", "momentum": "nesterov", "scaling": bool,
    "k": ..., "seed": ..., "partition": "linear" | "natural", "normalize": "max" | "l2"}``, or
    ``{"fp16": True}``. With ``"momentum": "nesterov"`` the momentum coefficient is
    ``"mu"`` or the optimizer's ``momentum``, which is then removed from ``optimizer_params``
    (as BytePS does: the momentum is applied before compression instead of in the update)."""
    if not compression_params:
        return Compression.none
    params = dict(compression_params)
    unknown = set(params) - _BYTEPS_KEYS
    if unknown:
        raise ValueError(f"compression_params: unknown key(s) {sorted(unknown)}; known: "
                         f"{sorted(_BYTEPS_KEYS)}")
    name = params.pop("compressor", None)
    if params.pop("fp16", False):
        name = name or "fp16"
    if name in (None, "none"):
        return Compression.none
    if name in ("fp16", "bf16"):
        return getattr(Compression, name)
    ef = params.get("ef")
    if ef not in (None, "vanilla"):
        raise ValueError(f"compression_params: ef={ef!r}; byteps_like has 'vanilla' error "
                         "feedback")
    kw: dict = {"error_feedback": ef == "vanilla"}
    mom = params.get("momentum")
    if mom not in (None, "nesterov"):
        raise ValueError(f"compression_params: momentum={mom!r}; byteps_like has 'nesterov'")
    if mom == "nesterov":
        mu = params.get("mu")
        if mu is None and optimizer_params is not None:
            mu = optimizer_params.pop("momentum", None)
        kw["momentum"] = float(0.9 if mu is None else mu)
    if name == "onebit":
        return Compression.onebit(scaling=bool(params.get("scaling", False)), **kw)
    if name in ("topk", "randomk"):
        if "k" not in params:
            raise ValueError(f"compression_params: {name} needs k (a fraction below 1 or a "
                             "count)")
        if name == "topk":
            return Compression.topk(params["k"], **kw)
        return Compression.randomk(params["k"], seed=int(params.get("seed", 0)), **kw)
    if name == "dithering":
        extra = {k: params[k] for k in ("partition", "normalize") if k in params}
        return Compression.dithering(levels=int(params.get("k", 16)),
                                     seed=int(params.get("seed", 0)), **extra, **kw)
    from ..compression import from_spec  # a compressor registered by the user
    return from_spec({"name": name, **{k: v for k, v in params.items()
                                       if k not in ("ef", "momentum", "mu")}})


class DistributedOptimizer(_mx.optimizer.Optimizer):
    """``DistributedOptimizer(optimizer)``: averages each gradient across workers, then lets the
    wrapped optimizer update. Use it with the Module API or with
    ``gluon.Trainer(params, opt, kvstore=None)``; for Gluon prefer :class:`DistributedTrainer`.

    Everything but the update is the wrapped optimizer's: attribute reads and writes (``lr``,
    ``rescale_grad``, ``param_dict``, ...) go to it.
    """

    def __init__(self, optimizer: Any):
        # deliberately not calling Optimizer.__init__: the wrapped optimizer owns the state
        if not isinstance(optimizer, _mx.optimizer.Optimizer):
            raise TypeError("DistributedOptimizer wraps an mx.optimizer.Optimizer, not "
                            f"{type(optimizer).__name__}")
        default_runtime().check()
        object.__setattr__(self, "_bps_opt", optimizer)

    def __getattr__(self, item: str) -> Any:  # only for what the wrapper itself lacks
        if item == "_bps_opt":
            raise AttributeError(item)
        return getattr(self._bps_opt, item)

    def __setattr__(self, key: str, value: Any) -> None:
        setattr(self._bps_opt, key, value)

    def _push_pull(self, index, grad) -> None:
        if isinstance(index, (tuple, list)):
            for i, g in zip(index, grad):
                byteps_push_pull(g, priority=-i, name=f"Gradient.{i}", is_average=True)
        else:
            byteps_push_pull(grad, priority=-index, name=f"Gradient.{index}", is_average=True)

    def create_state(self, index, weight):
        return self._bps_opt.create_state(index, weight)

    def create_state_multi_precision(self, index, weight):
        return self._bps_opt.create_state_multi_precision(index, weight)

    def update(self, index, weight, grad, state):
        self._push_pull(index, grad)
        self._bps_opt.update(index, weight, grad, state)

    def update_multi_precision(self, index, weight, grad, state):
        self._push_pull(index, grad)
        self._bps_opt.update_multi_precision(index, weight, grad, state)

    def set_learning_rate(self, lr):
        self._bps_opt.set_learning_rate(lr)

    def set_lr_mult(self, args_lr_mult):
        self._bps_opt.set_lr_mult(args_lr_mult)

    def set_wd_mult(self, args_wd_mult):
        self._bps_opt.set_wd_mult(args_wd_mult)

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self._bps_opt!r})"


class DistributedTrainer(_mx.gluon.Trainer):
    """``DistributedTrainer(params, optimizer, optimizer_params=None, root_rank=0,
    compression_params=None)``: a Gluon ``Trainer`` whose ``step()``/``allreduce_grads()``
    average every gradient across workers before the update (the first parameter first:
    priority ``-index``), named after the parameters.

    Parameters already initialised are broadcast from ``root_rank`` here; parameters with
    deferred initialisation at their first ``step()``.
    """

    _params_to_init: list[Any]  # gluon.Trainer's: the parameters still to be initialised

    def __init__(self, params, optimizer, optimizer_params=None, root_rank: int = 0,
                 compression_params: dict | None = None):
        if isinstance(optimizer, DistributedOptimizer):
            optimizer = optimizer._bps_opt
            warnings.warn("DistributedTrainer takes a plain optimizer, not a "
                          "DistributedOptimizer: it was unwrapped", UserWarning, stacklevel=2)
        rt = default_runtime()
        rt.check()
        if optimizer_params is not None:
            optimizer_params = dict(optimizer_params)
        self._bps_compression = _compressor(compression_params, optimizer_params)
        self._bps_root = root_rank
        self._bps_sync: GradientSynchronizer | None = None
        # compression is ours, not the kvstore's: the base class gets none
        super().__init__(params, optimizer, optimizer_params=optimizer_params, kvstore=None)
        check_names([p.name for p in self._params], "params")
        if rt.size() > 1:  # before anything is declared: declarations must match across workers
            # (deferred shapes hold zeros until the first forward; the core checks them later)
            model_signature_check(rt, [(p.name, tuple(p.shape or ()), str(p.dtype))
                                       for p in self._params], "model")
        self._bps_init_params()

    # -- parameters ---------------------------------------------------------------------------
    def _bps_init_params(self) -> None:
        ready = [p for p in self._params_to_init if not p._deferred_init]
        if default_runtime().size() > 1:
            broadcast_arrays([(p.name, p.data()) for p in ready], self._bps_root, "Parameter.")
        self._params_to_init = [p for p in self._params_to_init if p._deferred_init]

    def _init_params(self) -> None:  # called by step() while some parameters wait to be set
        self._bps_init_params()

    # -- gradients ----------------------------------------------------------------------------
    def _bps_trained(self) -> list[int]:
        return [i for i, p in enumerate(self._params) if p.grad_req != "null"]

    def _bps_synchronizer(self) -> GradientSynchronizer:
        if self._bps_sync is None:  # at the first step, when every shape is known
            rt = default_runtime()
            idx = self._bps_trained()
            names = [self._params[i].name for i in idx]

            def grad_buffer(k: int) -> GradBuffer:
                grad = self._params[idx[k]].list_grad()[0]
                arr = grad.asnumpy()

                def writeback() -> None:
                    grad[:] = arr
                return GradBuffer(arr, writeback=writeback)

            # tensor fusion: the gradients' bytes and dtypes (every shape is known by now)
            layout = dtype_layout(
                [(int(np.prod(self._params[i].shape)) * np.dtype(self._params[i].dtype)
                  .itemsize, str(np.dtype(self._params[i].dtype))) for i in idx],
                self._bps_compression, rt.cfg)
            self._bps_sync = GradientSynchronizer(rt, names, grad_buffer,
                                                  compression=self._bps_compression,
                                                  layout=layout)
        return self._bps_sync

    def _allreduce_grads(self) -> None:
        if len(self._contexts) > 1:
            raise NotImplementedError("DistributedTrainer trains on one context per process "
                                      "(one worker per device), as in BytePS")
        if default_runtime().size() == 1 and self._bps_compression is Compression.none:
            return
        sync = self._bps_synchronizer()
        sync.synchronize()  # one training step
