"""Keras callbacks (byteps.keras.callbacks): thin classes over :mod:`byteps_like._keras`."""
from __future__ import annotations

import keras

from .. import _keras as _impl
from ._backend import ops as _ops

(BroadcastGlobalVariablesCallback, MetricAverageCallback, LearningRateScheduleCallback,
 LearningRateWarmupCallback, JoinCallback) = _impl.callback_classes(keras, _ops, __name__)

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback", "JoinCallback",
           "LearningRateScheduleCallback", "LearningRateWarmupCallback"]
