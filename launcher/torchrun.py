"""Joining a torchrun job: what local rank 0 of each node starts, and its supervision.

Under torchrun (``torchrun --standalone``, ``--nnodes N --rdzv-endpoint ...``, ``python -m
torch.distributed.run``, or any launcher that sets RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT) a script that calls ``init()`` with no
byteps_like job configured joins one job of WORLD_SIZE workers. :func:`byteps_like.config.load`
reads torchrun's variables into the cluster settings (``Config.torchrun``); the worker's
rendezvous (``byteps_like.worker.membership``) calls :func:`join` before it registers, and
local rank 0 of each node starts that node's services here:

* node rank 0 (GROUP_RANK 0, the host of MASTER_ADDR): the scheduler, on a port every node
  derives alike from MASTER_PORT (byteps_like.config.torchrun_scheduler_port; DMLC_PS_ROOT_PORT
  when set), bound to loopback when the job has one node;
* every node: ``BYTEPS_TORCHRUN_SERVERS_PER_NODE`` servers (colocated, BytePS's default layout;
  1 per node when there are several nodes, none on one node, where push_pull stays on it).

They run under the launcher's :class:`~.procs.Supervisor`, driven by one thread of local rank 0
that lives until they are gone: each in its own process group, output prefixed
(``[scheduler] ...``), SIGTERM by the kernel the moment local rank 0 dies (``PR_SET_PDEATHSIG``,
SIGKILL of it included), and at local rank 0's exit they are waited for (they end with the job)
and stopped if they outlive it. A service that fails while the job runs fails this worker at
once (``on_failure``), not after the registration timeout.

Standard library, byteps_like.config and byteps_like.errors only, like the rest of the launcher.
"""
from __future__ import annotations

import atexit
import ipaddress
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from byteps_like.config import TORCHRUN_PORT_SOURCE, TORCHRUN_SECRET_SOURCE, Config
from byteps_like.errors import ConfigError

from .plan import ChildSpec, child_environment, role_argv
from .procs import Supervisor, describe_returncode

#: How long local rank 0 waits for the scheduler's port to be free before giving up: the
#: previous attempt's scheduler (a torchrun restart) may still be exiting.
PORT_WAIT_S = 5.0
#: After the job is over (this worker finished or failed), how long the services may take to
#: exit on their own before they are stopped; a floor to the configured shutdown timeout.
EXIT_WAIT_MIN_S = 5.0
#: Seconds between the reminders that local rank 0 waits for the job's other workers.
WAIT_NOTE_S = 30.0


def service_specs(cfg: Config) -> list[ChildSpec]:
    """What local rank 0 of this node starts (pure): the scheduler on node rank 0, then this
    node's servers, with the job's settings as the worker's configuration resolved them."""
    job = cfg.torchrun
    if job is None:
        raise ValueError("not a torchrun job")
    c = cfg.cluster
    service: dict[str, str | None] = {
        "DMLC_NUM_WORKER": str(c.num_worker), "DMLC_NUM_SERVER": str(c.num_server),
        "DMLC_PS_ROOT_URI": c.root_uri, "DMLC_PS_ROOT_PORT": str(c.root_port),
        "BYTEPS_LOCAL_SIZE": str(c.local_size), "BYTEPS_JOB_ID": c.job_id,
        # a scheduler or server has no worker id or local rank
        "DMLC_WORKER_ID": None, "BYTEPS_LOCAL_RANK": None,
    }
    if job.nnodes == 1 and not c.node_host:
        service["DMLC_NODE_HOST"] = c.root_uri
    if makes_secret(cfg):   # the job's one-time secret (share_secret)
        service["BYTEPS_AUTH_SECRET_FILE"] = cfg.auth.secret_file
    specs = []
    if job.node_rank == 0:
        specs.append(ChildSpec("scheduler", None, role_argv("scheduler"),
                               {**service, "DMLC_ROLE": "scheduler"}))
    first = job.node_rank * job.servers_per_node
    specs += [ChildSpec("server", first + i, role_argv("server"),
                        {**service, "DMLC_ROLE": "server"})
              for i in range(job.servers_per_node)]
    return specs


def describe(cfg: Config) -> str:
    """The line global rank 0 prints at start: the job it joined and what of torchrun does not
    apply to it."""
    job = cfg.torchrun
    assert job is not None
    c = cfg.cluster
    servers = (f"{job.servers_per_node} server(s) per node" if job.servers_per_node
               else "no server (one node: push_pull stays on it)")
    port = _port_origin(cfg)
    restart = (f"; this is torchrun's restart {job.restart_count} of {job.max_restarts}, a "
               "new job from the start" if job.restart_count else "")
    return (f"byteps_like: joined the torchrun job as one byteps_like job of {job.world_size} "
            f"workers ({job.nnodes} node(s) x {job.local_world_size} processes; the scheduler "
            f"on node 0 at {c.root_uri}:{c.root_port} ({port}), {servers}, started by each "
            f"node's local rank 0){restart}; {_auth_note(cfg)}. Not applied: torchrun's "
            "elasticity (--nnodes MIN:MAX, --max-restarts): a lost process fails the job, and "
            "a restart runs the script again as a new job from its first step")


