"""Unit tests of byteps_like.worker.handle.Handle: completion, failure, timeouts and callbacks."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from byteps_like.errors import CommTimeoutError, CommunicationError, PeerLostError
from byteps_like.worker.handle import Handle

WAIT = 5.0


def make_handle(nparts: int = 3, name: str = "layer1.weight", **kw) -> Handle:
    inp = np.arange(6, dtype=np.float32)
    return Handle(name, inp, np.zeros_like(inp), nparts, default_timeout=kw.pop("timeout", 30.0),
                  **kw)


def test_completes_only_when_every_part_is_done():
    h = make_handle(3)
    assert not h.done() and h.exception() is None
    h.part_done(0)
    h.part_done(2)
    assert not h.done()
    assert h.pending_parts == {1}
    h.part_done(1)
    assert h.done()
    assert h.wait(0) is h.output and h.result() is h.output
    assert h.exception() is None
    assert h.finished is not None and h.finished >= h.started


def test_part_done_is_idempotent_per_part():
    h = make_handle(2)
    for _ in range(5):
        h.part_done(0)
    assert not h.done(), "repeating part 0 must not count as part 1"
    h.part_done(1)
    assert h.done()
    h.part_done(1)  # after completion: ignored
    assert h.done() and h.wait(0) is h.output


def test_unknown_part_numbers_are_ignored():
    h = make_handle(2)
    h.part_done(2)
    h.part_done(-1)
    assert not h.done() and h.pending_parts == {0, 1}


def test_zero_part_handle_is_done_at_once():
    h = make_handle(0)
    assert h.done()
    assert h.wait(0) is h.output
    calls = []
    h.add_done_callback(calls.append)
    assert calls == [h]


def test_fail_makes_wait_raise_that_error():
    h = make_handle(3)
    h.part_done(0)
    err = PeerLostError("server 1 lost", role="server", rank=1)
    h.fail(err)
    assert h.done()
    assert h.exception() is err
    with pytest.raises(PeerLostError) as info:
        h.wait(1.0)
    assert info.value is err
    with pytest.raises(PeerLostError):
        h.result()


def test_first_failure_wins_and_later_parts_are_ignored():
    h = make_handle(2)
    first, second = RuntimeError("first"), RuntimeError("second")
    h.fail(first)
    h.fail(second)
    h.part_done(0)
    h.part_done(1)
    assert h.exception() is first


def test_fail_after_success_is_ignored():
    h = make_handle(1)
    h.part_done(0)
    h.fail(RuntimeError("late"))
    assert h.exception() is None and h.wait(0) is h.output


def test_wait_timeout_names_tensor_and_outstanding_count():
    h = make_handle(4, name="fc.bias")
    h.part_done(0)
    with pytest.raises(CommTimeoutError) as info:
        h.wait(0.01)
    text = str(info.value)
    assert "'fc.bias'" in text
    assert "3 of 4 partitions outstanding" in text
    assert "0.01 s" in text
    assert isinstance(info.value, TimeoutError) and isinstance(info.value, CommunicationError)
    assert not h.done()


def test_wait_uses_the_default_timeout():
    h = make_handle(1, timeout=0.01)
    with pytest.raises(CommTimeoutError, match="within 0.01 s"):
        h.wait()


def test_a_native_wait_that_used_up_the_timeout_names_the_whole_timeout():
    """The native data plane's fast wait spends the limit first; the error still says the
    limit the caller gave, not what was left of it (0 s)."""
    import time
    h = make_handle(1)
    h.fast_wait = lambda timeout: time.sleep(timeout)
    with pytest.raises(CommTimeoutError, match="within 0.05 s"):
        h.wait(0.05)


def test_wait_timeout_includes_describe_pending():
    h = make_handle(2, describe_pending=lambda hh: f" (parts {sorted(hh.pending_parts)} on "
                                                   "server 3)")
    h.part_done(1)
    with pytest.raises(CommTimeoutError, match=r"1 of 2 partitions outstanding \(parts \[0\] "
                                               r"on server 3\)"):
        h.wait(0.01)


def test_wait_returns_when_another_thread_completes():
    h = make_handle(2)
    t = threading.Thread(target=lambda: (h.part_done(0), h.part_done(1)))
    t.start()
    assert h.wait(WAIT) is h.output
    t.join(WAIT)


def test_callbacks_run_once_on_completion():
    h = make_handle(2)
    calls = []
    h.add_done_callback(lambda hh: calls.append(("a", hh)))
    h.add_done_callback(lambda hh: calls.append(("b", hh)))
    h.part_done(0)
    assert calls == []
    h.part_done(1)
    h.part_done(1)
    h.fail(RuntimeError("late"))
    assert calls == [("a", h), ("b", h)]


def test_callback_added_after_completion_runs_at_once_and_once():
    h = make_handle(1)
    h.part_done(0)
    calls = []
    h.add_done_callback(calls.append)
    assert calls == [h]
    h.part_done(0)
    assert calls == [h]


def test_callbacks_run_on_failure_too():
    h = make_handle(2)
    seen = []
    h.add_done_callback(lambda hh: seen.append(hh.exception()))
    err = RuntimeError("x")
    h.fail(err)
    assert seen == [err]


def test_repr_shows_state():
    h = make_handle(2, name="w")
    assert "'w'" in repr(h) and "2/2 partitions pending" in repr(h)
    h.part_done(0)
    h.part_done(1)
    assert "done" in repr(h)


# ------------------------------------------------------------------------------ races
# The interleavings are forced through the handle's completion Event (the one thing any
# implementation of wait(timeout) keeps): a subclass pauses chosen threads inside set()/is_set().
class PausingEvent(threading.Event):
    def __init__(self):
        super().__init__()
        self.pause_set = None      # (thread name, event to signal, event to wait for)
        self.pause_is_set = None

    def set(self):
        hook = self.pause_set
        if hook and threading.current_thread().name == hook[0]:
            hook[1].set()
            hook[2].wait(WAIT)
        super().set()

    def is_set(self):
        value = super().is_set()
        hook = self.pause_is_set
        if hook and threading.current_thread().name == hook[0]:
            hook[1].set()
            hook[2].wait(WAIT)
        return value


def test_failure_racing_the_last_part_completes_once():
    """fail() and the last part_done() arriving together (a peer lost while the last pull
    response lands) must complete the handle exactly once: done-callbacks (the runtime's
    _on_handle_done starts the next queued round of the tensor) must not run twice.

    Forced interleaving: the completing thread is paused just before it marks the handle done;
    fail() runs in that window."""
    h = make_handle(1)
    ev = h._event = PausingEvent()
    calls = []
    h.add_done_callback(calls.append)
    in_window, go_on = threading.Event(), threading.Event()
    ev.pause_set = ("last-part", in_window, go_on)
    completer = threading.Thread(target=h.part_done, args=(0,), name="last-part")
    completer.start()
    assert in_window.wait(WAIT)
    failer = threading.Thread(target=h.fail, args=(PeerLostError("server 0 lost"),))
    failer.start()
    failer.join(0.5)  # a Handle that decides completion under its lock blocks fail() here
    go_on.set()
    completer.join(WAIT)
    failer.join(WAIT)
    assert h.done()
    assert len(calls) == 1, f"done-callbacks ran {len(calls)} times"


def test_callback_added_during_completion_is_not_lost():
    """add_done_callback() racing the last part_done() must either register the callback before
    the callbacks run or run it itself; it must never be dropped.

    Forced interleaving: the adder sees "not done"; before it appends, the completing thread
    marks the handle done and runs the (still empty) callback list."""
    h = make_handle(1)
    ev = h._event = PausingEvent()
    calls = []
    in_window, checked, finished = threading.Event(), threading.Event(), threading.Event()
    ev.pause_set = ("completer", in_window, checked)
    ev.pause_is_set = ("adder", checked, finished)

    def complete():
        h.part_done(0)
        finished.set()

    completer = threading.Thread(target=complete, name="completer")
    completer.start()
    assert in_window.wait(WAIT)
    adder = threading.Thread(target=h.add_done_callback, args=(calls.append,), name="adder")
    adder.start()
    checked.wait(0.5)  # a Handle that completes under its lock keeps the adder out; go on
    checked.set()
    completer.join(WAIT)
    adder.join(WAIT)
    assert h.done()
    assert calls == [h], "a done-callback registered during completion was never run"
