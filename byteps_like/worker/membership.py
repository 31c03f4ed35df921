"""Rendezvous and membership: who this worker is in the job, and its connections to the rest.

:class:`Membership` holds a worker's identity (rank, size, local rank, machine) and its
connections: the endpoint, the control client that registers with the scheduler and receives
the node table, and, with several worker processes per machine, the local root's listening
socket and the local ranks' connections to it (authenticated by a token file,
:mod:`byteps_like.transport.local_peers`). A worker has no ZeroMQ connection to a server: a
dense tensor's bytes and the server-held tables' requests travel on the native data plane's
streams (:mod:`.dataplane`, :mod:`.sparse`).
It also holds what the node table decides about the servers: their addresses, the server ranks
a reply must come from, and the assigner that spreads partitions over servers.

The job-wide operations go through it too: ``barrier``, ``join`` (the rounds the job is at),
the shutdown handshake (``finish``) and the unhandled-exception hook that aborts the job.

Who calls it: the :class:`~byteps_like.worker.runtime.Runtime` facade, in this order:
:meth:`configure` (``init``), then for a distributed job :meth:`open`, :meth:`register` and
:meth:`meet_peers` (``Runtime._connect``), and :meth:`close` last at teardown.
:mod:`.dispatch` checks incoming messages against it; :mod:`.local_reduce` sends through its
endpoint.
"""
from __future__ import annotations

import logging
import os
import re
import sys
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING

from .. import local
from ..config import Config, report_unknown_settings
from ..control import ControlClient, PeerInfo
from ..errors import CommunicationError, ConfigError, NotInitializedError, PeerLostError
from ..partition import ServerAssigner, mixed_mode_weights
from ..roles import exit_if_peer_failed
from ..transport import local_peers, make_endpoint
from ..transport.base import Drops, Endpoint
from ..wire import Role, job_hash

if TYPE_CHECKING:
    import zmq

    from ..launcher.torchrun import NodeServices
    from ..transport.base import Handler

log = logging.getLogger("byteps_like.worker")



#: How long a process that fails because of another one of its torchrun node waits for that
#: one to be gone before it exits itself (wait_for_the_cause).
CAUSE_EXIT_WAIT_S = 10.0


def brief_exception(tp: type, val: BaseException) -> str:
    """One line for an exception, for the scheduler's abort notice (which every node logs):
    ``Type: message`` when the message is one line; else the last line of it that states an
    exception (``PeerLeftError: ...`` inside TensorFlow's ``UnknownError: Graph execution
    error:`` and its graph trace), else its first line."""
    text = "".join(traceback.format_exception_only(tp, val)).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if len(lines) <= 1:
        return text
    stated = [ln for ln in lines if re.match(r"^[\w.]*(Error|Exception|Exit|Interrupt)\b[^:]*: \S",
                                             ln)]
    return (stated[-1] if stated else lines[0])[:1000]