def _auth_note(cfg: Config) -> str:
    """How the job authenticates its peers, for describe (said once, by global rank 0)."""
    if makes_secret(cfg):
        return "authenticated with a one-time secret of the job (BYTEPS_AUTH_OFF=1 turns it off)"
    if cfg.auth.secret or cfg.auth.secret_file:
        return "authenticated with the secret BYTEPS_AUTH_SECRET(_FILE) gives"
    if cfg.auth.off:
        return ("authentication OFF (BYTEPS_AUTH_OFF=1): any process that reaches the job's "
                "ports can join it and push into it")
    return "authenticated"  # (a job of several nodes without a secret is refused at start)


def makes_secret(cfg: Config) -> bool:
    """Whether this single-node torchrun job makes its own one-time secret (config.py)."""
    return cfg.source("auth.secret_file") == TORCHRUN_SECRET_SOURCE


def share_secret(cfg: Config, wait: float) -> None:
    """A single-node torchrun job's one-time secret: local rank 0 writes it (256 random bits,
    a file of mode 0600 in a directory of mode 0700 of this user's, written whole and
    renamed into place, removed at its exit); the other local ranks wait up to ``wait``
    seconds for it. Raises ConfigError when the directory is not this user's own or the
    secret does not come."""
    if not makes_secret(cfg):
        return
    path = cfg.auth.secret_file
    folder = os.path.dirname(path)
    if cfg.torchrun is not None and cfg.torchrun.local_rank == 0:
        import secrets
        os.makedirs(folder, mode=0o700, exist_ok=True)
        _check_private(folder)
        tmp = f"{path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, secrets.token_hex(32).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        atexit.register(_remove, path)
        return
    deadline = time.monotonic() + wait
    while True:
        try:
            if os.path.getsize(path) > 0:
                _check_private(folder)
                return
        except OSError:
            pass
        if time.monotonic() >= deadline:
            raise ConfigError(f"this torchrun job's one-time secret did not appear at {path} "
                              f"within {wait:g} s (local rank 0 writes it when it joins); "
                              "set BYTEPS_AUTH_SECRET for every process, or BYTEPS_AUTH_OFF=1 "
                              "to run unauthenticated")
        time.sleep(0.05)


def _check_private(folder: str) -> None:
    import stat
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ConfigError(f"{folder}, where this torchrun job keeps its one-time secret, is not "
                          "a directory of this user's that only it can read (mode 0700); "
                          "remove it, or set BYTEPS_AUTH_SECRET for every process")


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def join(cfg: Config, *, on_failure: Callable[[str], None],
         job_over: Callable[[], bool], out=None) -> NodeServices | None:
    """Called by every worker of a torchrun job before it registers: global rank 0 says what
    job this is; local rank 0 starts this node's services and returns them (None elsewhere).
    ``on_failure(message)``: a service failed while the job runs. ``job_over()``: at exit,
    whether this worker is done with the job (finished or failed), so that the services may be
    stopped when they outlive it. Raises ConfigError (the scheduler's port is taken) or OSError
    (a service cannot be started)."""
    job = cfg.torchrun
    if job is None:
        raise ValueError("not a torchrun job")
    out = sys.stderr if out is None else out
    if job.rank == 0:
        print(describe(cfg), file=out, flush=True)
    share_secret(cfg, cfg.timeouts.register_timeout)
    if job.local_rank != 0:
        return None
    specs = service_specs(cfg)
    if not specs:
        return None
    if job.node_rank == 0:
        wait_for_port(cfg)
    services = NodeServices(specs, dict(os.environ), on_failure=on_failure,
                            job_over=job_over,
                            exit_wait=max(EXIT_WAIT_MIN_S, cfg.timeouts.shutdown_timeout),
                            out=out)
    services.start()
    return services


def wait_for_port(cfg: Config, wait: float = PORT_WAIT_S) -> None:
    """Fail with one clear line now when the scheduler's port is held, rather than the
    scheduler failing later; a port held by a previous attempt's scheduler that is exiting is
    waited for ``wait`` seconds. Bound like ZeroMQ binds it (SO_REUSEADDR: TIME_WAIT is fine)."""
    c = cfg.cluster
    try:
        ipaddress.ip_address(c.root_uri)
        host = c.root_uri
    except ValueError:  # the scheduler binds every interface for a host name
        host = "0.0.0.0"
    deadline = time.monotonic() + wait
    while True:
        try:
            with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET,
                               socket.SOCK_STREAM) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((host, c.root_port))
            return
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise ConfigError(
                    f"the scheduler of this torchrun job cannot listen on {host}:{c.root_port} "
                    f"({_port_origin(cfg)}): {exc.strerror or exc}; set DMLC_PS_ROOT_PORT to a "
                    "free port for every node of the job (docs/launcher.md, \"torchrun\")"
                ) from None
            time.sleep(0.2)


