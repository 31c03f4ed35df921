"""``bpslaunch slurm``: one SLURM task's share of a byteps_like job (docs/deployment.md, "SLURM").

Run one task per node (``srun --ntasks-per-node=1 bpslaunch slurm -- python train.py``, or
``sbatch scripts/sbatch_byteps_like.sh python train.py``). From SLURM's environment
(SLURM_JOB_ID, SLURM_JOB_NODELIST, SLURM_NODEID / SLURM_PROCID, SLURM_NNODES, SLURM_NTASKS) each
task works out the same layout:

* the first node of the allocation runs the scheduler (DMLC_PS_ROOT_URI = its name);
* the last ``--server-nodes`` nodes (default 0) run servers only; every other node is a worker
  machine (DMLC_WORKER_ID = its index) running ``--local-size`` copies of the command;
* ``--servers`` servers (default: one per server-hosting node) are spread round-robin over the
  dedicated server nodes, or over all nodes when there are none (colocated);
* DMLC_PS_ROOT_PORT = ``--port`` or 10000 + SLURM_JOB_ID mod 50000 and BYTEPS_JOB_ID =
  ``slurm-<SLURM_JOB_ID>`` (unless set), so jobs sharing nodes do not meet.

Authentication is on unless ``--no-auth``: the tasks of a job must share one secret, which they
cannot agree on by themselves, so BYTEPS_AUTH_SECRET (or BYTEPS_AUTH_SECRET_FILE) must come with
the job step; scripts/sbatch_byteps_like.sh generates one per job. Without it and without
``--no-auth`` bpslaunch slurm refuses to start (exit 2).

When a node runs more than one worker or server, they share its cores as with ``bpslaunch``
(launcher/shares.py: CPU sets and OMP_NUM_THREADS and the like; ``--no-bind``,
``--no-thread-share``, BYTEPS_THREAD_SHARE=0). Then it supervises its own processes like
``bpslaunch`` does (all-or-nothing).
Standard library, byteps_like.config, byteps_like.errors and byteps_like.topology only.
"""
from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .plan import ChildSpec, role_argv

PORT_BASE = 10000
PORT_SPAN = 50000


class SlurmError(Exception):
    """SLURM's environment is missing or inconsistent; the message says what."""


def expand_hostlist(text: str) -> list[str]:
    """SLURM's compressed host list: ``node[01-03,7],gpu-a[1-2]-ib`` -> node01 node02 node03
    node7 gpu-a1-ib gpu-a2-ib (as ``scontrol show hostnames`` does)."""
    names: list[str] = []
    for item in _split_top(text.strip()):
        if item:
            names += _expand_one(item)
    return names


def _split_top(text: str) -> list[str]:
    out, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise SlurmError(f"bad host list {text!r}: unbalanced ']'")
        elif ch == "," and depth == 0:
            out.append(text[start:i])
            start = i + 1
    if depth:
        raise SlurmError(f"bad host list {text!r}: unbalanced '['")
    out.append(text[start:])
    return out


def _expand_one(item: str) -> list[str]:
    m = re.match(r"^([^\[]*)\[([^\]]*)\](.*)$", item)
    if not m:
        return [item]
    prefix, ranges, rest = m.groups()
    tails = _expand_one(rest) if rest else [""]
    out = []
    for part in ranges.split(","):
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise SlurmError(f"bad host list range {part!r} in {item!r}")
        width = len(lo)
        for n in range(int(lo), int(hi if sep else lo) + 1):
            out += [f"{prefix}{n:0{width}d}{tail}" for tail in tails]
    return out


@dataclass(frozen=True)
class Layout:
    """The job over the allocation, the same in every task."""

    nodes: tuple[str, ...]
    worker_nodes: tuple[str, ...]
    server_hosts: tuple[str, ...]   # node of server s
    port: int
    job_id: str
    local_size: int

    @property
    def scheduler_host(self) -> str:
        return self.nodes[0]

    def env(self) -> dict[str, str]:
        return {"DMLC_NUM_WORKER": str(len(self.worker_nodes)),
                "DMLC_NUM_SERVER": str(len(self.server_hosts)),
                "DMLC_PS_ROOT_URI": self.scheduler_host, "DMLC_PS_ROOT_PORT": str(self.port),
                "BYTEPS_JOB_ID": self.job_id, "BYTEPS_LOCAL_SIZE": str(self.local_size)}

    def describe(self) -> str:
        return (f"SLURM layout: scheduler on {self.scheduler_host}:{self.port}, "
                f"{len(self.worker_nodes)} worker machine(s) x {self.local_size} process(es) "
                f"({', '.join(self.worker_nodes)}), {len(self.server_hosts)} server(s) on "
                f"{', '.join(self.server_hosts)}, BYTEPS_JOB_ID={self.job_id}")


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except KeyError:
        raise SlurmError(f"{name} is not set: run bpslaunch slurm inside a SLURM job step "
                         "(srun or sbatch)") from None
    except ValueError:
        raise SlurmError(f"{name}={env[name]!r} is not an integer") from None