def wait_for_the_cause(exc: BaseException | None, host: str) -> None:
    """Under torchrun: a process that fails because another process of its node failed (a
    ``PeerLostError`` naming that process's pid on this host) waits, at most CAUSE_EXIT_WAIT_S,
    until that process is gone (reaped by torchrun) before it exits. torchrun names the first
    failure it sees as the root cause, and the process that failed on its own is often still
    reporting when the others have heard of it; torchrun stops the waiting ones itself."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, PeerLostError):
            break
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    pid = getattr(exc, "pid", None)
    if exc is None or not pid or pid == os.getpid() or getattr(exc, "host", None) != host:
        return
    deadline = time.monotonic() + CAUSE_EXIT_WAIT_S
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)   # a zombie counts: torchrun has not seen it exit yet
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.05)

class Membership:
    """One worker's place in the job: its identity, connections and the job's topology."""

    def __init__(self) -> None:
        # identity: a standalone job (one process) until configure() says otherwise
        self.rank = 0
        self.size = 1
        self.local_rank = 0
        self.local_size = 1
        self.machine = 0          # this machine's index: what servers count pushes by
        self.push_rank = 0        # the rank a push carries (the machine's index)
        self.is_local_root = True
        self.single_machine = False   # one worker machine: push_pull never leaves it
        self.cfg: Config | None = None    # the job's configuration (configure())
        # connections
        self.ctx: zmq.Context | None = None
        self.ep: Endpoint | None = None
        self.control: ControlClient | None = None
        self.dropped = Drops(log, "worker")  # messages from no peer entitled to send them
        self.peers_ready = False  # the node table is in: peers' messages can be checked
        self.peers_token: str | None = None   # local root: the token file to remove at exit
        self._token = b""                     # local root: what the local ranks' ids derive from
        self.local_ids: dict[int, bytes] = {}  # local root: rank -> its connection's routing id
        # the servers, from the node table
        self.servers: list[PeerInfo] = []
        self.num_servers = 0
        self.server_ranks: list[int] = []   # what a reply's header must say, by server index
        self.assigner: ServerAssigner | None = None
        self.job = 0                        # the job's hash, in every header
        # a torchrun job: the scheduler and servers this node's local rank 0 started
        self.services: NodeServices | None = None
        self._service_failure: CommunicationError | None = None

    # -- identity --------------------------------------------------------------------------------
    def configure(self, cfg: Config) -> None:
        """The identity the configuration gives (the rank comes from the scheduler)."""
        self.cfg = cfg
        c = cfg.cluster
        self.local_rank, self.local_size = c.local_rank, c.local_size
        self.size = c.num_worker * c.local_size
        self.is_local_root = c.local_rank == 0
        if self.is_local_root:  # a misspelt setting: one line per machine, unless bpslaunch
            report_unknown_settings(cfg)   # said it already (BYTEPS_REPORT_UNKNOWN_SETTINGS)

    @property
    def config(self) -> Config:
        """The configuration of a configured worker."""
        if self.cfg is None:
            raise NotInitializedError("byteps_like is not initialised: call init() first")
        return self.cfg

    def divisor(self, contrib: int) -> int:
        """What an average of a round divides by: every rank, or only the ranks whose
        machines pushed it (``contrib``, the pushes the server summed) when some had joined."""
        return contrib * self.local_size if contrib else self.size

    @property
    def endpoint(self) -> Endpoint:
        """The endpoint of a connected worker."""
        if self.ep is None:
            raise NotInitializedError(f"worker rank {self.rank}: not connected")
        return self.ep

    @property
    def controller(self) -> ControlClient:
        """The control client of a connected worker."""
        if self.control is None:
            raise NotInitializedError(f"worker rank {self.rank}: not connected")
        return self.control

    # -- rendezvous (Runtime._connect) -------------------------------------------------------------
    def open(self, cfg: Config, *, on_message: Handler,
             on_fatal: Callable[[BaseException], None]) -> None:
        """Create the endpoint (and, on a local root of several local ranks, the listening
        socket the local ranks connect to) and the control client; start the I/O thread."""
        import zmq
        if cfg.torchrun is not None and self.services is None:
            # torchrun's job (launcher/torchrun.py): local rank 0 starts this node's services
            from ..launcher.torchrun import join
            self.services = join(cfg, on_failure=self._service_failed,
                                 job_over=self._done_with_job)
        self.ctx = zmq.Context()
        ep = self.ep = make_endpoint("worker", cfg, context=self.ctx)
        c = cfg.cluster
        port = 0
        if c.local_size > 1:
            if c.worker_id is None:
                raise ConfigError(f"BYTEPS_LOCAL_SIZE={c.local_size} needs DMLC_WORKER_ID: "
                                  "the local ranks of a machine find each other through it "
                                  "(bpslaunch sets it)")
            if self.is_local_root:  # the coordinator of this machine's local reduction
                from ..control import node_host
                local.sweep(local.segment_prefix(c.job_id, c.root_port)
                            + f"m{c.worker_id}-", c.shm_dir)
                bound = ep.bind(f"tcp://{node_host(cfg)}:0")
                port = int(bound.rsplit(":", 1)[1])
                # what the local ranks' connections prove they are this machine's with
                # (transport/local_peers.py), written before the node table can name the port
                self.peers_token = local_peers.token_path(c)
                self._token = local_peers.create_token(self.peers_token)
        self.control = ControlClient(cfg, ep, Role.WORKER, port=port, on_fatal=on_fatal)
        if self._service_failure is not None:  # a service failed before there was a client
            self.control.fail(self._service_failure)
        ep.on_message = on_message
        ep.on_error = on_fatal
        ep.start()

    def register(self) -> None:
        """Register with the scheduler and wait for the node table. A registration that
        fails because another process did (the scheduler refused another node, or was lost)
        makes an uncaught error exit with EXIT_PEER_FAILED, as it would after the table:
        bpslaunch then blames the process that failed on its own."""
        try:
            self.controller.connect_and_register()
        except CommunicationError:
            prev = sys.excepthook
            if not getattr(prev, "_bpsl_peer_exit", False):
                def hook(tp, val, tb):
                    prev(tp, val, tb)
                    exit_if_peer_failed(val)
                hook._bpsl_peer_exit = True  # type: ignore[attr-defined]
                sys.excepthook = hook
            raise

    def meet_peers(self, cfg: Config) -> None:
        """With the node table in: take the rank, connect to the local root (a local rank),
        and decide the assignment of partitions to servers."""
        control, ep = self.controller, self.endpoint
        c = cfg.cluster
        self.rank = control.rank
        # one worker machine: push_pull stays on it, no server is contacted
        self.single_machine = c.single_machine
        # the machine index is what servers count pushes by
        self.machine = self.rank // c.local_size
        self.push_rank = self.machine
        if c.local_size > 1 and not self.is_local_root:
            root = next(p for p in control.peers
                        if p.role == "worker" and p.rank == self.machine * c.local_size)
            token = local_peers.read_token(local_peers.token_path(c))
            ep.connect("localroot", f"tcp://{root.host}:{root.port}",
                       routing_id=local_peers.routing_id(token, c.local_rank))
        if c.local_size > 1 and self.is_local_root:  # the connection each local rank must use
            self.local_ids = {self.machine * c.local_size + lr:
                              local_peers.routing_id(self._token, lr)
                              for lr in range(1, c.local_size)}
        self.dropped.who = f"worker {self.rank}"
        self.peers_ready = True
        servers = sorted((p for p in control.peers if p.role == "server"),
                         key=lambda p: p.rank)
        self.servers = servers
        self.num_servers = len(servers)
        self.server_ranks = [p.rank for p in servers]
        weights = None
        if cfg.partition.mixed_mode != "off" and servers:   # BytePS mixed mode
            worker_hosts = {p.host for p in control.peers if p.role == "worker"}
            weights = mixed_mode_weights([p.host in worker_hosts for p in servers],
                                         len(worker_hosts))
        # without servers (one machine) partitions still cut tensors for the local reduction
        self.assigner = ServerAssigner(max(1, self.num_servers), weights)
        self.job = job_hash(cfg.cluster.job_id)

    def _service_failed(self, message: str) -> None:
        """A service local rank 0 started for a torchrun job failed (its supervising thread
        says so): this worker fails at once, its registration or its pending operations."""
        exc = CommunicationError(f"worker rank {self.rank}: {message}")
        self._service_failure = exc
        if self.control is not None:
            self.control.fail(exc)  # what the I/O thread does on the scheduler's abort notice

    def _done_with_job(self) -> bool:
        """At exit: whether this worker is done with the job (so the services it started may be
        stopped once they outlive it): it never connected, the job failed, or the scheduler
        sent the shutdown notice."""
        control = self.control
        return control is None or control.fatal is not None or control.shutting_down

    def install_excepthook(self, live: Callable[[], bool]) -> None:
        """An unhandled exception in the training script aborts the job (the scheduler tells
        every peer) while ``live()``, then exits as a lost peer's fault would."""
        prev = sys.excepthook

        def hook(tp, val, tb):
            if self.control is not None and live():
                self.control.abort(f"unhandled {brief_exception(tp, val)}")
                time.sleep(0.2)  # let the I/O thread flush the abort before exit
            prev(tp, val, tb)
            if self.cfg is not None and self.cfg.torchrun is not None and \
                    self.control is not None:
                wait_for_the_cause(val, self.control.host)
            exit_if_peer_failed(val)  # a lost peer's fault: exit with EXIT_PEER_FAILED
        sys.excepthook = hook

    # -- teardown ----------------------------------------------------------------------------------
    def close(self) -> None:
        """Remove the local root's token file, close the endpoint and its context."""
        self.dropped.flush()  # what was dropped since each reason's last line
        if self.peers_token is not None:
            local_peers.remove(self.peers_token)
            self.peers_token = None
        stopped = True
        if self.ep is not None:
            stopped = self.ep.close(linger=0.5)
            self.ep = None
        if self.ctx is not None:
            if stopped:
                self.ctx.term()
            else:  # never hang in shutdown: leave the context to the process exit
                log.warning("worker %d: I/O thread did not stop; skipping context teardown",
                            self.rank)
            self.ctx = None
