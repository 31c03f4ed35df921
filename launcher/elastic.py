"""``bpslaunch --local --elastic``: supervise an elastic job (docs/elastic.md, docs/launcher.md).

Unlike the all-or-nothing policy of launcher/job.py, a worker that exits non-zero or is killed
is *lost*, not a failure of the job: bpslaunch tells the scheduler at once (launcher/notify.py),
which forms a new membership epoch of the workers left without waiting for the heartbeat
timeout, and bpslaunch starts a replacement (a fresh worker that registers and is admitted at the
next epoch) while ``--max-restarts`` allows. ``--add-workers N --add-after S`` starts N more
workers S seconds into the run (at most ``--max-workers`` run at once). The job:

* completes (exit 0) when every worker still in it has exited 0 and the scheduler and servers
  have shut down; the workers lost on the way are listed;
* fails when the scheduler fails, or a server while the job cannot lose one (below two
  servers, or BYTEPS_SERVER_FAILOVER=0: the usual PeerLostError; otherwise its keys move to the
  other servers and the job goes on, docs/reliability.md): below ``--min-workers`` for longer
  than BYTEPS_ELASTIC_TIMEOUT_SECONDS the scheduler exits 1 with a line naming
  TooFewWorkersError and the workers lost. Then everything left is stopped and bpslaunch exits
  non-zero naming the cause.
"""
from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from .job import EXIT_FAILURE, JobSettings, _blame, _Job, _names
from .plan import ChildSpec, child_environment
from .procs import AffinityError, Child, Supervisor, describe_returncode

#: After a worker is lost, how long bpslaunch waits before starting its replacement: a worker
#: that failed because the whole job is failing (the scheduler's TooFewWorkersError) must not
#: be replaced.
RESTART_DELAY_S = 1.0


@dataclass(frozen=True)
class ElasticSettings:
    min_workers: int
    max_workers: int
    max_restarts: int
    add_workers: int = 0
    add_after: float = 0.0


def elastic_worker_specs(specs: Sequence[ChildSpec]) -> list[ChildSpec]:
    """The workers of an elastic job register without DMLC_WORKER_ID (ranks come from the
    scheduler's epochs)."""
    return [replace(s, env={**s.env, "DMLC_WORKER_ID": None}) if s.role == "worker" else s
            for s in specs]


def run_elastic_job(specs: Sequence[ChildSpec], base_env: Mapping[str, str],
                    settings: JobSettings, elastic: ElasticSettings) -> int:
    sup = Supervisor(log_dir=settings.log_dir, kill_after=settings.kill_after)
    sup.install_signal_handlers()
    try:
        return _ElasticJob(sup, settings, elastic).run(specs, base_env)
    finally:
        sup.close()


