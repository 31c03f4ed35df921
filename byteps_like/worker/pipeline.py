"""The worker pipeline: itineraries, the push stage's priority queue, stage threads.

Each partition of a push_pull is a :class:`Task` carrying its itinerary, a tuple of
:class:`Stage` names built by the pure function :func:`itinerary`. Stage threads are joined by
bounded queues; :meth:`Pipeline.advance` routes a task to the queue of its next stage, and
observers (tracing, metrics) subscribe to stage start and end without living inside the router.

Who calls it: :class:`~byteps_like.worker.runtime.Runtime` builds one :class:`Pipeline` when it
connects, with the stage executors of :mod:`~byteps_like.worker.stages` and
:mod:`~byteps_like.worker.local_reduce` as its handlers, and submits the tasks of each
push_pull (``Rounds.start``). The native data plane's completions
(:mod:`~byteps_like.worker.dataplane`) move a task waiting on its PUSH on with
:meth:`Pipeline.advance`; the local reduction's gate moves a parked one with
:meth:`Pipeline.resume`.
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
from enum import Enum, IntEnum
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from ..compression import Codec
    from ..local import Segment
    from .handle import Handle
    from .tensors import DeviceCopier


class Stage(str, Enum):
    """The stages, in the order a partition can meet them. Stages that do not apply to a tensor
    are absent from its itinerary: REDUCE and BROADCAST belong to the local reduction of
    several worker processes on one machine, the copies to device tensors staged by a plugin,
    COMPRESS and DECOMPRESS to a codec's encode and decode; PUSH and PULL reach the servers.

    A ``str``: a stage compares, hashes, formats and serialises as its name (``"push"``), so
    traces, metrics labels and thread names read as they always did."""
    REDUCE = "reduce"
    COPY_D2H = "copy_d2h"
    COMPRESS = "compress"
    PUSH = "push"
    PULL = "pull"
    DECOMPRESS = "decompress"
    COPY_H2D = "copy_h2d"
    BROADCAST = "broadcast"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


REDUCE, COPY_D2H, COMPRESS, PUSH, PULL, DECOMPRESS, COPY_H2D, BROADCAST = Stage
ALL_STAGES = tuple(Stage)


class Phase(IntEnum):
    """Where a partition is in the local-reduction protocol (:mod:`.local_reduce`), which spans
    two stages: REDUCE runs COPY_IN, then SUM_SLICE, and hands on at REDUCED; on a local rank
    other than the root, BROADCAST waits in AWAIT_RESULT for the root's sum."""
    COPY_IN = 0       # my input goes into my slot of the shared segment
    SUM_SLICE = 1     # every slot is filled (or the caller prereduced): sum my slice
    REDUCED = 2       # my slice is summed: on to the push (root) or the broadcast
    AWAIT_RESULT = 3  # a local rank waits for the root's LOCAL_DONE


#: the default of a Task's byte views before the runtime fills them in (tests build bare tasks)
NO_BYTES = np.empty(0, np.uint8)
NO_BYTES.flags.writeable = False


def _no_bytes() -> np.ndarray:
    return NO_BYTES


def itinerary(*, distributed: bool, local_size: int = 1, on_device: bool = False,
              compressed: bool = False, local_root: bool = True) -> tuple[Stage, ...]:
    """The itinerary of a partition, from the job's topology and the tensor's needs.

    With several local ranks only the local root talks to the servers: the other ranks reduce
    and receive the broadcast."""
    stages: list[Stage] = []
    if local_size > 1:
        stages.append(REDUCE)
        if not local_root:
            return (REDUCE, BROADCAST)
    if on_device and distributed:
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


@dataclass(eq=False, slots=True)
class Task:
    """One partition of one push_pull on its way through the pipeline.

    The first fields say what it is and where it goes (every task has them); the rest are
    filled in by ``Rounds.start`` for the stages it meets, and by the stages themselves.
    Slots: a field not declared here cannot be set on a task."""
    handle: Handle
    key: int
    part: int
    offset: int
    nbytes: int
    priority: int
    server: int
    round: int
    itinerary: tuple[Stage, ...]
    stage: int = 0
    seq: int = 0
    payload: Any = None      # set by the stage that received data (e.g. the pull response)
    contrib: int = 0         # pushes the server's round summed when fewer than all (join())
    enqueued_at: float = field(default_factory=time.monotonic)
    # -- what the runtime sets when it cuts a push_pull into tasks (Rounds.start) --
    dtype: str = "uint8"     # the wire dtype of the tensor
    average: bool = False    # divide the sum by the ranks that contributed
    src: np.ndarray = field(default_factory=_no_bytes)   # this partition of the input, as bytes
    dst: np.ndarray = field(default_factory=_no_bytes)   # ... and of the output
    # what goes to the servers and where their sum lands: the machine's reduced partition in
    # shared memory with several local ranks, ``src`` and ``dst`` otherwise
    push_src: np.ndarray = field(default_factory=_no_bytes)
    pull_dst: np.ndarray = field(default_factory=_no_bytes)
    seg: Segment | None = None           # the shared segment of the local reduction
    phase: Phase = Phase.COPY_IN         # the local-reduction protocol's state
    prereduced: bool = False             # the local ranks summed into the segment themselves
    device: DeviceCopier | None = None   # stages a device tensor (COPY_D2H, COPY_H2D)
    decl: dict[str, Any] | None = None   # the first round's declaration to the server
    codec: Codec | None = None           # compresses this partition (COMPRESS, DECOMPRESS)
    scratch: np.ndarray | None = None    # float32 staging of a non-float32 compressed tensor
    wire: np.ndarray | None = None       # the compressed payload between COMPRESS and PUSH

    @property
    def current(self) -> Stage | None:
        return self.itinerary[self.stage] if self.stage < len(self.itinerary) else None


