"""Unit tests of byteps_like.worker.pipeline: itineraries, the push stage's priority queue,
the stage threads (priority overtaking, observers, error isolation, shutdown), and the stage
names, phases and declared fields of a Task."""
from __future__ import annotations

import dataclasses
import itertools
import json
import queue
import threading

import pytest

from byteps_like.worker.pipeline import (
    ALL_STAGES,
    BROADCAST,
    COMPRESS,
    COPY_D2H,
    COPY_H2D,
    DECOMPRESS,
    PULL,
    PUSH,
    REDUCE,
    Phase,
    Pipeline,
    PriorityQueue,
    Stage,
    Task,
    itinerary,
)
from tests.support import wait_until

WAIT = 5.0  # upper bound on any wait for something that should happen at once


def make_task(key: int, *, nbytes: int = 1000, priority: int = 0,
              itinerary: tuple[str, ...] = (PUSH,)) -> Task:
    return Task(handle=None, key=key, part=0, offset=0, nbytes=nbytes, priority=priority,
                server=0, round=0, itinerary=itinerary)


def run_in_thread(fn, *args):
    """Start ``fn(*args)`` in a daemon thread; returns (thread, result box)."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001
            box["error"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t, box


# ------------------------------------------------------------------------------ itinerary()
def expected_itinerary(distributed, local_size, on_device, compressed):
    """The documented itinerary: the stages that apply, in the documented order (ALL_STAGES);
    a stage that does not apply is absent. Host copies and compression exist only to feed the
    network, so they need ``distributed``."""
    applies = {REDUCE: local_size > 1, BROADCAST: local_size > 1,
               COPY_D2H: on_device and distributed, COPY_H2D: on_device and distributed,
               COMPRESS: compressed and distributed, DECOMPRESS: compressed and distributed,
               PUSH: distributed, PULL: distributed}
    return tuple(s for s in ALL_STAGES if applies.get(s, False))


COMBOS = list(itertools.product([False, True], [1, 2, 8], [False, True], [False, True]))


@pytest.mark.parametrize("distributed, local_size, on_device, compressed", COMBOS,
                         ids=lambda v: str(v))
def test_itinerary_stages_in_documented_order(distributed, local_size, on_device, compressed):
    got = itinerary(distributed=distributed, local_size=local_size, on_device=on_device,
               compressed=compressed)
    assert isinstance(got, tuple)
    assert len(set(got)) == len(got), "a stage appears twice"
    assert list(got) == sorted(got, key=ALL_STAGES.index), "stages out of the documented order"
    want = expected_itinerary(distributed, local_size, on_device, compressed)
    if distributed:
        assert got == want
    else:  # host copies without the network: see test_no_host_copies_without_the_network
        copies = (COPY_D2H, COPY_H2D)
        assert tuple(s for s in got if s not in copies) == want


@pytest.mark.parametrize("local_size", [1, 4])
def test_no_host_copies_without_the_network(local_size):
    """Device-to-host and host-to-device copies only feed push/pull. A job that is not
    distributed reduces and broadcasts on the device; copying to the host and straight back
    does not apply, so (ARCHITECTURE.md section 5) it must be absent from the itinerary."""
    got = itinerary(distributed=False, local_size=local_size, on_device=True)
    assert COPY_D2H not in got and COPY_H2D not in got, got


def test_itinerary_examples():
    assert itinerary(distributed=True) == (PUSH, PULL)
    assert itinerary(distributed=False) == ()
    assert itinerary(distributed=True, local_size=4, on_device=True, compressed=True) == ALL_STAGES
    assert itinerary(distributed=False, local_size=2) == (REDUCE, BROADCAST)


def test_itinerary_push_pull_are_adjacent_and_compression_wraps_them():
    it = itinerary(distributed=True, compressed=True)
    assert it == (COMPRESS, PUSH, PULL, DECOMPRESS)


# ------------------------------------------------------------------------------ PriorityQueue
def test_highest_priority_first_fifo_within_a_priority():
    q = PriorityQueue()
    order = [(1, 0), (2, 5), (3, 0), (4, 5), (5, -1), (6, 9), (7, 5)]
    for key, prio in order:
        q.put(make_task(key, priority=prio))
    assert len(q) == len(order)
    got = [q.get(timeout=WAIT).key for _ in order]
    assert got == [6, 2, 4, 7, 1, 3, 5]
    assert len(q) == 0


def test_maxsize_put_raises_full_after_timeout():
    q = PriorityQueue(maxsize=2)
    q.put(make_task(1))
    q.put(make_task(2))
    with pytest.raises(queue.Full):
        q.put(make_task(3), timeout=0.05)
    assert len(q) == 2


def test_maxsize_put_blocks_until_a_get():
    q = PriorityQueue(maxsize=1)
    q.put(make_task(1))
    t, box = run_in_thread(q.put, make_task(2))
    t.join(0.05)
    assert t.is_alive(), "put() into a full queue must block"
    assert q.get(timeout=WAIT).key == 1
    t.join(WAIT)
    assert not t.is_alive() and "error" not in box
    assert q.get(timeout=WAIT).key == 2


def test_close_wakes_getters():
    q = PriorityQueue()
    getters = [run_in_thread(q.get) for _ in range(3)]
    for t, _ in getters:
        t.join(0.02)
        assert t.is_alive()
    q.close()
    for t, box in getters:
        t.join(WAIT)
        assert not t.is_alive() and box["value"] is None


def test_close_wakes_a_blocked_putter():
    q = PriorityQueue(maxsize=1)
    q.put(make_task(1))
    t, box = run_in_thread(q.put, make_task(2))
    t.join(0.02)
    assert t.is_alive()
    q.close()
    t.join(WAIT)
    assert not t.is_alive() and "error" not in box


# ------------------------------------------------------------------------------ Pipeline
class AsyncPushRig:
    """A Pipeline whose PUSH handler records the order it sees tasks and returns False, as the
    native data plane's hand-over does; the first push holds the push thread until ``gate``
    opens (a busy hand-over), so what is submitted meanwhile queues. An 'acker' thread plays the
    data plane's completion and advances each task."""

    def __init__(self, expect: int):
        self.pushed: list[int] = []
        self.first_pushed = threading.Event()
        self.all_done = threading.Event()
        self.gate = threading.Event()
        self.completed: list[int] = []
        self.errors: list = []
        self.expect = expect
        self._acks: queue.Queue = queue.Queue()
        self.pipe = Pipeline({PUSH: self._push}, queue_depth=64,
                             on_error=lambda task, exc: self.errors.append((task.key, exc)))
        self.pipe.on_complete = self._complete
        self._acker = threading.Thread(target=self._ack_loop, daemon=True)

    def _push(self, task: Task) -> bool:
        self.pushed.append(task.key)
        self.first_pushed.set()
        self.gate.wait(WAIT)
        self._acks.put(task)
        return False

    def _ack_loop(self) -> None:
        while True:
            task = self._acks.get()
            if task is None:
                return
            self.pipe.advance(task)

    def _complete(self, task: Task) -> None:
        self.completed.append(task.key)
        if len(self.completed) == self.expect:
            self.all_done.set()

    def __enter__(self):
        self._acker.start()
        self.pipe.start()
        return self

    def __exit__(self, *exc):
        self.gate.set()
        self._acks.put(None)
        self.pipe.close()
        self._acker.join(WAIT)


