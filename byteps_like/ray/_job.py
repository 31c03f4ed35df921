"""One byteps_like job on a Ray cluster: the scheduler and the servers as Ray actors, and the
environment (the DMLC_*/BYTEPS_* contract) of each training worker.

Each role runs *in* its actor's process (``byteps_like.scheduler`` / ``byteps_like.server``
objects, driven by :func:`byteps_like.roles.run_node` in a thread), not as a subprocess: killing
the actor (``ray.kill``, a lost node) kills the role with it, so nothing can outlive the job.

The environment comes from the launcher's own recipe (:func:`launcher.plan.local_cluster_plan`,
:func:`launcher.cli.local_job_env`), with ``DMLC_NODE_HOST`` set to the node Ray placed each
process on and ``DMLC_PS_ROOT_URI`` to the scheduler's node. The job's secret is generated here
and travels only through Ray (an actor method's argument, a function's argument on the
workers): never on a command line, in a runtime environment or in a file.
"""
from __future__ import annotations

import argparse
import logging
import secrets
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray

from ..errors import ConfigError

log = logging.getLogger("byteps_like.ray")

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
#: How many times a scheduler retries another free port when the one it was given was taken in
#: between (another process bound it first).
PORT_ATTEMPTS = 5
#: Prefix of every actor name: ``byteps_like-<job id>-<role>-<index>`` (:func:`actor_name`).
ACTOR_PREFIX = "byteps_like-"


def actor_name(job_id: str, role: str, index: int = 0) -> str:
    """The name of the actor running ``role`` ``index`` of job ``job_id`` (``ray.get_actor``).
    The scheduler is ``actor_name(job, "scheduler")``; a training worker sees its job id in
    ``BYTEPS_JOB_ID``."""
    return f"{ACTOR_PREFIX}{job_id}-{role}-{index}"


def _check_resources(what: str, resources: Mapping[str, float] | None) -> dict[str, float]:
    if resources is None:
        return {}
    if not isinstance(resources, Mapping):
        raise ConfigError(f"{what}={resources!r} is not a mapping of resource names to amounts, "
                          f"e.g. {{'CPU': 4}}")
    out = {}
    for name, amount in resources.items():
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{what}: resource name {name!r} is not a non-empty string")
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or amount < 0:
            raise ConfigError(f"{what}[{name!r}]={amount!r} is not a number >= 0")
        out[name] = float(amount)
    return out


def release(actors: Iterable[Any], placement_group: Any | None) -> None:
    """Kill ``actors`` (no restart) and remove ``placement_group`` (if any); what is gone
    already (an actor that exited, a group removed with its owner) is skipped."""
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
    if placement_group is not None:
        from ray.util.placement_group import remove_placement_group
        try:
            remove_placement_group(placement_group)
        except Exception:  # noqa: BLE001 - already removed
            pass


@dataclass
class RoleSettings:
    """The settings of what a job starts besides its training workers (the scheduler and the
    servers, as Ray actors): :class:`~byteps_like.ray.BytePSConfig` is made of them, and a
    :class:`JobSpec` is them plus the number of workers."""

    #: Summation servers, each a Ray actor (``DMLC_NUM_SERVER``).
    num_servers: int = 1
    #: Ray resources of each server actor, e.g. ``{"CPU": 4}`` or a custom resource that only
    #: the CPU nodes have (``{"CPU": 4, "cpu_node": 1}``), to keep servers off the GPU nodes;
    #: one placement-group bundle each.
    server_resources: Mapping[str, float] = field(default_factory=lambda: {"CPU": 1})
    #: Ray resources of the scheduler actor; it is placed on the node that starts the job
    #: (where Ray Train's controller or the executor's driver runs) unless these need another.
    scheduler_resources: Mapping[str, float] = field(default_factory=dict)
    #: Placement-group strategy of the servers: PACK, SPREAD, STRICT_PACK or STRICT_SPREAD.
    placement_strategy: str = "SPREAD"
    #: byteps_like settings (BYTEPS_*) for every role and worker, e.g.
    #: ``{"BYTEPS_PARTITION_BYTES": "1048576"}``.
    env: Mapping[str, str] = field(default_factory=dict)
    #: A one-time shared secret per job, passed through Ray (as ``bpslaunch --local``); False:
    #: authentication off.
    auth: bool = True
    #: Seconds to wait for the servers' placement group and the roles to come up.
    start_timeout: float = 120.0

    def job_spec(self, num_workers: int) -> JobSpec:
        """These settings (copied) for a job of ``num_workers`` workers, validated."""
        return JobSpec(num_workers=num_workers, num_servers=self.num_servers,
                       server_resources=dict(self.server_resources),
                       scheduler_resources=dict(self.scheduler_resources),
                       placement_strategy=self.placement_strategy, env=dict(self.env),
                       auth=self.auth, start_timeout=self.start_timeout).check()


