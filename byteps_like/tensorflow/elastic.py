"""Elastic training with TensorFlow 2 and tf.keras (docs/elastic.md), named as in Horovod's
``hvd.elastic`` for TensorFlow.

    import byteps_like.tensorflow as bps
    bps.init()
    model = ...; optimizer = bps.DistributedOptimizer(tf.keras.optimizers.SGD(0.01))
    state = bps.elastic.TensorFlowKerasState(model, optimizer, epoch=0, batch=0)

    @bps.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            ...                                     # steps; state.commit() every few
    train(state)

A membership change inside a ``tf.function`` (a Keras ``fit`` step) reaches Python as a
TensorFlow ``OpError``; ``run`` asks the runtime whether the membership changed and treats it as
the :class:`~byteps_like.errors.MembershipChangedError` it is. For ``model.fit`` use the
callbacks: :class:`CommitStateCallback`, :class:`UpdateBatchStateCallback`,
:class:`UpdateEpochStateCallback` and ``fit(..., initial_epoch=state.epoch)``.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from ..errors import MembershipChangedError, TooFewWorkersError
from ..worker import elastic as core
from ..worker.elastic import ObjectState, State, StateHandler, reset_synchronizer
from ..worker.runtime import Runtime
from . import ops as _tf_ops


def classify(exc: BaseException) -> MembershipChangedError | None:
    """The membership change behind a TensorFlow error (an exception raised by a collective
    inside a graph arrives as an ``OpError`` that only quotes it), or None."""
    text = str(exc)
    if not isinstance(exc, tf.errors.OpError) and "MembershipChangedError" not in text:
        return None
    rt: Any = core.runtime()
    try:
        rt.check_membership()
    except MembershipChangedError as found:
        return found
    if "MembershipChangedError" in text:  # already superseded and the epoch taken in: void step
        return MembershipChangedError(text, epoch=int(getattr(rt, "epoch", 0)))
    return None


def run(func):
    """Horovod's ``hvd.elastic.run`` (see :func:`byteps_like.worker.elastic.run`), catching the
    membership changes TensorFlow wraps in an ``OpError`` too."""
    return core.run_with(func, classify)


def forget_gradient_groups(ops: Any) -> None:
    """Drop the plugin's cached gradient groups of this runtime: every worker of the new epoch
    (those that stay and those that join, which have none) then checks the model signature at
    its first step, so all run the same collectives."""
    groups = getattr(ops, "_groups", None)
    if not isinstance(groups, dict):
        return
    rid = id(core.runtime())
    for key in [k for k in groups if isinstance(k, tuple) and k and k[0] == rid]:
        group = groups.pop(key)
        reset_synchronizer(getattr(group, "sync", None))


class KerasModelHandler(StateHandler):
    """A Keras model and its optimizer: the values of their variables. The optimizer is built
    for the model's trainable variables first, so that every worker has the same variables."""

    def __init__(self, model: Any, optimizer: Any, ops: Any) -> None:
        super().__init__(model)
        self.optimizer, self.ops = optimizer, ops

    def variables(self) -> list:
        opt = self.optimizer if self.optimizer is not None else getattr(
            self.value, "optimizer", None)
        out = list(self.value.variables)
        if opt is not None:
            if not getattr(opt, "built", True):
                opt.build(self.value.trainable_variables)
            out += list(opt.variables)
        return out

    def save(self) -> None:
        self._saved = [np.array(v.numpy(), copy=True) for v in self.variables()]

    def restore(self) -> None:
        vs = self.variables()
        if len(vs) != len(self._saved):
            raise RuntimeError(f"elastic restore: the model and optimizer have {len(vs)} "
                               f"variables now, {len(self._saved)} at the last commit")
        for v, val in zip(vs, self._saved):
            v.assign(val)

    def reset(self) -> None:
        forget_gradient_groups(self.ops)

    def sync(self, rt: Runtime, name: str) -> None:
        forget_gradient_groups(self.ops)
        if rt.size() > 1:
            self.ops.broadcast_variables(self.variables(), 0, prefix=f"{name}.")


