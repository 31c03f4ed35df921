"""Elastic training, written once for every framework (docs/elastic.md).

A :class:`State` is what a training function needs to go on after the set of workers changed:
the model, the optimizer, the data sampler and any number of plain values given as keyword
extras (``step=0`` is read and written as ``state.step``). ``commit()`` saves a copy of it and
then asks the runtime whether the membership changed (so a worker waiting to join is admitted at
the next commit); ``restore()`` goes back to the last commit; ``sync()`` gives every worker the
values of rank 0.

:func:`run` wraps a training function ``f(state, ...)``. A membership change surfaces inside a
collective (push_pull, a handle's wait, barrier, broadcast) or inside ``commit()`` as a
:class:`~byteps_like.errors.MembershipChangedError`; ``run`` catches it and then:

1. restores the last commit when workers were lost or the change interrupted a step (a change
   noticed by ``commit()`` itself, a join, leaves the commit just made as it is);
2. ``rt.rejoin()``: waits for the scheduler to form the new epoch and takes the new rank and size
   (``TooFewWorkersError`` when the job stays below ``--min-workers``);
3. calls the reset callbacks (``state.register_reset_callbacks([...])``), e.g. to rescale the
   learning rate to the new ``size()``;
4. ``state.sync()``: every worker takes rank 0's state (rank 0 is the lowest surviving rank, so
   it ran the callbacks: a joiner, which runs none, gets what they set);
5. calls the function again, which continues from the state (``state.epoch``, ``state.batch``).

A worker that starts into a running job does the same from step 4: ``init()`` admits it into the
next epoch, and the first thing ``run`` does is ``state.sync()``.

In a job that is not elastic ``run`` syncs the state once and calls the function: the same
script runs with and without ``bpslaunch --elastic``.

The framework modules (``byteps_like.elastic``, ``byteps_like.torch.elastic``,
``byteps_like.tensorflow.elastic``, ``byteps_like.keras.elastic``) add handlers for their objects
on top of :class:`ObjectState`; this module imports no framework.
"""
from __future__ import annotations

import copy
import functools
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import numpy as np

from ..errors import MembershipChangedError
from . import broadcast as core_broadcast
from . import objcodec
from .runtime import Runtime, default_runtime

log = logging.getLogger("byteps_like.elastic")

F = TypeVar("F", bound=Callable[..., Any])

#: Names a State keeps for itself: an extra of one of these names is refused.
RESERVED = frozenset({
    "commit", "save", "restore", "sync", "register_reset_callbacks", "on_reset", "check_membership",
    "extras", "handlers", "last_reset",
})


def runtime() -> Runtime:
    """The runtime elastic states and ``run`` talk to (the process's default runtime)."""
    return default_runtime()


def is_elastic(rt: Any) -> bool:
    """Whether ``rt`` runs an elastic job (``bpslaunch --elastic``, BYTEPS_ELASTIC=1)."""
    return bool(getattr(rt, "elastic", False))


class StateHandler:
    """Saves, restores and syncs one framework object (a model, an optimizer, a sampler).

    ``value`` is the object, reachable as ``state.<name>``. ``sync`` gets the runtime and a
    name unique within the state (the same on every worker) to name its tensors after."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self, rt: Runtime, name: str) -> None:
        """Take rank 0's value (a collective when ``rt.size() > 1``; called in a job of one
        worker too, e.g. for a sampler to re-split its data)."""
        raise NotImplementedError

    def reset(self) -> None:
        """After a membership change, before the state is synced (optional)."""


class State:
    """The base of every elastic state: commit, restore, sync and reset callbacks.

    Subclasses implement :meth:`save`, :meth:`restore` and :meth:`sync`; :class:`ObjectState`
    is the one to start from (handlers for framework objects plus extras)."""

    def __init__(self) -> None:
        self._reset_callbacks: list[Callable[[], Any]] = []
        #: (seconds from the change noticed to the function resumed, the error) of the last
        #: reset, or None before any
        self.last_reset: tuple[float, MembershipChangedError] | None = None

    # -- reset callbacks ----------------------------------------------------------------------
    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], Any]]) -> None:
        """Functions of no argument called after every membership change, once this worker has
        joined the new epoch (``size()`` and ``rank()`` are the new ones) and before the state
        is synced from rank 0 and the training function called again (e.g. to scale the
        learning rate to the new ``size()``). Called in the order registered. A worker that
        joins a running job calls none: the sync gives it what rank 0's callbacks set."""
        if callable(callbacks):
            callbacks = [callbacks]  # one function: forgive the missing list
        for cb in callbacks:
            if not callable(cb):
                raise TypeError(f"register_reset_callbacks: {cb!r} is not callable")
            self._reset_callbacks.append(cb)

    def on_reset(self) -> None:
        for cb in self._reset_callbacks:
            cb()

    # -- commit -------------------------------------------------------------------------------
    def commit(self) -> None:
        """Save a copy of the state (what :meth:`restore` returns to), then check for a
        membership change: a worker waiting to join is admitted here, and a change that
        happened since the last collective is raised here (MembershipChangedError), with
        nothing lost."""
        self.save()
        self.check_membership()

    def check_membership(self) -> None:
        rt: Any = runtime()
        if is_elastic(rt):
            try:
                rt.check_membership()
            except MembershipChangedError as exc:
                exc.at_commit = True  # type: ignore[attr-defined]  # run: no restore needed
                raise

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError


