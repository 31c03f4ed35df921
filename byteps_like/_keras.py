"""Keras support written once, Horovod's ``_keras`` pattern: ``byteps_like.keras`` (Keras 3)
is the public module, and ``byteps_like.tensorflow.keras`` re-exports it (tf.keras is Keras 3).

Nothing here imports a framework: every function takes the ``keras`` module and the plugin's
tensor operations as parameters (``ops``: :mod:`byteps_like.tensorflow.ops` on the TensorFlow
backend, ``byteps_like.keras._eager_ops.EagerOps`` on the others), which provide
``push_pull_gradients(grads, variables, compression, average, prefix)``,
``broadcast_variables(variables, root_rank, prefix=...)``, ``push_pull(tensor, average=,
name=, compression=)``, ``broadcast(tensor, root_rank, name=)`` and ``allgather(tensor,
name=)``. Metric averaging works on Python floats through the core.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from .compression import Compression, Compressor
from .worker.runtime import default_runtime

_classes: dict = {}


def distributed_optimizer_class(keras: Any, base: type[Any], ops: Any) -> type[Any]:
    """The distributed subclass of optimizer class ``base``, made once per (class, ops)."""
    key = (base, ops)
    cls = _classes.get(key)
    if cls is not None:
        return cls

    class _Distributed(base):
        _bps_ops = ops

        def apply(self, grads, trainable_variables=None):  # Keras 3: apply_gradients calls it
            grads = list(grads)
            variables = (list(trainable_variables) if trainable_variables is not None
                         else list(self._trainable_variables))
            # sparse_as_dense=False: IndexedSlices travel as rows (TensorFlow backend only)
            rows = {} if getattr(self, "_bps_sparse_as_dense", True) else {
                "sparse_as_dense": False}
            grads = self._bps_ops.push_pull_gradients(
                grads, variables, getattr(self, "_bps_compression", Compression.none),
                True, getattr(self, "_bps_prefix", "DistributedOptimizer."), **rows)
            return super().apply(grads, trainable_variables)

    # A saved model names the plain optimizer, so any Keras loads it, byteps_like or not (a
    # file outlives the job: serving, evaluation). Keras 3 writes a class that is neither
    # public nor registered as {module: __module__, class_name: __name__, registered_name:
    # get_registered_name(cls), which is __name__}, and loads it by that registered name, else
    # by importing a keras.* module and taking the class. The base's module and registered name
    # ("package>Name" for a registered optimizer) therefore lead every loader to the base. The
    # alternative, registering the subclasses as serializables, would make a file need
    # byteps_like and the same lazily made classes wherever it is loaded, and would load a
    # distributed optimizer in processes that are not in a job. load_model() wraps again.
    _Distributed.__module__ = base.__module__
    _Distributed.__name__ = keras.saving.get_registered_name(base)
    _Distributed.__qualname__ = base.__qualname__
    _Distributed.__doc__ = (f"{base.__name__} whose gradients are averaged across byteps_like "
                            "workers before the update.")
    _classes[key] = _Distributed
    return _Distributed


def create_distributed_optimizer(keras: Any, optimizer: Any, ops: Any, name: str | None = None,
                                 compression: Compressor = Compression.none,
                                 backward_passes_per_step: int = 1,
                                 sparse_as_dense: bool = True) -> Any:
    """A new optimizer of ``optimizer``'s class and configuration that averages gradients
    (``sparse_as_dense=False``: ``tf.IndexedSlices`` ones as rows, on the TensorFlow
    backend)."""
    if backward_passes_per_step != 1:
        raise ValueError("backward_passes_per_step > 1 is not supported by the Keras "
                         "DistributedOptimizer; use Keras 3's gradient_accumulation_steps "
                         "on the optimizer instead")
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a {keras.__name__}.optimizers.Optimizer, "
                        f"not a {type(optimizer).__name__}")
    cls = distributed_optimizer_class(keras, type(optimizer), ops)
    config = optimizer.get_config()
    if name is not None:
        config["name"] = name
    opt = cls.from_config(config)
    opt._bps_compression = compression
    if not sparse_as_dense:
        if not hasattr(ops, "push_pull_rows"):
            raise ValueError("sparse_as_dense=False needs the TensorFlow backend (its "
                             "IndexedSlices gradients travel as rows)")
        opt._bps_sparse_as_dense = False
    opt._bps_prefix = f"DistributedOptimizer.{config.get('name', 'optimizer')}."
    return opt


def is_distributed(optimizer: Any) -> bool:
    return hasattr(type(optimizer), "_bps_ops")


def make_distributed(keras: Any, optimizer: Any, ops: Any,
                     compression: Compressor = Compression.none) -> Any:
    """Turn ``optimizer`` (a loaded one: built, its slots and iterations restored, held by the
    model's compiled state) into the distributed optimizer in place: its class becomes the
    distributed subclass of its class, which adds ``apply`` and no state. In place rather than
    a new optimizer and a copy of every variable: nothing to keep in step with Keras's
    optimizer internals, and the model, its compile state and any reference the caller holds
    see the same object."""
    base = type(optimizer)
    if is_distributed(optimizer):
        base = base.__mro__[1]
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"the model's optimizer is a {base.__name__}, not a "
                        f"{keras.__name__}.optimizers.Optimizer")
    object.__setattr__(optimizer, "__class__", distributed_optimizer_class(keras, base, ops))
    optimizer._bps_compression = compression
    optimizer._bps_prefix = f"DistributedOptimizer.{optimizer.name}."
    return optimizer


def load_model(keras: Any, ops: Any, filepath: Any, custom_optimizers: Any = None,
               custom_objects: Any = None, compression: Compressor = Compression.none,
               compile: bool = True, safe_mode: bool = True) -> Any:
    """``keras.models.load_model``, then the model's optimizer distributed again (Horovod's
    ``hvd.load_model``). ``custom_optimizers``: the optimizer classes of your own the file may
    name (added to ``custom_objects``). Files written before saved models named the plain
    optimizer (module ``byteps_like._keras``) load too: every Keras optimizer class is offered
    under its name."""
    objects: dict = {}
    builtin = [c for c in vars(keras.optimizers).values()
               if isinstance(c, type) and issubclass(c, keras.optimizers.Optimizer)]
    for cls in builtin + list(custom_optimizers or []):
        objects[cls.__name__] = cls
        objects[keras.saving.get_registered_name(cls)] = cls
    objects.update(custom_objects or {})
    model = keras.models.load_model(filepath, custom_objects=objects, compile=compile,
                                    safe_mode=safe_mode)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        make_distributed(keras, optimizer, ops, compression)
    return model


# -- Horovod's hvd.keras collectives: thin, over the plugin's tensor operations ------------------
def allreduce(keras: Any, ops: Any, value: Any, name: str | None = None, average: bool = True,
              compression: Compressor = Compression.none) -> Any:
    return ops.push_pull(keras.ops.convert_to_tensor(value), average=average, name=name,
                         compression=compression)


def allgather(keras: Any, ops: Any, value: Any, name: str | None = None) -> Any:
    return ops.allgather(keras.ops.convert_to_tensor(value), name=name)


def broadcast(keras: Any, ops: Any, value: Any, root_rank: int, name: str | None = None) -> Any:
    return ops.broadcast(keras.ops.convert_to_tensor(value), root_rank, name=name)


def model_variables(model: Any = None, optimizer: Any = None, variables: Any = None) -> list:
    out = list(variables or [])
    if model is not None:
        out += list(model.variables)
        optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
    if optimizer is not None:
        out += list(optimizer.variables)
    return out


def broadcast_global_variables(keras: Any, ops: Any, root_rank: int, model: Any = None,
                               optimizer: Any = None, variables: Any = None) -> None:
    """Overwrite the model's (and its optimizer's) variables with the root rank's."""
    vs = model_variables(model, optimizer, variables)
    if not vs:
        raise TypeError("broadcast_global_variables: TensorFlow 2 has no global variable "
                        "collection; pass model= (and optimizer=) or variables=")
    ops.broadcast_variables(vs, root_rank, prefix="BroadcastGlobalVariables.")