def _port_origin(cfg: Config) -> str:
    source = cfg.source("cluster.root_port")
    return ("derived from MASTER_PORT" if source == TORCHRUN_PORT_SOURCE
            else f"DMLC_PS_ROOT_PORT, {source}")


class NodeServices:
    """The scheduler and servers local rank 0 started, under a Supervisor that one daemon
    thread drives from start to end (the children are forked by that thread, so their
    ``PR_SET_PDEATHSIG`` fires only when the process dies, not when the thread that called
    ``init()`` does)."""

    def __init__(self, specs: Sequence[ChildSpec], base_env: Mapping[str, str], *,
                 on_failure: Callable[[str], None], job_over: Callable[[], bool],
                 exit_wait: float, out=None):
        self.specs = tuple(specs)
        self.base_env = dict(base_env)
        self.on_failure = on_failure
        self.job_over = job_over
        self.exit_wait = exit_wait
        self.out = sys.stderr if out is None else out
        self.pids: list[int] = []
        self._started = threading.Event()
        self._stop = threading.Event()
        self._start_error: BaseException | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._drive, name="bps-torchrun-services",
                                        daemon=True)

    def start(self) -> None:
        """Start the services; returns once they run (raises what prevented one from
        starting). Registers the exit hook that waits for them."""
        self._thread.start()
        self._started.wait()
        if self._start_error is not None:
            self._thread.join()
            raise self._start_error
        atexit.register(self.close)  # after the Supervisor's own: runs before it

    def _drive(self) -> None:
        sup = Supervisor(stderr=self.out)
        try:
            try:
                for spec in self.specs:
                    # misspelt settings: said by local rank 0's worker, not again by these
                    env = {**child_environment(self.base_env, spec.env),
                           "BYTEPS_REPORT_UNKNOWN_SETTINGS": "0"}
                    child = sup.start(spec.name, spec.argv, env, role=spec.role,
                                      rank=spec.rank, log_name=spec.log_name)
                    self.pids.append(child.pid)
            except BaseException as exc:  # noqa: BLE001 - handed to start()'s caller
                self._start_error = exc
                self._started.set()
                sup.terminate_all()
                return
            self._started.set()
            while sup.running():
                for child in sup.wait_any(0.2):
                    if child.returncode and not self._stopping:
                        tail = " | ".join(line.strip() for line in child.stderr_tail
                                          if line.strip())[-600:]
                        self.on_failure(
                            f"{child.describe()}, which local rank 0 started for the torchrun "
                            f"job, {describe_returncode(child.returncode)}"
                            + (f"; last stderr: {tail}" if tail else ""))
                if self._stop.is_set():
                    self._stopping = True
                    killed = sup.terminate_all()
                    if killed:
                        self._say(f"sent SIGKILL to {', '.join(c.describe() for c in killed)}: "
                                  "still running after SIGTERM")
                    break
        finally:
            sup.close()

    def _say(self, text: str) -> None:
        try:
            print(f"byteps_like: {text}", file=self.out, flush=True)
        except (OSError, ValueError):
            pass

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        """At local rank 0's exit: the services end with the job, so wait for them (the job's
        other workers may still run: the scheduler and servers serve them); once this worker is
        done with the job they get ``exit_wait`` seconds, then are stopped. Idempotent."""
        atexit.unregister(self.close)
        deadline = None
        next_note = time.monotonic() + WAIT_NOTE_S
        while self._thread.is_alive():
            now = time.monotonic()
            if deadline is None and self.job_over():
                deadline = now + self.exit_wait
            if deadline is not None and now >= deadline:
                names = ", ".join(s.name for s in self.specs)
                self._say(f"stopping {names} (still running {self.exit_wait:g} s after this "
                          "worker left the job)")
                self.stop()
                return
            if deadline is None and now >= next_note:
                next_note += WAIT_NOTE_S
                self._say("local rank 0 keeps running the services it started (scheduler, "
                          "servers) until the job's other workers finish")
            self._thread.join(0.1)

    def stop(self) -> None:
        """Stop the services now (SIGTERM, then SIGKILL) and wait until they are gone."""
        self._stopping = True
        self._stop.set()
        self._thread.join()


__all__ = ["NodeServices", "describe", "join", "makes_secret", "service_specs", "share_secret",
           "wait_for_port"]
