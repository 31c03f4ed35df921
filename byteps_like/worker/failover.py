"""Losing a server, the worker's side (BYTEPS_SERVER_FAILOVER; docs/reliability.md, "Losing a
server").

The scheduler decides that a server is lost (its launcher saw it exit, a worker's streams to it
closed, or its heartbeats stopped) and tells every worker (``FAILOVER``: the failover's number,
the ranks of every server lost so far). Each worker then, on a thread of its own (never the
control plane's I/O thread):

1. moves the lost servers' keys to the survivors, in the native client: rendezvous hashing of
   each key over the servers alive, so only the lost servers' keys move and every worker moves
   them alike (``DataClient.failover``); the parts that were in flight to a lost server wait;
2. seeds each moved key on its new server with the answer of the last round it completed (the
   client keeps it), which repairs a round whose answers reached only some workers, and waits
   until the servers have taken the seeds (``DataClient.wait_seeds``);
3. tells the scheduler (``SEEDED``). Once every worker has, the scheduler says ``RESUME`` and
   each worker re-sends what waited (``DataClient.resume``).

The training script sees none of it: its push_pulls complete late, with the sums they would
have had. One line in the log names the lost server and how long the job stalled.
A worker whose streams to a server close tells the scheduler at once (``STREAM_LOST``), which
is how a server that dies without a launcher watching it is found in milliseconds.
"""
from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .dataplane import NativeDataPlane
    from .membership import Membership
    from .sparse import SparseTables

log = logging.getLogger("byteps_like.worker")

#: how long a worker waits for its seeds to be taken before it tells the scheduler anyway
#: (the new server is then lost too, and the next failover seeds again)
SEED_TIMEOUT_S = 30.0


