"""The worker pipeline: itineraries, the priority scheduler with byte credits, stage threads.

Each partition is a :class:`Task` carrying its itinerary, a tuple of stage names built by the
pure function :func:`plan`. Stage threads are joined by bounded queues; :meth:`Pipeline.advance`
routes a task to the queue of its next stage, and observers (tracing, metrics) subscribe to stage
start and end without living inside the router.
"""
from __future__ import annotations

import heapq
import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# Stage names, in the order a partition can meet them. Stages that do not apply to a tensor are
# absent from its itinerary. This build runs PUSH and PULL; the others belong to local reduction,
# device copies and compression.
REDUCE, COPY_D2H, COMPRESS, PUSH, PULL, DECOMPRESS, COPY_H2D, BROADCAST = (
    "reduce", "copy_d2h", "compress", "push", "pull", "decompress", "copy_h2d", "broadcast")
ALL_STAGES = (REDUCE, COPY_D2H, COMPRESS, PUSH, PULL, DECOMPRESS, COPY_H2D, BROADCAST)


def plan(*, distributed: bool, local_size: int = 1, on_device: bool = False,
         compressed: bool = False, local_root: bool = True,
         device_push: bool = False) -> tuple[str, ...]:
    """The itinerary of a partition, from the job's topology and the tensor's needs.

    With several local ranks only the local root talks to the servers: the other ranks reduce
    and receive the broadcast. ``device_push``: the transport sends device memory itself (UCX
    with CUDA support), so a device tensor needs no copy to the host before its push."""
    stages = []
    if local_size > 1:
        stages.append(REDUCE)
        if not local_root:
            return (REDUCE, BROADCAST)
    if on_device and distributed and not (device_push and not compressed):
        stages.append(COPY_D2H)
    if distributed:
        if compressed:
            stages.append(COMPRESS)
        stages += [PUSH, PULL]
        if compressed:
            stages.append(DECOMPRESS)
    if on_device and distributed:
        stages.append(COPY_H2D)
    if local_size > 1:
        stages.append(BROADCAST)
    return tuple(stages)


@dataclass(eq=False)
class Task:
    """One partition of one push_pull on its way through the pipeline."""
    handle: Any
    key: int
    part: int
    offset: int
    nbytes: int
    priority: int
    server: int
    conn: int
    round: int
    itinerary: tuple[str, ...]
    stage: int = 0
    seq: int = 0
    payload: Any = None      # set by the stage that received data (e.g. the pull response)
    acked: bool = False
    credited: bool = False   # holds bytes of the push credit (set when the push stage took it)
    native: bool = False     # pushed and pulled by the native data plane (transport/native.py)
    contrib: int = 0         # pushes the server's round summed when fewer than all (join())
    enqueued_at: float = field(default_factory=time.monotonic)

    @property
    def current(self) -> str | None:
        return self.itinerary[self.stage] if self.stage < len(self.itinerary) else None


class PriorityCreditQueue:
    """Bounded queue that hands out the most urgent task (largest priority, then FIFO) whose bytes
    fit in the credit: the bytes pushed but not yet acknowledged may not exceed ``credit_bytes``
    (0 = unlimited), except that one task may always go when nothing is in flight.
    """

    def __init__(self, credit_bytes: int = 0, maxsize: int = 0):
        self.credit_bytes = credit_bytes
        self.maxsize = maxsize
        self.inflight = 0
        self._heap: list = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._closed = False

    def __len__(self) -> int:
        return len(self._heap)

    def put(self, task: Task, timeout: float | None = None, *, force: bool = False) -> None:
        """Queue ``task``; blocks while the queue is full, unless ``force`` (used by pipeline
        threads, which must never wait on a queue that they themselves drain)."""
        with self._cv:
            if self.maxsize and not force and not self._cv.wait_for(
                    lambda: self._closed or len(self._heap) < self.maxsize, timeout):
                raise queue.Full
            task.seq = next(self._seq)
            heapq.heappush(self._heap, (-task.priority, task.seq, task))
            self._cv.notify_all()

    def _ready(self) -> bool:
        if self._closed:
            return True
        if not self._heap:
            return False
        nbytes = self._heap[0][2].nbytes
        return (not self.credit_bytes or self.inflight == 0
                or self.inflight + nbytes <= self.credit_bytes)

    def get(self, timeout: float | None = None) -> Task | None:
        """The next task to push, taking its bytes from the credit; None once closed."""
        with self._cv:
            if not self._cv.wait_for(self._ready, timeout):
                return None
            if self._closed:
                return None
            _p, _s, task = heapq.heappop(self._heap)
            self.inflight += task.nbytes
            task.credited = True
            self._cv.notify_all()
            return task

    def release(self, nbytes: int) -> None:
        with self._cv:
            self.inflight = max(0, self.inflight - nbytes)
            self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()


