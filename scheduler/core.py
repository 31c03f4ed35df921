"""The scheduler: rendezvous, rank assignment, barriers and liveness.

Every node registers with its role and address; once all have joined, ranks are assigned
deterministically and the node table is sent to everyone. Afterwards the scheduler runs barriers,
exchanges heartbeats with every node, reports a silent node to all others (who raise
``PeerLostError``), and shuts the job down once every worker has finished.

:class:`Scheduler` is the facade over its parts, each with one job, as the worker's runtime is:

* :class:`~.registration.Registration` (``registration``): registrations, ranks, the node
  table, the reports while the job forms;
* :class:`~.barriers.Barriers` (``barriers``): barriers by group and sequence number;
* :class:`~.join.Joins` (``joins``): ``join()``, ranks that ran out of data;
* :class:`~.elastic.Epochs` (``epochs``): the membership epochs of elastic jobs;
* :class:`~.failover.ServerLoss` (``server_loss``): losing a server while the job goes on.

The parts take the narrow :class:`~.nodes.Host` view of the scheduler (its nodes, ``send``,
``reject``, ``finish``, ...) and the parts they use, never this module. This module keeps the
message dispatch, liveness (heartbeats, a launcher's exit notices, the stall inspector), the
loss of a node and the lifecycle.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from ..config import Config
from ..control import WAIT_REPORT_INTERVAL_S, wait_level
from ..errors import EXIT_PEER_FAILED, ProtocolError
from ..transport import Route, make_endpoint
from ..transport.base import Drops
from ..wire import (
    ERR_PROTOCOL,
    ERR_REGISTER,
    ERR_REJOIN,
    Header,
    MsgType,
    Role,
    decode,
    encode,
    job_hash,
)
from .barriers import Barriers
from .dashboard import Dashboard, serve_dashboard
from .elastic import Epochs
from .failover import ServerLoss
from .join import Joins
from .nodes import BadField, NodeInfo, checked, show, workers
from .registration import Registration, assign_ranks
from .reports import EventLog, Reports
from .stalls import report_stalls

if TYPE_CHECKING:
    from ..metrics import RoleMetrics

# the names this module had before the parts were split out (tests and scripts import them)
_BadField, _field, _show = BadField, checked, show
__all__ = ["NodeInfo", "Scheduler", "assign_ranks", "run"]

log = logging.getLogger("byteps_like.scheduler")


class Scheduler:
    def __init__(self, cfg: Config, *, context=None, address: str | None = None):
        self.cfg = cfg
        c = cfg.cluster
        self.expected = {Role.WORKER: c.num_worker * c.local_size, Role.SERVER: c.num_server}
        self.job = job_hash(c.job_id)
        self.ep = make_endpoint("scheduler", cfg, context=context, data_plane=False)
        import zmq
        try:
            self.address = self.ep.bind(
                address or f"tcp://{_bind_host(c.root_uri)}:{c.root_port}")
        except zmq.ZMQError as exc:  # the port is taken (another job?) or not this host's
            from ..errors import ConfigError
            self.ep.close(linger=0)
            raise ConfigError(
                f"the scheduler cannot listen on {_bind_host(c.root_uri)}:{c.root_port}: {exc} "
                "(DMLC_PS_ROOT_PORT / bpslaunch --port, DMLC_PS_ROOT_URI): another job may "
                "hold the port; pick a free one") from None
        # keyed by the ZeroMQ routing id of the node's connection (Route.ident: never None for
        # a client of the listening socket, which is all the scheduler has)
        self.nodes: dict[bytes | None, NodeInfo] = {}
        self.phase = "register"
        self.started = time.monotonic()
        self._next_wait_report = self.started + WAIT_REPORT_INTERVAL_S  # registration
        self.table: list[dict] = []   # the node table, once every node has registered
        self.exit_code: int | None = None
        self.failure: str | None = None
        self.rejected = 0
        # by reason, logged at a bounded rate: a flood of bad messages is no flood of lines
        self.rejections = Drops(log, "scheduler", verb="rejected")
        # the stall inspector: (server rank, key, round) -> last report of that round
        self.stalls: dict[tuple[int, int, int], dict] = {}
        self.stall_log: list[str] = []
        self.lost_workers: list[str] = []   # asynchronous mode: workers lost, job went on
        # elastic jobs (BYTEPS_ELASTIC): membership epochs, see elastic.py
        self.elastic = cfg.elastic.enabled and not cfg.server.enable_async
        # the parts
        self.barriers = Barriers(self, lambda: self.epochs.pending)
        self.joins = Joins(self)
        self.epochs = Epochs(self, self.barriers, self.joins)
        self.registration = Registration(self, self.epochs)
        self.server_loss = ServerLoss(self, self.barriers)
        self.asked_back: set[bytes | None] = set()  # a restart: nodes asked to register again
        self.registration.replacement = self.server_loss.replace
        self.registration.on_rejoin_state = self.server_loss.adopt
        self.registration.on_recovered = self._recovered
        self.registration.on_missing = self.server_loss.missing
        # the nodes' reports and the job's events: the live page, straggler line and metrics
        self.events = EventLog()
        self.reports = Reports(self, self.events, self.server_loss)
        self.dashboard: Dashboard | None = None
        self._done = threading.Event()
        self.heartbeats_missed = 0   # metrics: ticks that found a node silent > 2 intervals
        self.metrics: RoleMetrics | None = None
        self.ep.on_message = self._on_message
        self.ep.on_error = self._io_failed
        self.ep.add_timer(cfg.timeouts.heartbeat_interval, self._tick)

    # -- helpers ----------------------------------------------------------------------------
    def send(self, node_or_route: NodeInfo | Route, mtype: MsgType, meta: dict | None = None,
             key: int = 0) -> None:
        # a reply to a bare route (a peer that may not be a node of this job) carries no job
        # tag: the tag is what a forged message to a server or a data stream would need
        registered = isinstance(node_or_route, NodeInfo)
        route = node_or_route.route if isinstance(node_or_route, NodeInfo) else node_or_route
        hdr = Header(mtype, role=Role.SCHEDULER, rank=0, job=self.job if registered else 0,
                     key=key)
        self.ep.send(route, encode(hdr, meta=meta))

    def reject(self, route: Route, reason: str, text: str, kind: str = ERR_PROTOCOL, *,
               log_as: str | None = None) -> None:
        """Refuse one message: count it (by reason), answer it with an ERROR; the job goes on."""
        self.rejected += 1
        self.rejections(reason, f"{log_as or text} (from {route})")
        self.send(route, MsgType.ERROR, {"kind": kind, "message": text})

    def finish(self, code: int, why: str | None = None) -> None:
        if self.exit_code is None:
            self.exit_code = code
            self.failure = why
            self.events.add("end", f"the job ended: exit status {code}"
                            + (f" ({why[:500]})" if why else ""))
            self.phase = "done"
            self._done.set()

    def _io_failed(self, exc: BaseException) -> None:
        """The I/O thread died (a bug): exit non-zero at once instead of hanging; the nodes see
        the scheduler's heartbeats stop and raise PeerLostError naming it."""
        self.finish(1, f"scheduler internal error: {exc!r}")

    def counts(self) -> str:
        parts = []
        for role in (Role.WORKER, Role.SERVER):
            have = [n for n in self.nodes.values() if n.role is role]
            parts.append(f"{len(have)} of {self.expected[role]} {role.label}s")
        return " and ".join(parts)

    # -- message handling -------------------------------------------------------------------
    def _on_message(self, route: Route, frames: list) -> None:
        try:
            msg = decode(frames, self.cfg.transport.max_message_bytes)
        except ProtocolError as exc:
            self.reject(route, "malformed", str(exc))
            return
        h = msg.header
        if h.job != self.job:
            # no job id in the answer: an outsider learns nothing it could inject with
            self.reject(route, "wrong job", "this scheduler serves another job; check "
                         "BYTEPS_JOB_ID and DMLC_PS_ROOT_PORT", ERR_REGISTER)
            return
        if msg.meta is not None and not isinstance(msg.meta, dict):
            self.reject(route, "bad field", f"{h.type.name}: the meta must be a JSON object, "
                        f"not {type(msg.meta).__name__}")
            return
        try:  # a bug (any other exception) still fails the scheduler, loudly
            self._dispatch(route, h, msg.meta or {})
        except BadField as exc:
            self.reject(route, "bad field", f"{h.type.name}: {exc}")

    def _dispatch(self, route: Route, h: Header, meta: dict) -> None:
        node = self.nodes.get(route.ident)
        if node is not None:
            node.last_seen = time.monotonic()
        if (node is not None and node.lost and self.elastic and node.role is Role.WORKER
                and h.type is not MsgType.REGISTER):
            if not node.told_removed:  # e.g. it was stopped (SIGSTOP) past the timeout
                node.told_removed = True
                self.send(node, MsgType.ERROR, {"kind": ERR_PROTOCOL, "message": (
                    f"{node.describe()} was declared lost and is no longer part of this "
                    f"elastic job (now in epoch {self.epochs.epoch}); start a new worker to "
                    "rejoin")})
            return
        if h.type is MsgType.REGISTER:
            self._register(route, meta, h)
        elif h.type is MsgType.EXITED:  # from a launcher, which is no node of the job
            self._exited(route, meta)
        elif node is None and h.rank >= 0 and self.phase == "register":
            # a node of a running job (it has a rank) that this scheduler, a restart, does not
            # know yet: its registration again follows (control.py, rejoin)
            self.rejections("rejoining", f"{h.type.name} from a node of rank {h.rank} that has "
                            "not registered again yet")
            if route.ident not in self.asked_back:  # once: it registers again (control.py)
                self.asked_back.add(route.ident)
                self.send(route, MsgType.ERROR, {"kind": ERR_REJOIN, "message": (
                    "this scheduler was restarted: register again with your rank")})
        elif node is None:
            self.reject(route, "unregistered", f"{h.type.name} from an unregistered node",
                        ERR_REGISTER)
        elif h.type is MsgType.HEARTBEAT:
            pass
        elif h.type is MsgType.BARRIER:
            group = meta.get("group", "all")
            if group not in ("all", node.role.label):  # also refuses a list (unhashable)
                raise BadField(f"group {show(group)}: a {node.role.label} takes part in "
                               f"barriers of group 'all' or {node.role.label!r}")
            self._barrier(node, group, h.key)
        elif h.type is MsgType.FINISH:
            self._worker_finished(node)
        elif h.type is MsgType.JOIN and node.role is Role.WORKER:
            self.joins.join(node, meta.get("rounds"))
        elif h.type is MsgType.MEMBERS and node.role is Role.SERVER:
            self.joins.members_ack(node, h.key)
        elif h.type is MsgType.READY and node.role is Role.WORKER and self.elastic:
            self.epochs.ready(node, h.key)
        elif h.type is MsgType.EPOCH and node.role is Role.SERVER and self.elastic:
            self.epochs.ack(node, h.key)
        elif h.type is MsgType.SEEDED:   # workers; servers in asynchronous mode
            self.server_loss.seeded(node, h.key, meta)
        elif h.type is MsgType.STREAM_LOST and node.role is Role.WORKER:
            self.server_loss.stream_lost(node, meta, self._lose)
        elif h.type is MsgType.REPORT:
            self.reports.report(node, meta)
        elif h.type is MsgType.STALL and node.role is Role.SERVER:
            self._stall(node, meta.get("stalls"))
        elif h.type is MsgType.ABORT:  # a failed node, or a server announcing its leave
            if not self.server_loss.leaving(node, meta, self._lose):
                self._lose(node, f"{node.describe()} failed: "
                                 f"{str(meta.get('reason', 'aborted'))[:4000]}")
                self.send(node, MsgType.SHUTDOWN)  # the failed node need not wait for anyone
        else:
            log.warning("scheduler: unexpected %s from %s", h.type.name, node.describe())

    def _register(self, route: Route, meta: dict, h: Header) -> None:
        known, phase = route.ident in self.nodes, self.phase
        self.registration.register(route, meta)
        self.reports.registered(None if known else self.nodes.get(route.ident), phase)

    def _barrier(self, node: NodeInfo, group: str, seq: int) -> None:
        self.barriers.arrive(node, group, seq)

    def _stall(self, server: NodeInfo, stalls) -> None:
        """The stall inspector's reports (scheduler/stalls.py)."""
        report_stalls(self, server, stalls, self._lose)

    def _exited(self, route: Route, meta: dict) -> None:
        """A launcher saw a process it started exit (bpslaunch, launcher/notify.py; its parent
        knows at once, the heartbeats only after BYTEPS_HEARTBEAT_TIMEOUT_SECONDS): lose that
        node now. Matched by role, advertised host and pid (or process group: the process
        bpslaunch started may be a wrapper of the node's). A node that finished, or is known
        lost already, exited as expected."""
        try:
            role = checked(meta, "role", str)
            host = checked(meta, "host", str)
            pid = checked(meta, "pid", int, lo=1, hi=(1 << 31) - 1)
            how = checked(meta, "how", str)[:200]
            name = checked(meta, "name", str, "")[:100] or role
        except BadField as exc:
            self.reject(route, "bad field", f"EXITED: {exc}")
            return
        if self.phase == "done":
            return
        found = [n for n in self.nodes.values()
                 if n.role.label == role and n.host == host and pid in (n.pid, n.pgid)]
        if len(found) != 1:  # not registered (yet), or ambiguous: the heartbeats decide
            if not found and self.phase == "register" and role in ("worker", "server") \
                    and not (self.elastic or self.registration.restarted):
                # a process the job needs is gone before it joined: it can never form
                why = (f"{name} (pid {pid} on {host}) exited before it registered ({how}); "
                       "the job cannot form without it")
                log.error("scheduler: %s", why)
                for n in self.nodes.values():
                    self.send(n, MsgType.PEER_LOST, {"role": role, "rank": -1, "host": host,
                                                      "port": 0, "pid": pid, "reason": why})
                self.finish(EXIT_PEER_FAILED, why)
            else:
                log.info("scheduler: %s (pid %d on %s) exited (%s); no node of the job "
                         "matches it alone", name, pid, host, how)
            return
        node = found[0]
        if node.finished or node.lost:
            return
        why = (f"lost {node.describe()}: its process exited ({how}; reported by its launcher "
               "at once)")
        if self.phase == "register" and (self.elastic or (node.role is Role.SERVER
                                                          and self.server_loss.enabled)):
            # no rank or epoch yet: its place is free again, for a replacement (a server that
            # bpslaunch starts again, --server-restarts)
            del self.nodes[node.route.ident]
            log.warning("scheduler: %s before the job formed; waiting for a replacement", why)
            return
        self._lose(node, why)

    def _recovered(self) -> None:
        """A restart has its nodes back: barriers and the end of the job they asked for."""
        self.server_loss.failover_missing()
        self.barriers.check_all()
        if all(n.finished for n in workers(self)):
            self.shutdown_all()

    def _worker_finished(self, node: NodeInfo) -> None:
        node.finished = True
        if self.phase == "register":  # a restart whose nodes are still coming back: the job
            return                    # ends once they all have (registration.py)
        self.events.add("finished", f"{node.describe()} finished")
        if self.elastic:
            self.epochs.finished(node)
            return
        everyone = workers(self)
        if self.cfg.server.enable_async:  # BYTEPS_ASYNC_STALENESS: nobody waits for it now
            self.joins.depart(node, f"{node.describe()} has finished")
        elif node.rank not in self.joins.joined and not all(n.finished for n in everyone):
            self.joins.leave(node)
        log.info("scheduler: %s finished (%d of %d)", node.describe(),
                 sum(n.finished for n in everyone), len(everyone))
        if all(n.finished for n in everyone):
            self.shutdown_all()

    def _lose(self, lost: NodeInfo, why: str, *, tell_lost: bool = False,
              code: int = EXIT_PEER_FAILED) -> None:
        self.events.add("lost", why)
        if not tell_lost and self.server_loss.takes(lost):  # the job goes on (failover.py)
            self.server_loss.lose(lost, why)
            return
        why = self.server_loss.fatal(lost, why)
        if self.elastic and lost.role is Role.WORKER and not tell_lost and self.phase == "running":
            self.epochs.lose(lost, why)
            return
        if (self.cfg.server.enable_async and lost.role is Role.WORKER and not tell_lost
                and self.phase == "running"):
            self._lose_async_worker(lost, why)
            return
        log.error("scheduler: %s", why)
        for n in self.nodes.values():
            if (n is not lost or tell_lost) and not n.finished:
                self.send(n, MsgType.PEER_LOST, {**lost.public(), "reason": why})
        lost.finished = True
        self.finish(code, why)  # EXIT_PEER_FAILED: bpslaunch blames the lost node

    def _lose_async_worker(self, lost: NodeInfo, why: str) -> None:
        """Asynchronous mode: a lost worker does not stop the others. It is logged, left out of
        barriers and staleness bounds; the job ends (exit 1, naming it) when the others finish."""
        log.error("scheduler: %s; asynchronous mode: the other workers continue", why)
        lost.lost = lost.finished = True
        self.joins.depart(lost, why)
        self.lost_workers.append(why)
        self.barriers.check_all()
        everyone = workers(self)
        if all(n.lost for n in everyone):
            self._lose_all(why)
        elif all(n.finished for n in everyone):
            self.shutdown_all()

    def _lose_all(self, why: str) -> None:
        for n in self.nodes.values():
            if not n.finished:
                self.send(n, MsgType.PEER_LOST, {"role": "worker", "rank": -1, "host": "",
                                                 "port": 0, "pid": 0, "reason": why})
        self.finish(EXIT_PEER_FAILED, why)

    def shutdown_all(self) -> None:
        for n in self.nodes.values():
            if not n.lost:
                self.send(n, MsgType.SHUTDOWN)
        if self.lost_workers:
            self.finish(EXIT_PEER_FAILED, "; ".join(self.lost_workers))
        else:
            self.finish(0)

    def _tick(self) -> None:
        now = time.monotonic()
        t = self.cfg.timeouts
        if self.phase == "register" and self.registration.recovering:
            self.registration.recovery_tick(now)  # a restart: its nodes coming back
        if self.phase == "register":
            # the report first, also when a late tick is already past the timeout: it comes
            # before the error
            if now >= self._next_wait_report:
                waited = self._next_wait_report - self.started
                log.log(wait_level(self.cfg, waited), "scheduler: waiting for nodes to register "
                        "at %s for %g s (gives up after %g s, BYTEPS_REGISTER_TIMEOUT_SECONDS): "
                        "%s joined; not seen yet: %s", self.address, waited,
                        t.register_timeout, self.counts(), self.registration.not_seen())
                while self._next_wait_report <= now:
                    self._next_wait_report += WAIT_REPORT_INTERVAL_S
            if now - self.started > t.register_timeout:
                why = self.registration.report()
                log.error("scheduler: %s", why)
                for n in self.nodes.values():
                    self.send(n, MsgType.ERROR, {"kind": ERR_REGISTER, "message": why})
                self.finish(1, why)
            return
        if self.phase == "refused":   # a node was refused: the job cannot form
            self.registration.refused_tick(now)
        if self.phase != "running":
            return
        if self.elastic and self.epochs.tick(now):
            return
        if self.server_loss.tick(now):
            return
        for n in list(self.nodes.values()):
            self.send(n, MsgType.HEARTBEAT)  # finished workers still wait for SHUTDOWN
            if n.finished or n.lost:
                continue
            silent = now - n.last_seen
            if silent > 2 * t.heartbeat_interval:
                self.heartbeats_missed += 1  # metrics
            if silent > t.heartbeat_timeout:
                self._lose(n, f"lost {n.describe()}: no heartbeat for {silent:.1f} s "
                              f"(BYTEPS_HEARTBEAT_TIMEOUT_SECONDS={t.heartbeat_timeout:g})")
                return

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        self.ep.start()
        from byteps_like.metrics import serve_role  # metrics: BYTEPS_METRICS_PORT
        self.metrics = serve_role("scheduler", 0, self.cfg, self._metrics_sample, "node_role")
        self.dashboard = serve_dashboard(self)  # the live page: BYTEPS_DASHBOARD_PORT

    def _metrics_sample(self) -> dict:
        """What the Prometheus endpoint reports (byteps_like/metrics.py)."""
        nodes: dict[str, int] = {"worker": 0, "server": 0}
        for n in list(self.nodes.values()):
            if not n.lost:
                nodes[n.role.label] = nodes.get(n.role.label, 0) + 1
        return {"byteps_scheduler_nodes": nodes,
                "byteps_scheduler_heartbeats_missed": self.heartbeats_missed,
                **self.reports.metrics()}

    def wait(self, timeout: float | None = None) -> int | None:
        self._done.wait(timeout)
        return self.exit_code

    def close(self) -> None:
        if self.dashboard is not None:
            self.dashboard.close()
            self.dashboard = None
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        self.closed_cleanly = self.ep.close(linger=2.0)
        self.rejections.flush()  # the last window's, which no later rejection will write

    def run(self) -> int:
        log.info("scheduler: listening on %s for %s", self.address, self.counts())
        self.start()
        try:
            self._done.wait()
        finally:
            self.close()
        return self.exit_code or 0


def _bind_host(uri: str) -> str:
    """Bind on the root address when it is an IP literal, on every interface otherwise."""
    import ipaddress
    try:
        ipaddress.ip_address(uri)
        return uri
    except ValueError:
        return "*"


def run(cfg: Config) -> int:
    """Run a scheduler in this process until the job ends; returns the exit status."""
    from ..roles import run_node
    return run_node(Scheduler, cfg)
