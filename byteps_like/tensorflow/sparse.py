"""A Keras embedding layer whose table is held and updated on the servers (docs/sparse.md),
for the TensorFlow backend, eager and in ``tf.function``.

``SparseEmbedding(input_dim, output_dim, ...)`` stands in for ``keras.layers.Embedding``. A call
finds the batch's unique ids (``tf.unique``), pulls their rows (``byteps_like.worker.sparse``, in
a ``tf.numpy_function``) and gathers ``rows[inverse]``. The rows hang on a scalar "anchor"
weight of the layer through a custom gradient. When a tape computes the gradient of the layer's
trainable weights, that gradient pushes each unique row's summed gradient, averaged over the
workers; the servers apply the table's optimizer. The anchor's own gradient is zero.

Every worker pushes every table once a step, so take the gradient of the layer's weights
(``model.trainable_variables``) once after each training call. A call under no tape only
reads. XLA cannot compile the pull: compile Keras models with ``jit_compile=False``.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from ..worker.runtime import default_runtime
from ..worker.sparse import EmbeddingTable


class SparseEmbedding(tf.keras.layers.Layer):
    """``keras.layers.Embedding(input_dim, output_dim)`` whose table is held and updated on
    the servers. ``init``: zeros, uniform (``init_args`` low, high) or normal (mean, std) from
    ``seed``; ``optimizer``: sgd, adagrad or adam, with its parameters by keyword (``lr=...``).
    Every worker creates the same layers in the same order; ``table`` defaults to
    ``SparseEmbedding.<n>``."""

    def __init__(self, input_dim: int, output_dim: int, *, table: str | None = None,
                 init: str = "normal", init_args: dict | None = None, seed: int = 0,
                 optimizer: str = "sgd", average: bool = True, name: str | None = None,
                 **optimizer_args: Any):
        super().__init__(name=name)
        rt = default_runtime()
        rt.check()
        self.table: EmbeddingTable = rt.sparse.create(
            table or f"SparseEmbedding.{len(rt.sparse.tables)}", input_dim, output_dim,
            init=init, init_args=init_args, seed=seed, optimizer=optimizer, **optimizer_args)
        self.input_dim, self.output_dim = input_dim, output_dim
        self.average = average   # the servers divide each round's sum by its pushes
        self.anchor = self.add_weight(shape=(), initializer="zeros", trainable=True,
                                      name="bps_anchor")

    def _pull(self, uniq: np.ndarray) -> np.ndarray:
        return self.table.pull(uniq)

    def _push(self, uniq: np.ndarray, grad: np.ndarray) -> np.float32:
        self.table.push(uniq, grad, average=self.average)
        return np.float32(0.0)

    def call(self, ids: Any) -> tf.Tensor:
        ids = tf.convert_to_tensor(ids)
        if not ids.dtype.is_integer:
            raise TypeError(f"table {self.table.name!r}: ids must be integers, not "
                            f"{ids.dtype.name}")
        uniq, inv = tf.unique(tf.reshape(tf.cast(ids, tf.int64), [-1]))
        rows = tf.reshape(tf.numpy_function(self._pull, [uniq], tf.float32),
                          [-1, self.output_dim])

        @tf.custom_gradient
        def attach(anchor: tf.Tensor) -> Any:
            def grad(dy: Any) -> tf.Tensor:
                pushed = tf.reshape(tf.numpy_function(
                    self._push, [uniq, tf.convert_to_tensor(dy)], tf.float32), [])
                return tf.zeros_like(anchor) + 0.0 * pushed   # the push is not pruned
            return rows + 0.0 * anchor, grad

        out = tf.gather(attach(tf.convert_to_tensor(self.anchor)), inv)
        return tf.reshape(out, tf.concat([tf.shape(ids), [self.output_dim]], 0))

    def compute_output_shape(self, input_shape: Any) -> tuple:
        return (*tuple(input_shape), self.output_dim)