@dataclass
class JobSpec(RoleSettings):
    """What to start besides the training workers, shared by the Ray Train backend and the
    executor (both validate through :meth:`check`)."""

    num_workers: int = field(kw_only=True)

    def check(self) -> JobSpec:
        """Validate; raises ConfigError naming the setting and what to do."""
        if isinstance(self.num_workers, bool) or not isinstance(self.num_workers, int) \
                or self.num_workers < 1:
            raise ConfigError(f"num_workers={self.num_workers!r}: needs an integer >= 1")
        if isinstance(self.num_servers, bool) or not isinstance(self.num_servers, int) \
                or self.num_servers < 0:
            raise ConfigError(f"num_servers={self.num_servers!r}: needs an integer >= 0")
        if self.num_servers < 1 and self.num_workers > 1:
            raise ConfigError(f"num_servers=0 with {self.num_workers} workers: a distributed "
                              "job needs at least one server (num_servers >= 1)")
        server = _check_resources("server_resources", self.server_resources)
        if self.num_servers and not any(v > 0 for v in server.values()):
            raise ConfigError(f"server_resources={self.server_resources!r}: a placement-group "
                              "bundle needs some resource > 0, e.g. {'CPU': 1}")
        _check_resources("scheduler_resources", self.scheduler_resources)
        if self.placement_strategy not in STRATEGIES:
            raise ConfigError(f"placement_strategy={self.placement_strategy!r}: expected one of "
                              f"{', '.join(STRATEGIES)}")
        if not isinstance(self.env, Mapping) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in self.env.items()):
            raise ConfigError(f"env={self.env!r}: expected a mapping of variable names to "
                              "strings, e.g. {'BYTEPS_LOG_LEVEL': 'INFO'}")
        contract = sorted(k for k in self.env if k in _CONTRACT)
        if contract:
            raise ConfigError(f"env sets {', '.join(contract)}: the Ray integration sets these "
                              "from the nodes Ray chose; leave them out")
        if not self.start_timeout > 0:
            raise ConfigError(f"start_timeout={self.start_timeout!r}: needs a number of "
                              "seconds > 0")
        return self


#: Set per process from Ray's placement; a user cannot choose them.
_CONTRACT = frozenset({"DMLC_ROLE", "DMLC_NUM_WORKER", "DMLC_NUM_SERVER", "DMLC_PS_ROOT_URI",
                       "DMLC_PS_ROOT_PORT", "DMLC_WORKER_ID", "DMLC_NODE_HOST",
                       "BYTEPS_LOCAL_RANK", "BYTEPS_LOCAL_SIZE", "BYTEPS_JOB_ID"})