def test_a_later_high_priority_task_is_handed_over_before_queued_bulk_traffic():
    """While the push stage hands one partition over, ten low-priority ones queue; a
    high-priority partition submitted after them is handed to the data plane second, not
    eleventh (the data plane's own credit then keeps that order on the wire: the native
    client's priority tests)."""
    HIGH = 100
    with AsyncPushRig(expect=11) as rig:
        for k in range(10):
            rig.pipe.submit(make_task(k, nbytes=1000, priority=0))
        assert rig.first_pushed.wait(WAIT)
        assert wait_until(lambda: len(rig.pipe.queues[PUSH]) == 9)
        rig.pipe.submit(make_task(HIGH, nbytes=1000, priority=10))
        rig.gate.set()  # the hand-over goes on
        assert rig.all_done.wait(WAIT), f"only {rig.completed} completed"
    assert rig.errors == []
    assert rig.pushed == [0, HIGH, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert sorted(rig.completed) == sorted(rig.pushed)


def test_observers_see_start_and_end_of_every_stage():
    events = []
    done = queue.Queue()
    pipe = Pipeline({PUSH: lambda t: True, PULL: lambda t: True}, queue_depth=4,
                    on_error=lambda t, e: done.put(("error", t.key, e)))
    pipe.observers.append(lambda task, stage, ev, when: events.append((task.key, stage, ev, when)))
    pipe.on_complete = lambda t: done.put(("done", t.key))
    pipe.start()
    try:
        for k in range(3):
            pipe.submit(make_task(k, itinerary=(PUSH, PULL)))
        assert sorted(done.get(timeout=WAIT) for _ in range(3)) == [("done", k) for k in range(3)]
    finally:
        pipe.close()
    for k in range(3):
        mine = [(stage, ev) for key, stage, ev, _ in events if key == k]
        assert mine == [(PUSH, "start"), (PUSH, "end"), (PULL, "start"), (PULL, "end")]
        times = [when for key, _s, _e, when in events if key == k]
        assert times == sorted(times)


def test_handler_exception_goes_to_on_error_and_the_stage_keeps_running():
    errors = queue.Queue()
    completed = queue.Queue()
    boom = RuntimeError("boom")

    def pull(task):
        if task.key == 1:
            raise boom
        return True

    pipe = Pipeline({PUSH: lambda t: True, PULL: pull}, queue_depth=4,
                    on_error=lambda t, e: errors.put((t.key, e)))
    pipe.on_complete = lambda t: completed.put(t.key)
    pipe.start()
    try:
        for k in range(4):
            pipe.submit(make_task(k, itinerary=(PUSH, PULL)))
        assert errors.get(timeout=WAIT) == (1, boom)
        assert sorted(completed.get(timeout=WAIT) for _ in range(3)) == [0, 2, 3]
        assert errors.empty()
        assert all(t.is_alive() for t in pipe._threads)
    finally:
        pipe.close()


def test_task_with_empty_itinerary_completes_at_submit():
    completed = []
    pipe = Pipeline({PUSH: lambda t: True}, queue_depth=1,
                    on_error=lambda t, e: None)
    pipe.on_complete = completed.append
    task = make_task(7, itinerary=())
    pipe.submit(task)  # not started: nothing to run
    assert completed == [task]


def test_close_stops_every_stage_thread():
    pipe = Pipeline({PUSH: lambda t: True, PULL: lambda t: True}, queue_depth=2,
                    on_error=lambda t, e: None)
    pipe.start()
    pipe.close()
    assert not any(t.is_alive() for t in pipe._threads)


def test_close_stops_a_stage_whose_queue_is_full():
    """close() must stop a stage thread even when its bounded queue is full at that moment
    (a slow handler is the usual reason). The stop sentinel must not be dropped."""
    entered, release = threading.Event(), threading.Event()

    def slow(task):
        entered.set()
        release.wait(WAIT)
        return True

    pipe = Pipeline({PULL: slow}, queue_depth=1, on_error=lambda t, e: None)
    pipe.start()
    pipe.submit(make_task(1, itinerary=(PULL,)))
    assert entered.wait(WAIT)
    pipe.submit(make_task(2, itinerary=(PULL,)))  # fills the queue of depth 1
    closer, _ = run_in_thread(pipe.close)
    closer.join(0.05)
    release.set()
    closer.join(WAIT + 6.0)
    assert not closer.is_alive()
    assert not any(t.is_alive() for t in pipe._threads), \
        "the stage thread outlived close(): its stop sentinel was dropped on a full queue"


# ------------------------------------------------------------------------------ names, fields
def test_stage_names_read_as_the_strings_traces_and_metrics_print():
    """Stages are an enum whose members are their names: traces (``cat``, ``args.stage``),
    metrics labels, thread names and the summary line print exactly what they printed as bare
    strings, and a lookup by the string finds a stage key and vice versa."""
    assert [str(s) for s in ALL_STAGES] == ["reduce", "copy_d2h", "compress", "push", "pull",
                                             "decompress", "copy_h2d", "broadcast"]
    assert ALL_STAGES == tuple(Stage)
    assert f"bpsl-{PUSH}" == "bpsl-push" and f"{PULL:<6}|" == "pull  |"
    assert json.dumps({PUSH: {"stage": PULL}}) == '{"push": {"stage": "pull"}}'
    assert PUSH == "push" and {"push": 1}[PUSH] == 1 and {PUSH: 1}["push"] == 1
    assert Stage("copy_h2d") is COPY_H2D


def test_local_reduction_phases_are_ordered():
    assert list(Phase) == sorted(Phase)
    assert Phase.COPY_IN < Phase.SUM_SLICE < Phase.REDUCED < Phase.AWAIT_RESULT


def test_task_declares_every_field_the_runtime_sets():
    """No attribute appears on a Task that its class does not declare (slots): what the runtime
    and the stages set is in the dataclass, with a default for bare tasks like these."""
    t = make_task(1)
    assert t.phase is Phase.COPY_IN and t.seg is None and t.codec is None and t.decl is None
    assert t.src.nbytes == 0 and t.push_src.nbytes == 0 and not t.src.flags.writeable
    with pytest.raises(AttributeError):
        t.undeclared = 1  # type: ignore[attr-defined]
    names = {f.name for f in dataclasses.fields(Task)}
    assert {"src", "dst", "push_src", "pull_dst", "seg", "phase", "prereduced", "device",
            "dtype", "average", "decl", "codec", "scratch", "wire", "contrib",
            "payload"} <= names
