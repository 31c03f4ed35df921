"""What bpslaunch starts: pure functions from settings to child specs (no processes, no I/O).

A :class:`ChildSpec` is one process to start: its role, rank, argv (never a shell string) and the
environment variables to set (a value of ``None`` removes an inherited one). Every other
variable of the launcher's environment passes through to the child unchanged.
"""
from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .binding import Binding

ROLES = ("scheduler", "server", "worker")
#: ``python -m <module>`` runs a role other than worker.
ROLE_MODULES = {"scheduler": "byteps_like.scheduler", "server": "byteps_like.server"}


@dataclass(frozen=True)
class ChildSpec:
    """One process of a launch."""

    role: str
    rank: int | None
    argv: tuple[str, ...]
    env: Mapping[str, str | None] = field(default_factory=dict)
    #: CPUs and NUMA node to run on (launcher/binding.py); None: wherever the OS puts it.
    binding: Binding | None = None

    @property
    def launch_argv(self) -> tuple[str, ...]:
        """The argv actually started: ``argv``, wrapped by numactl when bound through it."""
        return self.argv if self.binding is None else self.binding.wrap(self.argv)

    @property
    def name(self) -> str:
        """``scheduler``, ``server 0``, ``worker 3``: the prefix of its output lines."""
        return self.role if self.rank is None else f"{self.role} {self.rank}"

    @property
    def log_name(self) -> str:
        """File name under --log-dir: ``scheduler.log``, ``server-0.log``, ``worker-3.log``."""
        return f"{self.role}.log" if self.rank is None else f"{self.role}-{self.rank}.log"


@dataclass(frozen=True)
class LocalCluster:
    """The shape of a whole job on one machine (``bpslaunch --local``)."""

    command: tuple[str, ...]
    port: int
    workers: int = 2
    servers: int = 1
    local_size: int = 1
    host: str = "127.0.0.1"
    #: argv for the scheduler and server roles instead of ``python -m byteps_like.<role>``.
    role_argv: Mapping[str, Sequence[str]] = field(default_factory=dict)


def role_argv(role: str, overrides: Mapping[str, Sequence[str]] | None = None) -> tuple[str, ...]:
    """The argv that runs a scheduler or server: ``sys.executable -P -m byteps_like.<role>``.

    ``-P`` keeps the working directory off the child's ``sys.path``: run from a byteps_like
    source tree (its repository root) with a non-editable install, a plain ``-m`` would import
    the tree's ``byteps_like/``, which has no ``scheduler``/``server`` (they sit at the root and
    are mapped in by the install) and maybe no built ``_core``. Python 3.10 has no ``-P``: the
    same through runpy."""
    if overrides and role in overrides:
        return tuple(overrides[role])
    if sys.version_info >= (3, 11):
        return (sys.executable, "-P", "-m", ROLE_MODULES[role])
    return (sys.executable, "-c", "import runpy, sys; del sys.path[0]; runpy.run_module("
            f"{ROLE_MODULES[role]!r}, run_name='__main__', alter_sys=True)")


def torchrun_env(rank: int, world: int | None, local_rank: int, local_size: int) -> dict:
    """What torchrun sets, for scripts written against it: RANK, WORLD_SIZE (when known),
    LOCAL_RANK, LOCAL_WORLD_SIZE, with byteps_like's ranks (worker_id * local_size +
    local_rank)."""
    env = {"RANK": str(rank), "LOCAL_RANK": str(local_rank),
           "LOCAL_WORLD_SIZE": str(local_size)}
    if world is not None:
        env["WORLD_SIZE"] = str(world)
    return env


def local_cluster_plan(cluster: LocalCluster) -> list[ChildSpec]:
    """The scheduler, ``servers`` servers and ``workers`` x ``local_size`` worker processes.

    Worker rank = worker_id * local_size + local_rank. Started in the returned order.
    """
    if not cluster.command:
        raise ValueError("a local cluster needs the worker command")
    if not 0 < cluster.port < 65536:
        raise ValueError(f"port {cluster.port} is not a concrete TCP port; pick one first")
    for name in ("workers", "local_size"):
        if getattr(cluster, name) < 1:
            raise ValueError(f"{name} must be at least 1, not {getattr(cluster, name)}")
    if cluster.servers < (0 if cluster.workers == 1 else 1):
        raise ValueError(f"{cluster.workers} worker machines need at least 1 server, not "
                         f"{cluster.servers}")
    common: dict[str, str | None] = {
        "DMLC_NUM_WORKER": str(cluster.workers),
        "DMLC_NUM_SERVER": str(cluster.servers),
        "DMLC_PS_ROOT_URI": cluster.host,
        "DMLC_PS_ROOT_PORT": str(cluster.port),
        "DMLC_NODE_HOST": cluster.host,
        "BYTEPS_SERVER_PORT": "0",
        "BYTEPS_LOCAL_SIZE": str(cluster.local_size),
    }
    # A scheduler or server has no worker id or local rank; drop inherited ones.
    service = {**common, "DMLC_WORKER_ID": None, "BYTEPS_LOCAL_RANK": None}
    specs = [ChildSpec("scheduler", None, role_argv("scheduler", cluster.role_argv),
                       {**service, "DMLC_ROLE": "scheduler"})]
    specs += [ChildSpec("server", index, role_argv("server", cluster.role_argv),
                        {**service, "DMLC_ROLE": "server", "BYTEPS_SERVER_ID": str(index)})
              for index in range(cluster.servers)]
    specs += [ChildSpec("worker", worker_id * cluster.local_size + local_rank,
                        tuple(cluster.command),
                        {**common, "DMLC_ROLE": "worker", "DMLC_WORKER_ID": str(worker_id),
                         "BYTEPS_LOCAL_RANK": str(local_rank),
                         **torchrun_env(worker_id * cluster.local_size + local_rank,
                                        cluster.workers * cluster.local_size, local_rank,
                                        cluster.local_size)})
              for worker_id in range(cluster.workers)
              for local_rank in range(cluster.local_size)]
    return specs


def node_plan(role: str, command: Sequence[str], *, worker_id: int = 0, local_size: int = 1,
              role_overrides: Mapping[str, Sequence[str]] | None = None,
              num_workers: int | None = None) -> list[ChildSpec]:
    """What plain ``bpslaunch`` starts on one machine of a multi-machine job.

    A worker machine runs ``local_size`` copies of ``command`` with BYTEPS_LOCAL_RANK set; a
    scheduler or server machine runs that role's entry point (``command`` is not used).
    """
    if role == "worker":
        if not command:
            raise ValueError("a worker needs a command")
        return [ChildSpec("worker", worker_id * local_size + local_rank, tuple(command),
                          {"BYTEPS_LOCAL_RANK": str(local_rank),
                           "BYTEPS_LOCAL_SIZE": str(local_size),
                           **torchrun_env(worker_id * local_size + local_rank,
                                          None if num_workers is None
                                          else num_workers * local_size,
                                          local_rank, local_size)})
                for local_rank in range(local_size)]
    if role in ROLE_MODULES:
        return [ChildSpec(role, None, role_argv(role, role_overrides), {})]
    raise ValueError(f"unknown role {role!r}; expected one of {', '.join(ROLES)}")


def child_environment(base: Mapping[str, str], changes: Mapping[str, str | None]) -> dict[str, str]:
    """``base`` with ``changes`` applied (``None`` removes a variable). Output lines stream
    through pipes, so Python children run unbuffered unless the user said otherwise."""
    env = dict(base)
    env.setdefault("PYTHONUNBUFFERED", "1")
    for name, value in changes.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env
