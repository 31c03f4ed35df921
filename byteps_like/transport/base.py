"""The transport interface.

An :class:`Endpoint` owns one I/O thread. It may *bind* one listening address (servers and the
scheduler) and *connect* to named peers (workers to servers, everyone to the scheduler), with
several connections per peer. Every received message is handed to ``on_message(route, frames)`` on
the I/O thread; ``route`` says where to send a reply. ``send`` may be called from any thread.
"""
from __future__ import annotations

import abc
import heapq
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Route:
    """Where a message came from: a connected peer (``peer``, ``conn``) or a client of our
    listening socket (``ident``)."""
    peer: str | None = None
    conn: int = 0
    ident: bytes | None = None

    def __str__(self) -> str:
        return self.peer if self.peer is not None else f"client {self.ident!r}"


Handler = Callable[[Route, list], None]


class Endpoint(abc.ABC):
    on_message: Handler | None = None
    on_error: Callable[[BaseException], None] | None = None

    @abc.abstractmethod
    def bind(self, address: str) -> str:
        """Listen on ``address`` (``tcp://host:0`` picks a free port); return the bound address."""

    @abc.abstractmethod
    def connect(self, peer: str, address: str, connections: int = 1,
                routing_id: bytes | None = None) -> None:
        """Open ``connections`` connections to ``address`` under the name ``peer``.
        ``routing_id`` (one connection): the identity the listening side sees in its
        ``Route.ident``, so that it can tell this connection from any other client's."""

    @abc.abstractmethod
    def send(self, route: Route, frames: Sequence[Any]) -> None:
        """Send one multipart message; thread-safe; buffers are sent without copying."""

    @abc.abstractmethod
    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the I/O thread."""

    def watch_link(self, peer: str, fn: Callable[[str], None]) -> bool:
        """Before ``connect(peer, ...)``: call ``fn`` on the I/O thread with what happens to
        the first connection to ``peer``: ``"connected"`` (TCP is up), ``"up"`` (the handshake
        succeeded: the peer answers), ``"refused"`` (an attempt failed; retried),
        ``"rejected"`` (the handshake failed: wrong keys, another protocol), ``"down"`` (it
        closed: the peer exited, or the network failed; retried). Returns False where the
        transport cannot tell (``fn`` is then never called)."""
        return False

    @abc.abstractmethod
    def add_timer(self, interval: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the I/O thread every ``interval`` seconds."""

    @abc.abstractmethod
    def start(self) -> None:
        """Start the I/O thread."""

    @abc.abstractmethod
    def close(self, linger: float = 1.0) -> bool:
        """Stop the I/O thread and close every connection, flushing for at most ``linger`` s.
        Returns False when the I/O thread could not be stopped."""


class Timers:
    """The repeating timers of an I/O thread: a heap of (due, seq, interval, fn). Only the I/O
    thread touches it (``add_timer`` hands ``push`` over with ``call_soon``)."""

    def __init__(self) -> None:
        self._heap: list = []
        self._seq = itertools.count()

    def entry(self, interval: float, fn: Callable[[], None]) -> tuple:
        """A timer first due ``interval`` seconds from now (build it on the caller's thread)."""
        return (time.monotonic() + interval, next(self._seq), interval, fn)

    def push(self, entry: tuple) -> None:
        heapq.heappush(self._heap, entry)

    def run_due(self) -> float | None:
        """Run every due timer (each is re-armed before it runs); return the seconds until the
        next one, or None when there is none."""
        now = time.monotonic()
        while self._heap and self._heap[0][0] <= now:
            _due, seq, interval, fn = heapq.heappop(self._heap)
            heapq.heappush(self._heap, (now + interval, seq, interval, fn))
            fn()
        if not self._heap:
            return None
        return max(0.0, self._heap[0][0] - time.monotonic())

    def clear(self) -> None:
        self._heap.clear()


class Drops:
    """What a node drops or refuses instead of handling, counted by reason and logged at a
    bounded rate (the first of each reason at once, then at most one line per ``interval``
    seconds with the number since), so that a flood of hostile messages cannot flood the log
    too. Every refusal path uses it (malformed messages, CURVE/ZAP authentication refusals,
    connections past the limit): a peer that fails for 30 s costs at most four
    lines per cause. ``unit``: what is counted ("message", "connection"); ``clock``: the time
    source (tests)."""

    def __init__(self, logger, who: str, interval: float = 10.0, verb: str = "dropped",
                 unit: str = "message", clock: Callable[[], float] = time.monotonic):
        self.log = logger
        self.who = who
        self.verb = verb
        self.unit = unit
        self.clock = clock
        self.interval = interval
        self.counts: dict[str, int] = {}
        self._since: dict[str, int] = {}
        self._next: dict[str, float] = {}
        self._lock = threading.Lock()

    def __call__(self, reason: str, detail: str = "") -> None:
        now = self.clock()
        with self._lock:
            self.counts[reason] = self.counts.get(reason, 0) + 1
            self._since[reason] = n = self._since.get(reason, 0) + 1
            if now < self._next.get(reason, 0.0):
                return
            self._since[reason] = 0
            self._next[reason] = now + self.interval
        self.log.warning("%s: %s %d %s%s: %s%s", self.who, self.verb, n, self.unit,
                         "" if n == 1 else "s", reason,
                         f" (the last: {detail})" if detail else "")

    def flush(self) -> None:
        """One line per reason with what was counted since its last line: at close, where no
        later message would write it (a flood's last window was never logged)."""
        with self._lock:
            held = {r: n for r, n in self._since.items() if n}
            for r in held:
                self._since[r] = 0
        for reason, n in sorted(held.items()):
            self.log.warning("%s: %s %d %s%s: %s (since the last line of it, at close)",
                             self.who, self.verb, n, self.unit, "" if n == 1 else "s", reason)

    @property
    def total(self) -> int:
        return sum(self.counts.values())
