"""DistributedGradientTape: a tf.GradientTape whose gradient() returns averaged gradients."""
from __future__ import annotations

from typing import Any

import tensorflow as tf

from ..compression import Compression, Compressor
from .ops import push_pull_gradients


class DistributedGradientTape:
    """``DistributedGradientTape(tape, compression=Compression.none)``, as in BytePS.

    Wraps (composition) the user's ``tf.GradientTape``: everything but ``gradient`` is the
    tape's own. ``gradient`` computes the local gradients, then averages them across workers:
    all start at once through the core's GradientSynchronizer, first source first. Works in
    eager mode and inside ``tf.function``. ``sparse_as_dense=False``: a ``tf.IndexedSlices``
    gradient (an embedding lookup's) travels as its rows, not as the whole variable
    (:func:`~byteps_like.tensorflow.ops.push_pull_rows`)."""

    def __init__(self, gradtape: tf.GradientTape, device_dense: str = "",
                 device_sparse: str = "", compression: Compressor = Compression.none,
                 sparse_as_dense: bool = True, op: Any = None, average: bool = True,
                 prefix: str = "DistributedGradientTape."):
        self._tape = gradtape
        self._compression = compression
        self._average = average
        self._prefix = prefix
        self._sparse_as_dense = sparse_as_dense

    def __getattr__(self, item: str) -> Any:
        return getattr(self.__dict__["_tape"], item)

    def __enter__(self) -> DistributedGradientTape:
        self._tape.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._tape.__exit__(*exc)

    def gradient(self, target: Any, sources: Any, output_gradients: Any = None,
                 **kwargs: Any) -> Any:
        grads = self._tape.gradient(target, sources, output_gradients, **kwargs)
        flat_sources = tf.nest.flatten(sources)
        flat_grads = tf.nest.flatten(grads)
        averaged = push_pull_gradients(flat_grads, flat_sources, self._compression,
                                       self._average, self._prefix, self._sparse_as_dense)
        return tf.nest.pack_sequence_as(grads, averaged)