class ObjectState(State):
    """A state of framework objects (``handlers``) and extras (keyword arguments).

    Extras are read and written as attributes (``state.step += 1``). A numpy array extra is
    kept in place: ``restore()`` copies the commit into the same array and ``sync()``
    broadcasts into it; other extras (numbers, strings, lists, dicts, ... whatever
    ``broadcast_object`` carries) are replaced by their saved or broadcast copies."""

    #: the codec hooks of broadcast_object for framework tensors among the extras
    _to_array: objcodec.ToArray | None = None
    _from_array: objcodec.FromArray | None = None

    def __init__(self, handlers: dict[str, StateHandler] | None = None, **extras: Any) -> None:
        super().__init__()
        handlers = dict(handlers or {})
        for name in [*handlers, *extras]:
            if name in RESERVED or name.startswith("_"):
                raise ValueError(f"{type(self).__name__}: {name!r} cannot be the name of an "
                                 f"extra; it is a method or attribute of the state (or "
                                 "private); choose another name")
        both = set(handlers) & set(extras)
        if both:
            raise ValueError(f"{type(self).__name__}: {sorted(both)} given twice")
        self._handlers = handlers
        self._extra_names = list(extras)
        self._saved: dict[str, Any] = {}
        self._synced_once = False
        for name, h in handlers.items():
            object.__setattr__(self, name, h.value)
        for name, value in extras.items():
            object.__setattr__(self, name, value)
        self.save()

    @property
    def extras(self) -> dict[str, Any]:
        """The current values of the extras, by name."""
        return {n: getattr(self, n) for n in self._extra_names}

    @property
    def handlers(self) -> dict[str, StateHandler]:
        return dict(self._handlers)

    def __setattr__(self, name: str, value: Any) -> None:
        handlers = self.__dict__.get("_handlers")
        if handlers and name in handlers:
            handlers[name].value = value  # e.g. state.model = new_model
        object.__setattr__(self, name, value)

    # -- save / restore -----------------------------------------------------------------------
    def save(self) -> None:
        for h in self._handlers.values():
            h.save()
        self._saved = {n: _copy(getattr(self, n)) for n in self._extra_names}

    def restore(self) -> None:
        for h in self._handlers.values():
            h.restore()
        for n in self._extra_names:
            saved, now = self._saved[n], getattr(self, n)
            if (isinstance(saved, np.ndarray) and isinstance(now, np.ndarray)
                    and now.shape == saved.shape and now.dtype == saved.dtype
                    and now.flags.writeable):
                np.copyto(now, saved)  # in place: references the user holds stay valid
            else:
                object.__setattr__(self, n, _copy(saved))

    # -- sync ---------------------------------------------------------------------------------
    def sync(self) -> None:
        """Every worker takes rank 0's state; then it is saved (a commit every worker shares).
        A collective: every worker of the epoch calls it at the same point (``run`` does)."""
        rt = runtime()
        self._sync_handlers(rt, not self._synced_once)
        if rt.size() > 1:
            self._sync_extras(rt)
        self._synced_once = True
        self.save()

    def _sync_handlers(self, rt: Runtime, first: bool) -> None:
        """Each handler's sync, in the order given (a handler skips its collectives in a job of
        one worker). ``first``: the first sync of this state in this process."""
        prefix = f"elastic.{type(self).__name__}"
        for name, h in self._handlers.items():
            h.sync(rt, f"{prefix}.{name}")

    def _sync_extras(self, rt: Runtime) -> None:
        prefix = f"elastic.{type(self).__name__}"
        plain = {}
        for n in self._extra_names:
            v = getattr(self, n)
            if isinstance(v, np.ndarray) and v.dtype != object and v.size:
                if not v.flags.writeable or not v.flags.c_contiguous:
                    v = np.ascontiguousarray(v).copy()
                    object.__setattr__(self, n, v)
                core_broadcast.broadcast_array(
                    rt, v, 0, f"{prefix}.extra.{n}.{v.dtype.name}{list(v.shape)}")
            else:
                plain[n] = v
        if plain:
            synced = core_broadcast.broadcast_object(
                rt, plain, 0, f"{prefix}.extras", type(self)._to_array, type(self)._from_array)
            if not isinstance(synced, dict) or set(synced) != set(plain):
                theirs = sorted(synced) if isinstance(synced, dict) else type(synced).__name__
                raise ValueError(f"{type(self).__name__}.sync: rank 0 has the extras {theirs}, "
                                 f"this rank {sorted(plain)}: every worker must create the "
                                 "state with the same extras")
            for n, v in synced.items():
                object.__setattr__(self, n, v)