class _ElasticJob(_Job):
    def __init__(self, sup: Supervisor, settings: JobSettings, elastic: ElasticSettings):
        # no restarted scheduler: an elastic job's epochs are not rebuilt by one
        super().__init__(sup, replace(settings, scheduler_restarts=0))
        self.elastic = elastic
        self.restarts = 0
        self.next_rank = 0
        self.lost: list[str] = []
        self.lost_children: list[Child] = []
        self.finished_ok = 0  # workers that exited 0
        self.servers_lost: list[Child] = []  # servers lost while the job went on (failover)

    def _restart_server(self, child: Child) -> None:
        """An elastic job's lost server is not replaced: its servers follow the membership
        epochs, which a replacement cannot join (its keys stay on the others)."""

    def _start_worker(self, template: ChildSpec, base_env: Mapping[str, str],
                      why: str) -> None:
        spec = replace(template, rank=self.next_rank, binding=None)
        self.next_rank += 1
        self._start(spec, child_environment(base_env, spec.env))
        self.say(f"started {spec.name} ({why})")

    def run(self, specs: Sequence[ChildSpec], base_env: Mapping[str, str]) -> int:
        sup, settings, el = self.sup, self.settings, self.elastic
        started_at = time.monotonic()
        deadline = None if settings.timeout is None else started_at + settings.timeout
        template = next(s for s in specs if s.role == "worker")
        for spec in specs:
            if sup.signal_received is not None:
                return self._interrupted(None)
            try:
                self._start(spec, child_environment(base_env, spec.env),
                            cpus=None if spec.binding is None else spec.binding.affinity)
            except AffinityError as exc:
                return self._cannot_bind(exc)
            except OSError as exc:
                return self._cannot_start(spec, exc)
            if spec.role == "worker":
                self.next_rank = max(self.next_rank, (spec.rank or 0) + 1)
        add_at = started_at + el.add_after if el.add_workers else None
        restart_due: list[float] = []
        failure: Child | None = None
        grace_deadline: float | None = None
        shutdown_deadline: float | None = None
        exited = sup.poll_exited()
        while True:
            if sup.signal_received is not None:
                return self._interrupted(failure)
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return self._timed_out(failure)
            for child in exited:
                code = child.returncode or 0
                if code != 0 and child.role == "server" and failure is None \
                        and self._lost_server(child, []):  # its keys move (failover)
                    self.servers_lost.append(child)
                    continue
                if code != 0:  # the scheduler re-forms without it now, not after the timeout
                    self._tell_scheduler(child)
                if child.role == "worker":
                    if code == 0:
                        self.finished_ok += 1
                    else:
                        self.lost_children.append(child)
                        how = describe_returncode(code)
                        self.lost.append(f"{child.describe()}: {how}")
                        self.say(f"{child.describe()} lost ({how}); the elastic job goes on")
                        restart_due.append(now + RESTART_DELAY_S)
                elif code != 0 and failure is None:
                    failure = child
                    self.say(f"{child.describe()} failed: {describe_returncode(code)}")
                    grace_deadline = now + settings.grace
            running = sup.running()
            services = [c for c in running if c.role != "worker"]
            workers = [c for c in running if c.role == "worker"]
            if failure is not None:
                if not running:
                    break
                if not workers or grace_deadline is None or now >= grace_deadline:
                    self.say(f"stopping {_names(running)}")
                    self._stop()
                    break
            else:
                while restart_due and restart_due[0] <= now:
                    restart_due.pop(0)
                    if self.restarts >= el.max_restarts:
                        self.say(f"not replacing the lost worker: --max-restarts "
                                 f"{el.max_restarts} used up")
                    elif len(sup.running()) - len(services) >= el.max_workers:
                        self.say("not replacing the lost worker: --max-workers running")
                    elif len(services) == len([c for c in sup.children if c.role != "worker"
                                               and c not in self.servers_lost]):
                        self.restarts += 1
                        self._start_worker(template, base_env,
                                           f"restart {self.restarts} of {el.max_restarts}")
                if add_at is not None and now >= add_at:
                    add_at = None
                    room = el.max_workers - len(workers)
                    for _ in range(max(0, min(el.add_workers, room))):
                        self._start_worker(template, base_env, "--add-workers")
                if not running:
                    return self._completed()
                if not workers and self._only_lost_servers_left(running, now):
                    self.say(f"stopping {_names(running)}: the job is over (servers the "
                             "scheduler lost, or a replacement that came too late)")
                    self._stop()
                    return self._completed()
                if not workers and not restart_due:
                    # no worker left: the scheduler ends the job (done, or too few workers)
                    if shutdown_deadline is None:
                        shutdown_deadline = now + max(settings.shutdown_timeout,
                                                      self._elastic_timeout(base_env) + 5.0)
                    elif now >= shutdown_deadline:
                        return self._shutdown_timed_out(services)
                else:
                    shutdown_deadline = None
            wake = [t for t in (grace_deadline, shutdown_deadline, deadline, add_at,
                                *restart_due) if t is not None]
            exited = sup.wait_any(min([0.5] + [max(0.0, t - time.monotonic()) for t in wake]))
        assert failure is not None
        return self._failed(failure)

    @staticmethod
    def _elastic_timeout(env: Mapping[str, str]) -> float:
        try:
            return float(env.get("BYTEPS_ELASTIC_TIMEOUT_SECONDS", "60").rstrip("s"))
        except ValueError:
            return 60.0

    def _completed(self) -> int:
        if not self.finished_ok and self.lost_children:
            # every worker was lost: nothing completed (a script that fails on every worker
            # is an error, not elasticity), whatever the scheduler made of their departures
            self.say(f"no worker finished: all {len(self.lost)} were lost")
            return self._failed(_blame(self.lost_children) or self.lost_children[0])
        if self.lost:
            self.say(f"the elastic job completed; {len(self.lost)} worker(s) were lost on the "
                     f"way ({self.restarts} restarted): " + "; ".join(self.lost))
        return 0

    def _failed(self, child: Child) -> int:
        if self.lost:  # before the error line, which stays the last
            self.say("workers lost on the way: " + "; ".join(self.lost))
        return super()._failed(child) or EXIT_FAILURE