# ----------------------------------------------------------------------------- the role actor
class RoleActor:
    """A Ray actor that runs one scheduler or server in its own process (in a thread)."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._code: int | None = None
        self._error: str | None = None

    def node(self) -> tuple[str, str]:
        """(address, Ray node id) of the node this actor runs on."""
        return ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id()

    def free_port(self) -> int:
        from byteps_like.launcher.cli import free_port
        return free_port(ray.util.get_node_ip_address())

    def start(self, role: str, env: dict[str, str], timeout: float) -> str:
        """Load the role's settings from ``env`` alone (this process's own environment is not
        read) and run it; returns its address once it listens. Raises ConfigError (a bad
        setting, the scheduler's port taken) or what the role raised while starting."""
        from byteps_like.config import load
        from byteps_like.log import setup_logging
        from byteps_like.roles import run_node
        if self._thread is not None:
            raise RuntimeError("this actor already runs a role")
        cfg = load(env=env, overrides={"cluster.role": role})
        setup_logging(cfg.log.level, role)
        node_class: Any
        if role == "scheduler":
            from byteps_like.scheduler.core import Scheduler
            node_class = Scheduler
        else:
            from byteps_like.server.core import Server
            node_class = Server
        ready = threading.Event()
        box: dict[str, Any] = {}

        def factory(cfg: Any, context: Any = None) -> Any:
            try:
                node = node_class(cfg, context=context)
            except BaseException as exc:
                box["error"] = exc
                ready.set()
                raise
            box["node"] = node
            ready.set()
            return node

        def main() -> None:
            try:
                self._code = run_node(factory, cfg)
            except BaseException as exc:  # noqa: BLE001 - reported through status()
                self._error = f"{type(exc).__name__}: {exc}"
                self._code = 1
                box.setdefault("error", exc)
                ready.set()

        self._thread = threading.Thread(target=main, name=f"byteps_like-{role}", daemon=True)
        self._thread.start()
        if not ready.wait(timeout):
            raise TimeoutError(f"the {role} did not start listening within {timeout:g} s")
        if "error" in box:
            raise box["error"]
        return str(box["node"].address)

    def status(self, timeout: float = 0.0) -> tuple[int | None, str | None]:
        """(exit status or None while it runs, the error that ended it if any)."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self._code, self._error


# ---------------------------------------------------------------------------------- one job
@dataclass
class _Role:
    role: str
    index: int
    actor: Any
    ip: str = ""
    node_id: str = ""


class Job:
    """The scheduler and servers of one byteps_like job; :meth:`start` returns the environment
    changes of each training worker (``None`` removes a variable), :meth:`stop` ends it."""

    def __init__(self, spec: JobSpec):
        self.spec = spec.check()
        self.job_id = f"ray-{secrets.token_hex(6)}"
        self.port = 0
        self.roles: list[_Role] = []
        self.placement_group: Any = None
        self.notes: list[str] = []
        self.started_s = 0.0
        self.shm_dir = "/dev/shm"
        #: The variables :meth:`start` sets on the workers (removed again at the end).
        self.worker_names: tuple[str, ...] = ()

    # -- start -----------------------------------------------------------------------------
    def start(self, worker_ips: Sequence[str]) -> list[dict[str, str | None]]:
        """Start the scheduler and the servers; ``worker_ips[r]`` is the node address of
        training worker ``r``. On any failure, what was started is stopped again."""
        t0 = time.monotonic()
        if len(worker_ips) != self.spec.num_workers:
            raise ConfigError(f"{len(worker_ips)} training workers but num_workers="
                              f"{self.spec.num_workers}")
        try:
            envs = self._start(list(worker_ips))
        except BaseException:
            self.stop(graceful=False)
            raise
        self.started_s = time.monotonic() - t0
        log.info("byteps_like job %s: scheduler %s:%d, %d server(s) on %s, started in %.1f s",
                 self.job_id, self.roles[0].ip, self.port, self.spec.num_servers,
                 ", ".join(r.ip for r in self.roles[1:]) or "-", self.started_s)
        return envs

    def _start(self, worker_ips: list[str]) -> list[dict[str, str | None]]:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import (
            NodeAffinitySchedulingStrategy,
            PlacementGroupSchedulingStrategy,
        )
        spec = self.spec
        remote = ray.remote(RoleActor)
        timeout = spec.start_timeout
        # the scheduler: on this node unless its resources say otherwise
        sched_res = _check_resources("scheduler_resources", spec.scheduler_resources)
        options: dict[str, Any] = {"num_cpus": sched_res.pop("CPU", 0),
                                   "num_gpus": sched_res.pop("GPU", 0),
                                   "resources": sched_res or None,
                                   "name": actor_name(self.job_id, "scheduler"),
                                   "max_restarts": 0}
        if not options["resources"] and not options["num_cpus"] and not options["num_gpus"]:
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
                ray.get_runtime_context().get_node_id(), soft=True)
        self.roles.append(_Role("scheduler", 0, remote.options(**options).remote()))
        # the servers: one placement-group bundle each
        if spec.num_servers:
            bundle = _check_resources("server_resources", spec.server_resources)
            self.placement_group = placement_group([dict(bundle)] * spec.num_servers,
                                                   strategy=spec.placement_strategy,
                                                   name=f"{ACTOR_PREFIX}{self.job_id}-servers")
            ready, _ = ray.wait([self.placement_group.ready()], timeout=timeout)
            if not ready:
                raise ConfigError(
                    f"Ray could not place {spec.num_servers} server(s) with server_resources="
                    f"{dict(bundle)} (placement_strategy={spec.placement_strategy}) within "
                    f"{timeout:g} s; the cluster has {ray.cluster_resources()} in all, "
                    f"{ray.available_resources()} free: add nodes with those resources or ask "
                    "for less")
            res = dict(bundle)
            for index in range(spec.num_servers):
                actor = remote.options(
                    num_cpus=res.pop("CPU", 0), num_gpus=res.pop("GPU", 0),
                    resources=res or None, name=actor_name(self.job_id, "server", index),
                    max_restarts=0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        self.placement_group, placement_group_bundle_index=index)).remote()
                res = dict(bundle)
                self.roles.append(_Role("server", index, actor))
        nodes = _get([r.actor.node.remote() for r in self.roles], timeout, "the role actors")
        for role, (ip, node_id) in zip(self.roles, nodes):
            role.ip, role.node_id = ip, node_id
        return self._start_roles(worker_ips, timeout)

    def _base_env(self) -> dict[str, str]:
        from byteps_like.launcher.cli import local_job_env
        args = argparse.Namespace(auth=True if self.spec.auth else None,
                                  no_auth=None if self.spec.auth else True,
                                  host=self.roles[0].ip if self.roles else None)
        # a lost server actor ends the attempt and Ray Train retries from the last checkpoint
        # (its own recovery, docs/deployment.md), unless the user's settings say otherwise
        return local_job_env(args, {"BYTEPS_SERVER_FAILOVER": "0", **self.spec.env,
                                    "BYTEPS_JOB_ID": self.job_id}, self.notes)

    def _plan(self, port: int) -> list[Any]:
        from byteps_like.launcher.plan import LocalCluster, local_cluster_plan
        return local_cluster_plan(LocalCluster(
            command=("ray-train-worker",), port=port, workers=self.spec.num_workers,
            servers=self.spec.num_servers, host=self.roles[0].ip))

    def _start_roles(self, worker_ips: list[str], timeout: float) -> list[dict[str, str | None]]:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        base = self._base_env()
        for note in self.notes:
            log.warning("byteps_like job %s: %s", self.job_id, note)
        scheduler = self.roles[0]
        for attempt in range(PORT_ATTEMPTS):
            self.port = ray.get(scheduler.actor.free_port.remote(), timeout=timeout)
            specs = self._plan(self.port)
            try:
                env = _role_env(base, specs[0], scheduler.ip)
                _get([scheduler.actor.start.remote("scheduler", env, timeout)], timeout,
                     "the scheduler")
                break
            except ConfigError:
                if attempt == PORT_ATTEMPTS - 1:
                    raise
                ray.kill(scheduler.actor)  # a fresh actor for the next port
                scheduler.actor = ray.remote(RoleActor).options(
                    num_cpus=0, name=actor_name(self.job_id, "scheduler", attempt + 1),
                    scheduling_strategy=NodeAffinitySchedulingStrategy(
                        scheduler.node_id, soft=False)).remote()
        servers = [r for r in self.roles if r.role == "server"]
        _get([r.actor.start.remote("server", _role_env(base, specs[1 + r.index], r.ip), timeout)
              for r in servers], timeout, "the servers")
        workers = specs[1 + self.spec.num_servers:]
        from byteps_like.config import load
        self.shm_dir = load(env=base).cluster.shm_dir
        envs: list[dict[str, str | None]] = [{**base, **dict(spec.env), "DMLC_NODE_HOST": ip}
                                             for spec, ip in zip(workers, worker_ips)]
        self.worker_names = tuple(sorted({name for env in envs for name in env}))
        return envs

    # -- watch and stop --------------------------------------------------------------------
    def status(self, timeout: float = 0.0) -> list[tuple[str, int | None, str | None]]:
        """(``scheduler`` / ``server 1``, exit status or None while running, error) per role;
        an actor that is gone (killed, its node lost) reads as exit status -9."""
        out: list[tuple[str, int | None, str | None]] = []
        refs = [r.actor.status.remote(timeout) for r in self.roles]
        for role, ref in zip(self.roles, refs):
            name = role.role if role.role == "scheduler" else f"server {role.index}"
            try:
                code, error = ray.get(ref, timeout=timeout + 30)
            except Exception as exc:  # noqa: BLE001 - the actor died: report it as such
                code, error = -9, f"its actor is gone: {type(exc).__name__}"
            out.append((name, code, error))
        return out

    def finished(self) -> bool:
        """Whether the scheduler is no longer running (the job ended, or failed)."""
        return bool(self.roles) and self.status()[0][1] is not None

    def stop(self, graceful: bool = True, wait_s: float = 10.0) -> list[str]:
        """End the job: with ``graceful``, give the roles ``wait_s`` seconds to exit on their
        own (they do once every worker has left); then kill every actor and remove the
        placement group. Returns one line per role that did not exit 0. Never raises."""
        problems: list[str] = []
        if graceful and self.roles:
            try:
                for name, code, error in self.status(wait_s):
                    if code != 0:
                        problems.append(f"{name}: " + ("still running" if code is None else
                                                       f"exit status {code}")
                                        + (f" ({error})" if error else ""))
            except Exception as exc:  # noqa: BLE001 - teardown goes on regardless
                problems.append(f"status: {exc}")
        release([role.actor for role in self.roles], self.placement_group)
        self.roles, self.placement_group = [], None
        return problems

    @property
    def shm_prefix(self) -> str:
        from byteps_like.launcher.shm import segment_prefix
        return segment_prefix(self.job_id, self.port)


def _role_env(base: Mapping[str, str], spec: Any, ip: str) -> dict[str, str]:
    env = {**base, **{k: v for k, v in spec.env.items() if v is not None},
           "DMLC_NODE_HOST": ip}
    return {k: v for k, v in env.items() if v is not None}


def _get(refs: list[Any], timeout: float, what: str) -> list[Any]:
    """``ray.get`` with a deadline whose error says what did not come up; a RayTaskError is
    unwrapped to the role's own exception (a ConfigError stays a ConfigError)."""
    from ray.exceptions import GetTimeoutError, RayTaskError
    try:
        return ray.get(refs, timeout=timeout)
    except GetTimeoutError:
        raise TimeoutError(f"{what} did not start within {timeout:g} s (start_timeout); is "
                           "the cluster short of resources?") from None
    except RayTaskError as exc:  # an instance of both RayTaskError and the role's exception
        raise exc.as_instanceof_cause() from None


# ------------------------------------------------------------------- on each training worker
def worker_node_ip() -> str:
    return ray.util.get_node_ip_address()


def apply_worker_env(changes: Mapping[str, str | None]) -> None:
    """Make ``changes`` this process's environment, before the training loop calls
    ``bps.init()`` (``None`` removes a variable)."""
    import os
    for name, value in changes.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def leave_job(graceful: bool, shm_dir: str, prefix: str,
              names: Sequence[str]) -> list[str]:
    """On a training worker at the end: leave the byteps_like job if the loop did not call
    ``bps.shutdown()`` (``graceful``: the scheduler still runs), remove the job's
    shared-memory segments on this node and the job's variables. Returns the segments
    removed."""
    import os
    import sys

    from byteps_like.launcher.shm import sweep
    if graceful and "byteps_like.worker.runtime" in sys.modules:
        from byteps_like.worker.runtime import default_runtime
        try:
            default_runtime().shutdown()
        except Exception as exc:  # noqa: BLE001 - the job is over either way
            log.warning("byteps_like: leaving the job: %s", exc)
    removed = sweep(shm_dir, prefix)
    for name in names:
        os.environ.pop(name, None)
    return removed
