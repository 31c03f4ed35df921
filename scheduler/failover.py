"""Losing a server, the scheduler's side (BYTEPS_SERVER_FAILOVER; docs/reliability.md,
"Losing a server").

A lost server (its launcher saw it exit, a worker's data streams to it closed, its heartbeats
stopped) no longer ends a synchronous job while another server survives. The scheduler:

1. marks it lost (barriers and the end of the job stop waiting for it; a server that was only
   cut off is told to shut down, so nobody pushes to a server the others left behind);
2. tells every worker (``FAILOVER``, the failover's number in the key, the ranks of every
   server lost so far), and each moves the lost servers' keys to the survivors and seeds
   them (byteps_like/worker/failover.py);
3. once every worker has answered ``SEEDED`` with that number, tells them all ``RESUME``: the
   pushes that waited go to the keys' new servers.

A second loss before the first is resumed starts a new failover that covers both. A worker
that does not answer within ``BYTEPS_HEARTBEAT_TIMEOUT_SECONDS`` fails the job, naming it.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ..errors import EXIT_PEER_FAILED
from ..transport import Route
from ..wire import MsgType, Role
from .barriers import Barriers
from .nodes import Host, NodeInfo, checked, servers, workers

log = logging.getLogger("byteps_like.scheduler")


class ServerLoss:
    """The failovers of one scheduler."""

    def __init__(self, host: Host, barriers: Barriers):
        self.host = host
        self.barriers = barriers
        cfg = host.cfg
        self.enabled = cfg.can_lose_servers
        self.number = 0                      # failovers so far
        self.lost: list[NodeInfo] = []       # servers lost, in order
        self.waiting: set[bytes | None] = set()  # workers that have not seeded the current one
        self.began = 0.0
        self.events: list[dict] = []         # every loss and its stall, for status and logs
        self.pending_missing: list[int] = []  # a restart's servers that did not come back
        self.ages: dict[str, float] = {}     # async: lost server -> its snapshot's age (s)

    def takes(self, node: NodeInfo) -> bool:
        """Whether losing ``node`` is a failover rather than the end of the job."""
        return (self.enabled and node.role is Role.SERVER and self.host.phase == "running"
                and not node.lost and any(s is not node for s in servers(self.host)))

    def leaving(self, node: NodeInfo, meta: dict, lose: Callable[[NodeInfo, str], None]
                ) -> bool:
        """A server that announces its leave (ABORT with "leave": a preemption notice,
        server/preempt.py): lost now, before it exits, so nobody waits to detect it (``lose``:
        the scheduler's). A job that cannot lose it keeps it, saying why. False when ``meta``
        is no announced leave of a server (an ordinary ABORT)."""
        if meta.get("leave") is not True or node.role is not Role.SERVER:
            return False
        reason = checked(meta, "reason", str, "")[:1000]
        if self.takes(node):
            lose(node, f"lost {node.describe()}: it announced its leave ({reason})")
        elif not node.lost:
            why = ("BYTEPS_SERVER_FAILOVER is off or the job is asynchronous" if not self.enabled
                   else "the job is not running" if self.host.phase != "running"
                   else "it is the job's last server")
            log.warning("scheduler: %s announced its leave (%s), but the job cannot lose it "
                        "(%s): it serves on until it goes", node.describe(), reason, why)
        return True

    def stream_lost(self, worker: NodeInfo, meta: dict, lose: Callable[[NodeInfo, str], None]
                    ) -> None:
        """A worker's data streams to a server closed: that server is lost now (a server that
        dies without a launcher watching it), not after the heartbeat timeout."""
        rank = checked(meta, "server", int, lo=0, hi=1 << 20)
        reason = checked(meta, "reason", str, "")[:1000]
        found = [n for n in servers(self.host) if n.rank == rank]
        if found and self.host.phase == "running":
            lose(found[0], f"lost {found[0].describe()}: the data streams of "
                           f"{worker.describe()} to it closed ({reason})")

    def fatal(self, node: NodeInfo, why: str) -> str:
        """Why the job ends with ``node`` lost: says so when no server is left."""
        if node.role is Role.SERVER and self.lost:
            why += ("; no server of the job is left (lost before: "
                    + ", ".join(n.describe() for n in self.lost) + ")")
        return why

    def lose(self, node: NodeInfo, why: str) -> None:
        node.lost = node.finished = True
        self.lost.append(node)
        self._begin(why, node.rank, node.host, node.pid)
        alive = servers(self.host)
        log.warning("scheduler: %s; failover %d: its keys move to server rank(s) %s "
                    "(BYTEPS_SERVER_FAILOVER)", why, self.number,
                    ", ".join(str(s.rank) for s in alive))
        self.host.send(node, MsgType.SHUTDOWN)  # if it still runs, it leaves the job
        # a server found by its silence stalled the job since it was last heard from
        silent = time.monotonic() - node.last_seen
        if silent <= 2 * self.host.cfg.timeouts.heartbeat_interval:
            silent = 0.0  # found by its exit or its streams, not its silence
        self._announce(why, silent=silent)
        self.barriers.check_all()  # a barrier that waited for the lost server

    def _begin(self, why: str, server: int, host: str, pid: int, cause: str = "") -> None:
        """The next failover: its number, when it began, its event (status and logs)."""
        self.number += 1
        self.began = time.monotonic()
        self.events.append({"failover": self.number, "server": server, "host": host,
                            "pid": pid, "why": why, "cause": cause or loss_cause(why),
                            "at": time.time(), "stall": None})

    def _announce(self, why: str, *, silent: float = 0.0, joined: list | None = None) -> None:
        """FAILOVER (the current one, _begin) to every worker: the servers gone, the ones that
        joined; then wait for every live worker's SEEDED."""
        meta = {"lost": [s.rank for s in self.lost], "reason": why[:2000], "silent": silent,
                "joined": joined or []}
        self.waiting = {w.route.ident for w in self._told() if not w.lost and not w.finished}
        for w in self._told():
            if not w.lost:
                self.host.send(w, MsgType.FAILOVER, meta, key=self.number)
        self._maybe_resume()

    def _told(self) -> list[NodeInfo]:
        """Who takes part in a failover: the workers, and in asynchronous mode the servers
        too, which take a lost server's values from its snapshot before the workers go on
        (server/async_snapshots.py)."""
        return workers(self.host) + (servers(self.host) if self.host.cfg.server.enable_async
                                     else [])

    def adopt(self, number: int, gone: list[int]) -> None:
        """A restarted scheduler: what a re-registering worker says of the failovers so far
        (their number, the ranks of the servers gone), so that a server lost or replaced later
        is handled as before the restart."""
        self.number = max(self.number, number)
        known = {n.rank for n in self.lost}
        for rank in gone:
            if rank not in known:
                ghost = NodeInfo(Route(ident=b"lost-server-%d" % rank), Role.SERVER, "", 0, 0,
                                 rank=rank, lost=True, finished=True)
                self.lost.append(ghost)
                known.add(rank)

    def missing(self, ranks: list[int]) -> bool:
        """A restart's servers that did not come back: lost (their keys move once the job
        runs again, failover_missing). False when the job cannot lose them."""
        known = {n.rank for n in self.lost}
        fresh = [r for r in ranks if r not in known]
        if not self.enabled or len(fresh) + len(known) >= self.host.expected[Role.SERVER]:
            return False
        self.adopt(self.number, ranks)
        self.pending_missing = fresh
        return True

    def failover_missing(self) -> None:
        """After a restart came back without some servers: tell the workers (a failover)."""
        fresh, self.pending_missing = self.pending_missing, []
        if fresh:
            why = (f"server rank(s) {', '.join(map(str, fresh))} did not register again with "
                   "the restarted scheduler")
            self._begin(why, fresh[0], "", 0, "not back after a scheduler restart")
            log.warning("scheduler: %s; failover %d: their keys move to the other servers",
                        why, self.number)
            self._announce(why)

    def replace(self, route: Route, info: NodeInfo) -> bool:
        """A server registering while the job runs takes the place of the first server lost
        (its rank, its keys: they move back at once, as a failover moves them away). False when
        no lost server waits for a replacement (the registration is refused as usual)."""
        host = self.host
        # (an elastic job's servers follow its membership epochs, which a replacement would
        # have to join between the seeds and the resumed pushes: not supported)
        if not (self.enabled and self.lost and host.phase == "running") or host.elastic:
            return False
        if host.cfg.server.enable_async:   # the keys stay where their snapshots put them
            log.warning("scheduler: %s registered to replace a lost server; an asynchronous "
                        "job does not take replacements (its keys would move back without "
                        "their newest values)", info.describe())
            return False
        # the lost server it was started for (BYTEPS_SERVER_ID), else the first lost
        same = [n for n in self.lost if info.server_id is not None and n.rank == info.server_id]
        old = same[0] if same else self.lost[0]
        self.lost.remove(old)
        info.rank = old.rank
        host.nodes.pop(old.route.ident, None)
        host.nodes[route.ident] = info
        host.table = [info.public() if d.get("role") == "server" and d.get("rank") == old.rank
                      else d for d in host.table]
        c = host.cfg.cluster
        host.send(info, MsgType.NODE_TABLE, {"rank": info.rank, "nodes": host.table,
                                             "num_worker": c.num_worker,
                                             "local_size": c.local_size})
        why = f"{info.describe()} replaces {old.describe()}"
        self._begin(why, info.rank, info.host, info.pid, "replacement")
        log.warning("scheduler: %s; failover %d: its keys move back to it", why, self.number)
        self._announce(why, joined=[info.public()])
        return True

    def seeded(self, node: NodeInfo, number: int, meta: dict | None = None) -> None:
        if number == self.number and node.route.ident in self.waiting:   # once each
            self.waiting.discard(node.route.ident)
            ages = (meta or {}).get("async_snapshot_age")
            if isinstance(ages, dict):   # asynchronous mode: the snapshots' ages, for RESUME
                for rank, age in list(ages.items())[:64]:
                    if isinstance(age, (int, float)) and str(rank).isdigit():
                        self.ages[str(rank)] = max(float(age), self.ages.get(str(rank), -1.0))
            self._maybe_resume()

    def _maybe_resume(self) -> None:
        if not self.number or self.waiting or not self.began:   # (began: not resumed yet)
            return
        stall = time.monotonic() - self.began
        meta = {"async_snapshot_age": self.ages} if self.ages else None
        self.ages = {}
        for w in workers(self.host):
            if not w.lost:
                self.host.send(w, MsgType.RESUME, meta, key=self.number)
        if self.events:
            self.events[-1]["stall"] = stall
        log.warning("scheduler: failover %d done: every worker re-seeded the moved keys in "
                    "%.2f s; the job goes on with %d server(s)", self.number, stall,
                    len(servers(self.host)))
        self.began = 0.0

    def tick(self, now: float) -> bool:
        """Workers lost or finished meanwhile are not waited for; one that does not answer
        in time fails the job (True: it did)."""
        if not self.waiting:
            return False
        gone = {w.route.ident for w in self._told() if w.lost or w.finished}
        if self.waiting & gone:
            self.waiting -= gone
            self._maybe_resume()
            return False
        limit = self.host.cfg.timeouts.heartbeat_timeout
        if self.began and now - self.began > limit:
            silent = [n for n in self._told() if n.route.ident in self.waiting]
            why = (f"failover {self.number} after losing {self.lost[-1].describe()}: "
                   f"{', '.join(n.describe() for n in silent)} did not re-seed the moved keys "
                   f"within {limit:g} s (BYTEPS_HEARTBEAT_TIMEOUT_SECONDS)")
            log.error("scheduler: %s", why)
            self.waiting = set()
            for n in self.host.nodes.values():
                if not n.finished:
                    self.host.send(n, MsgType.PEER_LOST, {**silent[0].public(), "reason": why}
                                   if silent else {"reason": why})
            self.host.finish(EXIT_PEER_FAILED, why)
            return True
        return False


def loss_cause(why: str) -> str:
    """How a server was found lost, in a word or two, from the scheduler's text of it."""
    for needle, cause in (("announced its leave", "announced leave"),
                          ("process exited", "exit"), ("data streams", "stream lost"),
                          ("no heartbeat", "heartbeat"), ("failed:", "failed")):
        if needle in why:
            return cause
    return "lost"
