"""One server-held table shard as a server keeps it: the shard, its open round, what waits for
it (server/sparse.py serves it; server/sparse_survival.py keeps it)."""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..embedding import TableShard, TableSpec
from ..transport import Route
from ..wire import ERR_MISMATCH, Message, as_buffer

if TYPE_CHECKING:
    from .core import Server

log = logging.getLogger("byteps_like.server")


@dataclass
class Table:
    spec: TableSpec
    shard: TableShard
    shards: int
    decl_rank: int
    charged: int
    applied: int = 0                        # rounds applied: the open round is this one
    pushes: dict = field(default_factory=dict)   # rank -> (ids, grads) of the open round
    pending: list = field(default_factory=list)  # (route, msg, ids) waiting for the round
    failed: str | None = None
    failed_kind: str = ERR_MISMATCH
    failed_extra: dict = field(default_factory=dict)   # peer_left: rank, last_round
    average: bool | None = None                  # the open round's pushes: averaged or summed
    done: dict = field(default_factory=dict)     # (type, tag) -> round of a save/load done
    saving: dict = field(default_factory=dict)   # (type, tag) -> (round, [(route, header)])
    round_started: float | None = None           # monotonic time of the open round's 1st push
    key: int = -1                                # the table's id

    # what the stall inspector reads of a store (server/stalls.py)
    @property
    def round(self) -> int:
        return self.applied

    @property
    def pushed(self) -> dict:
        return self.pushes

    @property
    def decl(self) -> dict:
        return {"name": f"table {self.spec.name}"}


#: bytes of requests queued for the tables' thread (each counted with its payload and
#: QUEUED_OVERHEAD) at which the server stops reading its clients (Endpoint.hold_clients) until
#: the thread has served the queue down to half of it: peers that send faster than the tables
#: are served are held back by TCP, not buffered. At most one request more is queued (the one
#: that crossed the line; a message is at most BYTEPS_MAX_MESSAGE_BYTES).
QUEUE_BYTES = 64 << 20
#: what a queued request costs beside its payload (its Message, header, route, queue entry)
QUEUED_OVERHEAD = 1024
#: seconds between two warnings that the queue is full
QUEUE_WARN_INTERVAL_S = 10.0


#: worker processes per machine a table job may declare (BYTEPS_LOCAL_SIZE)
MAX_LOCAL_SIZE = 256


class Pushers:
    """Who pushes the tables' rounds: every worker process. A machine of L processes pushes
    L times a round, as process ranks m*L .. m*L+L-1 (the ranks of the job: the same sums in
    the same order as L machines of one process); join() and leaving the job are by machine.
    L comes with the first table's declaration and is the same for every table."""

    def __init__(self, machines: int):
        self.machines = machines
        self.per_machine = 0             # L; 0: no table declared yet
        self.joined: frozenset = frozenset()   # machines in join()
        self.left: dict[int, str] = {}         # machines gone without it -> why

    def limit(self) -> int:
        """Ranks below this may ask for a table (before the first declaration: any L)."""
        return self.machines * (self.per_machine or MAX_LOCAL_SIZE)

    def declare(self, per_machine: object, rank: int) -> str | None:
        """A declaration's L from worker rank ``rank``: None when it fits, else why not."""
        if type(per_machine) is not int or not 1 <= per_machine <= MAX_LOCAL_SIZE:
            return f"local size {per_machine!r} is not 1..{MAX_LOCAL_SIZE}"
        if self.per_machine and per_machine != self.per_machine:
            return (f"declared with {per_machine} worker processes per machine, the tables "
                    f"have {self.per_machine} (BYTEPS_LOCAL_SIZE must be the same everywhere)")
        if rank >= self.machines * per_machine:
            return (f"rank {rank} is not below {self.machines} machines x {per_machine} "
                    "processes")
        self.per_machine = per_machine
        return None

    def _ranks(self, machine: int) -> range:
        n = self.per_machine or 1
        return range(machine * n, (machine + 1) * n)

    def joined_ranks(self) -> frozenset:
        return frozenset(r for m in self.joined for r in self._ranks(m))

    def left_ranks(self) -> dict[int, str]:
        return {r: why for m, why in self.left.items() for r in self._ranks(m)}

    def of(self, machines: Iterable[int]) -> int:
        """How many process ranks the machines hold."""
        return sum(len(self._ranks(m)) for m in machines)


class RequestQueue:
    """The queue of a server's tables' thread, bounded: once QUEUE_BYTES of requests wait, the
    server reads no more of its clients until the thread has served half of them."""

    def __init__(self, server: Server):
        self.server = server
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.queued_bytes = 0
        self.holds = 0    # times the server stopped reading its clients for it
        self._holding = False
        self._lock = threading.Lock()
        self._warned_at = -QUEUE_WARN_INTERVAL_S
        self.put, self.get = self.q.put, self.q.get   # control items: (None, what, 0, 0.0)

    def submit(self, route: Route, msg: Message) -> None:
        """Queue a request for the tables' thread (on the I/O thread). Once QUEUE_BYTES are
        queued the server stops reading its clients until half of them are served."""
        payload = 0 if msg.payload is None else memoryview(as_buffer(msg.payload)).nbytes
        cost = payload + QUEUED_OVERHEAD
        with self._lock:
            self.queued_bytes += cost
            hold = not self._holding and self.queued_bytes >= QUEUE_BYTES
            if hold:
                self._holding = True
                self.holds += 1
        self.q.put((route, msg, cost, time.perf_counter()))
        if hold:
            now = time.monotonic()
            if now - self._warned_at >= QUEUE_WARN_INTERVAL_S:
                self._warned_at = now
                log.warning("server %d: %d bytes of embedding-table requests are queued; the "
                            "server reads no more requests until its tables' thread has served "
                            "half of them (%d times so far; the last from worker rank %d): a "
                            "slow optimizer or checkpoint, or peers that send faster than the "
                            "tables are served", self.server.rank, self.queued_bytes,
                            self.holds, msg.header.rank)
            self.server.ep.hold_clients(True)

    def served(self, cost: int) -> None:
        """A request of ``cost`` was served (on the tables' thread)."""
        with self._lock:
            self.queued_bytes -= cost
            resume = self._holding and self.queued_bytes <= QUEUE_BYTES // 2
            if resume:
                self._holding = False
        if resume:
            self.server.ep.hold_clients(False)
