"""The handle of an asynchronous push_pull: owns its buffers, knows its own state."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from ..errors import CommTimeoutError


class Handle:
    """Returned by ``push_pull_async``. Keeps the input and output arrays alive until done.

    ``wait(timeout)`` blocks until every partition has come back and returns the output, or raises
    the error that failed the operation (``PeerLostError``, ``MismatchError``, ...), or
    ``CommTimeoutError`` naming the tensor and what is still outstanding.
    """

    def __init__(self, name: str, inp: Any, out: Any, nparts: int, *, default_timeout: float,
                 describe_pending: Callable[[Handle], str] | None = None):
        self.name = name
        self.input = inp
        self.output = out
        self.nparts = nparts
        self.default_timeout = default_timeout
        self._remaining = nparts
        self._lock = threading.Lock()
        self._event = threading.Event()
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[Handle], None]] = []
        self._describe_pending = describe_pending
        self.started = time.monotonic()
        self.finished: float | None = None
        self.pending_parts: set[int] = set(range(nparts))
        #: set by the runtime for an operation of the native data plane: ``fast_wait(timeout)``
        #: blocks (GIL released) until the operation completes and finishes this handle on the
        #: waiting thread, saving a handoff through the completion thread
        self.fast_wait: Callable[[float], None] | None = None
        #: set for a tensor converted whole by a cast compressor (worker/rounds.py): writes the
        #: sum into ``output`` in the caller's dtype, once, in the first wait() that succeeds
        self.convert: Callable[[], None] | None = None
        if nparts == 0:
            self._finish()

    def __repr__(self) -> str:
        state = "done" if self.done() else f"{self._remaining}/{self.nparts} partitions pending"
        return f"<Handle {self.name!r} {state}>"

    # -- completion (pipeline side) --------------------------------------------------------------
    def _finish_locked(self) -> list:
        """Mark done (caller holds the lock); returns the callbacks to run after unlocking."""
        self.finished = time.monotonic()
        self._event.set()
        callbacks, self._callbacks = self._callbacks, []
        return callbacks

    def _finish(self) -> None:
        with self._lock:
            callbacks = self._finish_locked()
        for cb in callbacks:
            cb(self)

    def part_done(self, part: int) -> None:
        with self._lock:
            if self._event.is_set() or part not in self.pending_parts:
                return
            self.pending_parts.discard(part)
            self._remaining -= 1
            callbacks = self._finish_locked() if self._remaining == 0 else []
        for cb in callbacks:
            cb(self)

    def complete(self) -> None:
        """Every partition done at once (the native data plane reports whole operations)."""
        with self._lock:
            if self._event.is_set():
                return
            self.pending_parts.clear()
            self._remaining = 0
            callbacks = self._finish_locked()
        for cb in callbacks:
            cb(self)

    def fail(self, exc: BaseException) -> None:
        with self._lock:
            if self._event.is_set():
                return
            self._error = exc
            callbacks = self._finish_locked()
        for cb in callbacks:
            cb(self)

    def add_done_callback(self, fn: Callable[[Handle], None]) -> None:
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    # -- user side ------------------------------------------------------------------------------
    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> Any:
        limit = self.default_timeout if timeout is None else timeout
        timeout = limit
        fast = self.fast_wait
        if fast is not None and not self._event.is_set():
            deadline = time.monotonic() + timeout
            fast(timeout)
            timeout = max(0.0, deadline - time.monotonic())   # what is left of the limit
        if not self._event.wait(timeout):
            detail = self._describe_pending(self) if self._describe_pending else ""
            raise CommTimeoutError(
                f"push_pull of {self.name!r} did not complete within {limit:g} s: "
                f"{self._remaining} of {self.nparts} partitions outstanding{detail}")
        if self._error is not None:
            raise self._error
        if self.convert is not None:
            with self._lock:  # done: nothing else takes the lock for long now
                convert, self.convert = self.convert, None
                if convert is not None:
                    convert()
        return self.output

    def result(self) -> Any:
        return self.wait()

    def exception(self) -> BaseException | None:
        return self._error if self.done() else None
