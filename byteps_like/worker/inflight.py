"""What the worker's parts share of the operations in flight: the narrow interface they get
instead of the :class:`~byteps_like.worker.runtime.Runtime`.

One :class:`InFlight` per runtime holds the lock over the state the parts share (tensors,
handles and native operations in flight), the handles in flight, the job's fatal error, the
pipeline while connected, and the byte counters; and it fails a partition
(:meth:`InFlight.fail_task`) for every part.

The parts (:mod:`.stages`, :mod:`.dispatch`, :mod:`.dataplane`, :mod:`.local_reduce`,
:mod:`.elastic_membership`) take this object and the other parts they use, never the runtime,
so nothing in ``byteps_like/worker/`` imports :mod:`.runtime` back
(``tests/unit/test_layering.py`` checks it).
"""
from __future__ import annotations

import threading
from collections.abc import Callable

from ..errors import NotInitializedError
from .handle import Handle
from .pipeline import Pipeline, Task


class InFlight:
    """The operations of one worker runtime in flight, and their bookkeeping."""

    def __init__(self, who: Callable[[], str] = lambda: "worker") -> None:
        self.who = who  # names this worker in errors: "worker rank 3"
        # one lock for the state the parts share: tensors, handles and native operations in
        # flight
        self.lock = threading.RLock()
        self.handles: set[Handle] = set()
        self.fatal: BaseException | None = None  # the job's fatal error, once there is one
        self.pipeline: Pipeline | None = None  # while connected
        self.bytes_pushed = 0                  # payload bytes on the wire (compressed size
        self.bytes_pulled = 0                  # for compressed partitions)

    @property
    def active_pipeline(self) -> Pipeline:
        """The pipeline of a connected runtime (the parts use it only while connected)."""
        if self.pipeline is None:
            raise NotInitializedError(f"{self.who()}: the pipeline is closed")
        return self.pipeline

    def fail_task(self, task: Task, exc: BaseException) -> None:
        """Fail ``task``'s handle (the pipeline's on_error)."""
        task.handle.fail(exc)

    def fail_handles(self, exc: BaseException) -> None:
        """Fail every handle in flight with ``exc`` (a fatal error, an epoch that ended)."""
        for h in list(self.handles):
            h.fail(exc)

    @staticmethod
    def wait(handles: list[Handle]) -> None:
        """Wait for each of ``handles``; their errors are for whoever waits for them."""
        for h in handles:
            try:
                h.wait()
            except Exception:  # noqa: BLE001 - reported by whoever waits for it
                pass