def _copy(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.copy()
    return copy.deepcopy(value)


def reset_synchronizer(sync: Any) -> None:
    """Forget the gradients of a step a membership change interrupted (a
    :class:`~byteps_like.worker.sync.GradientSynchronizer`): their handles belong to the old
    epoch, which ``rt.rejoin()`` abandoned."""
    if sync is not None:
        sync.reset()


def run(func: F) -> F:
    """Decorate a training function ``func(state, *args, **kwargs)`` so that it survives
    membership changes (see the module's docstring). Returns what ``func`` returns."""
    return run_with(func, None)


def run_with(func: F, classify: Callable[[BaseException], MembershipChangedError | None] | None
             ) -> F:
    """:func:`run` for a framework whose errors may wrap a membership change (TensorFlow turns
    an exception raised inside a graph into an ``OpError``): ``classify(exc)`` returns the
    MembershipChangedError behind ``exc``, or None to let ``exc`` through."""

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(state, State):
            raise TypeError(f"{getattr(func, '__name__', 'the function')} decorated with "
                            "elastic.run takes an elastic State as its first argument, got "
                            f"{type(state).__name__}")
        rt = runtime()
        change: MembershipChangedError | None = None
        noticed = 0.0
        while True:
            try:
                if change is not None:
                    _recover(rt, state, change)
                    # before the sync: what the callbacks set (a learning rate scaled to the
                    # new size) is then rank 0's on every worker, a joiner's too
                    state.on_reset()
                state.sync()
                if change is not None:
                    took = time.monotonic() - noticed
                    state.last_reset = (took, change)
                    log.warning("elastic: resumed as worker rank %d of %d (epoch %s) %.2f s "
                                "after the membership change was noticed", rt.rank(), rt.size(),
                                getattr(rt, "epoch", "?"), took)
                    change = None
                return func(state, *args, **kwargs)
            except MembershipChangedError as exc:
                change, noticed = _note(exc, change, noticed)
            except Exception as exc:
                found = classify(exc) if classify is not None and is_elastic(rt) else None
                if found is None:
                    raise
                change, noticed = _note(found, change, noticed)

    return wrapper  # type: ignore[return-value]


def _note(exc: MembershipChangedError, prev: MembershipChangedError | None,
          noticed: float) -> tuple[MembershipChangedError, float]:
    if prev is not None:
        # a second change while recovering: the restore decision must remember the first
        if prev.lost and not exc.lost:
            exc.lost = prev.lost
        if not getattr(prev, "at_commit", False):
            exc.at_commit = False  # type: ignore[attr-defined]
        return exc, noticed
    what = []
    if exc.lost:
        what.append("; ".join(exc.lost))
    if exc.added:
        what.append(f"{exc.added} worker(s) joining")
    log.warning("elastic: membership changed (epoch %s%s)%s", exc.epoch,
                "; " + "; ".join(what) if what else "",
                "" if getattr(exc, "at_commit", False) else "; the current step is void")
    return exc, time.monotonic()


def _recover(rt: Any, state: State, change: MembershipChangedError) -> None:
    if change.lost or not getattr(change, "at_commit", False):
        state.restore()
    for h in getattr(state, "_handlers", {}).values():
        h.reset()
    rt.rejoin()


__all__ = ["State", "ObjectState", "StateHandler", "run", "run_with", "reset_synchronizer",
           "RESERVED", "MembershipChangedError"]
