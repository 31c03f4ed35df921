"""byteps_like.tensorflow.keras: drop-in for ``byteps.tensorflow.keras`` (tf.keras).

The same implementation as :mod:`byteps_like.keras` (:mod:`byteps_like._keras`), given
``tf.keras`` instead of ``keras``."""
from __future__ import annotations

import tensorflow as tf

from ... import _keras as _impl
from ...compression import Compression
from ...worker.api import local_rank, local_size, rank, size
from .. import init, shutdown
from .. import ops as _ops

keras = tf.keras


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


from . import callbacks  # noqa: E402
from .callbacks import (  # noqa
    BroadcastGlobalVariablesCallback,
    LearningRateScheduleCallback,
    LearningRateWarmupCallback,
    MetricAverageCallback,
)

__all__ = ["init", "shutdown", "rank", "size", "local_rank", "local_size", "Compression",
           "DistributedOptimizer", "broadcast_global_variables", "callbacks",
           "BroadcastGlobalVariablesCallback", "MetricAverageCallback",
           "LearningRateScheduleCallback", "LearningRateWarmupCallback"]