class ServerFailover:
    """One worker's part in losing servers. Created by the runtime when the job may lose one
    (BYTEPS_SERVER_FAILOVER, a synchronous job of two servers or more)."""

    def __init__(self, members: Membership, plane: NativeDataPlane):
        self.members = members
        self.plane = plane
        self.current = 0                      # the newest failover heard of
        self.began: float | None = None       # when this worker first saw the loss
        self.stalls: list[float] = []         # seconds each failover held the moved keys
        self._told: set[int] = set()          # servers whose lost streams we reported
        self._announced: set[int] = set()     # servers whose loss the log has named
        self.replacements = 0                 # replacement servers connected
        # (failover, server indices gone before, after): the keys each moved (telemetry.py)
        self.history: collections.deque[tuple[int, list[int], list[int]]] = \
            collections.deque(maxlen=200)
        self._work: queue.SimpleQueue[tuple[int, list[int], list] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.tables: SparseTables | None = None

    @classmethod
    def attach(cls, members: Membership, plane: NativeDataPlane, tables: SparseTables,
               cfg: Any) -> ServerFailover | None:
        """Before registering, when the job may lose a server (:func:`enabled`): the control
        client hands the scheduler's notices to a new instance, and the native plane its lost
        streams. ``tables``: the server-held embedding tables, whose shards a lost server
        takes with it unless they have a copy (BYTEPS_SPARSE_SURVIVAL)."""
        if not cfg.can_lose_servers:
            return None
        self = cls(members, plane)
        self.tables = tables
        control = members.controller
        control.on_failover = self.on_failover
        control.on_resume = self.on_resume
        plane.on_server_lost = self.on_stream_lost
        plane.failover_on = True
        plane.on_close = self.close
        return self

    # -- notices ------------------------------------------------------------------------------
    def on_stream_lost(self, server: int, message: str) -> None:
        """The native client's streams to server index ``server`` closed (completion thread):
        the scheduler hears of it at once."""
        with self._lock:
            if server in self._told:
                return
            self._told.add(server)
            if self.began is None:
                self.began = time.monotonic()
        rank = self._rank_of(server)
        log.warning("worker %d: %s; the job goes on without it once the scheduler moves its "
                    "keys (BYTEPS_SERVER_FAILOVER)", self.members.rank, message)
        self.members.controller.stream_lost(rank, message)

    def on_failover(self, number: int, meta: dict) -> None:
        """The scheduler's FAILOVER (I/O thread): the work goes to this module's thread."""
        lost = meta.get("lost")
        ranks = [r for r in lost if type(r) is int] if isinstance(lost, list) else []
        given = meta.get("silent")  # found by its silence: the job stalled since
        silent = float(given) if isinstance(given, (int, float)) and 0 <= given < 1e6 else 0.0
        with self._lock:
            if number <= self.current:
                return
            self.current = number
        # what this worker tells a restarted scheduler (control.py, rejoin)
        self.members.controller.rejoin_state = {"failover": number, "servers_gone": ranks}
        with self._lock:
            if self.began is None:
                self.began = time.monotonic() - silent
        why = (self.tables.servers_lost([self._index_of(r) for r in ranks], number)
               if self.tables is not None else None)
        if why is not None:  # a table's shard went with the server, and no copy is left
            from ..errors import PeerLostError
            self.members.controller.fail(PeerLostError(
                f"worker {self.members.rank}: {meta.get('reason', 'a server was lost')}; "
                f"{why}", role="server", rank=ranks[-1] if ranks else -1))
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="bps-failover", daemon=True)
            self._thread.start()
        joined = meta.get("joined")
        self._work.put((number, ranks, joined if isinstance(joined, list) else []))

    def on_resume(self, number: int, meta: dict | None = None) -> None:
        """The scheduler's RESUME (I/O thread): every worker has seeded; re-send what waited.
        ``meta``: in asynchronous mode, how old each lost server's snapshot was."""
        with self._lock:
            if number != self.current:
                return  # superseded by a later failover, which will be resumed in its turn
            began, self.began = self.began, None
        cli = self.plane.client
        if cli is not None:
            cli.resume()
        stall = time.monotonic() - began if began is not None else 0.0
        self.stalls.append(stall)
        new = [s for s in self.plane.gone if s not in self._announced]
        self._announced |= set(new)
        lost = ", ".join(f"rank {self._rank_of(s)}" for s in new)
        if self.members.rank == 0 and not new:  # a replacement took its keys back
            log.warning("worker %d: a replacement server joined; its keys moved back to it, the "
                        "job stalled %.2f s (failover %d; servers still lost: %s)",
                        self.members.rank, stall, number,
                        ", ".join(str(self._rank_of(s)) for s in self.plane.gone) or "none")
        elif self.members.rank == 0:
            log.warning("worker %d: lost server %s; its keys moved to the other servers and the "
                        "open rounds were pushed again; the job stalled %.2f s (failover %d)",
                        self.members.rank, lost, stall, number)
        else:
            log.info("worker %d: failover %d done, stalled %.2f s", self.members.rank, number,
                     stall)
        ages = (meta or {}).get("async_snapshot_age")
        for rank, age in sorted(ages.items()) if isinstance(ages, dict) else ():
            (log.warning if self.members.rank == 0 else log.info)(
                "worker %d: the parameters server %s held went back to %s "
                "(BYTEPS_ASYNC_SNAPSHOT_SECONDS): the pushes to them since are lost",
                self.members.rank, rank, f"its snapshot, {age:.2f} s old when its keys moved"
                if isinstance(age, (int, float)) and age >= 0 else "zero (no snapshot)")

    # -- the work -----------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            item = self._work.get()
            if item is None:
                return
            number, ranks, joined = item
            try:
                self._fail_over(number, ranks, joined)
            except Exception as exc:  # noqa: BLE001 - the scheduler's timeout names us
                log.error("worker %d: failover %d failed: %r", self.members.rank, number, exc)

    def _fail_over(self, number: int, ranks: list[int], joined: list) -> None:
        for new in joined:  # a replacement first: connected before its keys move back
            self._replaced(new)
        with self._lock:
            if number != self.current:
                return  # a newer one is queued: it covers these servers too
        servers = [self._index_of(r) for r in ranks]
        cli = self.plane.client
        if cli is not None:
            before = list(self.plane.gone)
            self.plane.gone = sorted(s for s in servers if s >= 0)
            self.history.append((number, before, list(self.plane.gone)))
            cli.failover(self.plane.gone, True)
            why = cli.wait_seeds(SEED_TIMEOUT_S)
            if why:
                log.warning("worker %d: failover %d: %s", self.members.rank, number, why)
        self.members.controller.seeded(number)
        if self.tables is not None:   # snapshots: the tables go back to the newest one
            try:
                self.tables.after_failover(number)
            except Exception as exc:  # noqa: BLE001 - the job cannot go on with its tables
                from ..errors import PeerLostError
                self.members.controller.fail(PeerLostError(
                    f"worker {self.members.rank}: the server-held tables could not go back to "
                    f"their snapshot after failover {number}: {exc}", role="server",
                    rank=ranks[-1] if ranks else -1))

    def _replaced(self, new: Any) -> None:
        """A replacement server took a lost one's rank: its address in the node table, and
        this worker's streams to it."""
        from ..control import PeerInfo
        try:
            peer = PeerInfo("server", int(new["rank"]), str(new["host"])[:255],
                            int(new["port"]), int(new["pid"]), int(new["data_port"]))
        except (KeyError, TypeError, ValueError):
            log.warning("worker %d: a malformed replacement server in FAILOVER: %.200r",
                        self.members.rank, new)
            return
        idx = self._index_of(peer.rank)
        if idx < 0:
            return
        self.members.servers[idx] = peer
        self._told.discard(idx)
        self._announced.discard(idx)
        try:
            self.plane.reconnect(idx, peer)
        except RuntimeError as exc:  # the scheduler's timeout names this worker
            log.error("worker %d: cannot reach the replacement %s: %s", self.members.rank,
                      peer.describe(), exc)
            return
        self.replacements += 1
        log.info("worker %d: connected to the replacement %s", self.members.rank,
                 peer.describe())

    def close(self) -> None:
        if self._thread is not None:
            self._work.put(None)
            self._thread.join(5.0)
            self._thread = None

    # -- server ranks and indices ---------------------------------------------------------------
    def _rank_of(self, index: int) -> int:
        ranks = self.members.server_ranks
        return ranks[index] if 0 <= index < len(ranks) else index

    def _index_of(self, rank: int) -> int:
        ranks = self.members.server_ranks
        return ranks.index(rank) if rank in ranks else -1



