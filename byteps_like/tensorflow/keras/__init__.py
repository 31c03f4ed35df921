"""byteps_like.tensorflow.keras: drop-in for ``byteps.tensorflow.keras`` (tf.keras).

Since TensorFlow 2.16 ``tf.keras`` is Keras 3 (the same classes as ``import keras``), so this is
:mod:`byteps_like.keras` under the name BytePS gives it: every name here is that module's. The
legacy Keras 2 (``tf_keras``, ``TF_USE_LEGACY_KERAS=1``) is not supported."""
from __future__ import annotations

import tensorflow as tf

from ...keras import *  # noqa: F403 - this module is a re-export
from ...keras import __all__, _ops  # noqa: F401
from ...keras import keras as _keras

if tf.keras.optimizers.Optimizer is not _keras.optimizers.Optimizer:  # pragma: no cover
    raise ImportError("byteps_like.tensorflow.keras needs tf.keras to be Keras 3 (TensorFlow "
                      ">= 2.16 without TF_USE_LEGACY_KERAS=1); the legacy tf_keras is not "
                      "supported")

keras = _keras


def __getattr__(name: str):  # bps.elastic loads on first use (docs/elastic.md)
    if name == "elastic":
        import importlib
        return importlib.import_module("byteps_like.keras.elastic")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
