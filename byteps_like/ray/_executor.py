"""``RayExecutor``: byteps_like workers as Ray actors, for programs outside Ray Train (the shape
of ``horovod.ray.RayExecutor``)::

    executor = RayExecutor(num_workers=4, num_servers=2, server_resources={"CPU": 4})
    executor.start()
    results = executor.run(train, args=(config,))   # one result per worker, in rank order
    executor.shutdown()

The function runs in each worker actor and calls ``byteps_like.torch`` (or any plugin) as a
script under bpslaunch does: ``bps.init()`` first. The job lives from :meth:`start` to
:meth:`shutdown`; a function that calls ``bps.shutdown()`` ends it, and the next :meth:`run`
starts a fresh one (new scheduler and servers) before it calls the function.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ray

from ..errors import ConfigError
from ._job import (
    STRATEGIES,
    Job,
    JobSpec,
    _check_resources,
    apply_worker_env,
    leave_job,
    release,
)

log = logging.getLogger("byteps_like.ray")


class _WorkerActor:
    """One byteps_like worker (one worker machine of the job: local size 1)."""

    def node(self) -> str:
        return ray.util.get_node_ip_address()

    def set_env(self, changes: Mapping[str, str | None]) -> None:
        apply_worker_env(changes)

    def execute(self, fn: Callable[..., Any], args: Sequence[Any],
                kwargs: Mapping[str, Any]) -> Any:
        return fn(*args, **kwargs)

    def leave(self, graceful: bool, shm_dir: str, prefix: str,
              names: Sequence[str]) -> list[str]:
        return leave_job(graceful, shm_dir, prefix, names)


class RayExecutor:
    """Runs a function on ``num_workers`` byteps_like workers placed by Ray, with
    ``num_servers`` server actors and a scheduler actor."""

    def __init__(self, num_workers: int, num_servers: int = 1, *, cpus_per_worker: float = 1,
                 gpus_per_worker: float = 0,
                 worker_resources: Mapping[str, float] | None = None,
                 server_resources: Mapping[str, float] | None = None,
                 scheduler_resources: Mapping[str, float] | None = None,
                 placement_strategy: str = "SPREAD",
                 worker_placement_strategy: str = "PACK",
                 env: Mapping[str, str] | None = None, auth: bool = True,
                 start_timeout: float = 120.0):
        self.spec = JobSpec(num_workers=num_workers, num_servers=num_servers,
                            server_resources=dict(server_resources or {"CPU": 1}),
                            scheduler_resources=dict(scheduler_resources or {}),
                            placement_strategy=placement_strategy, env=dict(env or {}),
                            auth=auth, start_timeout=start_timeout).check()
        for what, value in (("cpus_per_worker", cpus_per_worker),
                            ("gpus_per_worker", gpus_per_worker)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ConfigError(f"{what}={value!r}: needs a number >= 0")
        if worker_placement_strategy not in STRATEGIES:
            raise ConfigError(f"worker_placement_strategy={worker_placement_strategy!r}: "
                              f"expected one of {', '.join(STRATEGIES)}")
        self.worker_bundle = {**_check_resources("worker_resources", worker_resources),
                              "CPU": float(cpus_per_worker), "GPU": float(gpus_per_worker)}
        self.worker_bundle = {k: v for k, v in self.worker_bundle.items() if v > 0}
        if not self.worker_bundle:
            raise ConfigError("a worker asks for no resources at all: give cpus_per_worker, "
                              "gpus_per_worker or worker_resources")
        self.worker_placement_strategy = worker_placement_strategy
        self.workers: list[Any] = []
        self.job: Job | None = None
        self._placement_group: Any = None

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Start the worker actors and a byteps_like job (scheduler, servers); needs
        ``ray.init()`` first (or starts a local Ray the way ``ray.init()`` does)."""
        if self.workers:
            raise RuntimeError("RayExecutor.start(): already started")
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        if not ray.is_initialized():
            ray.init()
        try:
            n = self.spec.num_workers
            self._placement_group = placement_group([dict(self.worker_bundle)] * n,
                                                    strategy=self.worker_placement_strategy)
            ready, _ = ray.wait([self._placement_group.ready()],
                                timeout=self.spec.start_timeout)
            if not ready:
                raise ConfigError(
                    f"Ray could not place {n} worker(s) with {self.worker_bundle} each "
                    f"(worker_placement_strategy={self.worker_placement_strategy}) within "
                    f"{self.spec.start_timeout:g} s; free: {ray.available_resources()}")
            remote = ray.remote(_WorkerActor)
            for rank in range(n):
                res = dict(self.worker_bundle)
                self.workers.append(remote.options(
                    num_cpus=res.pop("CPU", 0), num_gpus=res.pop("GPU", 0),
                    resources=res or None, max_restarts=0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        self._placement_group, placement_group_bundle_index=rank)).remote())
            self._start_job()
        except BaseException:
            self.shutdown()
            raise

    def _start_job(self) -> None:
        ips = ray.get([w.node.remote() for w in self.workers], timeout=self.spec.start_timeout)
        job = Job(self.spec)
        envs = job.start(ips)
        try:
            ray.get([w.set_env.remote(env) for w, env in zip(self.workers, envs)])
        except BaseException:
            job.stop(graceful=False)
            raise
        self.job = job

    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (),
            kwargs: Mapping[str, Any] | None = None) -> list[Any]:
        """``fn(*args, **kwargs)`` on every worker at once; the results in rank order. An
        exception on a worker is raised here (Ray's RayTaskError, of the worker's type)."""
        if not self.workers or self.job is None:
            raise RuntimeError("RayExecutor.run(): call start() first")
        if self.job.finished():  # the previous function ended the job: a fresh one
            self._end_job()
            self._start_job()
        return ray.get([w.execute.remote(fn, tuple(args), dict(kwargs or {}))
                        for w in self.workers])

    def _end_job(self) -> list[str]:
        job, self.job = self.job, None
        if job is None:
            return []
        ok = True
        try:
            states = job.status()
            graceful = all(code is None for _, code, _ in states)
            ok = all(code in (None, 0) for _, code, _ in states)
            refs = [w.leave.remote(graceful, job.shm_dir, job.shm_prefix, job.worker_names)
                    for w in self.workers]
            ray.wait(refs, num_returns=len(refs), timeout=40.0)
        except Exception as exc:  # noqa: BLE001 - teardown goes on
            log.warning("byteps_like job %s: the workers could not leave: %s", job.job_id, exc)
            ok = False
        return job.stop(graceful=ok)

    def shutdown(self) -> None:
        """End the job and remove every actor and placement group this executor made."""
        for line in self._end_job():
            log.warning("byteps_like: %s", line)
        release(self.workers, self._placement_group)
        self.workers, self._placement_group = [], None

    def __enter__(self) -> RayExecutor:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
