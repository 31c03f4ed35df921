"""Keras callbacks (byteps.keras.callbacks): thin classes over :mod:`byteps_like._keras`."""
from __future__ import annotations

import keras

from .. import _keras as _impl
from . import _ops


class BroadcastGlobalVariablesCallback(_impl.BroadcastGlobalVariablesCallbackImpl,
                                       keras.callbacks.Callback):
    """Start training from the root rank's model and optimizer variables."""

    def __init__(self, root_rank: int, device: str = ""):
        super().__init__(keras, _ops, root_rank)


class MetricAverageCallback(_impl.MetricAverageCallbackImpl, keras.callbacks.Callback):
    """Average the epoch's metrics over the workers (put it first among the callbacks)."""

    def __init__(self, device: str = ""):
        super().__init__(keras)


class LearningRateScheduleCallback(_impl.LearningRateScheduleCallbackImpl,
                                   keras.callbacks.Callback):
    """lr = initial_lr * multiplier(epoch) between start_epoch and end_epoch."""

    def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True,
                 momentum_correction=True, steps_per_epoch=None):
        super().__init__(keras, initial_lr, multiplier, start_epoch, end_epoch, staircase,
                         momentum_correction, steps_per_epoch)


class LearningRateWarmupCallback(_impl.LearningRateWarmupCallbackImpl, keras.callbacks.Callback):
    """Ramp the learning rate from initial_lr / size() to initial_lr over warmup_epochs."""

    def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=True,
                 steps_per_epoch=None, verbose=0):
        super().__init__(keras, initial_lr, warmup_epochs, momentum_correction, steps_per_epoch,
                         verbose)
