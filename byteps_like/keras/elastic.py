"""Elastic training with Keras 3 (docs/elastic.md), named as in Horovod's
``horovod.keras.elastic``.

    import keras
    import byteps_like.keras as bps
    bps.init()
    model.compile(optimizer=bps.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss=...)
    state = bps.elastic.KerasState(model, batch=0, epoch=0)
    callbacks = [bps.elastic.UpdateBatchStateCallback(state),
                 bps.elastic.UpdateEpochStateCallback(state),
                 bps.elastic.CommitStateCallback(state, batches_per_commit=10)]

    @bps.elastic.run
    def train(state):
        model.fit(x, y, epochs=epochs, initial_epoch=state.epoch, callbacks=callbacks)

    train(state)

The implementation is :mod:`byteps_like.tensorflow.elastic`'s, given Keras 3 and this plugin's
operations (the TensorFlow backend is what byteps_like.keras elastic supports).
"""
from __future__ import annotations

import keras

from ..errors import MembershipChangedError, TooFewWorkersError
from ..tensorflow import elastic as _impl
from ..worker.elastic import ObjectState, State, StateHandler
from ._backend import ops as _ops

run = _impl.run

KerasState = _impl.state_class(_ops, "KerasState")
TensorFlowKerasState = KerasState

CommitStateCallback, UpdateBatchStateCallback, UpdateEpochStateCallback = \
    _impl.callback_classes(keras)

__all__ = ["run", "KerasState", "TensorFlowKerasState", "ObjectState", "State", "StateHandler",
           "CommitStateCallback", "UpdateBatchStateCallback", "UpdateEpochStateCallback",
           "MembershipChangedError", "TooFewWorkersError"]
