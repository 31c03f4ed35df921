"""The processes of the benchmarks: jobs planned by bpslaunch's recipe, started and watched by
its supervisor, their results collected.

- :func:`local_job` is ``bpslaunch --local``'s plan (:func:`byteps_like.launcher.plan.
  local_cluster_plan`): a scheduler, servers and worker machines of ``local_size`` processes
  each, with the environment bpslaunch gives them. The emulated cluster (``bench cluster``)
  uses the same plan and only moves each process into its host's network namespace.
- :class:`Job` starts children through :class:`byteps_like.launcher.procs.Supervisor`: no shell,
  each child in its own session (a process group that is stopped as a whole: SIGTERM, then
  SIGKILL), bound to die with the driver (``PR_SET_PDEATHSIG``). Their output is not echoed: it
  is kept for :func:`collect` (stdout) and for the failure report (the tail of stderr), and the
  ``progress:`` lines of one child are relayed to the driver's stderr. Leaving the ``with``
  block stops every child still running.
- The planned children of :meth:`Job.start` share the machine's cores as bpslaunch's do
  (:func:`share`, launcher/shares.py): workers on CPU sets of their own, servers and the
  scheduler floating over every usable CPU, and OMP_NUM_THREADS and the like, so a benchmark
  measures what a ``bpslaunch --local`` job runs; ``BYTEPS_THREAD_SHARE=0`` turns it off.
- Every child finds the same ``byteps_like`` as this process: :func:`child_env` puts the folder
  that holds the imported package first on ``PYTHONPATH``, and :func:`role_argv` gives the
  command of a scheduler or server that works in an editable install, a wheel and a bare source
  tree alike (see :mod:`._role`).
"""
from __future__ import annotations

import collections
import io
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TextIO, cast

from ._role import locate as _locate_role
from ._role import plan as _role_plan
from .report import RESULT_TAG

# A bare source tree keeps the launcher in <root>/launcher: map it into byteps_like first.
_locate_role("launcher")
from byteps_like.launcher.plan import (  # noqa: E402
    ChildSpec,
    LocalCluster,
    child_environment,
    local_cluster_plan,
)
from byteps_like.launcher.procs import (  # noqa: E402
    Child,
    Supervisor,
    describe_returncode,
    free_port,
)
from byteps_like.launcher.shares import ShareSettings, share_host, sharing  # noqa: E402

#: Seconds a child's process group gets between SIGTERM and SIGKILL.
KILL_AFTER_S = 3.0
#: stderr lines of each child kept for the failure report.
TAIL_LINES = 60


class ChildFailed(RuntimeError):
    """A child exited non-zero, died, or the phase ran past its timeout."""


# ------------------------------------------------------------------------- finding byteps_like
def package_root() -> str:
    """The folder that holds the imported ``byteps_like`` package (its parent folder)."""
    import byteps_like
    return os.path.dirname(os.path.dirname(os.path.abspath(byteps_like.__file__)))


def _automatic_paths() -> set[str]:
    """Folders every child of this interpreter has on sys.path anyway (site-packages): putting
    one of them on PYTHONPATH would move it before the standard library."""
    import site
    paths = list(getattr(site, "getsitepackages", lambda: [])())
    try:
        paths.append(site.getusersitepackages())
    except (AttributeError, TypeError):
        pass
    return {os.path.realpath(p) for p in paths if p}


def child_env(env: Mapping[str, str], *, always: bool = False) -> dict[str, str]:
    """``env`` with the folder of the imported byteps_like first on ``PYTHONPATH`` (before what
    was there), unless it is a site-packages folder a child of this interpreter searches anyway
    (on PYTHONPATH it would come before the standard library). ``always``: add it regardless,
    for a child that runs another interpreter."""
    out = dict(env)
    root = package_root()
    if not always and os.path.realpath(root) in _automatic_paths():
        return out
    old = [p for p in out.get("PYTHONPATH", "").split(os.pathsep) if p]
    out["PYTHONPATH"] = os.pathsep.join([root] + [p for p in old
                                                  if os.path.realpath(p)
                                                  != os.path.realpath(root)])
    return out


def role_argv(role: str, python: str | None = None) -> list[str]:
    """``python -m byteps_like.<role>`` (scheduler, server, launcher) of the imported
    byteps_like, from any install: through :mod:`._role`, which maps ``<root>/<role>`` into the
    namespace first, where the plain import would not find that tree's role (a bare source tree,
    or one that shadows an install of another checkout)."""
    py = python or sys.executable
    how, _where = _role_plan(role)
    if how == "import":
        return [py, "-m", f"byteps_like.{role}"]
    return [py, "-m", "byteps_like.bench._role", role]   # "missing": it says why and exits 2


