"""byteps_like.tensorflow: drop-in for ``byteps.tensorflow`` (TensorFlow 2, eager and
``tf.function``).

    import byteps_like.tensorflow as bps
    bps.init()
    tape = bps.DistributedGradientTape(tape)          # averaged gradients
    bps.broadcast_variables(model.variables, root_rank=0)
"""
from __future__ import annotations

try:
    import tensorflow as _tf  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without tensorflow
    raise ImportError("byteps_like.tensorflow needs TensorFlow: pip install "
                      "'byteps_like[tensorflow]' (or tensorflow-cpu itself)") from exc

from ..compression import Compression
from ..worker.api import declare, join, local_rank, local_size, rank, shutdown, size  # the core's
from ..worker.api import plugin_init as init
from .data import epoch_dataset, epoch_indices
from .ops import allgather, broadcast, broadcast_variables, push_pull, push_pull_gradients
from .sparse import SparseEmbedding
from .tape import DistributedGradientTape


def DistributedOptimizer(optimizer, name=None, use_locking=False, device_dense="",  # noqa: N802
                         device_sparse="", compression=Compression.none, sparse_as_dense=True,
                         backward_passes_per_step=1, op=None):
    """A Keras optimizer (``tf.keras.optimizers.*``) whose updates use gradients averaged
    across workers; see :mod:`byteps_like.tensorflow.keras`."""
    from .keras import DistributedOptimizer as _dist
    return _dist(optimizer, name=name, compression=compression,
                 backward_passes_per_step=backward_passes_per_step,
                 sparse_as_dense=sparse_as_dense)


__all__ = ["init", "shutdown", "join", "allgather", "rank", "size", "local_rank", "local_size",
           "declare",
           "push_pull", "push_pull_gradients", "broadcast", "broadcast_variables",
           "DistributedGradientTape", "DistributedOptimizer", "Compression",
           "SparseEmbedding", "epoch_indices", "epoch_dataset"]


def __getattr__(name: str):  # bps.elastic loads on first use (docs/elastic.md)
    if name == "elastic":
        import importlib
        return importlib.import_module(f"{__name__}.elastic")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
