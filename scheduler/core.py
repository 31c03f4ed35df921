"""The scheduler: rendezvous, rank assignment, barriers and liveness.

Every node registers with its role and address; once all have joined, ranks are assigned
deterministically and the node table is sent to everyone. Afterwards the scheduler runs barriers,
exchanges heartbeats with every node, reports a silent node to all others (who raise
``PeerLostError``), and shuts the job down once every worker has finished.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..config import Config
from ..control import WAIT_REPORT_INTERVAL_S, wait_level
from ..errors import EXIT_PEER_FAILED, ProtocolError
from ..transport import Route, make_endpoint
from ..transport.base import Drops

if TYPE_CHECKING:
    from ..metrics import RoleMetrics
from ..wire import (
    ERR_PROTOCOL,
    ERR_REGISTER,
    ERR_TOO_FEW,
    Header,
    MsgType,
    Role,
    decode,
    encode,
    epoch_round_base,
    job_hash,
)

log = logging.getLogger("byteps_like.scheduler")


@dataclass
class NodeInfo:
    route: Route
    role: Role
    host: str
    port: int
    pid: int
    worker_id: int | None = None
    local_rank: int = 0
    rank: int = -1
    last_seen: float = field(default_factory=time.monotonic)
    finished: bool = False
    lost: bool = False
    data_port: int = 0
    told_removed: bool = False   # elastic: a worker declared lost that spoke again was told
    pgid: int = 0                # its process group (bpslaunch's child: see _exited)

    def describe(self) -> str:
        return f"{self.role.label} rank {self.rank} on {self.host} (pid {self.pid})"

    def public(self) -> dict:
        return {"role": self.role.label, "rank": self.rank, "host": self.host, "port": self.port,
                "pid": self.pid, "data_port": self.data_port}


def assign_ranks(nodes: list[NodeInfo], local_size: int) -> None:
    """Deterministic ranks: a worker with DMLC_WORKER_ID gets worker_id*local_size+local_rank;
    the others fill the free ranks in (host, pid, local_rank) order; servers rank by
    (host, port)."""
    workers = [n for n in nodes if n.role is Role.WORKER]
    taken = set()
    for n in workers:
        if n.worker_id is not None:
            n.rank = n.worker_id * local_size + n.local_rank
            taken.add(n.rank)
    free = iter(r for r in range(len(workers)) if r not in taken)
    for n in sorted((n for n in workers if n.worker_id is None),
                    key=lambda n: (n.host, n.pid, n.local_rank)):
        n.rank = next(free)
    servers = sorted((n for n in nodes if n.role is Role.SERVER), key=lambda n: (n.host, n.port))
    for i, n in enumerate(servers):
        n.rank = i


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
        self.barriers: dict[tuple[str, int], set[bytes | None]] = {}
        self.exit_code: int | None = None
        self.failure: str | None = None
        self.rejected = 0
        # by reason, logged at a bounded rate: a flood of bad messages is no flood of lines
        self.rejections = Drops(log, "scheduler", verb="rejected")
        # the stall inspector: (server rank, key, round) -> last report of that round
        self.stalls: dict[tuple[int, int, int], dict] = {}
        self.stall_log: list[str] = []
        self.lost_workers: list[str] = []   # asynchronous mode: workers lost, job went on
        # join(): worker ranks waiting in join(), machines that finished without joining (why),
        # and the membership epoch the servers last acknowledged (see _members)
        self.joined: dict[int, NodeInfo] = {}
        self.last_joined = -1
        self.left: dict[int, str] = {}
        self.members_epoch = 0
        # servers yet to ack the post-join reset
        self._release_acks: set[bytes | None] | None = None
        self._release_epoch = 0
        self.joined_all: dict[int, NodeInfo] = {}     # the ranks released by that ack
        self.join_rounds: dict[str, int] = {}         # tensor -> most rounds a joiner pushed
        # elastic jobs (BYTEPS_ELASTIC): membership epochs, see _begin_epoch
        self.elastic = cfg.elastic.enabled and not cfg.server.enable_async
        self.capacity = cfg.elastic.capacity(c.num_worker) * c.local_size
        self.epoch = 0                       # the last epoch formed (or being formed)
        self.members: list[NodeInfo] = []    # the workers of the current epoch, in rank order
        self.pending: list[NodeInfo] = []    # workers registered since, waiting to be admitted
        self.forming: dict | None = None     # the epoch being formed: ready workers, server acks
        self.below_since: float | None = None  # when the job fell below BYTEPS_ELASTIC_MIN_...
        self.elastic_lost: list[str] = []    # every worker lost, for the log and the failure
        self.epoch_log: list[tuple[int, int, float]] = []  # (epoch, size, monotonic start)
        self._done = threading.Event()
        self.heartbeats_missed = 0   # metrics: ticks that found a node silent > 2 intervals
        self.metrics: RoleMetrics | None = None
        self.ep.on_message = self._on_message
        self.ep.on_error = self._io_failed
        self.ep.add_timer(cfg.timeouts.heartbeat_interval, self._tick)

    # -- helpers ----------------------------------------------------------------------------
    def _send(self, node_or_route, mtype: MsgType, meta: dict | None = None, key: int = 0) -> None:
        # a reply to a bare route (a peer that may not be a node of this job) carries no job
        # tag: the tag is what a forged message to a server or a data stream would need
        registered = isinstance(node_or_route, NodeInfo)
        route = node_or_route.route if registered else node_or_route
        hdr = Header(mtype, role=Role.SCHEDULER, rank=0, job=self.job if registered else 0,
                     key=key)
        self.ep.send(route, encode(hdr, meta=meta))

    def _reject(self, route: Route, reason: str, text: str, kind: str = ERR_PROTOCOL, *,
                log_as: str | None = None) -> None:
        """Refuse one message: count it (by reason), answer it with an ERROR; the job goes
        on."""
        self.rejected += 1
        self.rejections(reason, f"{log_as or text} (from {route})")
        self._send(route, MsgType.ERROR, {"kind": kind, "message": text})

    def _finish(self, code: int, why: str | None = None) -> None:
        if self.exit_code is None:
            self.exit_code = code
            self.failure = why
            self.phase = "done"
            self._done.set()

    def _io_failed(self, exc: BaseException) -> None:
        """The I/O thread died (a bug): exit non-zero at once instead of hanging; the nodes see
        the scheduler's heartbeats stop and raise PeerLostError naming it."""
        self._finish(1, f"scheduler internal error: {exc!r}")

    def _counts(self) -> str:
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
            self._reject(route, "malformed", str(exc))
            return
        h = msg.header
        if h.job != self.job:
            # no job id in the answer: an outsider learns nothing it could inject with
            self._reject(route, "wrong job", "this scheduler serves another job; check "
                         "BYTEPS_JOB_ID and DMLC_PS_ROOT_PORT", ERR_REGISTER)
            return
        if msg.meta is not None and not isinstance(msg.meta, dict):
            self._reject(route, "bad field", f"{h.type.name}: the meta must be a JSON object, "
                         f"not {type(msg.meta).__name__}")
            return
        try:  # a bug (any other exception) still fails the scheduler, loudly
            self._dispatch(route, h, msg.meta or {})
        except _BadField as exc:
            self._reject(route, "bad field", f"{h.type.name}: {exc}")

    def _dispatch(self, route: Route, h: Header, meta: dict) -> None:
        node = self.nodes.get(route.ident)
        if node is not None:
            node.last_seen = time.monotonic()
        if (node is not None and node.lost and self.elastic and node.role is Role.WORKER
                and h.type is not MsgType.REGISTER):
            if not node.told_removed:  # e.g. it was stopped (SIGSTOP) past the timeout
                node.told_removed = True
                self._send(node, MsgType.ERROR, {"kind": ERR_PROTOCOL, "message": (
                    f"{node.describe()} was declared lost and is no longer part of this "
                    f"elastic job (now in epoch {self.epoch}); start a new worker to rejoin")})
            return
        if h.type is MsgType.REGISTER:
            self._register(route, meta, h)
        elif h.type is MsgType.EXITED:  # from a launcher, which is no node of the job
            self._exited(route, meta)
        elif node is None:
            self._reject(route, "unregistered", f"{h.type.name} from an unregistered node",
                         ERR_REGISTER)
        elif h.type is MsgType.HEARTBEAT:
            pass
        elif h.type is MsgType.BARRIER:
            group = meta.get("group", "all")
            if group not in ("all", node.role.label):  # also refuses a list (unhashable)
                raise _BadField(f"group {_show(group)}: a {node.role.label} takes part in "
                                f"barriers of group 'all' or {node.role.label!r}")
            self._barrier(node, group, h.key)
        elif h.type is MsgType.FINISH:
            self._worker_finished(node)
        elif h.type is MsgType.JOIN and node.role is Role.WORKER:
            self._join(node, meta.get("rounds"))
        elif h.type is MsgType.MEMBERS and node.role is Role.SERVER:
            self._members_ack(node, h.key)
        elif h.type is MsgType.READY and node.role is Role.WORKER and self.elastic:
            self._ready(node, h.key)
        elif h.type is MsgType.EPOCH and node.role is Role.SERVER and self.elastic:
            self._epoch_ack(node, h.key)
        elif h.type is MsgType.STALL and node.role is Role.SERVER:
            self._stall(node, meta.get("stalls"))
        elif h.type is MsgType.ABORT:
            reason = str(meta.get("reason", "aborted"))[:4000]
            self._lose(node, f"{node.describe()} failed: {reason}")
            self._send(node, MsgType.SHUTDOWN)  # the failed node need not wait for anyone
        else:
            log.warning("scheduler: unexpected %s from %s", h.type.name, node.describe())

    def _register(self, route: Route, meta: dict, h: Header) -> None:
        c = self.cfg.cluster
        try:  # every field of its type and in range: a registration becomes the node table
            role_name = _field(meta, "role", str)
            if role_name not in ("worker", "server"):
                raise _BadField(f"role {_show(role_name)} is not 'worker' or 'server'")
            role = Role.parse(role_name)
            host = _field(meta, "host", str)
            if not 0 < len(host) <= 255:
                raise _BadField(f"host of {len(host)} characters (1 to 255)")
            local_size = _field(meta, "local_size", int, c.local_size, lo=1, hi=1 << 16)
            # DMLC_WORKER_ID's upper bound and BYTEPS_LOCAL_SIZE against the job's are
            # checked below, with messages that name both sides
            worker_id = _field(meta, "worker_id", int, None, lo=0, what="DMLC_WORKER_ID")
            local_rank = _field(meta, "local_rank", int, 0, lo=0,
                                hi=local_size - 1 if role is Role.WORKER else None,
                                what="BYTEPS_LOCAL_RANK")
            info = NodeInfo(route, role, host, _field(meta, "port", int, 0, lo=0, hi=65535),
                            _field(meta, "pid", int, 0, lo=0, hi=(1 << 31) - 1), worker_id,
                            local_rank)
            info.data_port = _field(meta, "data_port", int, 0, lo=0, hi=65535)
            info.pgid = _field(meta, "pgid", int, 0, lo=0, hi=(1 << 31) - 1)
            # the job size this node was told (absent from nodes of older releases)
            sizes = {"DMLC_NUM_WORKER": _field(meta, "num_worker", int, None, lo=1,
                                               hi=1 << 20, what="DMLC_NUM_WORKER"),
                     "DMLC_NUM_SERVER": _field(meta, "num_server", int, None, lo=0,
                                               hi=1 << 20, what="DMLC_NUM_SERVER")}
            if self.elastic:  # ranks come from the epochs, not DMLC_WORKER_ID
                info.worker_id = None
        except _BadField as exc:
            self._reject(route, "bad registration", f"bad registration: {exc}", ERR_REGISTER)
            return
        err = self._size_mismatch(info, sizes)
        if err is None and (self.elastic and role is Role.WORKER and self.phase == "running"
                            and local_size == c.local_size):
            self._register_joiner(route, info)
            return
        if err is not None:
            pass  # the job size first: a node told another size may trip the checks below too
        elif self.phase != "register":
            err = "registration is closed: every node of this job has already joined"
        elif role is Role.SCHEDULER:
            err = "a second scheduler tried to register"
        elif sum(n.role is role for n in self.nodes.values()) >= self.expected[role]:
            err = (f"too many {role.label}s: this job expects {self.expected[role]} "
                   f"(DMLC_NUM_WORKER x BYTEPS_LOCAL_SIZE workers, DMLC_NUM_SERVER servers)")
        elif role is Role.WORKER and local_size != self.cfg.cluster.local_size:
            err = (f"worker on {info.host} has BYTEPS_LOCAL_SIZE={local_size}, the scheduler "
                   f"expects {self.cfg.cluster.local_size}")
        elif role is Role.WORKER and info.worker_id is not None and not self.elastic:
            if info.worker_id >= self.cfg.cluster.num_worker:
                err = (f"DMLC_WORKER_ID={info.worker_id} is out of range for "
                       f"DMLC_NUM_WORKER={self.cfg.cluster.num_worker}")
            for n in self.nodes.values():
                if (n.role is Role.WORKER and n.worker_id == info.worker_id
                        and n.local_rank == info.local_rank):
                    err = (f"DMLC_WORKER_ID={info.worker_id} BYTEPS_LOCAL_RANK={info.local_rank} "
                           f"is already taken by {n.host} pid {n.pid}")
        if err:
            self._reject(route, "registration refused", err, ERR_REGISTER,
                         log_as=f"a {role.label} from {info.host}: {err}")
            return
        self.nodes[route.ident] = info
        log.info("scheduler: %s joined from %s:%d (%s)", role.label, info.host, info.port,
                 self._counts())
        if all(sum(n.role is r for n in self.nodes.values()) == k
               for r, k in self.expected.items()):
            self._publish_table()

    def _size_mismatch(self, info: NodeInfo, sizes: dict[str, int | None]) -> str | None:
        """Why a node told another job size than the scheduler cannot join (None: it can)."""
        c = self.cfg.cluster
        mine = {"DMLC_NUM_WORKER": c.num_worker, "DMLC_NUM_SERVER": c.num_server}
        wrong = [f"{name}={value} but the scheduler has {name}={mine[name]}"
                 for name, value in sizes.items() if value is not None and value != mine[name]]
        if not wrong:
            return None
        who = f"{info.role.label} on {info.host} (pid {info.pid}"
        who += f", DMLC_WORKER_ID={info.worker_id})" if info.worker_id is not None else ")"
        return (f"{who} has {' and '.join(wrong)}: every process of a job needs the same "
                "DMLC_NUM_WORKER and DMLC_NUM_SERVER")

    def _publish_table(self) -> None:
        assign_ranks(list(self.nodes.values()), self.cfg.cluster.local_size)
        me = {"role": "scheduler", "rank": 0, "host": self.cfg.cluster.root_uri,
              "port": self.cfg.cluster.root_port, "pid": os.getpid()}
        table = [me] + sorted((n.public() for n in self.nodes.values()),
                              key=lambda d: (d["role"], d["rank"]))
        now = time.monotonic()
        self.table = table
        for n in self.nodes.values():
            n.last_seen = now
            if self.elastic and n.role is Role.WORKER:
                continue  # once the servers have reset for epoch 1 (_epoch_ack)
            self._send(n, MsgType.NODE_TABLE, {"rank": n.rank, "nodes": table,
                       "num_worker": self.cfg.cluster.num_worker,
                       "local_size": self.cfg.cluster.local_size})
        self.phase = "running"
        if self.elastic:
            self.members = sorted(self._workers(), key=lambda n: n.rank)
            self._begin_epoch([], initial=True)
        log.info("scheduler: all %d nodes joined; node table sent", len(self.nodes))

    def _barrier(self, node: NodeInfo, group: str, seq: int) -> None:
        self.barriers.setdefault((group, seq), set()).add(node.route.ident)
        self._check_barrier(group, seq)

    def _check_barrier(self, group: str, seq: int) -> None:
        members = [n for n in self.nodes.values()
                   if (group == "all" or n.role.label == group) and not n.lost
                   and n not in self.pending]   # elastic: joiners not admitted yet
        arrived = self.barriers.get((group, seq), set())
        if {n.route.ident for n in members} <= arrived:
            del self.barriers[(group, seq)]
            for n in members:
                self._send(n, MsgType.BARRIER_DONE, {"group": group}, key=seq)

    def _worker_ranks(self, machines: list[int]) -> list[int]:
        """Worker ranks of worker machine indices (servers count pushes per machine)."""
        ls = self.cfg.cluster.local_size
        return [m * ls + i for m in machines for i in range(ls)]

    def _stall(self, server: NodeInfo, stalls) -> None:
        """The stall inspector: a server reports synchronous rounds that some workers pushed and
        others did not; log them, aggregated, and fail the job past the shutdown limit."""
        if not isinstance(stalls, list) or self.phase != "running":
            return
        fresh, oldest = [], None
        for st in stalls[:1000]:
            try:
                ident = (server.rank, int(st["key"]), int(st["round"]))
                age = float(st["age"])
                missing = self._worker_ranks([int(m) for m in st["missing"]])
                name = str(st["name"])[:200]
            except (KeyError, TypeError, ValueError):
                continue
            if ident not in self.stalls:
                fresh.append(f"{name!r} (key {ident[1]}, round {ident[2]}, server {server.rank}, "
                             f"{age:.0f} s) is missing worker ranks {missing}")
            self.stalls[ident] = {"name": name, "age": age, "missing": missing}
            if oldest is None or age > oldest[0]:
                oldest = (age, name, missing)
        if fresh:
            text = (f"stall inspector: {len(fresh)} tensor round(s) pushed by some workers but "
                    f"not all for over {self.cfg.timeouts.stall_check_time:g} s "
                    f"(BYTEPS_STALL_CHECK_TIME_SECONDS): " + "; ".join(fresh[:20])
                    + (f"; and {len(fresh) - 20} more" if len(fresh) > 20 else ""))
            self.stall_log.append(text)
            log.warning("scheduler: %s", text)
        limit = self.cfg.timeouts.stall_shutdown_time
        if limit > 0 and oldest is not None and oldest[0] >= limit:
            age, name, missing = oldest
            names = sorted({v["name"] for v in self.stalls.values()})
            workers = {n.rank: n for n in self.nodes.values() if n.role is Role.WORKER}
            first = workers.get(missing[0]) if missing else None
            why = (f"stall inspector: tensor {name!r} has waited {age:.0f} s for worker ranks "
                   f"{missing} (stalled tensors: {', '.join(repr(n) for n in names[:20])}); "
                   f"BYTEPS_STALL_SHUTDOWN_TIME_SECONDS={limit:g} reached, failing the job")
            if first is None:
                first = server
            self._lose(first, why, tell_lost=True, code=1)  # the scheduler's own verdict

    def _exited(self, route: Route, meta: dict) -> None:
        """A launcher saw a process it started exit (bpslaunch, launcher/notify.py; its parent
        knows at once, the heartbeats only after BYTEPS_HEARTBEAT_TIMEOUT_SECONDS): lose that
        node now. Matched by role, advertised host and pid (or process group: the process
        bpslaunch started may be a wrapper of the node's). A node that finished, or is known
        lost already, exited as expected."""
        try:
            role = _field(meta, "role", str)
            host = _field(meta, "host", str)
            pid = _field(meta, "pid", int, lo=1, hi=(1 << 31) - 1)
            how = _field(meta, "how", str)[:200]
            name = _field(meta, "name", str, "")[:100] or role
        except _BadField as exc:
            self._reject(route, "bad field", f"EXITED: {exc}")
            return
        if self.phase == "done":
            return
        found = [n for n in self.nodes.values()
                 if n.role.label == role and n.host == host and pid in (n.pid, n.pgid)]
        if len(found) != 1:  # not registered (yet), or ambiguous: the heartbeats decide
            if not found and self.phase == "register" and not self.elastic \
                    and role in ("worker", "server"):
                # a process the job needs is gone before it joined: it can never form
                why = (f"{name} (pid {pid} on {host}) exited before it registered ({how}); "
                       "the job cannot form without it")
                log.error("scheduler: %s", why)
                for n in self.nodes.values():
                    self._send(n, MsgType.PEER_LOST, {"role": role, "rank": -1, "host": host,
                                                      "port": 0, "pid": pid, "reason": why})
                self._finish(EXIT_PEER_FAILED, why)
            else:
                log.info("scheduler: %s (pid %d on %s) exited (%s); no node of the job "
                         "matches it alone", name, pid, host, how)
            return
        node = found[0]
        if node.finished or node.lost:
            return
        why = (f"lost {node.describe()}: its process exited ({how}; reported by its launcher "
               "at once)")
        if self.phase == "register" and self.elastic:
            # no rank or epoch yet: its place is free again, for a replacement
            del self.nodes[node.route.ident]
            log.warning("scheduler: %s before the job formed; waiting for a replacement", why)
            return
        self._lose(node, why)

    # -- join(): ranks that run out of data -------------------------------------------------
    def _workers(self) -> list[NodeInfo]:
        return [n for n in self.nodes.values() if n.role is Role.WORKER]

    def _members(self) -> None:
        """Tell every server which worker machines are joined or left (a new epoch)."""
        self.members_epoch += 1
        ls = self.cfg.cluster.local_size
        meta = {"joined": sorted({r // ls for r in self.joined}),
                "left": {str(m): why for m, why in self.left.items()}}
        for n in self.nodes.values():
            if n.role is Role.SERVER and not n.lost:
                self._send(n, MsgType.MEMBERS, meta, key=self.members_epoch)

    def _join(self, node: NodeInfo, rounds) -> None:
        """A worker ran out of data: later rounds need no push from it. Once every worker has
        joined, the servers go back to expecting all of them (acknowledged) before the workers
        are released, so no round of the next epoch completes short."""
        if self.left:
            self._send(node, MsgType.JOIN_DONE, {"error": "; ".join(self.left.values())})
            return
        self.joined[node.rank] = node
        self.last_joined = node.rank
        # per tensor, the most rounds any worker pushed: where every worker continues
        if isinstance(rounds, dict):
            for name, rnd in list(rounds.items())[:100_000]:
                if isinstance(name, str) and type(rnd) is int and rnd >= 0:
                    self.join_rounds[name] = max(rnd, self.join_rounds.get(name, 0))
        workers = self._workers()
        log.info("scheduler: worker rank %d joined (%d of %d)", node.rank, len(self.joined),
                 len(workers))
        if len(self.joined) < len(workers):
            self._members()
            return
        self.joined_all = dict(self.joined)
        self.joined = {}
        self._members()
        servers = {n.route.ident for n in self.nodes.values()
                   if n.role is Role.SERVER and not n.lost}
        self._release_acks = servers
        self._release_epoch = self.members_epoch
        if not servers:
            self._release_join()

    def _members_ack(self, node: NodeInfo, epoch: int) -> None:
        if self._release_acks is None or epoch != self._release_epoch:
            return
        self._release_acks.discard(node.route.ident)
        if not self._release_acks:
            self._release_join()

    def _release_join(self) -> None:
        self._release_acks = None
        for n in self.joined_all.values():
            self._send(n, MsgType.JOIN_DONE, {"last": self.last_joined,
                                              "rounds": self.join_rounds})
        self.joined_all = {}
        self.join_rounds = {}

    def _left(self, node: NodeInfo) -> None:
        """A worker finished without join() while others may still push: rounds it has not
        pushed can never complete. The servers fail them with PeerLeftError naming it; ranks
        waiting in join() get the same error."""
        why = (f"worker rank {node.rank} on {node.host} (pid {node.pid}) has finished (its "
               "script ended without join()) and pushes no more")
        log.info("scheduler: %s while other workers still run", why)
        self.left[node.rank // self.cfg.cluster.local_size] = why
        self._members()
        for n in list(self.joined.values()):
            self._send(n, MsgType.JOIN_DONE, {"error": why})
        self.joined = {}
        # nothing needs it any more: it leaves now instead of waiting in shutdown() for the
        # others (which fail with PeerLeftError naming it, or finish: it pushed their rounds)
        self._send(node, MsgType.SHUTDOWN)

    def _worker_finished(self, node: NodeInfo) -> None:
        node.finished = True
        if self.elastic:
            self._elastic_finished(node)
            return
        workers = [n for n in self.nodes.values() if n.role is Role.WORKER]
        if (not self.cfg.server.enable_async and node.rank not in self.joined
                and not all(n.finished for n in workers)):
            self._left(node)
        log.info("scheduler: %s finished (%d of %d)", node.describe(),
                 sum(n.finished for n in workers), len(workers))
        if all(n.finished for n in workers):
            self._shutdown_all()

    def _lose(self, lost: NodeInfo, why: str, *, tell_lost: bool = False,
              code: int = EXIT_PEER_FAILED) -> None:
        if self.elastic and lost.role is Role.WORKER and not tell_lost and self.phase == "running":
            self._lose_elastic(lost, why)
            return
        if (self.cfg.server.enable_async and lost.role is Role.WORKER and not tell_lost
                and self.phase == "running"):
            self._lose_async_worker(lost, why)
            return
        log.error("scheduler: %s", why)
        for n in self.nodes.values():
            if (n is not lost or tell_lost) and not n.finished:
                self._send(n, MsgType.PEER_LOST, {**lost.public(), "reason": why})
        lost.finished = True
        self._finish(code, why)  # EXIT_PEER_FAILED: bpslaunch blames the lost node

    def _lose_async_worker(self, lost: NodeInfo, why: str) -> None:
        """Asynchronous mode: no round waits for every worker, so a lost worker does not stop
        the others. It is logged, left out of barriers, and the job ends (exit status 1, naming
        it) when the surviving workers finish."""
        log.error("scheduler: %s; asynchronous mode: the other workers continue", why)
        lost.lost = lost.finished = True
        self.lost_workers.append(why)
        for group, seq in list(self.barriers):
            self._check_barrier(group, seq)
        workers = [n for n in self.nodes.values() if n.role is Role.WORKER]
        if all(n.lost for n in workers):
            self._lose_all(why)
        elif all(n.finished for n in workers):
            self._shutdown_all()

    def _lose_all(self, why: str) -> None:
        for n in self.nodes.values():
            if not n.finished:
                self._send(n, MsgType.PEER_LOST, {"role": "worker", "rank": -1, "host": "",
                                                  "port": 0, "pid": 0, "reason": why})
        self._finish(EXIT_PEER_FAILED, why)

    def _shutdown_all(self) -> None:
        for n in self.nodes.values():
            if not n.lost:
                self._send(n, MsgType.SHUTDOWN)
        if self.lost_workers:
            self._finish(EXIT_PEER_FAILED, "; ".join(self.lost_workers))
        else:
            self._finish(0)

    # -- elastic membership epochs (BYTEPS_ELASTIC, docs/elastic.md) ---------------------------
    # An epoch is a set of workers with dense ranks 0..size-1. A change (a worker lost, one that
    # registers, a worker asking for a new epoch with READY) begins the next epoch: its workers
    # are told (EPOCH, the key the new epoch: they raise MembershipChangedError and rejoin with
    # READY); once every survivor is ready and at least BYTEPS_ELASTIC_MIN_WORKERS are in, the
    # servers reset to it (EPOCH, acknowledged) and only then the workers start it (EPOCH_START,
    # a joiner its NODE_TABLE), so no push of the new epoch meets a server of the old one.
    def _describe_worker(self, n: NodeInfo) -> str:
        return f"worker rank {n.rank} on {n.host} (pid {n.pid})"

    def _register_joiner(self, route: Route, info: NodeInfo) -> None:
        # beyond BYTEPS_ELASTIC_MAX_WORKERS a joiner waits for a free place (a worker lost
        # but not detected yet still holds one)
        self.nodes[route.ident] = info
        self.pending.append(info)
        log.info("scheduler: worker on %s (pid %d) registered to join the running elastic job "
                 "(%d waiting)", info.host, info.pid, len(self.pending))
        if self.forming is not None:
            self._check_formed()
            return
        live = [m for m in self.members if not m.lost and not m.finished]
        if not live:
            self._begin_epoch([])
            return
        if len(live) >= self.capacity:
            log.warning("scheduler: the job runs BYTEPS_ELASTIC_MAX_WORKERS=%d workers; the "
                        "new one waits for a place", self.capacity)
            return
        for m in live:  # check_membership() raises MembershipChangedError(added=...)
            self._send(m, MsgType.EPOCH, {"lost": [], "added": len(self.pending)},
                       key=self.epoch)

    def _begin_epoch(self, lost: list[str], *, initial: bool = False) -> None:
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
            for m in self.members:
                if not m.lost and not m.finished:
                    self._send(m, MsgType.EPOCH, {"lost": self.forming["lost"],
                                                  "added": len(self.pending)}, key=self.epoch)
        self._check_formed()

    def _ready(self, node: NodeInfo, epoch: int) -> None:
        if node.lost or node.finished or node in self.pending:
            return
        if node not in self.members:
            self._reject(node.route, "bad field", "READY from a worker of no epoch")
            return
        if self.forming is None:
            if epoch < self.epoch:
                return  # a late READY of an epoch formed since
            self._begin_epoch([])  # the worker saw joiners waiting: admit them now
        assert self.forming is not None
        self.forming["ready"].add(node.route.ident)
        self._check_formed()

    def _check_formed(self) -> None:
        f = self.forming
        if f is None or f["acks"] is not None:
            return
        survivors = [m for m in self.members if not m.lost and not m.finished]
        if any(m.route.ident not in f["ready"] for m in survivors):
            return
        admitted = self.pending[:max(0, self.capacity - len(survivors))]
        size = len(survivors) + len(admitted)
        if size < self.cfg.elastic.min_workers * self.cfg.cluster.local_size:
            if self.below_since is None:
                self.below_since = time.monotonic()
                log.warning("scheduler: %d worker(s) left, below BYTEPS_ELASTIC_MIN_WORKERS=%d; "
                            "waiting up to %g s (BYTEPS_ELASTIC_TIMEOUT_SECONDS) for workers "
                            "to join", size, self.cfg.elastic.min_workers,
                            self.cfg.elastic.timeout)
            return
        self.below_since = None
        f["members"] = survivors + admitted
        self.pending = self.pending[len(admitted):]
        if self.pending:
            log.warning("scheduler: %d worker(s) wait for a place (BYTEPS_ELASTIC_MAX_WORKERS="
                        "%d)", len(self.pending), self.capacity)
        servers = [n for n in self.nodes.values() if n.role is Role.SERVER and not n.lost]
        f["acks"] = {n.route.ident for n in servers}
        for n in servers:
            self._send(n, MsgType.EPOCH, {"size": len(f["members"])}, key=f["epoch"])
        if not servers:
            self._start_epoch()

    def _epoch_ack(self, node: NodeInfo, epoch: int) -> None:
        f = self.forming
        if f is None or f["acks"] is None or epoch != f["epoch"]:
            return
        f["acks"].discard(node.route.ident)
        if not f["acks"]:
            self._start_epoch()

    def _start_epoch(self) -> None:
        f, self.forming = self.forming, None
        assert f is not None
        members = [m for m in f["members"] if not m.lost and not m.finished]
        for r, m in enumerate(members):
            m.rank = r
        self.members = members
        self.barriers.clear()
        self.left = {}   # the servers' reset cleared theirs
        now = time.monotonic()
        self.epoch_log.append((f["epoch"], len(members), now))
        base = epoch_round_base(f["epoch"])
        for m in members:
            m.last_seen = now
            meta = {"epoch": f["epoch"], "rank": m.rank, "size": len(members),
                    "round_base": base, "lost": f["lost"]}
            if f["initial"] or m.route.ident not in f["ready"]:  # a joiner: its node table
                self._send(m, MsgType.NODE_TABLE, {
                    **meta, "nodes": self.table, "num_worker": len(members),
                    "local_size": self.cfg.cluster.local_size})
            else:
                self._send(m, MsgType.EPOCH_START, meta)
        log.warning("scheduler: membership epoch %d formed: %d worker(s)", f["epoch"],
                    len(members))
        if self.pending and len(members) < self.capacity:  # registered while the servers
            for m in members:                                 # reset: admitted at the next
                self._send(m, MsgType.EPOCH, {"lost": [], "added": len(self.pending)},
                           key=self.epoch)

    def _lose_elastic(self, lost: NodeInfo, why: str) -> None:
        if lost.lost or lost.finished:
            return
        lost.lost = lost.finished = True
        if lost in self.pending:
            self.pending.remove(lost)
            log.warning("scheduler: %s (it had not joined yet)", why)
            self._check_formed()
            return
        name = why if f"pid {lost.pid}" in why else f"{self._describe_worker(lost)}: {why}"
        self.elastic_lost.append(name)
        log.warning("scheduler: %s; elastic job: the other workers continue", why)
        self._begin_epoch([name])

    def _elastic_finished(self, node: NodeInfo) -> None:
        """A worker finished its script: the job ends when every member has."""
        live = [m for m in self.members if not m.lost]
        log.info("scheduler: %s finished (%d of %d)", node.describe(),
                 sum(m.finished for m in live), len(live))
        if node in live and not all(m.finished for m in live) and self.forming is None:
            self._left(node)  # rounds it never pushes fail with PeerLeftError, as without
        if all(m.finished for m in live):
            for n in self.pending:
                n.finished = True
            self._shutdown_all()
        elif self.forming is not None:
            self._check_formed()

    def _elastic_tick(self, now: float) -> bool:
        """Fail the job once it has been below the minimum for too long (True: it did)."""
        e = self.cfg.elastic
        if self.below_since is None or now - self.below_since <= e.timeout:
            return False
        lost = self.elastic_lost
        size = sum(1 for m in self.members if not m.lost and not m.finished) + len(self.pending)
        why = (f"TooFewWorkersError: {size} worker(s) for {now - self.below_since:.1f} s, below "
               f"BYTEPS_ELASTIC_MIN_WORKERS={e.min_workers} (BYTEPS_ELASTIC_TIMEOUT_SECONDS="
               f"{e.timeout:g}); lost: {'; '.join(lost) if lost else 'none'}")
        log.error("scheduler: %s", why)
        for n in self.nodes.values():
            if n.lost:
                continue
            if n.role is Role.WORKER:
                self._send(n, MsgType.ERROR, {"kind": ERR_TOO_FEW, "message": why,
                                              "lost": lost, "min_workers": e.min_workers})
            else:
                self._send(n, MsgType.SHUTDOWN)
        self._finish(1, why)
        return True

    def _tick(self) -> None:
        now = time.monotonic()
        t = self.cfg.timeouts
        if self.phase == "register":
            if now - self.started > t.register_timeout:
                why = self._registration_report()
                log.error("scheduler: %s", why)
                for n in self.nodes.values():
                    self._send(n, MsgType.ERROR, {"kind": ERR_REGISTER, "message": why})
                self._finish(1, why)
            elif now >= self._next_wait_report:
                waited = self._next_wait_report - self.started
                log.log(wait_level(self.cfg, waited), "scheduler: waiting for nodes to register "
                        "at %s for %g s (gives up after %g s, BYTEPS_REGISTER_TIMEOUT_SECONDS): "
                        "%s joined; not seen yet: %s", self.address, waited,
                        t.register_timeout, self._counts(), self._not_seen())
                while self._next_wait_report <= now:
                    self._next_wait_report += WAIT_REPORT_INTERVAL_S
            return
        if self.phase != "running":
            return
        if self.elastic and self._elastic_tick(now):
            return
        for n in list(self.nodes.values()):
            self._send(n, MsgType.HEARTBEAT)  # finished workers still wait for SHUTDOWN
            if n.finished or n.lost:
                continue
            silent = now - n.last_seen
            if silent > 2 * t.heartbeat_interval:
                self.heartbeats_missed += 1  # metrics
            if silent > t.heartbeat_timeout:
                self._lose(n, f"lost {n.describe()}: no heartbeat for {silent:.1f} s "
                              f"(BYTEPS_HEARTBEAT_TIMEOUT_SECONDS={t.heartbeat_timeout:g})")
                return

    def _not_seen(self, most: int = 20) -> str:
        """The nodes registration still waits for: the DMLC_WORKER_IDs (with BYTEPS_LOCAL_RANK
        when several per machine) while every worker so far gave one, else how many workers;
        how many servers (they have no id before the table)."""
        c = self.cfg.cluster
        workers = [n for n in self.nodes.values() if n.role is Role.WORKER]
        parts = []
        if len(workers) < self.expected[Role.WORKER]:
            if all(n.worker_id is not None for n in workers):
                seen = {(n.worker_id, n.local_rank) for n in workers}
                ids = [(w, lr) for w in range(c.num_worker) for lr in range(c.local_size)
                       if (w, lr) not in seen]
                names = [str(w) if c.local_size == 1 else f"{w}.{lr}" for w, lr in ids]
                shown = ", ".join(names[:most]) + (f", ... ({len(names) - most} more)"
                                                   if len(names) > most else "")
                parts.append(f"worker ids [{shown}] (DMLC_WORKER_ID)" if c.local_size == 1 else
                             f"worker processes [{shown}] (DMLC_WORKER_ID.BYTEPS_LOCAL_RANK)")
            else:
                missing = self.expected[Role.WORKER] - len(workers)
                parts.append(f"{missing} worker{'s' if missing > 1 else ''}")
        servers = sum(n.role is Role.SERVER for n in self.nodes.values())
        if servers < self.expected[Role.SERVER]:
            missing = self.expected[Role.SERVER] - servers
            parts.append(f"{missing} server{'s' if missing > 1 else ''}")
        return ", ".join(parts)

    def _registration_report(self) -> str:
        c = self.cfg.cluster
        workers = [n for n in self.nodes.values() if n.role is Role.WORKER]
        missing = sorted(set(range(c.num_worker)) - {n.worker_id for n in workers
                                                     if n.worker_id is not None})
        hint = (f" (worker ids not seen: {missing})"
                if missing and len(workers) < self.expected[Role.WORKER] else "")
        return (f"registration timed out after {self.cfg.timeouts.register_timeout:g} s: "
                f"{self._counts()} joined{hint}; check that every node runs with "
                f"DMLC_PS_ROOT_URI={c.root_uri} DMLC_PS_ROOT_PORT={c.root_port} and the same "
                f"DMLC_NUM_WORKER/DMLC_NUM_SERVER")

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        self.ep.start()
        from byteps_like.metrics import serve_role  # metrics: BYTEPS_METRICS_PORT
        self.metrics = serve_role("scheduler", 0, self.cfg, self._metrics_sample, "node_role")

    def _metrics_sample(self) -> dict:
        """What the Prometheus endpoint reports (byteps_like/metrics.py)."""
        nodes: dict[str, int] = {"worker": 0, "server": 0}
        for n in list(self.nodes.values()):
            if not n.lost:
                nodes[n.role.label] = nodes.get(n.role.label, 0) + 1
        return {"byteps_scheduler_nodes": nodes,
                "byteps_scheduler_heartbeats_missed": self.heartbeats_missed}

    def wait(self, timeout: float | None = None) -> int | None:
        self._done.wait(timeout)
        return self.exit_code

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        self.closed_cleanly = self.ep.close(linger=2.0)
        self.rejections.flush()  # the last window's, which no later rejection will write

    def run(self) -> int:
        log.info("scheduler: listening on %s for %s", self.address, self._counts())
        self.start()
        try:
            self._done.wait()
        finally:
            self.close()
        return self.exit_code or 0


class _BadField(ValueError):
    """A message field of the wrong type or out of range (answered with an ERROR)."""


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


_MISSING = object()


def _field(meta: dict, name: str, kind: type, default=_MISSING, *, lo: int | None = None,
           hi: int | None = None, what: str | None = None):
    """meta[name], checked: exactly of ``kind`` (a JSON number that is a bool or a float is
    no int), within [lo, hi]; ``default`` when absent (None allowed only as the default)."""
    value = meta.get(name, default)
    label = f"{name} ({what})" if what else name
    if value is _MISSING:
        raise _BadField(f"{label} is missing")
    if value is None and default is None:
        return None
    if type(value) is not kind:
        raise _BadField(f"{label} {_show(value)} is not {'an' if kind is int else 'a'} "
                        f"{'integer' if kind is int else 'string'}")
    if isinstance(value, int) and (lo is not None and value < lo or hi is not None and value > hi):
        span = f"{lo if lo is not None else '-inf'}..{hi if hi is not None else 'inf'}"
        raise _BadField(f"{label}={value} is out of range ({span})")
    return value


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
