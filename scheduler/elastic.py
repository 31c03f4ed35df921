"""The scheduler's elastic membership epochs (BYTEPS_ELASTIC, docs/elastic.md).

An epoch is a set of workers with dense ranks 0..size-1. A change (a worker lost, one that
registers, a worker asking for a new epoch with READY) begins the next epoch: its workers are
told (EPOCH, the key the new epoch: they raise MembershipChangedError and rejoin with READY);
once every survivor is ready and at least BYTEPS_ELASTIC_MIN_WORKERS are in, the servers reset
to it (EPOCH, acknowledged) and only then the workers start it (EPOCH_START, a joiner its
NODE_TABLE), so no push of the new epoch meets a server of the old one.
"""
from __future__ import annotations

import logging
import time

from ..transport import Route
from ..wire import ERR_TOO_FEW, MsgType, Role, epoch_round_base
from .barriers import Barriers
from .join import Joins
from .nodes import Host, NodeInfo, servers

log = logging.getLogger("byteps_like.scheduler")


class Epochs:
    """The membership epochs of one scheduler (kept, and empty, when the job is not
    elastic: ``pending`` is what barriers leave out)."""

    def __init__(self, host: Host, barriers: Barriers, joins: Joins):
        self.host = host
        self.barriers = barriers
        self.joins = joins
        c = host.cfg.cluster
        self.capacity = host.cfg.elastic.capacity(c.num_worker) * c.local_size
        self.epoch = 0                       # the last epoch formed (or being formed)
        self.members: list[NodeInfo] = []    # the workers of the current epoch, in rank order
        self.pending: list[NodeInfo] = []    # workers registered since, waiting to be admitted
        self.forming: dict | None = None     # the epoch being formed: ready workers, server acks
        self.below_since: float | None = None  # when the job fell below BYTEPS_ELASTIC_MIN_...
        self.lost: list[str] = []            # every worker lost, for the log and the failure
        self.epoch_log: list[tuple[int, int, float]] = []  # (epoch, size, monotonic start)

    @staticmethod
    def describe_worker(n: NodeInfo) -> str:
        return f"worker rank {n.rank} on {n.host} (pid {n.pid})"

    def _live(self) -> list[NodeInfo]:
        return [m for m in self.members if not m.lost and not m.finished]

    def register_joiner(self, route: Route, info: NodeInfo) -> None:
        # beyond BYTEPS_ELASTIC_MAX_WORKERS a joiner waits for a free place (a worker lost
        # but not detected yet still holds one)
        self.host.nodes[route.ident] = info
        self.pending.append(info)
        log.info("scheduler: worker on %s (pid %d) registered to join the running elastic job "
                 "(%d waiting)", info.host, info.pid, len(self.pending))
        if self.forming is not None:
            self.check_formed()
            return
        live = self._live()
        if not live:
            self.begin([])
            return
        if len(live) >= self.capacity:
            log.warning("scheduler: the job runs BYTEPS_ELASTIC_MAX_WORKERS=%d workers; the "
                        "new one waits for a place", self.capacity)
            return
        for m in live:  # check_membership() raises MembershipChangedError(added=...)
            self.host.send(m, MsgType.EPOCH, {"lost": [], "added": len(self.pending)},
                           key=self.epoch)

    def begin(self, lost: list[str], *, initial: bool = False) -> None:
        """Start forming the next epoch; workers already ready for one that was superseded
        (another loss meanwhile) stay ready."""
        self.epoch += 1
        if self.forming is not None and self.forming.get("members"):
            # superseded while the servers reset: its joiners wait for this one
            back = [m for m in self.forming["members"]
                    if m not in self.members and not m.lost and not m.finished]
            self.pending = back + self.pending
        ready = self.forming["ready"] if self.forming else set()
        old_lost = self.forming["lost"] if self.forming else []
        self.forming = {"epoch": self.epoch, "ready": ready, "lost": old_lost + lost,
                        "acks": None, "initial": initial, "began": time.monotonic()}
        self.barriers.clear()
        if initial:  # the registered workers are ready by nature
            ready.update(n.route.ident for n in self.members)
        else:
            log.warning("scheduler: membership epoch %d begins%s (%d waiting to join)",
                        self.epoch, f"; lost: {'; '.join(lost)}" if lost else "",
                        len(self.pending))
            for m in self._live():
                self.host.send(m, MsgType.EPOCH, {"lost": self.forming["lost"],
                                                  "added": len(self.pending)}, key=self.epoch)
        self.check_formed()

    def ready(self, node: NodeInfo, epoch: int) -> None:
        if node.lost or node.finished or node in self.pending:
            return
        if node not in self.members:
            self.host.reject(node.route, "bad field", "READY from a worker of no epoch")
            return
        if self.forming is None:
            if epoch < self.epoch:
                return  # a late READY of an epoch formed since
            self.begin([])  # the worker saw joiners waiting: admit them now
        assert self.forming is not None
        self.forming["ready"].add(node.route.ident)
        self.check_formed()

    def check_formed(self) -> None:
        f = self.forming
        if f is None or f["acks"] is not None:
            return
        survivors = self._live()
        if any(m.route.ident not in f["ready"] for m in survivors):
            return
        admitted = self.pending[:max(0, self.capacity - len(survivors))]
        size = len(survivors) + len(admitted)
        e = self.host.cfg.elastic
        if size < e.min_workers * self.host.cfg.cluster.local_size:
            if self.below_since is None:
                self.below_since = time.monotonic()
                log.warning("scheduler: %d worker(s) left, below BYTEPS_ELASTIC_MIN_WORKERS=%d; "
                            "waiting up to %g s (BYTEPS_ELASTIC_TIMEOUT_SECONDS) for workers "
                            "to join", size, e.min_workers, e.timeout)
            return
        self.below_since = None
        f["members"] = survivors + admitted
        self.pending = self.pending[len(admitted):]
        if self.pending:
            log.warning("scheduler: %d worker(s) wait for a place (BYTEPS_ELASTIC_MAX_WORKERS="
                        "%d)", len(self.pending), self.capacity)
        servers_now = servers(self.host)
        f["acks"] = {n.route.ident for n in servers_now}
        for n in servers_now:
            self.host.send(n, MsgType.EPOCH, {"size": len(f["members"])}, key=f["epoch"])
        if not servers_now:
            self.start()

    def ack(self, node: NodeInfo, epoch: int) -> None:
        """A server reset for the epoch being formed."""
        f = self.forming
        if f is None or f["acks"] is None or epoch != f["epoch"]:
            return
        f["acks"].discard(node.route.ident)
        if not f["acks"]:
            self.start()

    def start(self) -> None:
        f, self.forming = self.forming, None
        assert f is not None
        members = [m for m in f["members"] if not m.lost and not m.finished]
        for r, m in enumerate(members):
            m.rank = r
        self.members = members
        self.barriers.clear()
        self.joins.left = {}   # the servers' reset cleared theirs
        now = time.monotonic()
        self.epoch_log.append((f["epoch"], len(members), now))
        base = epoch_round_base(f["epoch"])
        for m in members:
            m.last_seen = now
            meta = {"epoch": f["epoch"], "rank": m.rank, "size": len(members),
                    "round_base": base, "lost": f["lost"]}
            if f["initial"] or m.route.ident not in f["ready"]:  # a joiner: its node table
                self.host.send(m, MsgType.NODE_TABLE, {
                    **meta, "nodes": self.host.table, "num_worker": len(members),
                    "local_size": self.host.cfg.cluster.local_size})
            else:
                self.host.send(m, MsgType.EPOCH_START, meta)
        log.warning("scheduler: membership epoch %d formed: %d worker(s)", f["epoch"],
                    len(members))
        if self.pending and len(members) < self.capacity:  # registered while the servers
            for m in members:                                 # reset: admitted at the next
                self.host.send(m, MsgType.EPOCH, {"lost": [], "added": len(self.pending)},
                               key=self.epoch)

    def lose(self, lost: NodeInfo, why: str) -> None:
        if lost.lost or lost.finished:
            return
        lost.lost = lost.finished = True
        if lost in self.pending:
            self.pending.remove(lost)
            log.warning("scheduler: %s (it had not joined yet)", why)
            self.check_formed()
            return
        name = why if f"pid {lost.pid}" in why else f"{self.describe_worker(lost)}: {why}"
        self.lost.append(name)
        log.warning("scheduler: %s; elastic job: the other workers continue", why)
        self.begin([name])

    def finished(self, node: NodeInfo) -> None:
        """A worker finished its script: the job ends when every member has."""
        live = [m for m in self.members if not m.lost]
        log.info("scheduler: %s finished (%d of %d)", node.describe(),
                 sum(m.finished for m in live), len(live))
        if node in live and not all(m.finished for m in live) and self.forming is None:
            self.joins.leave(node)  # rounds it never pushes fail with PeerLeftError, as without
        if all(m.finished for m in live):
            for n in self.pending:
                n.finished = True
            self.host.shutdown_all()
        elif self.forming is not None:
            self.check_formed()

    def tick(self, now: float) -> bool:
        """Fail the job once it has been below the minimum for too long (True: it did)."""
        e = self.host.cfg.elastic
        if self.below_since is None or now - self.below_since <= e.timeout:
            return False
        lost = self.lost
        size = len(self._live()) + len(self.pending)
        why = (f"TooFewWorkersError: {size} worker(s) for {now - self.below_since:.1f} s, below "
               f"BYTEPS_ELASTIC_MIN_WORKERS={e.min_workers} (BYTEPS_ELASTIC_TIMEOUT_SECONDS="
               f"{e.timeout:g}); lost: {'; '.join(lost) if lost else 'none'}")
        log.error("scheduler: %s", why)
        for n in self.host.nodes.values():
            if n.lost:
                continue
            if n.role is Role.WORKER:
                self.host.send(n, MsgType.ERROR, {"kind": ERR_TOO_FEW, "message": why,
                                                  "lost": lost, "min_workers": e.min_workers})
            else:
                self.host.send(n, MsgType.SHUTDOWN)
        self.host.finish(1, why)
        return True
