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

from ..config import Config
from ..transport import Route, make_endpoint
from ..wire import (ERR_PROTOCOL, ERR_REGISTER, Header, MsgType, Role, decode, encode,
                    job_hash)
from ..errors import ProtocolError

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

    def describe(self) -> str:
        return f"{self.role.label} rank {self.rank} on {self.host} (pid {self.pid})"

    def public(self) -> dict:
        return {"role": self.role.label, "rank": self.rank, "host": self.host, "port": self.port,
                "pid": self.pid}


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
        self.ep = make_endpoint("scheduler", cfg, context=context)
        self.address = self.ep.bind(address or f"tcp://{_bind_host(c.root_uri)}:{c.root_port}")
        self.nodes: dict[bytes, NodeInfo] = {}
        self.phase = "register"
        self.started = time.monotonic()
        self.barriers: dict[tuple[str, int], set[bytes]] = {}
        self.exit_code: int | None = None
        self.failure: str | None = None
        self._done = threading.Event()
        self.ep.on_message = self._on_message
        self.ep.add_timer(cfg.timeouts.heartbeat_interval, self._tick)

    # -- helpers ----------------------------------------------------------------------------
    def _send(self, node_or_route, mtype: MsgType, meta: dict | None = None, key: int = 0) -> None:
        route = node_or_route.route if isinstance(node_or_route, NodeInfo) else node_or_route
        hdr = Header(mtype, role=Role.SCHEDULER, rank=0, job=self.job, key=key)
        self.ep.send(route, encode(hdr, meta=meta))

    def _finish(self, code: int, why: str | None = None) -> None:
        if self.exit_code is None:
            self.exit_code = code
            self.failure = why
            self.phase = "done"
            self._done.set()

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
            log.warning("scheduler: rejected a malformed message from %s: %s", route, exc)
            self._send(route, MsgType.ERROR, {"kind": ERR_PROTOCOL, "message": str(exc)})
            return
        h = msg.header
        if h.job != self.job:
            self._send(route, MsgType.ERROR, {"kind": ERR_REGISTER, "message":
                       f"this scheduler serves job {self.cfg.cluster.job_id!r}; the peer belongs "
                       "to another job (check BYTEPS_JOB_ID and DMLC_PS_ROOT_PORT)"})
            return
        node = self.nodes.get(route.ident)
        if node is not None:
            node.last_seen = time.monotonic()
        if h.type is MsgType.REGISTER:
            self._register(route, msg.meta or {}, h)
        elif node is None:
            self._send(route, MsgType.ERROR, {"kind": ERR_REGISTER,
                       "message": f"{h.type.name} from an unregistered node"})
        elif h.type is MsgType.HEARTBEAT:
            pass
        elif h.type is MsgType.BARRIER:
            self._barrier(node, (msg.meta or {}).get("group", "all"), h.key)
        elif h.type is MsgType.FINISH:
            self._worker_finished(node)
        elif h.type is MsgType.ABORT:
            reason = (msg.meta or {}).get("reason", "aborted")
            self._lose(node, f"{node.describe()} failed: {reason}")
        else:
            log.warning("scheduler: unexpected %s from %s", h.type.name, node.describe())

    def _register(self, route: Route, meta: dict, h: Header) -> None:
        try:
            role = Role.parse(str(meta["role"]))
            info = NodeInfo(route, role, str(meta["host"]), int(meta.get("port", 0)),
                            int(meta.get("pid", 0)),
                            None if meta.get("worker_id") is None else int(meta["worker_id"]),
                            int(meta.get("local_rank", 0)))
            local_size = int(meta.get("local_size", self.cfg.cluster.local_size))
        except (KeyError, ValueError, TypeError) as exc:
            self._send(route, MsgType.ERROR, {"kind": ERR_REGISTER,
                       "message": f"bad registration: {exc}"})
            return
        err = None
        if self.phase != "register":
            err = "registration is closed: every node of this job has already joined"
        elif role is Role.SCHEDULER:
            err = "a second scheduler tried to register"
        elif sum(n.role is role for n in self.nodes.values()) >= self.expected[role]:
            err = (f"too many {role.label}s: this job expects {self.expected[role]} "
                   f"(DMLC_NUM_WORKER x BYTEPS_LOCAL_SIZE workers, DMLC_NUM_SERVER servers)")
        elif role is Role.WORKER and local_size != self.cfg.cluster.local_size:
            err = (f"worker on {info.host} has BYTEPS_LOCAL_SIZE={local_size}, the scheduler "
                   f"expects {self.cfg.cluster.local_size}")
        elif role is Role.WORKER and info.worker_id is not None:
            if info.worker_id >= self.cfg.cluster.num_worker:
                err = (f"DMLC_WORKER_ID={info.worker_id} is out of range for "
                       f"DMLC_NUM_WORKER={self.cfg.cluster.num_worker}")
            for n in self.nodes.values():
                if (n.role is Role.WORKER and n.worker_id == info.worker_id
                        and n.local_rank == info.local_rank):
                    err = (f"DMLC_WORKER_ID={info.worker_id} BYTEPS_LOCAL_RANK={info.local_rank} "
                           f"is already taken by {n.host} pid {n.pid}")
        if err:
            log.error("scheduler: refused %s from %s: %s", role.label, info.host, err)
            self._send(route, MsgType.ERROR, {"kind": ERR_REGISTER, "message": err})
            return
        self.nodes[route.ident] = info
        log.info("scheduler: %s joined from %s:%d (%s)", role.label, info.host, info.port,
                 self._counts())
        if all(sum(n.role is r for n in self.nodes.values()) == k
               for r, k in self.expected.items()):
            self._publish_table()

    def _publish_table(self) -> None:
        assign_ranks(list(self.nodes.values()), self.cfg.cluster.local_size)
        me = {"role": "scheduler", "rank": 0, "host": self.cfg.cluster.root_uri,
              "port": self.cfg.cluster.root_port, "pid": os.getpid()}
        table = [me] + sorted((n.public() for n in self.nodes.values()),
                              key=lambda d: (d["role"], d["rank"]))
        now = time.monotonic()
        for n in self.nodes.values():
            n.last_seen = now
            self._send(n, MsgType.NODE_TABLE, {"rank": n.rank, "nodes": table,
                       "num_worker": self.cfg.cluster.num_worker,
                       "local_size": self.cfg.cluster.local_size})
        self.phase = "running"
        log.info("scheduler: all %d nodes joined; node table sent", len(self.nodes))

    def _barrier(self, node: NodeInfo, group: str, seq: int) -> None:
        members = [n for n in self.nodes.values()
                   if group == "all" or n.role.label == group]
        arrived = self.barriers.setdefault((group, seq), set())
        arrived.add(node.route.ident)
        if len(arrived) >= len(members):
            del self.barriers[(group, seq)]
            for n in members:
                self._send(n, MsgType.BARRIER_DONE, {"group": group}, key=seq)

    def _worker_finished(self, node: NodeInfo) -> None:
        node.finished = True
        workers = [n for n in self.nodes.values() if n.role is Role.WORKER]
        log.info("scheduler: %s finished (%d of %d)", node.describe(),
                 sum(n.finished for n in workers), len(workers))
        if all(n.finished for n in workers):
            for n in self.nodes.values():
                self._send(n, MsgType.SHUTDOWN)
            self._finish(0)

    def _lose(self, lost: NodeInfo, why: str) -> None:
        log.error("scheduler: %s", why)
        for n in self.nodes.values():
            if n is not lost and not n.finished:
                self._send(n, MsgType.PEER_LOST, {**lost.public(), "reason": why})
        lost.finished = True
        self._finish(1, why)

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
            return
        if self.phase != "running":
            return
        for n in list(self.nodes.values()):
            self._send(n, MsgType.HEARTBEAT)  # finished workers still wait for SHUTDOWN
            if n.finished:
                continue
            silent = now - n.last_seen
            if silent > t.heartbeat_timeout:
                self._lose(n, f"lost {n.describe()}: no heartbeat for {silent:.1f} s "
                              f"(BYTEPS_HEARTBEAT_TIMEOUT_SECONDS={t.heartbeat_timeout:g})")
                return

    def _registration_report(self) -> str:
        c = self.cfg.cluster
        workers = [n for n in self.nodes.values() if n.role is Role.WORKER]
        missing = sorted(set(range(c.num_worker)) - {n.worker_id for n in workers
                                                     if n.worker_id is not None})
        hint = f" (worker ids not seen: {missing})" if missing and len(workers) < self.expected[Role.WORKER] else ""
        return (f"registration timed out after {self.cfg.timeouts.register_timeout:g} s: "
                f"{self._counts()} joined{hint}; check that every node runs with "
                f"DMLC_PS_ROOT_URI={c.root_uri} DMLC_PS_ROOT_PORT={c.root_port} and the same "
                f"DMLC_NUM_WORKER/DMLC_NUM_SERVER")

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        self.ep.start()

    def wait(self, timeout: float | None = None) -> int | None:
        self._done.wait(timeout)
        return self.exit_code

    def close(self) -> None:
        self.closed_cleanly = self.ep.close(linger=2.0)

    def run(self) -> int:
        log.info("scheduler: listening on %s for %s", self.address, self._counts())
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
