"""The all-or-nothing policy of one bpslaunch run (torchrun's and mpirun's rule).

``run_job`` starts the planned children and watches them:

* a child exiting non-zero or by a signal is a failure; the first one starts the grace period:
  the others get ``grace`` seconds to exit on their own (so they can print their own
  PeerLostError naming the lost node), then their process groups get SIGTERM and,
  ``kill_after`` s later, SIGKILL;
* a worker or server that fails on its own is reported to the job's scheduler at once
  (launcher/notify.py), which then fails the job (or, elastic, re-forms it) without waiting
  for the node's heartbeat timeout;
* a child exiting with ``EXIT_PEER_FAILED`` only reacted to another process's failure (the
  scheduler's abort notice, a lost peer): it is reported as such and blamed only when no
  process failed on its own. The job's cause is the first *primary* failure, whatever order the
  processes exited in (the scheduler and servers usually exit before the worker that failed),
  except that a scheduler that could not start (exit status 2: a bad setting, its port taken)
  is the cause of whatever else failed;
* when every worker has exited 0, the scheduler and servers must exit 0 by themselves within
  ``shutdown_timeout`` s, else they are stopped and that is a failure;
* ``timeout`` bounds the whole run (exit 124); SIGINT/SIGTERM/SIGHUP to the launcher stop
  everything (exit 128 + signal).

The final line on stderr always names the cause of a non-zero exit.
"""
from __future__ import annotations

import errno
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TextIO

from .notify import ExitNotices
from .plan import ChildSpec, child_environment
from .procs import (
    AffinityError,
    Child,
    Supervisor,
    describe_returncode,
    exit_status_for,
    signal_name,
)
from .report import failed_how as _failed_how
from .report import failure_report
from .report import failure_summary as _failure_summary
from .report import secondary as _secondary

EXIT_FAILURE = 1
EXIT_CANNOT_EXECUTE = 126
EXIT_NOT_FOUND = 127
EXIT_TIMEOUT = 124
#: A scheduler (or server) that exits 2 could not start: a bad setting, its port taken
#: (byteps_like/roles.py's role_main).
EXIT_SCHEDULER_CANNOT_START = 2
#: A traceback a child printed is held back (launcher/report.py) until the job fails, the child
#: exits 0, or this many seconds pass with the job still running (it went on after printing it).
HOLD_S = 2.0


@dataclass(frozen=True)
class JobSettings:
    grace: float
    shutdown_timeout: float = 30.0
    timeout: float | None = None
    log_dir: str | None = None
    kill_after: float = 5.0
    # losing a server (BYTEPS_SERVER_FAILOVER, docs/reliability.md): a server that exits is
    # reported to the scheduler, which moves its keys; the job goes on
    server_failover: bool = False
    server_restarts: int = 0   # lost servers started again, in all (their keys move back)
    scheduler_restarts: int = 0  # a lost scheduler started again, times in all (issue 37)