def state_class(ops: Any, cls_name: str) -> type:
    """The Keras state class over plugin operations ``ops`` (tf.keras here, Keras 3 in
    :mod:`byteps_like.keras.elastic`)."""

    class _KerasState(ObjectState):
        __doc__ = (f"``{cls_name}(model, optimizer=None, **extra)``: Horovod's state of a Keras "
                   "model. ``state.model``, ``state.optimizer`` (the model's own when not "
                   "given) and the extras are attributes; commit saves the values of the "
                   "model's and the optimizer's variables, sync broadcasts them from rank 0.")

        def __init__(self, model: Any, optimizer: Any = None, backend: Any = None,
                     **kwargs: Any) -> None:
            del backend  # Horovod's argument for Keras 2 sessions; nothing to do in TF 2
            if optimizer is None:
                optimizer = getattr(model, "optimizer", None)
            super().__init__({"model": KerasModelHandler(model, optimizer, ops)}, **kwargs)
            object.__setattr__(self, "optimizer", optimizer)

    _KerasState.__name__ = _KerasState.__qualname__ = cls_name
    return _KerasState


TensorFlowKerasState = state_class(_tf_ops, "TensorFlowKerasState")
TensorFlowState = TensorFlowKerasState


# -- Keras callbacks (Horovod's names) -------------------------------------------------------------
def callback_classes(keras: Any) -> tuple[type, type, type]:
    """CommitStateCallback, UpdateBatchStateCallback, UpdateEpochStateCallback for ``keras``."""
    base = keras.callbacks.Callback

    class CommitStateCallback(base):  # type: ignore[misc, valid-type]
        """``state.commit()`` every ``batches_per_commit`` batches and at the end of every
        epoch (put it after the Update*StateCallbacks)."""

        def __init__(self, state: State, batches_per_commit: int = 1) -> None:
            super().__init__()
            if batches_per_commit < 1:
                raise ValueError(f"batches_per_commit={batches_per_commit}: must be >= 1")
            self.state, self.batches_per_commit = state, batches_per_commit
            self._left = batches_per_commit

        def on_train_batch_end(self, batch, logs=None):
            self._left -= 1
            if self._left == 0:
                self._left = self.batches_per_commit
                self.state.commit()

        def on_epoch_end(self, epoch, logs=None):
            self._left = self.batches_per_commit
            self.state.commit()

    class UpdateBatchStateCallback(base):  # type: ignore[misc, valid-type]
        """``state.batch``: the batches done in the current epoch (0 at an epoch's end)."""

        def __init__(self, state: State) -> None:
            super().__init__()
            self.state = state

        def on_train_batch_end(self, batch, logs=None):
            self.state.batch = int(batch) + 1

        def on_epoch_end(self, epoch, logs=None):
            self.state.batch = 0

    class UpdateEpochStateCallback(base):  # type: ignore[misc, valid-type]
        """``state.epoch``: the epochs done; pass ``initial_epoch=state.epoch`` to ``fit`` so a
        restarted ``fit`` goes on from there."""

        def __init__(self, state: State) -> None:
            super().__init__()
            self.state = state

        def on_epoch_end(self, epoch, logs=None):
            self.state.epoch = int(epoch) + 1

    return CommitStateCallback, UpdateBatchStateCallback, UpdateEpochStateCallback


CommitStateCallback, UpdateBatchStateCallback, UpdateEpochStateCallback = \
    callback_classes(tf.keras)

__all__ = ["run", "TensorFlowKerasState", "TensorFlowState", "ObjectState", "State",
           "StateHandler", "CommitStateCallback", "UpdateBatchStateCallback",
           "UpdateEpochStateCallback", "MembershipChangedError", "TooFewWorkersError"]