class BroadcastGlobalVariablesCallbackImpl:
    """At the start of training, every rank takes the root rank's model and optimizer
    variables (the optimizer's only once they exist: again after the first batch)."""

    model: Any  # set by keras.callbacks.Callback (the other base of the public class)

    def __init__(self, keras: Any, ops: Any, root_rank: int, *args: Any):
        super().__init__(*args)
        self._keras, self._ops = keras, ops
        self.root_rank = root_rank
        self.broadcast_done = False

    def _broadcast(self) -> None:
        broadcast_global_variables(self._keras, self._ops, self.root_rank, self.model,
                                   getattr(self.model, "optimizer", None))

    def on_train_begin(self, logs=None):
        if not self.broadcast_done:
            self._broadcast()
            self.broadcast_done = True


# -- uneven epochs: join at every epoch's end -----------------------------------------------------
_joined_at: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> that epoch's logs


def join_epoch(keras: Any, ops: Any, model: Any, logs: dict | None) -> None:
    """The end of one epoch of ``fit`` (JoinCallback, MetricAverageCallback): ``join()``.

    A rank whose shard ran out of batches first waits here while the others run their last
    steps, whose rounds complete without it and average over the ranks still in; ``join()``
    returns once every rank is here. Then, if the ranks ran different numbers of steps (their
    optimizers' ``iterations`` differ), every rank takes the model and optimizer variables of
    the rank that ran the most (it applied every round; ties hold the same values), so the next
    epoch starts everywhere from the same state. Once per epoch end: the callbacks of one fit
    receive the same ``logs`` dict, so the second caller sees that the first has joined.
    Skipped in a one-worker job, with several processes per machine, where ``join()`` is not
    supported, in elastic jobs, whose membership the elastic state owns, and with backup
    workers (``BYTEPS_BACKUP_WORKERS``), which refuse ``join()``: every rank must then run the
    same number of steps (``bps.DistributedPyDataset`` gives every rank the same)."""
    if logs is not None and _joined_at.get(model) is logs:
        return
    rt = default_runtime()
    if (rt.size() == 1 or rt.local_size() > 1 or rt.elastic
            or rt.config.server.backup_workers > 0):
        return
    rt.join()
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        steps = np.zeros(rt.size(), np.int64)
        steps[rt.rank()] = int(keras.ops.convert_to_numpy(optimizer.iterations))
        rt.push_pull_async(steps, name=f"JoinEpoch.iterations.{rt.size()}", average=False,
                           out=steps).wait()
        if steps.min() != steps.max():
            ops.broadcast_variables(model_variables(model, optimizer), int(np.argmax(steps)),
                                    prefix="JoinEpoch.")
    if logs is not None:
        _joined_at[model] = logs


