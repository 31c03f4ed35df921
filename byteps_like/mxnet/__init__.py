"""byteps_like.mxnet: drop-in for ``byteps.mxnet`` (MXNet 1.9.1, Gluon and the Module API).

    import byteps_like.mxnet as bps
    bps.init()
    trainer = bps.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
    ...
    trainer.step(batch_size)      # gradients averaged across workers, then the update

``bps.DistributedSampler(len(dataset))`` deals the training set over the workers for Gluon's
``DataLoader`` (a new deal each epoch: ``set_epoch``; with backup workers its epoch holds as
many samples as the rounds average).

MXNet is imported lazily: ``init``, ``rank`` and friends work without it, and the first use of an
MXNet-facing name raises an ImportError naming the numpy range MXNet 1.9.1 works with.
"""
from __future__ import annotations

import importlib
from typing import Any

from ..compression import Compression
from ..worker.api import join, local_rank, local_size, rank, shutdown, size  # the core's
from ..worker.api import plugin_init as init
from .ops import broadcast_parameters, byteps_declare_tensor, byteps_push_pull

_LAZY = {"DistributedOptimizer": ".trainer", "DistributedTrainer": ".trainer",
         "DistributedSampler": ".data"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["init", "shutdown", "join", "rank", "size", "local_rank", "local_size",
           "byteps_push_pull",
           "byteps_declare_tensor", "broadcast_parameters", "Compression",
           "DistributedOptimizer", "DistributedTrainer", "DistributedSampler"]