def base_env(*, drop: Sequence[str] = ("DMLC_",), force_distributed: bool = True
             ) -> dict[str, str]:
    """The driver's environment without any job description of its own (variables starting with
    one of ``drop``); BYTEPS_* tuning the user set is kept, so it can be benchmarked.
    ``force_distributed``: BYTEPS_FORCE_DISTRIBUTED=1, so that a job of one worker machine still
    goes through the servers, the path these benchmarks measure."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(tuple(drop))}
    env["PYTHONUNBUFFERED"] = "1"
    if force_distributed:
        env["BYTEPS_FORCE_DISTRIBUTED"] = "1"
    return env


# ------------------------------------------------------------------------------------ the plan
def local_job(command: Sequence[str], port: int, *, workers: int = 1, servers: int = 1,
              local_size: int = 1, host: str = "127.0.0.1", python: str | None = None
              ) -> list[ChildSpec]:
    """``bpslaunch --local``'s plan of a job: the scheduler on ``port``, ``servers`` servers
    and ``workers`` worker machines of ``local_size`` processes running ``command``; the roles
    run with ``python`` (default: this interpreter) from this byteps_like (:func:`role_argv`)."""
    return local_cluster_plan(LocalCluster(
        command=tuple(command), port=port, workers=workers, servers=servers,
        local_size=local_size, host=host,
        role_argv={r: role_argv(r, python) for r in ("scheduler", "server")}))


def on_hosts(specs: list[ChildSpec], cluster) -> list[ChildSpec]:
    """A :func:`local_job` plan spread over the hosts of ``cluster`` (a
    :class:`.netns.NetnsCluster`, or None: the plan as it is): the scheduler and worker i on host
    ``w{i}``, server j on ``s{j}``, each process advertising its host's address."""
    if cluster is None:
        return specs
    placed = []
    for spec in specs:
        host = ("w0" if spec.role == "scheduler" else f"s{spec.rank}" if spec.role == "server"
                else f"w{spec.rank}")
        placed.append(replace(spec, argv=tuple(cluster.exec_argv(host, list(spec.argv))),
                              env={**spec.env, "DMLC_NODE_HOST": cluster.ip(host)}))
    return placed


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports, each free a moment ago (:func:`free_port`)."""
    ports: list[int] = []
    while len(ports) < n:
        port = free_port(host)
        if port not in ports:
            ports.append(port)
    return ports


def share(specs: list[ChildSpec], env: Mapping[str, str]) -> tuple[list[ChildSpec], list[str]]:
    """The processes of one machine get their shares of its cores, exactly as bpslaunch gives
    them (launcher/shares.py: CPU sets, OMP_NUM_THREADS and the like, unless the environment
    sets them or BYTEPS_THREAD_SHARE=0), and the plan lines bpslaunch would print. An
    environment that is not a valid configuration is left to the children to report."""
    if not sharing(specs):
        return specs, []
    import warnings

    from byteps_like.config import load
    from byteps_like.errors import ConfigError
    from byteps_like.launcher.binding import probe
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfg = load(env=child_environment(env, specs[0].env))
    except ConfigError:
        return specs, []
    if not cfg.placement.thread_share:
        return specs, []
    return share_host(specs, probe(env), env, ShareSettings.from_config(cfg))


# ---------------------------------------------------------------------------------- processes
@dataclass(eq=False)
class Proc:
    """One child of a :class:`Job`, and the output it printed so far."""

    name: str
    service: bool   # a scheduler or server: may be stopped once the main children are done
    child: Child | None = None
    out: list[str] = field(default_factory=list)
    err: collections.deque = field(
        default_factory=lambda: collections.deque(maxlen=TAIL_LINES))
    progress: list[str] = field(default_factory=list)
    relayed: int = 0

    @property
    def pid(self) -> int:
        assert self.child is not None
        return self.child.pid

    def poll(self) -> int | None:
        """The exit status, or None while it runs."""
        assert self.child is not None
        return self.child.popen.poll()

    def drain(self, timeout: float = 5.0) -> None:
        """Wait (bounded) until the output of an exited child has been read to the end."""
        if self.child is not None and self.poll() is not None:
            self.child.join_pumps(timeout)

    def stdout(self) -> str:
        self.drain()
        return "".join(line + "\n" for line in self.out)

    def stderr_tail(self, nchars: int = 4000) -> str:
        text = "\n".join(self.err)
        return ("..." if len(text) > nchars else "") + text[-nchars:]


class _Lines(io.TextIOBase):
    """The supervisor's stdout or stderr: each ``[name] text`` line goes to that child's Proc."""

    def __init__(self, job: Job, which: str):
        self._job, self._which = job, which

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        for line in s.splitlines():
            name, sep, text = line[1:].partition("] ")
            proc = self._job.procs.get(name) if line.startswith("[") and sep else None
            if proc is None:
                continue
            if self._which == "stdout":
                proc.out.append(text)
            else:
                proc.err.append(text)
                if text.startswith("progress: "):
                    proc.progress.append(text[len("progress: "):])
        return len(s)


class Job:
    """A set of child processes that live and die together (``with Job(label) as job:``).

    Leaving the block stops every child still running (its whole process group: SIGTERM, then
    SIGKILL) and removes :attr:`dir`, a private folder for files the children exchange."""

    def __init__(self, label: str = "bench", *, log: TextIO | None = None,
                 kill_after: float = KILL_AFTER_S):
        self.label = label
        self.log = log if log is not None else sys.stderr
        self.procs: dict[str, Proc] = {}
        #: children a run kills on purpose (bench sparse --kill): their death is no failure
        self.may_die: set[str] = set()
        self.sup = Supervisor(stdout=cast(TextIO, _Lines(self, "stdout")),
                              stderr=cast(TextIO, _Lines(self, "stderr")), kill_after=kill_after)
        self._tmp = tempfile.TemporaryDirectory(prefix=f"bpsl-{label}-")
        self.dir = self._tmp.name
        #: The launch plan of the last :meth:`start` (one line per process, as bpslaunch
        #: prints it; empty when the machine was not shared).
        self.plan: list[str] = []

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- starting ------------------------------------------------------------------------------
    def spawn(self, name: str, argv: Sequence[str], env: Mapping[str, str], *,
              service: bool = False, cpus: Iterable[int] | None = None) -> Proc:
        """Start ``argv`` with ``env`` (this byteps_like first on its PYTHONPATH), bound to
        ``cpus`` when given."""
        if name in self.procs:
            raise ValueError(f"{self.label}: two children named {name!r}")
        proc = self.procs[name] = Proc(name, service)
        try:
            proc.child = self.sup.start(name, argv, child_env(env), cpus=cpus)
        except BaseException:
            del self.procs[name]
            raise
        return proc

    def start(self, specs: Iterable[ChildSpec], env: Mapping[str, str]) -> list[Proc]:
        """Start planned children (:func:`local_job`) in order, each with ``env`` changed as
        its spec says; returns the workers. They share this machine's cores as bpslaunch's
        children do (:func:`share`)."""
        specs, self.plan = share(list(specs), env)
        procs = [self.spawn(spec.name, spec.launch_argv, child_environment(env, spec.env),
                            service=spec.role != "worker",
                            cpus=None if spec.binding is None else spec.binding.affinity)
                 for spec in specs]
        return [p for p in procs if not p.service]

    # -- waiting ------------------------------------------------------------------------------
    def read_when_written(self, proc: Proc, path: str, what: str,
                          timeout: float = 60.0) -> str:
        """The text ``proc`` writes to ``path`` once it has started (a port file, say),
        stripped. ChildFailed naming ``what`` when ``proc`` exits first or takes more than
        ``timeout`` seconds."""
        end = time.monotonic() + timeout
        while not os.path.exists(path):
            if time.monotonic() > end:
                raise ChildFailed(self.report(f"{what} did not start"))
            if proc.poll() is not None:
                raise ChildFailed(self.report(f"{what} exited"))
            time.sleep(0.05)
        with open(path, encoding="ascii") as f:
            return f.read().strip()

    def report(self, why: str) -> str:
        """``why`` and every child's state and stderr tail."""
        lines = [f"{self.label}: {why}"]
        for p in self.procs.values():
            p.drain(0.5)
            rc = p.poll()
            state = "running" if rc is None else describe_returncode(rc)
            lines.append(f"--- {p.name} (pid {p.pid}, {state}) stderr tail ---")
            lines.append(p.stderr_tail().rstrip() or "(empty)")
        return "\n".join(lines)

    def _relay(self, proc: Proc | None, prefix: str) -> None:
        if proc is None:
            return
        new = proc.progress[proc.relayed:]
        proc.relayed += len(new)
        for text in new:
            print(f"{prefix}{text}", file=self.log, flush=True)

    def _check(self, procs: Iterable[Proc]) -> None:
        for p in procs:
            rc = p.poll()
            if rc is not None and rc != 0 and not (rc < 0 and p.name in self.may_die):
                raise ChildFailed(self.report(f"{p.name} exited with status {rc}" if rc > 0
                                              else f"{p.name} was {describe_returncode(rc)}"))

    def wait(self, timeout: float, *, relay: Proc | None = None, relay_prefix: str = "",
             service_grace: float = 15.0) -> None:
        """Wait until every main child (not a service) has exited 0, then give the services
        ``service_grace`` seconds to exit 0 on their own.

        Raises :class:`ChildFailed` (with every child's stderr tail) as soon as any child exits
        non-zero or ``timeout`` passes. A service may exit 0 before the main children (a
        scheduler ends the job once every worker has said it is finished). The caller's
        ``with`` block then stops whatever is left."""
        deadline = time.monotonic() + timeout
        mains = [p for p in self.procs.values() if not p.service]
        services = [p for p in self.procs.values() if p.service]
        while True:
            self._relay(relay, relay_prefix)
            self._check(self.procs.values())
            if all(p.poll() is not None for p in mains):
                break
            if time.monotonic() > deadline:
                raise ChildFailed(self.report(f"timed out after {timeout:g} s (watchdog); "
                                              "killing every child"))
            time.sleep(0.05)
        for p in mains:
            p.drain()
        self._relay(relay, relay_prefix)
        end = min(deadline, time.monotonic() + service_grace)
        while any(p.poll() is None for p in services):
            if time.monotonic() > end:
                late = [p.name for p in services if p.poll() is None]
                print(f"{self.label}: {', '.join(late)} still running {service_grace:g} s after "
                      "the workers finished; killing", file=self.log, flush=True)
                return
            time.sleep(0.05)
        self._check(services)

    # -- cleanup --------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop every child tree still alive and remove :attr:`dir`. A SIGTERM, SIGINT or SIGHUP
        that arrives meanwhile waits until this is done."""
        held = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
        old = signal.pthread_sigmask(signal.SIG_BLOCK, held)
        try:
            self.sup.close()
            self._tmp.cleanup()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)


def collect(procs: Iterable[Proc], what: str) -> list[dict]:
    """The ``BENCH_RESULT`` object (:func:`.report.emit`) each child printed last."""
    results = []
    for p in procs:
        lines = [ln for ln in p.stdout().splitlines() if ln.startswith(RESULT_TAG)]
        if not lines:
            raise ChildFailed(f"{what}: {p.name} exited 0 but printed no result\n"
                              f"--- stderr tail ---\n{p.stderr_tail()}")
        results.append(json.loads(lines[-1][len(RESULT_TAG):]))
    return results


# ------------------------------------------------------------------------------ timed cases
@dataclass(frozen=True)
class Case:
    """One tensor size and how often it is run."""
    nbytes: int
    repeats: int
    warmup: int

    def encode(self) -> str:
        return f"{self.nbytes}:{self.repeats}:{self.warmup}"

    @classmethod
    def decode(cls, text: str) -> Case:
        a, b, c = (int(x) for x in text.split(":"))
        return cls(a, b, c)


def encode_cases(cases: Sequence[Case]) -> str:
    """``--cases`` of a child: ``nbytes:repeats:warmup,...``."""
    return ",".join(c.encode() for c in cases)


def decode_cases(text: str) -> list[Case]:
    return [Case.decode(t) for t in text.split(",") if t]


def slowest_median(per_worker: list[dict], key: str | int,
                   field_name: str = "times") -> tuple[float, list[float]]:
    """The slowest worker's time of each repetition, and their median."""
    series = [w[field_name][str(key)] for w in per_worker]
    slowest = [max(rep) for rep in zip(*series)]
    return statistics.median(slowest), slowest


def summarize(per_worker: list[dict], case: Case) -> dict:
    """Max over workers per repetition, then the median over repetitions."""
    med, slowest = slowest_median(per_worker, case.nbytes)
    return {"median_s": med, "gbps": case.nbytes / med / 1e9, "slowest_per_repeat_s": slowest,
            "per_worker_s": [w["times"][str(case.nbytes)] for w in per_worker]}