class JoinCallbackImpl:
    """At the end of every epoch every rank joins (:func:`join_epoch`), so epochs of different
    lengths on different ranks (uneven shards) complete. Put it before callbacks that
    communicate at epoch end (MetricAverageCallback joins by itself)."""

    model: Any  # set by keras.callbacks.Callback (the other base of the public class)

    def __init__(self, keras: Any, ops: Any, *args: Any):
        super().__init__(*args)
        self._keras, self._ops = keras, ops

    def on_epoch_end(self, epoch, logs=None):
        join_epoch(self._keras, self._ops, self.model, logs)


class MetricAverageCallbackImpl:
    """At the end of every epoch, replace each numeric entry of ``logs`` with its average over
    the workers. Put it before callbacks that read the logs (checkpoints, early stopping). It
    joins first (:func:`join_epoch`): with uneven shards a rank reaches its epoch's end while
    others still train, so every rank's epoch metrics are averaged once all are there."""

    model: Any  # set by keras.callbacks.Callback (the other base of the public class)

    def __init__(self, keras: Any, ops: Any, *args: Any):
        super().__init__(*args)
        self._keras, self._ops = keras, ops

    def _average(self, logs: dict | None, what: str) -> None:
        if not logs:
            return
        keys = sorted(k for k, v in logs.items() if _is_number(v))
        if not keys:
            return
        rt = default_runtime()
        vec = np.array([float(np.asarray(logs[k])) for k in keys], np.float64)
        rt.push_pull_async(vec, name=f"MetricAverage.{what}.{','.join(keys)}", average=True,
                           out=vec).wait()
        for k, v in zip(keys, vec.tolist()):
            logs[k] = v

    def on_epoch_end(self, epoch, logs=None):
        join_epoch(self._keras, self._ops, self.model, logs)
        self._average(logs, "epoch")


def _is_number(v: Any) -> bool:
    try:
        return np.asarray(v).size == 1 and np.asarray(v).dtype.kind in "biuf"
    except Exception:  # noqa: BLE001 - not an array-like number
        return False


def get_lr(keras: Any, optimizer: Any) -> float:
    return float(keras.ops.convert_to_numpy(optimizer.learning_rate))


def set_lr(keras: Any, optimizer: Any, value: float) -> None:
    optimizer.learning_rate = value


