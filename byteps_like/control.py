"""The node side of the control plane: register with the scheduler, receive the node table,
barriers, heartbeats, and the scheduler's notices (a lost peer, shutdown).

Used by servers and workers alike. Messages from the scheduler arrive on the owner's endpoint
I/O thread and are handed to :meth:`ControlClient.handle`.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .config import Config, resolve_root
from .errors import (
    CommTimeoutError,
    ConfigError,
    PeerLeftError,
    PeerLostError,
    RemoteError,
    TooFewWorkersError,
)
from .transport import Endpoint, Route
from .wire import ERR_TOO_FEW, Header, Message, MsgType, Role, encode, job_hash

if TYPE_CHECKING:
    from collections.abc import Mapping

log = logging.getLogger("byteps_like.control")
SCHEDULER = Route(peer="scheduler")
#: While registration waits (a node for the node table, the scheduler for the nodes), what is
#: awaited is logged this often: at INFO while the job may still be starting (peers importing
#: their frameworks), at WARNING, which the default log level shows, from
#: BYTEPS_STARTUP_WARN_SECONDS on (:func:`wait_level`).
WAIT_REPORT_INTERVAL_S = 5.0


def wait_level(cfg: Config, waited: float) -> int:
    """The level of a registration wait report after ``waited`` seconds: INFO while peers may
    merely be starting, WARNING from ``BYTEPS_STARTUP_WARN_SECONDS`` on."""
    return logging.INFO if waited < cfg.timeouts.startup_warn else logging.WARNING


@dataclass(frozen=True)
class PeerInfo:
    role: str
    rank: int
    host: str
    port: int
    pid: int
    data_port: int = 0   # a server's native data plane (0: none)

    def describe(self) -> str:
        return f"{self.role} rank {self.rank} on {self.host} (pid {self.pid})"


def node_host(cfg: Config) -> str:
    """The address this node advertises: DMLC_NODE_HOST, else loopback for a loopback
    scheduler, else the address this host uses to reach the scheduler."""
    if cfg.cluster.node_host:
        return cfg.cluster.node_host
    uri = cfg.cluster.root_uri
    if uri in ("localhost",) or uri.startswith("127."):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((uri, cfg.cluster.root_port))  # no packet is sent for UDP connect
            return s.getsockname()[0]
    except OSError:
        return socket.gethostname()


class ControlClient:
    def __init__(self, cfg: Config, ep: Endpoint, role: Role, *, port: int = 0,
                 data_port: int = 0, on_fatal: Callable[[BaseException], None] | None = None,
                 on_shutdown: Callable[[], None] | None = None,
                 on_members: Callable[[dict], None] | None = None,
                 on_epoch: Callable[[int, dict], None] | None = None,
                 on_epoch_start: Callable[[dict], None] | None = None):
        self.cfg = cfg
        self.ep = ep
        self.role = role
        self.port = port
        self.data_port = data_port
        self.host = node_host(cfg)
        self.job = job_hash(cfg.cluster.job_id)
        self.rank = -1
        self.peers: list[PeerInfo] = []
        self.fatal: BaseException | None = None
        self.on_fatal = on_fatal
        self.on_shutdown = on_shutdown
        self.on_members = on_members   # servers: who has joined / left (join())
        # elastic jobs: servers reset to a new epoch (they acknowledge with ack_epoch); workers
        # hear that their epoch is superseded / workers wait to join, and that the next started
        self.on_epoch = on_epoch
        self.on_epoch_start = on_epoch_start
        # losing a server (worker/failover.py): a server is lost and its keys move (FAILOVER,
        # the failover's number and meta), every worker has re-seeded them (RESUME)
        self.on_failover: Callable[[int, dict], None] | None = None
        self.on_resume: Callable[[int, dict], None] | None = None
        self.early: list = []      # elastic notices that came before a handler was set
        self.interrupt: BaseException | None = None  # elastic: the epoch ended; waits raise it
        self.epoch = 0             # elastic: the epoch of the node table (0: not elastic)
        self.size = 0              # elastic: workers in that epoch
        self.round_base = 0
        self._join_done = threading.Event()
        self._join_result: dict = {}
        self._table = threading.Event()
        self._shutdown = threading.Event()
        self._barrier_seq = 0
        self._barriers: dict[int, threading.Event] = {}
        # a restarted scheduler (issue 37): what this node registered with, the groups of its
        # barriers in flight, whether it has finished, and what it tells a new scheduler of the
        # job's state (worker/failover.py: the failover's number, the servers gone)
        self._register_meta: dict = {}
        self._barrier_groups: dict[int, str] = {}
        self._finished = False
        self._downs_seen = 0
        self.rejoin_state: dict = {}
        self._lock = threading.Lock()
        self._last_heard = time.monotonic()
        self._heartbeats = False
        self._link = _Link()       # the scheduler's connection, as ZeroMQ's monitor sees it

    # -- sending ----------------------------------------------------------------------------
    def _send(self, mtype: MsgType, meta: dict | None = None, key: int = 0) -> None:
        hdr = Header(mtype, role=self.role, rank=self.rank, job=self.job, key=key)
        self.ep.send(SCHEDULER, encode(hdr, meta=meta))

    def connect_and_register(self, address: str | None = None) -> None:
        """Connect, register, and block until the node table arrives."""
        c = self.cfg.cluster
        if address is None:
            resolve_root(self.cfg)  # an unresolvable host fails now, not after the timeout
            address = f"tcp://{c.root_uri}:{c.root_port}"
        if address.startswith("tcp://") and self.ep.watch_link("scheduler", self._link.event):
            self.ep.add_timer(_LINK_CHECK_S, lambda: self._check_link(address))
        self.ep.connect("scheduler", address)
        # pgid: bpslaunch starts every process in a session of its own, so a process whose
        # launcher saw it exit is found by it even behind a wrapper script (tell_exited);
        # num_worker/num_server: the scheduler refuses a node told another job size
        meta = {"role": self.role.label, "host": self.host, "port": self.port,
                "data_port": self.data_port, "pid": os.getpid(), "pgid": os.getpgid(0),
                "worker_id": c.worker_id, "local_rank": c.local_rank, "local_size": c.local_size,
                "server_id": c.server_id,
                "num_worker": c.num_worker, "num_server": c.num_server}
        self._register_meta = meta
        self._send(MsgType.REGISTER, meta)
        self.ep.add_timer(self.cfg.timeouts.heartbeat_interval, self._tick)
        t = self.cfg.timeouts.register_timeout
        started = time.monotonic()
        deadline = started + t
        next_report = started + WAIT_REPORT_INTERVAL_S
        # elastic: a worker joining a running job waits for the next commit, however long,
        # while the scheduler's heartbeats say it is alive and has it on its list
        joining = self.cfg.elastic.enabled and self.role is Role.WORKER
        while not self._table.wait(0.1):
            if self.fatal is not None:
                raise self.fatal
            if self._shutdown.is_set():
                raise PeerLeftError(f"{self.role.label} on {self.host}: the job ended before "
                                    "this node was admitted into it")
            now = time.monotonic()
            if joining and self._last_heard > started:
                deadline = max(deadline, self._last_heard + self.cfg.timeouts.heartbeat_timeout)
                if now >= next_report:
                    log.log(wait_level(self.cfg, now - started),
                            "worker on %s: registered with the running elastic job; waiting "
                            "%.0f s so far to be admitted (at the workers' next commit)",
                            self.host, now - started)
                    next_report += WAIT_REPORT_INTERVAL_S
            elif now >= next_report:  # also when a stalled process wakes past the deadline:
                waited = next_report - started  # the report still comes before the error
                if wait_level(self.cfg, waited) < logging.WARNING:  # peers may be importing
                    log.info("%s on %s: waiting for the node table from the scheduler at %s "
                             "(%g s so far): the other nodes may still be starting",
                             self.role.label, self.host, address, waited)
                else:
                    log.warning("%s on %s: no node table yet from the scheduler at %s after %g "
                                "s (gives up after %g s, BYTEPS_REGISTER_TIMEOUT_SECONDS): the "
                                "scheduler is not running or not reachable at that address, "
                                "or it is still waiting for other nodes to register",
                                self.role.label, self.host, address, waited, t)
                next_report += WAIT_REPORT_INTERVAL_S
            if now > deadline:
                raise CommTimeoutError(
                    f"{self.role.label} on {self.host}: no node table from the scheduler at "
                    f"{address} within {t:g} s (BYTEPS_REGISTER_TIMEOUT_SECONDS); is the "
                    "scheduler running, and have all workers and servers been started?")
        if self.fatal is not None:
            raise self.fatal

    def barrier(self, group: str = "all", timeout: float | None = None) -> None:
        with self._lock:
            seq = self._barrier_seq
            self._barrier_seq += 1
            ev = self._barriers[seq] = threading.Event()
            self._barrier_groups[seq] = group
        self._send(MsgType.BARRIER, {"group": group}, key=seq)
        timeout = self.cfg.timeouts.op_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while not ev.wait(0.05):
            self.check()
            if time.monotonic() > deadline:
                raise CommTimeoutError(f"barrier of group {group!r} (#{seq}) did not complete "
                                       f"within {timeout:g} s")
        self.check()

    def finish(self, timeout: float) -> bool:
        """Tell the scheduler this worker is done; wait for the job's shutdown notice."""
        self._finished = True
        self._send(MsgType.FINISH)
        deadline = time.monotonic() + timeout
        while not self._shutdown.wait(0.05):
            self.check()  # a peer (or the scheduler) lost meanwhile: raise, do not wait it out
            if time.monotonic() > deadline:
                return False
        return True

    def join(self, rounds: dict[str, int],
             progress_every: float = 30.0) -> tuple[int, dict[str, int]]:
        """Tell the scheduler this worker is out of data (with the rounds its tensors are at);
        block until every worker has joined. Returns the rank that joined last and, per tensor,
        the most rounds any worker pushed; raises PeerLeftError when a rank finished without
        joining (the join can never complete), or the job's fatal error."""
        self._join_done.clear()
        self._send(MsgType.JOIN, {"rounds": rounds})
        t0 = time.monotonic()
        next_note = t0 + progress_every
        while not self._join_done.wait(0.05):
            self.check()
            if time.monotonic() >= next_note:
                next_note += progress_every
                log.info("%s %d: join() waiting %.0f s for the other workers to join",
                         self.role.label, self.rank, time.monotonic() - t0)
        self.check()
        res = self._join_result
        if "error" in res:
            raise PeerLeftError(f"{self.role.label} {self.rank}: join() cannot complete: "
                                f"{res['error']}")
        rounds_out = res.get("rounds") or {}
        return int(res.get("last", -1)), {str(k): int(v) for k, v in rounds_out.items()}

    def ack_epoch(self, epoch: int) -> None:
        """Elastic jobs (servers): the reset to ``epoch`` is applied."""
        self._send(MsgType.EPOCH, key=epoch)

    def ready(self, epoch: int) -> None:
        """Elastic jobs (workers): this worker left its epoch and is ready for the next one
        (``epoch``: the newest it has heard of)."""
        self._send(MsgType.READY, key=epoch)

    def reset_barriers(self) -> None:
        """Elastic jobs: barriers are numbered per epoch; those waiting are abandoned."""
        with self._lock:
            self._barrier_seq = 0
            self._barriers.clear()

    def send_stall(self, stalls: list[dict]) -> None:
        """Report stalled synchronous rounds to the scheduler (the stall inspector)."""
        self._send(MsgType.STALL, {"stalls": stalls})

    def seeded(self, failover: int, meta: dict | None = None) -> None:
        """Losing a server (workers): this worker's moved keys are seeded on their new
        servers; its pushes of them wait for RESUME. (Servers in asynchronous mode: they took
        the lost server's snapshot; ``meta`` says how old it was, for the workers.)"""
        self._send(MsgType.SEEDED, meta, key=failover)

    def stream_lost(self, server: int, why: str) -> None:
        """Losing a server (workers): this worker's data streams to server rank ``server``
        closed; the scheduler declares it lost at once, not after the heartbeat timeout."""
        self._send(MsgType.STREAM_LOST, {"server": server, "reason": why[:1000]})

    def scheduler_lost(self) -> BaseException | None:
        """The job's fatal error when the scheduler's connection is down now, else None. A
        server that lost the scheduler too stops after the same grace and may close its data
        streams before this node's own check has said so: what this node reports is then the
        cause, not the stream. Waits for the check (I/O thread) for what is left of the grace
        and half a second more, at most 1.5 s."""
        link, grace = self._link, self.cfg.timeouts.scheduler_lost_grace
        down = link.down_since
        if down is None:
            return None
        deadline = time.monotonic() + min(1.5, max(0.0, down + grace - time.monotonic()) + 0.5)
        while self.fatal is None and link.down_since is not None \
                and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.fatal if link.down_since is not None else None

    def abort(self, reason: str) -> None:
        self._send(MsgType.ABORT, {"reason": reason[:4000]})

    def leave(self, reason: str) -> None:
        """A server announces that it leaves (a preemption notice: server/preempt.py): the
        scheduler moves its keys to the other servers, then tells it to shut down."""
        self._send(MsgType.ABORT, {"reason": reason[:1000], "leave": True})

    def check(self) -> None:
        if self.fatal is not None:
            raise self.fatal
        if self.interrupt is not None:
            raise self.interrupt

    @property
    def shutting_down(self) -> bool:
        return self._shutdown.is_set()

    def wait_admitted(self, timeout: float) -> bool:
        """Whether the node table (and with it this node's rank) has come, waiting up to
        ``timeout`` seconds for it."""
        return self._table.wait(timeout)

    # -- receiving (I/O thread) ---------------------------------------------------------------
    def fail(self, exc: BaseException) -> None:
        """Record the job's fatal error (the first one only) and tell the owner: what the I/O
        thread does on a lost peer or the scheduler's abort notice, and what the owner's parts
        do when they see the job cannot go on (a failed service, a crashed engine)."""
        if self.fatal is None:
            self.fatal = exc
            log.error("%s", exc)
            if self.on_fatal is not None:
                self.on_fatal(exc)

    def handle(self, msg: Message) -> None:
        self._last_heard = time.monotonic()
        h, meta = msg.header, msg.meta or {}
        if h.type is MsgType.NODE_TABLE:
            if type(meta.get("epoch")) is int:  # elastic: the epoch this node starts in
                self.epoch, self.size = meta["epoch"], int(meta.get("size", 0))
                self.round_base = int(meta.get("round_base", 0))
            self.rank = int(meta["rank"])
            self.peers = [PeerInfo(str(n["role"]), int(n["rank"]), str(n["host"]), int(n["port"]),
                                   int(n.get("pid", 0)), int(n.get("data_port", 0)))
                          for n in meta["nodes"]]
            self._heartbeats = True
            self._table.set()
        elif h.type is MsgType.HEARTBEAT:
            pass
        elif h.type is MsgType.BARRIER_DONE:
            with self._lock:
                ev = self._barriers.pop(h.key, None)
                self._barrier_groups.pop(h.key, None)
            if ev is not None:
                ev.set()
        elif h.type is MsgType.PEER_LOST:
            me = (f"{self.role.label} {self.rank}" if self.rank >= 0  # no rank before the table
                  else f"{self.role.label} on {self.host}")
            pid = meta.get("pid")
            self.fail(PeerLostError(f"{me}: {meta.get('reason', 'a peer was lost')}",
                                     role=meta.get("role"), rank=meta.get("rank"),
                                     host=meta.get("host"),
                                     pid=pid if type(pid) is int and pid > 0 else None))
        elif h.type is MsgType.JOIN_DONE:
            self._join_result = dict(meta)
            self._join_done.set()
        elif h.type is MsgType.MEMBERS and self.on_members is not None:
            self.on_members(meta)
            self._send(MsgType.MEMBERS, key=h.key)  # applied (or queued before later pushes)
        elif h.type is MsgType.FAILOVER and self.on_failover is not None:
            self.on_failover(h.key, meta)
        elif h.type is MsgType.RESUME and self.on_resume is not None:
            self.on_resume(h.key, meta)
        elif h.type is MsgType.EPOCH and self.on_epoch is not None:
            self.on_epoch(h.key, meta)
        elif h.type is MsgType.EPOCH_START and self.on_epoch_start is not None:
            self.on_epoch_start(meta)
        elif h.type in (MsgType.EPOCH, MsgType.EPOCH_START) and self.role is Role.WORKER:
            self.early.append((h.type, h.key, dict(meta)))  # replayed by the elastic handler
        elif h.type is MsgType.SHUTDOWN:
            self._shutdown.set()
            if self.on_shutdown is not None:
                self.on_shutdown()
        elif h.type is MsgType.ERROR and meta.get("kind") == "rejoin":
            if self._table.is_set():  # a restarted scheduler asks the job's nodes to come back
                self._rejoin(f"{self.role.label} {self.rank}")
        elif h.type is MsgType.ERROR:
            text = str(meta.get("message", "unknown error"))
            exc: BaseException
            if meta.get("kind") == "register":
                exc = ConfigError(f"the scheduler refused this {self.role.label}: {text}")
            elif meta.get("kind") == ERR_TOO_FEW:
                lost = meta.get("lost")
                mw = meta.get("min_workers")
                exc = TooFewWorkersError(
                    f"{self.role.label} {self.rank}: {text}",
                    lost=tuple(str(x) for x in lost) if isinstance(lost, list) else (),
                    min_workers=mw if type(mw) is int else 0)
            else:
                exc = RemoteError(f"scheduler: {text}", role="scheduler", rank=0)
            self.fail(exc)
        else:
            log.warning("%s: unexpected %s from the scheduler", self.role.label, h.type.name)

    def _check_link(self, address: str) -> None:
        """The scheduler's connection (I/O thread, every _LINK_CHECK_S): closed for longer
        than BYTEPS_SCHEDULER_LOST_GRACE_SECONDS (not back: a restarted scheduler would be),
        or its address silent since the first attempt for
        BYTEPS_SCHEDULER_CONNECT_TIMEOUT_SECONDS."""
        if self._shutdown.is_set() or self.fatal is not None:
            return
        t, link, now = self.cfg.timeouts, self._link, time.monotonic()
        me = (f"{self.role.label} {self.rank}" if self.rank >= 0
              else f"{self.role.label} on {self.host}")
        if link.up and link.downs > self._downs_seen:
            self._downs_seen = link.downs
            if self._table.is_set():  # back: a restarted scheduler, maybe: register again
                self._rejoin(me)
        if link.down_since is not None and now - link.down_since >= t.scheduler_lost_grace:
            self.fail(PeerLostError(
                f"{me}: lost the scheduler at {address}: its connection closed (the scheduler "
                f"exited or was killed) and was not back within {t.scheduler_lost_grace:g} s "
                "(BYTEPS_SCHEDULER_LOST_GRACE_SECONDS)", role="scheduler", rank=0,
                host=self.cfg.cluster.root_uri))
        elif (not link.answered and t.scheduler_connect_timeout > 0
              and now - link.since >= t.scheduler_connect_timeout):
            # raised by connect_and_register, which waits for it: said once, not logged too
            self.fatal = (CommTimeoutError(
                f"{me}: no answer from the scheduler's address {address} within "
                f"{t.scheduler_connect_timeout:g} s (BYTEPS_SCHEDULER_CONNECT_TIMEOUT_SECONDS): "
                "no connection and no refusal, so the address is not reachable from this "
                "host; check DMLC_PS_ROOT_URI and DMLC_PS_ROOT_PORT, and that no firewall "
                "drops the port"))

    def _rejoin(self, me: str) -> None:
        """The scheduler's connection came back after it closed (I/O thread): a scheduler
        restarted at the same address knows nothing of the job, so this node registers again
        with its rank and what it knows of the job (the servers lost), then asks again for
        its barriers in flight and says again that it finished. A scheduler that never went
        away ignores the registration of a node it has (scheduler/registration.py)."""
        log.warning("%s: the scheduler's connection is back; registering again (a restarted "
                    "scheduler rebuilds the job's membership from its nodes)", me)
        self._last_heard = time.monotonic()
        self._send(MsgType.REGISTER, {**self._register_meta,
                                      "rejoin": {"rank": self.rank, **self.rejoin_state}})
        with self._lock:
            pending = dict(self._barrier_groups)
        for seq, group in sorted(pending.items()):
            self._send(MsgType.BARRIER, {"group": group}, key=seq)
        if self._finished:
            self._send(MsgType.FINISH)

    def _tick(self) -> None:
        if self._shutdown.is_set() or self.fatal is not None:
            return
        self._send(MsgType.HEARTBEAT)
        if not self._heartbeats:
            return
        silent = time.monotonic() - self._last_heard
        limit = self.cfg.timeouts.heartbeat_timeout
        if silent > limit:
            c = self.cfg.cluster
            self.fail(PeerLostError(
                f"{self.role.label} {self.rank}: lost the scheduler at {c.root_uri}:{c.root_port}: "
                f"no heartbeat for {silent:.1f} s (BYTEPS_HEARTBEAT_TIMEOUT_SECONDS={limit:g})",
                role="scheduler", rank=0, host=c.root_uri))


