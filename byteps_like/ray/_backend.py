"""The Ray Train backend: ``DataParallelTrainer(..., backend_config=BytePSConfig(...))``.

For every attempt of a training run (the first, and each retry that Ray Train's
``FailureConfig(max_failures=...)`` allows) :meth:`_BytePSBackend.on_start` starts a fresh
byteps_like job (scheduler and servers as actors, a new job id, ports and secret) and sets the
DMLC_*/BYTEPS_* contract on each training worker, so that the training loop calls
``byteps_like.torch`` exactly as under bpslaunch; :meth:`_BytePSBackend.on_shutdown` ends it,
whether training finished or failed.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import ray
from ray.train.backend import Backend, BackendConfig

from ._job import Job, RoleSettings, apply_worker_env, leave_job, worker_node_ip

log = logging.getLogger("byteps_like.ray")
#: Seconds the workers get to leave the job at the end (byteps_like's own shutdown waits at
#: most BYTEPS_SHUTDOWN_TIMEOUT_SECONDS, 30 by default).
LEAVE_TIMEOUT_S = 40.0


@dataclass
class BytePSConfig(RoleSettings, BackendConfig):
    """What a Ray Train run starts besides its training workers (``ScalingConfig`` decides
    those: each is one byteps_like worker machine, ``DMLC_NUM_WORKER = num_workers``): the
    settings of :class:`~byteps_like.ray._job.RoleSettings` (``num_servers``,
    ``server_resources``, ``scheduler_resources``, ``placement_strategy``, ``env``, ``auth``,
    ``start_timeout``)."""

    def __post_init__(self) -> None:
        self.job_spec(1)  # bad settings fail here, in the driver, not in the controller

    @property
    def backend_cls(self) -> type[Backend]:
        return _BytePSBackend

    @property
    def framework(self) -> str:
        return "byteps_like"

    def to_dict(self) -> dict[str, Any]:
        return {"num_servers": self.num_servers, "server_resources": dict(self.server_resources),
                "scheduler_resources": dict(self.scheduler_resources),
                "placement_strategy": self.placement_strategy, "auth": self.auth}


class _BytePSBackend(Backend):
    """Starts and ends one byteps_like job per worker group (one per attempt)."""

    def __init__(self) -> None:
        self._jobs: dict[int, Job] = {}

    def on_start(self, worker_group: Any, backend_config: BackendConfig) -> None:
        assert isinstance(backend_config, BytePSConfig)
        ips = worker_group.execute(worker_node_ip)  # in rank order
        job = Job(backend_config.job_spec(len(ips)))
        envs = job.start(ips)
        try:
            ray.get([worker_group.execute_single_async(rank, apply_worker_env, env)
                     for rank, env in enumerate(envs)])
        except BaseException:
            job.stop(graceful=False)
            raise
        self._jobs[id(worker_group)] = job
        log.info("byteps_like job %s: %d worker(s), %d server(s), started in %.1f s",
                 job.job_id, len(ips), job.spec.num_servers, job.started_s)

    def on_shutdown(self, worker_group: Any, backend_config: BackendConfig) -> None:
        job = self._jobs.pop(id(worker_group), None)
        if job is None:
            return
        try:
            states = job.status()
            # every role still running: the workers may still be in the job (a loop that did
            # not call bps.shutdown()); one that ended: the job ended or failed
            graceful = all(code is None for _, code, _ in states)
            ok = all(code in (None, 0) for _, code, _ in states)
            refs = worker_group.execute_async(leave_job, graceful, job.shm_dir, job.shm_prefix,
                                              job.worker_names)
            ray.wait(refs, num_returns=len(refs), timeout=LEAVE_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - a worker died: teardown goes on
            log.warning("byteps_like job %s: the workers could not leave: %s", job.job_id, exc)
            ok = False
        problems = job.stop(graceful=ok)
        for line in problems:
            log.warning("byteps_like job %s: %s", job.job_id, line)