Observer = Callable[[Task, str, str, float], None]  # (task, stage, "start"|"end", time)


class Spans:
    """Pairs the start and end events of each (task, stage) for observers that time stages."""

    def __init__(self) -> None:
        self._open: dict[tuple[int, str], float] = {}

    def end(self, task: Task, stage: str, event: str, t: float) -> float | None:
        """Record a start (returns None); for an end, return its start time (None if the start
        was never seen)."""
        ident = (id(task), stage)
        if event == "start":
            self._open[ident] = t
            return None
        return self._open.pop(ident, None)


class Pipeline:
    """Stage threads joined by bounded queues. ``handlers[stage](task)`` does a stage's work and
    returns True when the task should move on at once, False when something else (a network
    reply) will call :meth:`advance` for it later."""

    def __init__(self, handlers: dict[str, Callable[[Task], bool]], *, queue_depth: int,
                 credit_bytes: int, on_error: Callable[[Task, BaseException], None]):
        self.handlers = handlers
        self.on_error = on_error
        self.observers: list[Observer] = []
        self.queues: dict[str, Any] = {}
        for stage in handlers:
            if stage == PUSH:
                self.queues[stage] = PriorityCreditQueue(credit_bytes, queue_depth)
            else:
                self.queues[stage] = _ClosableQueue(queue_depth)
        self.on_complete: Callable[[Task], None] = lambda task: None
        self._threads = [threading.Thread(target=self._loop, args=(s,), name=f"bpsl-{s}",
                                          daemon=True) for s in handlers]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def submit(self, task: Task, *, block: bool = True) -> None:
        """Enter ``task`` into its first stage. From a user thread this blocks while that
        stage's queue is full (back-pressure); pipeline and I/O threads pass ``block=False``."""
        task.stage = 0
        self._route(task, force=not block)

    def resume(self, task: Task) -> None:
        """Run ``task``'s current stage again (a multi-step stage whose event has come)."""
        self._route(task, force=True)

    def advance(self, task: Task) -> None:
        """Move ``task`` on to its next stage, or complete it. Never blocks: the tasks inside
        the pipeline are already bounded by the credit and by what users submitted."""
        task.stage += 1
        self._route(task, force=True)

    def _route(self, task: Task, force: bool) -> None:
        stage = task.current
        if stage is None:
            self.on_complete(task)
            return
        task.enqueued_at = time.monotonic()
        self.queues[stage].put(task, force=force)

    def _emit(self, task: Task, stage: str, event: str) -> None:
        for obs in self.observers:
            obs(task, stage, event, time.monotonic())

    def _loop(self, stage: str) -> None:
        q = self.queues[stage]
        handler = self.handlers[stage]
        while True:
            task = q.get()
            if task is None:
                return
            self._emit(task, stage, "start")
            try:
                move_on = handler(task)
            except BaseException as exc:  # noqa: BLE001 - fails the task's handle, not the thread
                self.on_error(task, exc)
                continue
            self._emit(task, stage, "end")
            if move_on:
                self.advance(task)

    def close(self) -> None:
        for q in self.queues.values():
            q.close()
        for t in self._threads:
            if t.is_alive() and t is not threading.current_thread():
                t.join(5.0)


class _ClosableQueue:
    """A bounded FIFO whose close() always wakes the consumer, even when the queue is full."""

    def __init__(self, maxsize: int):
        self._q: deque = deque()
        self._maxsize = maxsize
        self._cv = threading.Condition()
        self._closed = False

    def put(self, task: Task, *, force: bool = False) -> None:
        with self._cv:
            if not force:
                self._cv.wait_for(lambda: self._closed or not self._maxsize
                                  or len(self._q) < self._maxsize)
            self._q.append(task)
            self._cv.notify_all()

    def get(self) -> Task | None:
        with self._cv:
            self._cv.wait_for(lambda: self._closed or self._q)
            if self._closed:
                return None
            task = self._q.popleft()
            self._cv.notify_all()
            return task

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