#: How often the scheduler's connection is looked at (ControlClient._check_link).
_LINK_CHECK_S = 0.1


class _Link:
    """What ZeroMQ's socket monitor said of a node's connection to the scheduler (events on
    the I/O thread, read by its timer): whether the address ever answered (a connection or a
    refusal), and since when an established connection is down (None: it is not)."""

    def __init__(self) -> None:
        self.since = time.monotonic()
        self.answered = False
        self.up = False
        self.down_since: float | None = None
        self.downs = 0   # times an established connection closed

    def event(self, what: str) -> None:
        if what != "down":
            self.answered = True
        if what == "up":
            self.up, self.down_since = True, None
        elif what == "down" and self.up:
            self.up, self.down_since = False, time.monotonic()
            self.downs += 1


def tell_exited(cfg: Config, exited: Mapping[str, object], *, linger: float = 2.0) -> None:
    """Tell the job's scheduler that a process of the job has exited: what bpslaunch does the
    moment a worker or server it started exits non-zero (launcher/notify.py), so that the
    scheduler declares it lost at once instead of after ``BYTEPS_HEARTBEAT_TIMEOUT_SECONDS``.

    ``exited``: ``role``, ``pid`` (the process bpslaunch started: the node's pid or its process
    group), ``host`` (the address that node advertises, :func:`node_host` of its
    configuration), ``how`` (``killed by SIGKILL``, ``exit status 3``) and ``name`` (the
    launcher's name for it). The notice travels like every control message: from a ZeroMQ
    endpoint with the job's CURVE keys when it has a secret, with the job's tag, and is
    validated field by field by the scheduler. Fire and forget: flushed for at most ``linger``
    seconds (a scheduler that is gone already is no error)."""
    import zmq

    from .transport import make_endpoint
    c = cfg.cluster
    ctx = zmq.Context()
    ep = make_endpoint("launcher", cfg, context=ctx, data_plane=False)
    try:
        ep.start()
        ep.connect("scheduler", f"tcp://{c.root_uri}:{c.root_port}")
        role = Role.SERVER if exited.get("role") == "server" else Role.WORKER
        ep.send(SCHEDULER, encode(Header(MsgType.EXITED, role=role, rank=-1,
                                         job=job_hash(c.job_id)), meta=dict(exited)))
    finally:
        stopped = ep.close(linger=linger)
        if stopped:
            ctx.term()
