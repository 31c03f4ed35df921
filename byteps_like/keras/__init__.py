"""byteps_like.keras: drop-in for ``byteps.keras`` on Keras 3.

    import keras
    import byteps_like.keras as bps
    bps.init()
    opt = bps.DistributedOptimizer(keras.optimizers.SGD(0.01 * bps.size()))
    model.compile(optimizer=opt, loss=...)
    model.fit(x_shard, y_shard, callbacks=[bps.callbacks.BroadcastGlobalVariablesCallback(0),
                                           bps.callbacks.MetricAverageCallback()])

With the TensorFlow backend everything works in eager mode and in compiled ``fit`` steps
(``tf.function``); on another backend the gradient averaging runs eagerly through numpy.
The implementation is shared with ``byteps_like.tensorflow.keras`` (:mod:`byteps_like._keras`).
"""
from __future__ import annotations

from typing import Any

try:
    import keras
except ImportError as exc:  # pragma: no cover - exercised only without keras
    raise ImportError("byteps_like.keras needs Keras 3: pip install "
                      "'byteps_like[tensorflow]' (or keras and a backend)") from exc

from .. import _keras as _impl
from ..compression import Compression
from ..worker.api import join, local_rank, local_size, rank, size
from ..worker.runtime import default_runtime


def _make_ops():
    if keras.backend.backend() == "tensorflow":
        from ..tensorflow import ops
        return ops
    from ._eager_ops import EagerOps
    return EagerOps(keras)


_ops: Any = _make_ops()  # byteps_like.tensorflow.ops or an EagerOps


def init(lazy: bool = True, **overrides) -> None:
    from ..worker.api import init as _init
    _init(**overrides)


def shutdown() -> None:
    default_runtime().shutdown()


def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",  # noqa: N802
                         compression=Compression.none, sparse_as_dense=True,
                         backward_passes_per_step=1):
    """A new optimizer of ``optimizer``'s class and configuration whose ``apply`` /
    ``apply_gradients`` average the gradients across workers first."""
    return _impl.create_distributed_optimizer(keras, optimizer, _ops, name, compression,
                                              backward_passes_per_step)


def broadcast_global_variables(root_rank: int, model=None, optimizer=None, variables=None):
    """Give every rank the root rank's model (and optimizer) variables."""
    _impl.broadcast_global_variables(keras, _ops, root_rank, model, optimizer, variables)


def push_pull(value, name: str, average: bool = True):
    """Average (or sum) a number or numpy array over the workers (eager; for metrics)."""
    import numpy as np
    arr = np.array(value, dtype=np.float64)
    default_runtime().push_pull_async(arr, name=name, average=average, out=arr).wait()
    return arr if arr.ndim else float(arr)


from . import callbacks  # noqa: E402
from .callbacks import (  # noqa
    BroadcastGlobalVariablesCallback,
    LearningRateScheduleCallback,
    LearningRateWarmupCallback,
    MetricAverageCallback,
)

__all__ = ["init", "shutdown", "join", "rank", "size", "local_rank", "local_size", "Compression",
           "DistributedOptimizer", "broadcast_global_variables", "push_pull", "callbacks",
           "BroadcastGlobalVariablesCallback", "MetricAverageCallback",
           "LearningRateScheduleCallback", "LearningRateWarmupCallback"]


def __getattr__(name: str):  # bps.elastic loads on first use (docs/elastic.md)
    if name == "elastic":
        import importlib
        return importlib.import_module(f"{__name__}.elastic")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