def run_job(specs: Sequence[ChildSpec], base_env: Mapping[str, str], settings: JobSettings, *,
            stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    """Start ``specs`` (in order), supervise them to the end and return the exit status."""
    sup = Supervisor(stdout=stdout, stderr=stderr, log_dir=settings.log_dir,
                     kill_after=settings.kill_after, hold_tracebacks=True)
    sup.install_signal_handlers()
    try:
        return _Job(sup, settings).run(specs, base_env)
    finally:
        sup.close()


class _Job:
    def __init__(self, sup: Supervisor, settings: JobSettings):
        self.sup = sup
        self.settings = settings
        self.say = lambda text: sup.sink.message(f"bpslaunch: {text}")
        self.notices = ExitNotices()
        self.envs: dict[Child, Mapping[str, str]] = {}   # what each child was started with
        self.specs: dict[Child, ChildSpec] = {}
        self.server_restarts = 0
        self.scheduler_restarts = 0
        self._over_since: float | None = None  # the job was over, lost servers still ran
        self.stopped: set[Child] = set()   # running when bpslaunch stopped the job

    def _start(self, spec: ChildSpec, env: Mapping[str, str], **kw) -> Child:
        # bpslaunch reported misspelt settings already, once for all of them (cli.py, slurm.py)
        env = {**env, "BYTEPS_REPORT_UNKNOWN_SETTINGS": "0"}
        if self.settings.scheduler_restarts and spec.role != "scheduler" \
                and "BYTEPS_SCHEDULER_LOST_GRACE_SECONDS" not in env:
            # the nodes wait for the scheduler bpslaunch starts again (it takes a second or
            # two to listen); bpslaunch itself stops the job at once when it cannot
            env["BYTEPS_SCHEDULER_LOST_GRACE_SECONDS"] = str(SCHEDULER_RESTART_GRACE_S)
        child = self.sup.start(spec.name, spec.launch_argv, env, role=spec.role, rank=spec.rank,
                               log_name=spec.log_name, **kw)
        self.envs[child] = env
        self.specs[child] = spec
        return child

    def _tell_scheduler(self, child: Child) -> None:
        """A worker or server failed on its own: its scheduler hears of it now, not after the
        heartbeat timeout (launcher/notify.py); not when it is a child here that is gone."""
        schedulers = [c for c in self.sup.children if c.role == "scheduler"]
        if schedulers and not any(c.running for c in schedulers):
            return   # (a scheduler restarted here is a new child: the old one stays listed)
        env = self.envs.get(child)
        if env is not None:
            self.notices.child_exited(child, env)

    def run(self, specs: Sequence[ChildSpec], base_env: Mapping[str, str]) -> int:
        sup, settings = self.sup, self.settings
        started_at = time.monotonic()
        deadline = None if settings.timeout is None else started_at + settings.timeout
        for spec in specs:
            if sup.signal_received is not None:
                return self._interrupted(None)
            binding = spec.binding
            try:
                self._start(spec, child_environment(base_env, spec.env),
                            cpus=None if binding is None else binding.affinity)
            except AffinityError as exc:
                return self._cannot_bind(exc)
            except OSError as exc:
                return self._cannot_start(spec, exc)

        failures: list[Child] = []  # in the order they were seen
        lost_servers: list[Child] = []  # servers lost while the job went on (failover)
        grace_deadline = shutdown_deadline = None
        exited = sup.poll_exited()
        while True:
            if sup.signal_received is not None:
                return self._interrupted(_blame(failures))
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return self._timed_out(_blame(failures))
            for child in exited:
                if child.returncode == 0:
                    sup.release_held(children=[child])   # a traceback it went on after
                if child.returncode != 0 and self._lost_server(child, failures):
                    lost_servers.append(child)
                elif child.returncode != 0 and self._restart_scheduler(child, failures):
                    pass
                elif child.returncode != 0:
                    self._tell_scheduler(child)
                    self.say(f"{child.describe()} {_failed_how(child)}: "
                             f"{describe_returncode(child.returncode)}")
                    failures.append(child)
                    gone = child.role == "scheduler" and not _secondary(child)
                    if grace_deadline is None or gone:
                        grace = self._gone_grace() if gone else settings.grace
                        grace_deadline = min(grace_deadline or now + grace, now + grace)
                        others = len(sup.running())
                        if others and grace == 0:
                            self.say(f"{child.name} {_failed_how(child)} and is not restarted; "
                                     f"stopping the other {others} process(es) now (they "
                                     "would wait for a restarted scheduler)")
                        elif others:
                            self.say(f"{child.name} {_failed_how(child)}; giving the other "
                                     f"{others} process(es) {grace:g} s to exit "
                                     f"before stopping them")
            running = sup.running()
            if failures:
                if not running:
                    break
                if not any(c.role == "worker" for c in running):
                    # no worker left: the scheduler and servers have nobody to serve or wait
                    # for, and nothing of the failure to report; stop them now
                    self.say(f"stopping {_names(running)} (no worker is left)")
                    self._stop()
                    break
                if grace_deadline is not None and now >= grace_deadline:
                    self.say(f"stopping {_names(running)} (grace period over)")
                    self._stop()
                    break
            else:
                sup.release_held(HOLD_S)   # tracebacks of children that went on after them
                workers = [c for c in sup.children if c.role == "worker"]
                if not running:
                    sup.release_held()
                    self._finished_without(lost_servers)
                    return 0
                if workers and all(not c.running for c in workers):
                    if shutdown_deadline is None:
                        shutdown_deadline = now + settings.shutdown_timeout
                    elif now >= shutdown_deadline:
                        return self._shutdown_timed_out(running)
                    if self._only_lost_servers_left(running, now):
                        self.say(f"stopping {_names(running)}: the job is over (servers the "
                                 "scheduler lost, or a replacement that came too late)")
                        self._stop()
                        self._finished_without(lost_servers)
                        return 0
            wake_ups = [t for t in (grace_deadline, shutdown_deadline, deadline) if t is not None]
            exited = sup.wait_any(
                min([0.5] + [max(0.0, t - time.monotonic()) for t in wake_ups]))
        blamed = _blame(lost_servers + failures)
        assert blamed is not None  # the loop ends only after a failure
        return self._failed(blamed)

    def _lost_server(self, child: Child, failures: list[Child]) -> bool:
        """A server that exited while the job may lose one: its scheduler hears of it now and
        moves its keys (True); the job fails only if the scheduler cannot go on without it."""
        if not (self.settings.server_failover and child.role == "server" and not failures):
            return False
        if not any(c.role == "server" and c.running for c in self.sup.children) \
                and all(c.role != "server" or not c.running or c is child
                        for c in self.sup.children) and self._all_servers_here():
            return False  # no server of this job is left: the job cannot go on
        self._tell_scheduler(child)
        self.say(f"{child.describe()} {_failed_how(child)}: "
                 f"{describe_returncode(child.returncode)}; its keys move to the other "
                 "servers and the job goes on (BYTEPS_SERVER_FAILOVER)")
        self._restart_server(child)
        return True

    def _gone_grace(self) -> float:
        """How long the others get once the scheduler failed for good: SCHEDULER_GONE_GRACE_S
        to fail on their own (they do within BYTEPS_SCHEDULER_LOST_GRACE_SECONDS), or none
        with --scheduler-restarts, which gave them SCHEDULER_RESTART_GRACE_S to wait for a
        restart that does not come now (its restarts used up, or not possible): the job
        ended 2.1 s after such a scheduler's SIGKILL when they were given 2 s (issue 40)."""
        if self.settings.scheduler_restarts:
            return 0.0
        return min(self.settings.grace, SCHEDULER_GONE_GRACE_S)

    def _restart_scheduler(self, child: Child, failures: list[Child]) -> bool:
        """A scheduler that failed on its own while the job runs, started again at the same
        address (--scheduler-restarts): the nodes register again with it and the job goes on
        (its data never crosses the scheduler). True when it was."""
        spec, env = self.specs.get(child), self.envs.get(child)
        limit = self.settings.scheduler_restarts
        if child.role != "scheduler" or failures or spec is None or env is None \
                or _secondary(child) or child.returncode == ROLE_CONFIG_ERROR \
                or not any(c.role == "worker" and c.running for c in self.sup.children):
            return False  # (exit 2: its configuration or port; a restart would fail alike)
        if self.scheduler_restarts >= limit:
            if limit:
                self.say(f"not restarting the scheduler: --scheduler-restarts {limit} used up")
            return False
        self.scheduler_restarts += 1
        self.say(f"{child.describe()} {_failed_how(child)}: "
                 f"{describe_returncode(child.returncode)}; restarting it (restart "
                 f"{self.scheduler_restarts} of {limit}): the nodes register again with it")
        try:
            self._start(spec, {**env, "BYTEPS_SCHEDULER_RESTART": str(self.scheduler_restarts)})
        except (OSError, AffinityError) as exc:
            self.say(f"cannot restart the scheduler: {exc}")
            return False
        child.restarted = True
        return True

    def _restart_server(self, child: Child) -> None:
        """A lost server started again (--server-restarts): it registers with the running
        job, takes the lost one's rank, and its keys move back to it."""
        spec, env = self.specs.get(child), self.envs.get(child)
        limit = self.settings.server_restarts
        if spec is None or env is None or self.server_restarts >= limit:
            if spec is not None and limit:
                self.say(f"not restarting {child.name}: --server-restarts {limit} used up")
            return
        self.server_restarts += 1
        try:
            new = self._start(spec, env)
        except (OSError, AffinityError) as exc:
            self.say(f"cannot restart {child.name}: {exc}")
            return
        child.restarted = True
        self.say(f"restarted {child.name} as pid {new.pid} (restart {self.server_restarts} of "
                 f"{limit}): it takes the lost server's keys back")

    def _finished_without(self, lost: list[Child]) -> None:
        if lost:
            self.say(f"the job finished without {_names(lost)}, lost along the way "
                     "(BYTEPS_SERVER_FAILOVER)")

    def _only_lost_servers_left(self, running: list[Child], now: float) -> bool:
        """The job is over (every worker and the scheduler exited 0), and the servers still
        running had 5 s to exit: a server the scheduler declared lost (hung: its heartbeats
        stopped) never hears SHUTDOWN, so it is stopped instead of failing the job."""
        if not self.settings.server_failover or any(c.role != "server" for c in running):
            return False
        sched = [c for c in self.sup.children if c.role == "scheduler"]
        if not sched or sched[0].running or sched[0].returncode != 0:
            return False
        if self._over_since is None:
            self._over_since = now
        return now - self._over_since >= 5.0

    def _all_servers_here(self) -> bool:
        """Whether every server of the job is a child of this bpslaunch (--local, or a
        host that runs them all)."""
        mine = sum(1 for c in self.sup.children if c.role == "server")
        env = next(iter(self.envs.values()), {})
        try:
            return mine >= int(env.get("DMLC_NUM_SERVER", "0"))
        except ValueError:
            return False

    # -- outcomes ----------------------------------------------------------------------------

    def _stop(self) -> None:
        self.stopped.update(self.sup.running())
        killed = self.sup.terminate_all()
        if killed:
            self.say(f"sent SIGKILL to {_names(killed)}: still running "
                     f"{self.settings.kill_after:g} s after SIGTERM")

    def _failed(self, child: Child) -> int:
        self._stop()  # grandchildren left in the groups
        self.sup.sink.mute_children()   # what they held back: in the report, or summarised
        for line in failure_report(child, self.sup.children, self.stopped):
            self.say(line)
        return exit_status_for(child.returncode) or EXIT_FAILURE

    def _end(self) -> None:
        """A job ending otherwise than by a failure: stop it, print what was held back."""
        self._stop()
        self.sup.release_held()
        self.sup.sink.mute_children()

    def _interrupted(self, first_failure: Child | None) -> int:
        signum = self.sup.signal_received
        assert signum is not None  # called only once a signal was received
        running = self.sup.running()
        if running:
            self.say(f"received {signal_name(signum)}; stopping {_names(running)}")
        self._end()
        cause = f"interrupted by {signal_name(signum)}"
        if first_failure is not None:
            cause += f" after the first failure: {_failure_summary(first_failure)}"
        self.say(f"error: {cause}")
        return 128 + signum

    def _timed_out(self, first_failure: Child | None) -> int:
        running = self.sup.running()
        self._end()
        cause = f"job exceeded --timeout {self.settings.timeout:g} s"
        if running:
            cause += f"; stopped {_names(running)}"
        if first_failure is not None:
            cause += f" (first failure: {_failure_summary(first_failure)})"
        self.say(f"error: {cause}")
        return EXIT_TIMEOUT

    def _shutdown_timed_out(self, running: list[Child]) -> int:
        self._end()
        self.say(f"error: all workers exited 0 but {_names(running)} did not exit within "
                 f"--timeout-shutdown {self.settings.shutdown_timeout:g} s; stopped them. "
                 "They wait for every worker to register and then to shut down: a worker "
                 "script that never calls bps.init() (or a framework's init) leaves them "
                 "waiting; check that every worker process calls it")
        return EXIT_FAILURE

    def _cannot_bind(self, exc: AffinityError) -> int:
        started = self.sup.running()
        self._end()
        self.say(f"error: {exc.strerror}; bpslaunch --no-bind starts without binding"
                 + (f" (stopped {_names(started)})" if started else ""))
        return EXIT_FAILURE

    def _cannot_start(self, spec: ChildSpec, exc: OSError) -> int:
        started = self.sup.running()
        self._end()
        reason = exc.strerror or str(exc)
        self.say(f"error: cannot execute {spec.launch_argv[0]!r} for {spec.name}: {reason}"
                 + (f" (stopped {_names(started)})" if started else ""))
        return EXIT_NOT_FOUND if exc.errno == errno.ENOENT else EXIT_CANNOT_EXECUTE


#: A scheduler that failed on its own (killed, crashed; there is no restarting it today): the
#: other processes get this long to fail on their own (each does within
#: BYTEPS_SCHEDULER_LOST_GRACE_SECONDS, 0.5 s, of its connection closing, naming the scheduler,
#: and exits), then they are stopped. A scheduler that failed at start leaves nobody to wait
#: for either.
SCHEDULER_GONE_GRACE_S = 2.0
#: The exit status of a role that stopped on its configuration (a ConfigError, its port taken:
#: byteps_like/roles.py): a restart would fail alike
ROLE_CONFIG_ERROR = 2
#: With --scheduler-restarts: how long the nodes wait for a restarted scheduler
#: (BYTEPS_SCHEDULER_LOST_GRACE_SECONDS in their environment, unless the user set it)
SCHEDULER_RESTART_GRACE_S = 15.0


def _names(children: Sequence[Child]) -> str:
    if len(children) > 6:
        return f"{len(children)} processes"
    return ", ".join(c.describe() for c in children)


def _blame(failures: Sequence[Child]) -> Child | None:
    """The failure that explains the job's end: a scheduler that could not start (exit status
    2: a bad setting, or its port taken by another job), without which nothing else of the job
    could work; else the first one that was not a reaction to another (whenever it came); with
    none such, the scheduler's (its log names the node it lost), else the first.

    The scheduler's start-up failure comes first whenever it was seen: the other processes
    fail because of it in an order nobody controls. Two jobs on one port: the losing job's
    workers, refused by the other job's scheduler, may exit before their own scheduler's
    bind failure is reaped (tests/faults/test_resources.py)."""
    for child in failures:
        if child.role == "scheduler" and child.returncode == EXIT_SCHEDULER_CANNOT_START:
            return child
    for child in failures:
        if not _secondary(child):
            return child
    for child in failures:
        if child.role == "scheduler":
            return child
    return failures[0] if failures else None


__all__ = ["JobSettings", "run_job", "EXIT_FAILURE", "EXIT_TIMEOUT", "EXIT_NOT_FOUND",
           "EXIT_CANNOT_EXECUTE"]
