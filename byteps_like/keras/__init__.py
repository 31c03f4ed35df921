"""byteps_like.keras: drop-in for ``byteps.keras`` / ``horovod.keras`` on Keras 3.

    import keras
    import byteps_like.keras as bps
    bps.init()
    opt = bps.DistributedOptimizer(keras.optimizers.SGD(0.01 * bps.size()))
    model.compile(optimizer=opt, loss=...)
    model.fit(x_shard, y_shard, callbacks=[bps.callbacks.BroadcastGlobalVariablesCallback(0),
                                           bps.callbacks.MetricAverageCallback()])

With the TensorFlow backend everything works in eager mode and in compiled ``fit`` steps
(``tf.function``); on another backend the gradient averaging runs eagerly through numpy.
``byteps_like.tensorflow.keras`` is this module under the name BytePS gives tf.keras (tf.keras
is Keras 3); the Keras logic itself is in :mod:`byteps_like._keras`.
"""
from __future__ import annotations

try:
    import keras
except ImportError as exc:  # pragma: no cover - exercised only without keras
    raise ImportError("byteps_like.keras needs Keras 3: pip install "
                      "'byteps_like[tensorflow]' (or keras and a backend)") from exc

from .. import _keras as _impl
from ..compression import Compression
from ..worker.api import barrier, join, local_rank, local_size, rank, shutdown, size
from ..worker.api import plugin_init as init
from ..worker.runtime import default_runtime
from ._backend import ops as _ops  # byteps_like.tensorflow.ops or an EagerOps
from .data import DistributedPyDataset


def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",  # noqa: N802
                         compression=Compression.none, sparse_as_dense=True,
                         backward_passes_per_step=1):
    """A new optimizer of ``optimizer``'s class and configuration whose ``apply`` /
    ``apply_gradients`` average the gradients across workers first. ``sparse_as_dense=False``
    (TensorFlow backend): ``tf.IndexedSlices`` gradients (embedding lookups) travel as rows,
    not as the whole variable."""
    return _impl.create_distributed_optimizer(keras, optimizer, _ops, name, compression,
                                              backward_passes_per_step, sparse_as_dense)


def broadcast_global_variables(root_rank: int, model=None, optimizer=None, variables=None):
    """Give every rank the root rank's model (and optimizer) variables."""
    _impl.broadcast_global_variables(keras, _ops, root_rank, model, optimizer, variables)


def push_pull(value, name: str, average: bool = True):
    """Average (or sum) a number or numpy array over the workers, in float64 (eager; for
    metrics): a float or a numpy array. :func:`allreduce` keeps the dtype and takes tensors."""
    import numpy as np
    arr = np.array(value, dtype=np.float64)
    default_runtime().push_pull_async(arr, name=name, average=average, out=arr).wait()
    return arr if arr.ndim else float(arr)


def allreduce(value, name: str | None = None, average: bool = True,
              compression=Compression.none):
    """Horovod's ``hvd.keras.allreduce``: the average (``average=False``: the sum) over the
    workers of ``value`` (a number, a numpy array, a tensor or a Keras variable), as a tensor
    of the backend in ``value``'s dtype (Python floats: ``floatx``). Eager, and in
    ``tf.function`` on the TensorFlow backend. Unnamed calls take the next name of one
    sequence: pass ``name=`` for a value reduced in a loop."""
    return _impl.allreduce(keras, _ops, value, name, average, compression)


def allgather(value, name: str | None = None):
    """Horovod's ``hvd.keras.allgather``: every worker's ``value`` concatenated along the first
    axis in rank order (the first dimension may differ between workers), as a tensor."""
    return _impl.allgather(keras, _ops, value, name)


def broadcast(value, root_rank: int, name: str | None = None):
    """Horovod's ``hvd.keras.broadcast``: ``value`` of rank ``root_rank`` on every worker, as a
    tensor."""
    return _impl.broadcast(keras, _ops, value, root_rank, name)


def load_model(filepath, custom_optimizers=None, custom_objects=None,
               compression=Compression.none, compile: bool = True, safe_mode: bool = True):
    """Horovod's ``hvd.keras.load_model``: ``keras.models.load_model(filepath)`` with the
    model's optimizer (its state restored) made a :func:`DistributedOptimizer` again, with
    ``compression``. ``custom_optimizers``: optimizer classes of your own that the file names.
    (``keras.models.load_model`` alone loads the plain optimizer, byteps_like or not.)"""
    return _impl.load_model(keras, _ops, filepath, custom_optimizers, custom_objects,
                            compression, compile, safe_mode)


from . import callbacks  # noqa: E402
from .callbacks import (  # noqa
    BroadcastGlobalVariablesCallback,
    JoinCallback,
    LearningRateScheduleCallback,
    LearningRateWarmupCallback,
    MetricAverageCallback,
)

__all__ = ["init", "shutdown", "join", "barrier", "rank", "size", "local_rank", "local_size",
           "Compression", "DistributedOptimizer", "broadcast_global_variables", "load_model",
           "push_pull", "allreduce", "allgather", "broadcast", "callbacks",
           "BroadcastGlobalVariablesCallback", "MetricAverageCallback", "JoinCallback",
           "LearningRateScheduleCallback", "LearningRateWarmupCallback",
           "DistributedPyDataset"]


def __getattr__(name: str):  # bps.elastic loads on first use (docs/elastic.md)
    if name == "elastic":
        import importlib
        return importlib.import_module(f"{__name__}.elastic")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