def layout(env: Mapping[str, str], *, servers: int | None = None, server_nodes: int = 0,
           local_size: int | None = None, port: int | None = None) -> tuple[Layout, int]:
    """The job's layout and this task's node index, from SLURM's environment."""
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise SlurmError("SLURM_JOB_NODELIST is not set: run bpslaunch slurm inside a SLURM "
                         "job step (srun or sbatch)")
    nodes = tuple(expand_hostlist(nodelist))
    job = _int(env, "SLURM_JOB_ID")
    nnodes = int(env.get("SLURM_NNODES", len(nodes)))
    ntasks = int(env.get("SLURM_NTASKS", nnodes))
    if nnodes != len(nodes):
        raise SlurmError(f"SLURM_NNODES={nnodes} but SLURM_JOB_NODELIST names {len(nodes)} "
                         "nodes")
    if ntasks != nnodes:
        raise SlurmError(f"{ntasks} tasks on {nnodes} node(s): run exactly one task per node "
                         "(srun --ntasks-per-node=1); bpslaunch starts the processes of a node")
    index = int(env["SLURM_NODEID"]) if "SLURM_NODEID" in env else _int(env, "SLURM_PROCID")
    if not 0 <= index < len(nodes):
        raise SlurmError(f"node index {index} is outside the allocation of {len(nodes)} node(s)")
    if not 0 <= server_nodes < len(nodes):
        raise SlurmError(f"--server-nodes {server_nodes}: needs at least one worker node, and "
                         f"the allocation has {len(nodes)} node(s)")
    worker_nodes = nodes[:len(nodes) - server_nodes]
    hosts_for_servers = nodes[len(nodes) - server_nodes:] if server_nodes else nodes
    count = servers if servers is not None else len(hosts_for_servers)
    if count < 1:
        raise SlurmError(f"--servers must be at least 1, not {count}")
    if local_size is None:
        gpus = env.get("SLURM_GPUS_ON_NODE", "")
        local_size = int(gpus) if gpus.isdigit() and int(gpus) > 0 else 1
    if port is None:
        port = PORT_BASE + job % PORT_SPAN
    job_id = env.get("BYTEPS_JOB_ID") or f"slurm-{job}"
    server_hosts = tuple(hosts_for_servers[s % len(hosts_for_servers)] for s in range(count))
    return Layout(nodes, worker_nodes, server_hosts, port, job_id, local_size), index


def node_specs(lay: Layout, index: int, command: Sequence[str], *,
               node_host: str | None = None) -> list[ChildSpec]:
    """The processes of node ``index``: the scheduler (node 0), its servers, its workers."""
    me = lay.nodes[index]
    common = {**lay.env(), "DMLC_NODE_HOST": node_host or me, "BYTEPS_SERVER_PORT": "0"}
    service = {**common, "DMLC_WORKER_ID": None, "BYTEPS_LOCAL_RANK": None}
    specs = []
    if index == 0:
        specs.append(ChildSpec("scheduler", None, role_argv("scheduler"),
                               {**service, "DMLC_ROLE": "scheduler"}))
    specs += [ChildSpec("server", s, role_argv("server"), {**service, "DMLC_ROLE": "server"})
              for s, host in enumerate(lay.server_hosts) if host == me]
    if index < len(lay.worker_nodes):
        if not command:
            raise SlurmError("missing the worker command after --")
        specs += [ChildSpec("worker", index * lay.local_size + lr, tuple(command),
                            {**common, "DMLC_ROLE": "worker", "DMLC_WORKER_ID": str(index),
                             "BYTEPS_LOCAL_RANK": str(lr)})
                  for lr in range(lay.local_size)]
    return specs


