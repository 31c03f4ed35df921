"""tf.keras callbacks (byteps.tensorflow.keras.callbacks), over :mod:`byteps_like._keras`."""
from __future__ import annotations

import tensorflow as tf

from ... import _keras as _impl
from .. import ops as _ops

(BroadcastGlobalVariablesCallback, MetricAverageCallback, LearningRateScheduleCallback,
 LearningRateWarmupCallback) = _impl.callback_classes(tf.keras, _ops, __name__)

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback",
           "LearningRateScheduleCallback", "LearningRateWarmupCallback"]