class LearningRateScheduleCallbackImpl:
    """``lr = initial_lr * multiplier(epoch)`` for ``start_epoch <= epoch < end_epoch``: at the
    start of every epoch (``staircase=True``) or every batch with a fractional epoch
    (``staircase=False``), as in Horovod/BytePS. ``multiplier`` is a function of the epoch or a
    constant. ``momentum_correction`` is accepted for compatibility: Keras 3 optimizers hold
    momentum as a constant of the compiled step, so it is not corrected."""

    model: Any  # set by keras.callbacks.Callback (the other base of the public class)

    def __init__(self, keras: Any, initial_lr: float, multiplier: Callable | float,
                 start_epoch: int = 0, end_epoch: int | None = None, staircase: bool = True,
                 momentum_correction: bool = True, steps_per_epoch: int | None = None,
                 *args: Any):
        super().__init__(*args)
        self._keras = keras
        self.initial_lr = initial_lr
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = 0
        self.multiplier = multiplier if callable(multiplier) else (lambda epoch: multiplier)

    def _in_range(self, epoch: int) -> bool:
        return epoch >= self.start_epoch and (self.end_epoch is None or epoch < self.end_epoch)

    def _adjust(self, epoch: float) -> None:
        set_lr(self._keras, self.model.optimizer, self.initial_lr * self.multiplier(epoch))

    def on_train_begin(self, logs=None):
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = (self.params or {}).get("steps")
            if not self.steps_per_epoch:
                raise ValueError("steps_per_epoch is unknown (a dataset of unknown length): "
                                 "pass steps_per_epoch to the callback")

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if not self._in_range(self.current_epoch):
            return
        if self.staircase:
            if batch == 0:
                self._adjust(self.current_epoch)
        else:
            self._adjust(self.current_epoch + float(batch) / self.steps_per_epoch)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = get_lr(self._keras, self.model.optimizer)


class LearningRateWarmupCallbackImpl(LearningRateScheduleCallbackImpl):
    """Ramp the learning rate from ``initial_lr / size()`` to ``initial_lr`` over
    ``warmup_epochs`` epochs, batch by batch (Goyal et al.; Horovod's formula)."""

    def __init__(self, keras: Any, initial_lr: float, warmup_epochs: int = 5,
                 momentum_correction: bool = True, steps_per_epoch: int | None = None,
                 verbose: int = 0, *args: Any):
        def multiplier(epoch: float) -> float:
            if self.steps_per_epoch is None:  # on_train_begin sets it (or raises)
                raise ValueError("steps_per_epoch is unknown: the warmup runs batch by batch "
                                 "and needs it (pass steps_per_epoch to the callback)")
            epoch += 1.0 / self.steps_per_epoch   # round numbers at epoch ends
            size = default_runtime().size()
            return 1.0 / size * (epoch * (size - 1) / warmup_epochs + 1)

        super().__init__(keras, initial_lr, multiplier, 0, warmup_epochs, False,
                         momentum_correction, steps_per_epoch, *args)
        self.verbose = verbose
        self.warmup_epochs = warmup_epochs

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and default_runtime().rank() == 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                  f"{get_lr(self._keras, self.model.optimizer):g}.")


def callback_classes(keras: Any, ops: Any,
                     module: str) -> tuple[type, type, type, type, type]:
    """The public callback classes for one keras module, made once per module:
    (BroadcastGlobalVariablesCallback, MetricAverageCallback, LearningRateScheduleCallback,
    LearningRateWarmupCallback, JoinCallback)."""
    base: type[Any] = keras.callbacks.Callback  # a class of the keras module passed in

    class BroadcastGlobalVariablesCallback(BroadcastGlobalVariablesCallbackImpl, base):
        """Start training from the root rank's model and optimizer variables."""

        def __init__(self, root_rank: int, device: str = ""):
            super().__init__(keras, ops, root_rank)

    class MetricAverageCallback(MetricAverageCallbackImpl, base):
        """Average the epoch's metrics over the workers (put it first among the callbacks)."""

        def __init__(self, device: str = ""):
            super().__init__(keras, ops)

    class LearningRateScheduleCallback(LearningRateScheduleCallbackImpl, base):
        """lr = initial_lr * multiplier(epoch) between start_epoch and end_epoch."""

        def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None,
                     staircase=True, momentum_correction=True, steps_per_epoch=None):
            super().__init__(keras, initial_lr, multiplier, start_epoch, end_epoch, staircase,
                             momentum_correction, steps_per_epoch)

    class LearningRateWarmupCallback(LearningRateWarmupCallbackImpl, base):
        """Ramp the learning rate from initial_lr / size() to initial_lr over warmup_epochs."""

        def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=True,
                     steps_per_epoch=None, verbose=0):
            super().__init__(keras, initial_lr, warmup_epochs, momentum_correction,
                             steps_per_epoch, verbose)

    class JoinCallback(JoinCallbackImpl, base):
        """Join at every epoch's end: epochs of different lengths on different ranks."""

        def __init__(self):
            super().__init__(keras, ops)

    classes = (BroadcastGlobalVariablesCallback, MetricAverageCallback,
               LearningRateScheduleCallback, LearningRateWarmupCallback, JoinCallback)
    for cls in classes:
        cls.__module__ = module  # where users import it from
    return classes