class TaskQueue:
    """A bounded FIFO of tasks whose close() always wakes its consumer and its producers, even
    when it is full; :class:`PriorityQueue` hands out the most urgent task first instead."""

    def __init__(self, maxsize: int = 0):
        self.maxsize = maxsize
        self._items: Any = deque()
        self._cv = threading.Condition()
        self._closed = False

    def __len__(self) -> int:
        return len(self._items)

    def _push(self, task: Task) -> None:
        self._items.append(task)

    def _pop(self) -> Task:
        return self._items.popleft()

    def put(self, task: Task, timeout: float | None = None, *, force: bool = False) -> None:
        """Queue ``task``; blocks while the queue is full, unless ``force`` (used by pipeline
        threads, which must never wait on a queue that they themselves drain)."""
        with self._cv:
            if self.maxsize and not force and not self._cv.wait_for(
                    lambda: self._closed or len(self._items) < self.maxsize, timeout):
                raise queue.Full
            self._push(task)
            self._cv.notify_all()

    def get(self, timeout: float | None = None) -> Task | None:
        """The next task; None once closed (or after ``timeout`` with none)."""
        with self._cv:
            if not self._cv.wait_for(lambda: self._closed or bool(self._items), timeout):
                return None
            if self._closed:
                return None
            task = self._pop()
            self._cv.notify_all()
            return task

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()


class PriorityQueue(TaskQueue):
    """The push stage's queue: the most urgent task first (largest priority, then FIFO), each
    handed to the native data plane. The byte credit that makes priorities hold is the native
    client's (BYTEPS_SCHEDULING_CREDIT), which queues what it is given by priority too; a
    second credit here, taken and given back around the hand-over, only ran two schedulers in
    series."""

    def __init__(self, maxsize: int = 0):
        super().__init__(maxsize)
        self._items = []
        self._seq = itertools.count()

    def _push(self, task: Task) -> None:
        task.seq = next(self._seq)
        heapq.heappush(self._items, (-task.priority, task.seq, task))

    def _pop(self) -> Task:
        return heapq.heappop(self._items)[2]


Observer = Callable[[Any, Stage, str, float], None]  # (task, stage, "start"|"end", time)


class Spans:
    """Pairs the start and end events of each (task, stage) for observers that time stages."""

    def __init__(self) -> None:
        self._open: dict[tuple[int, str], float] = {}

    def end(self, task: Any, stage: str, event: str, t: float) -> float | None:
        """Record a start (returns None); for an end, return its start time (None if the start
        was never seen)."""
        ident = (id(task), stage)
        if event == "start":
            self._open[ident] = t
            return None
        return self._open.pop(ident, None)


#: stages run by several threads: each task's work there is its own (its partition's codec;
#: a key's rounds never overlap) and the kernels release the GIL
_POOLED = (COMPRESS, DECOMPRESS)


def codec_threads(setting: int = 0) -> int:
    """Threads of each codec stage (COMPRESS, DECOMPRESS; ``BYTEPS_CODEC_THREADS``, 0 = auto):
    one encodes 1 MiB of onebit with error feedback in ~0.35 ms, so one thread caps a worker
    near 3 GB/s of model bytes, below a 25 Gbit/s NIC; auto is a quarter of the usable CPUs,
    1 to 4 (1 on a 2-core machine)."""
    if setting > 0:
        return setting
    from ..transport.native import usable_cpus
    return max(1, min(4, usable_cpus() // 4))


def native_codec_threads(setting: int = 0) -> int:
    """Threads of the native data plane's codec pool (``BYTEPS_CODEC_THREADS``, 0 = auto): one
    pool encodes and decodes, busy only while compressed tensors are in flight, so auto is
    every usable CPU, 1 to 8 (bpslaunch gives a worker CPUs of its own; on a 16-core machine of
    two workers and two servers, a worker's 8 threads took a onebit round of 256 MiB from 79 to
    57 ms against 4)."""
    if setting > 0:
        return setting
    from ..transport.native import usable_cpus
    return max(1, min(8, usable_cpus()))


class Pipeline:
    """Stage threads joined by bounded queues. ``handlers[stage](task)`` does a stage's work and
    returns True when the task should move on at once, False when something else (the native
    data plane's completion) will call :meth:`advance` for it later."""

    def __init__(self, handlers: dict[Stage, Callable[[Task], bool]], *, queue_depth: int,
                 on_error: Callable[[Task, BaseException], None],
                 codec_threads_setting: int = 0):
        self.handlers = handlers
        self.on_error = on_error
        self.observers: list[Observer] = []
        self.queues: dict[Stage, Any] = {}
        for stage in handlers:
            if stage == PUSH:
                self.queues[stage] = PriorityQueue(queue_depth)
            else:
                self.queues[stage] = TaskQueue(queue_depth)
        self.on_complete: Callable[[Task], None] = lambda task: None
        pool = codec_threads(codec_threads_setting)
        self._threads = [threading.Thread(target=self._loop, args=(s,), name=f"bpsl-{s}",
                                          daemon=True)
                         for s in handlers for _ in range(pool if s in _POOLED else 1)]

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

    def _emit(self, task: Task, stage: Stage, event: str) -> None:
        for obs in self.observers:
            obs(task, stage, event, time.monotonic())

    def _loop(self, stage: Stage) -> None:
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