def main(argv: Sequence[str], env: Mapping[str, str]) -> int:
    from byteps_like.config import load, unknown_settings_message
    from byteps_like.errors import ConfigError

    from .binding import probe
    from .job import JobSettings, run_job
    from .plan import child_environment
    from .shares import ShareSettings, share_host
    from .shm import segment_prefix, sweep

    argv = list(argv)
    options, command = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) \
        if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(
        prog="bpslaunch slurm", allow_abbrev=False,
        usage="srun --ntasks-per-node=1 bpslaunch slurm [options] -- COMMAND [ARG ...]",
        description="Run this node's share of a byteps_like job inside a SLURM allocation: "
                    "the first node runs the scheduler, servers and workers are spread over "
                    "the nodes (docs/deployment.md).")
    p.add_argument("--servers", type=int, help="servers, DMLC_NUM_SERVER (default: one per "
                   "server-hosting node)")
    p.add_argument("--server-nodes", type=int, default=0,
                   help="the last M nodes run servers only (default 0: colocated)")
    p.add_argument("--local-size", type=int, help="worker processes per node, "
                   "BYTEPS_LOCAL_SIZE (default SLURM_GPUS_ON_NODE or 1)")
    p.add_argument("--port", type=int, help="scheduler port (default 10000 + job id mod 50000)")
    p.add_argument("--node-host", help="address this node advertises (default: its SLURM "
                   "node name, or DMLC_NODE_HOST when set)")
    p.add_argument("--timeout", type=float, help="wall-clock limit, seconds")
    p.add_argument("--log-dir", help="write each process's output to DIR/<role>-<rank>.log")
    p.add_argument("--no-bind", action="store_true",
                   help="with several workers or servers on this node, give them no CPU sets "
                        "of their own (their thread counts are still shared)")
    p.add_argument("--no-thread-share", action="store_true",
                   help="do not split this node's cores among its workers and servers: no CPU "
                        "sets, no OMP_NUM_THREADS and the like (BYTEPS_THREAD_SHARE=0)")
    p.add_argument("--no-auth", action="store_true",
                   help="run without a secret (any host that reaches the nodes can join); "
                        "else BYTEPS_AUTH_SECRET or BYTEPS_AUTH_SECRET_FILE must be set for "
                        "every task (scripts/sbatch_byteps_like.sh generates one)")
    try:
        a = p.parse_args(options)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    env = dict(env)
    if a.no_auth:
        for name in ("BYTEPS_AUTH_SECRET", "BYTEPS_AUTH_SECRET_FILE"):
            env.pop(name, None)
    try:
        lay, index = layout(env, servers=a.servers, server_nodes=a.server_nodes,
                            local_size=a.local_size, port=a.port)
        specs = node_specs(lay, index, command,
                           node_host=a.node_host or env.get("DMLC_NODE_HOST") or None)
        cfg = load(env=child_environment(env, specs[0].env)) if specs else None
        if cfg is not None and cfg.unknown_settings and cfg.log.report_unknown:
            print(f"bpslaunch: warning: {unknown_settings_message(cfg)}", file=sys.stderr,
                  flush=True)  # once for this node: its processes do not repeat it (job.py)
        lines: list[str] = []
        if cfg is not None and cfg.placement.thread_share and not a.no_thread_share:
            # the scheduler, servers and workers of this node share its cores (shares.py)
            specs, lines = share_host(specs, probe(env), env, ShareSettings.from_config(cfg),
                                      bind=not a.no_bind)
    except (SlurmError, ConfigError, ValueError) as exc:
        print(f"bpslaunch slurm: error: {exc}", file=sys.stderr)
        return 2
    if not a.no_auth and not (env.get("BYTEPS_AUTH_SECRET", "").strip()
              or env.get("BYTEPS_AUTH_SECRET_FILE", "").strip()):
        print("bpslaunch slurm: error: no BYTEPS_AUTH_SECRET (or BYTEPS_AUTH_SECRET_FILE) for "
              "this job: every task needs the same secret, e.g. `export BYTEPS_AUTH_SECRET="
              "$(openssl rand -hex 32)` before srun (scripts/sbatch_byteps_like.sh does it), or "
              "pass --no-auth to run unauthenticated", file=sys.stderr)
        return 2
    if index == 0:
        print(f"bpslaunch: {lay.describe()}", file=sys.stderr, flush=True)
    for line in lines:
        print(f"bpslaunch: {line}", file=sys.stderr, flush=True)
    if not specs or cfg is None:
        return 0
    grace = cfg.timeouts.heartbeat_timeout + 5.0
    try:
        return run_job(specs, env, JobSettings(grace=grace, timeout=a.timeout,
                                               log_dir=a.log_dir))
    finally:  # this node's segments, whatever became of its workers
        if index < len(lay.worker_nodes):
            sweep(cfg.cluster.shm_dir, segment_prefix(lay.job_id, lay.port) + f"m{index}-")
