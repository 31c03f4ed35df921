"""The bpslaunch command line: options, validation through byteps_like.config, the launch.

Imports only the standard library, byteps_like.config, byteps_like.errors and (through
binding.py) the standard-library-only byteps_like.topology, so it runs on a machine with no
deep-learning framework installed.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from byteps_like.config import load, resolve_root, unknown_settings_message
from byteps_like.errors import ConfigError
from byteps_like.topology import format_cpu_list

from . import shm
from .binding import Machine, NoBinding, bind_workers, probe
from .job import EXIT_CANNOT_EXECUTE, EXIT_NOT_FOUND, JobSettings, run_job
from .plan import (
    ROLE_MODULES,
    ChildSpec,
    LocalCluster,
    child_environment,
    local_cluster_plan,
    node_plan,
)
from .procs import free_port
from .shares import ShareSettings, share_host, sharing

EXIT_USAGE = 2
DEFAULT_WORKERS = 2
DEFAULT_SERVERS = 1
DEFAULT_LOCAL_SIZE = 1
DEFAULT_HOST = "127.0.0.1"
DEFAULT_SHUTDOWN_TIMEOUT = 30.0
#: The default grace period is the heartbeat timeout plus this, so that survivors have time to
#: notice the lost peer and report it themselves.
GRACE_MARGIN_S = 5.0

# Internal, for tests only (hidden from --help): ``--_role-cmd ROLE=JSON_ARGV`` replaces the
# argv of the scheduler or server role, e.g. ``--_role-cmd 'server=["python","-c","..."]'``, so
# the supervision can be exercised with stand-in processes. Not a user interface.
_ROLE_CMD_OPTION = "--_role-cmd"

_USAGE = """\
bpslaunch [options] [--] COMMAND [ARG ...]
       bpslaunch --local [--workers N] [--servers M] [--local-size L] [--port P] [--host H]
                 [options] -- COMMAND [ARG ...]
       bpslaunch plan|k8s|slurm|status ...   (bpslaunch SUBCOMMAND --help)"""

_DESCRIPTION = """\
Start the processes of a byteps_like job and supervise them (all-or-nothing: when one fails,
the rest are stopped and bpslaunch exits non-zero naming the first failure).

Without --local, the role comes from DMLC_ROLE (the BytePS environment contract): a worker
machine runs BYTEPS_LOCAL_SIZE copies of COMMAND with BYTEPS_LOCAL_RANK=0..L-1; a server or
scheduler machine runs `python -m byteps_like.server` / `byteps_like.scheduler`.
With --local, a whole cluster (scheduler, servers, workers) runs on this machine."""

_EPILOG = """\
exit status: 0 success; the status of the first process that failed on its own (128+N if
killed by signal N); 75 only processes that stopped because another one failed (exit status
75) were seen; 1 scheduler/server did not shut down; 2 usage or configuration error;
124 --timeout; 126 command not executable; 127 command not found; 130/143 interrupted by
SIGINT/SIGTERM. See docs/launcher.md."""


class UsageError(Exception):
    """A bad command line; the message is shown after the usage text (exit status 2)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print and sys.exit(2); main() does that
        raise UsageError(message)


def default_servers(args, env) -> int:
    """Servers of a local cluster when --servers is not given: none for one worker machine with
    several local ranks (push_pull stays on the machine, BYTEPS_FORCE_DISTRIBUTED aside),
    else DEFAULT_SERVERS."""
    workers = args.workers or DEFAULT_WORKERS
    local_size = args.local_size or DEFAULT_LOCAL_SIZE
    forced = str(env.get("BYTEPS_FORCE_DISTRIBUTED", "")).strip().lower() in (
        "1", "true", "yes", "on")
    return 0 if workers == 1 and local_size > 1 and not forced else DEFAULT_SERVERS


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 0")
    return value


def _port(text: str) -> int:
    value = _positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a TCP port (1-65535)")
    return value


def _dashboard_port(text: str) -> int:
    return 0 if text == "0" else _port(text)


def _seconds(allow_zero: bool):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
        if not value == value or value < 0 or (value == 0 and not allow_zero):
            raise argparse.ArgumentTypeError(f"must be {'>= 0' if allow_zero else '> 0'}, "
                                             f"not {text}")
        return value
    parse.__name__ = "seconds"
    return parse


def _role_cmd(text: str) -> tuple[str, tuple[str, ...]]:
    role, sep, argv_json = text.partition("=")
    try:
        argv = json.loads(argv_json) if sep else None
    except ValueError:
        argv = None
    if role not in ROLE_MODULES or not isinstance(argv, list) or not argv \
            or not all(isinstance(a, str) for a in argv):
        raise argparse.ArgumentTypeError("expected ROLE=JSON_LIST_OF_STRINGS, ROLE one of "
                                         + ", ".join(ROLE_MODULES))
    return role, tuple(argv)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="bpslaunch", usage=_USAGE, description=_DESCRIPTION, epilog=_EPILOG,
                     formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    parser.add_argument("--version", action="version",
                        version=f"bpslaunch (byteps_like {package_version()})")
    local = parser.add_argument_group("local cluster (--local)")
    local.add_argument("--local", action="store_true",
                       help="run scheduler, servers and workers on this machine")
    local.add_argument("--workers", type=_positive_int, metavar="N",
                       help=f"worker machines, DMLC_NUM_WORKER (default {DEFAULT_WORKERS})")
    local.add_argument("--servers", type=_positive_int, metavar="M",
                       help=f"servers, DMLC_NUM_SERVER (default {DEFAULT_SERVERS}; none for "
                            "--workers 1 with --local-size > 1, where push_pull stays on the "
                            "machine unless BYTEPS_FORCE_DISTRIBUTED=1)")
    local.add_argument("--local-size", type=_positive_int, metavar="L",
                       help="processes per worker machine, BYTEPS_LOCAL_SIZE "
                            f"(default {DEFAULT_LOCAL_SIZE})")
    local.add_argument("--port", type=_port, metavar="P",
                       help="scheduler port, DMLC_PS_ROOT_PORT (default: a free port)")
    local.add_argument("--host", metavar="H",
                       help=f"address of every process, DMLC_PS_ROOT_URI and DMLC_NODE_HOST "
                            f"(default {DEFAULT_HOST})")
    local.add_argument("--auth", action="store_true", default=None,
                       help="the default: generate a one-time BYTEPS_AUTH_SECRET for this job "
                            "(unless one is set), so that only its processes can join it")
    local.add_argument("--no-auth", action="store_true", default=None,
                       help="no secret: authentication off (an inherited BYTEPS_AUTH_SECRET "
                            "or BYTEPS_AUTH_SECRET_FILE is not passed on)")
    local.add_argument("--status", action="store_true", default=None,
                       help="show a live status of the cluster (a redrawn screen on a "
                            "terminal, a status line every few seconds otherwise); implies "
                            "--metrics (docs/observability.md)")
    local.add_argument("--metrics", action="store_true", default=None,
                       help="give every process a free BYTEPS_METRICS_PORT (Prometheus) and "
                            "print the addresses")
    parser.add_argument("--dashboard", nargs="?", const=0, type=_dashboard_port,
                        metavar="PORT", help="the scheduler serves the live job page on "
                        "127.0.0.1:PORT (--dashboard=PORT; bare: a free port), "
                        "BYTEPS_DASHBOARD_PORT; bpslaunch prints its address "
                        "(docs/observability.md)")
    parser.add_argument("--backup-workers", type=_non_negative_int, metavar="B",
                        help="BYTEPS_BACKUP_WORKERS: a round of an averaged tensor completes "
                             "once all but B workers pushed it; the late ones catch up with "
                             "the same sums (docs/reliability.md, 'Backup workers'; with two "
                             "servers or more also set BYTEPS_SERVER_FAILOVER=0)")
    sup = parser.add_argument_group("supervision")
    sup.add_argument("--timeout", type=_seconds(False), metavar="SECONDS",
                     help="wall-clock limit of the whole job; on expiry everything is "
                          "stopped and bpslaunch exits 124 (default: none)")
    sup.add_argument("--grace", type=_seconds(True), metavar="SECONDS",
                     help="after the first failure, how long the others may take to exit on "
                          "their own before SIGTERM (default: heartbeat timeout + "
                          f"{GRACE_MARGIN_S:g} s)")
    sup.add_argument("--server-restarts", type=int, default=3, metavar="N",
                     help="a server lost while the job goes on (BYTEPS_SERVER_FAILOVER) is "
                          "started again, at most N times in all; the new one takes its keys "
                          "back (default 3; 0: never)")
    sup.add_argument("--scheduler-restarts", type=int, default=3, metavar="N",
                     help="a scheduler that fails while the job runs is started again at the "
                          "same address, at most N times; the nodes register again with it "
                          "(default 3; 0: a lost scheduler ends the job)")
    sup.add_argument("--timeout-shutdown", type=_seconds(False), metavar="SECONDS",
                     default=DEFAULT_SHUTDOWN_TIMEOUT,
                     help="after the last worker exits 0, how long the scheduler and servers "
                          f"may take to exit (default {DEFAULT_SHUTDOWN_TIMEOUT:g})")
    sup.add_argument("--log-dir", metavar="DIR",
                     help="also write each process's output to DIR/<role>-<rank>.log "
                          "(scheduler.log for the scheduler)")
    el = parser.add_argument_group("elastic training (docs/elastic.md)")
    el.add_argument("--elastic", action="store_true", default=None,
                    help="an elastic job (BYTEPS_ELASTIC=1): workers may be lost and join "
                         "while it runs; with --local, --workers is the starting count")
    el.add_argument("--min-workers", type=_positive_int, metavar="N",
                    help="fewest workers the job runs with, BYTEPS_ELASTIC_MIN_WORKERS "
                         "(default 1); below it for longer than --elastic-timeout it fails "
                         "with TooFewWorkersError")
    el.add_argument("--max-workers", type=_positive_int, metavar="M",
                    help="most workers at once, BYTEPS_ELASTIC_MAX_WORKERS (default: the "
                         "starting count)")
    el.add_argument("--elastic-timeout", type=_seconds(True), metavar="SECONDS",
                    help="how long the job may stay below --min-workers, "
                         "BYTEPS_ELASTIC_TIMEOUT_SECONDS (default 60)")
    el.add_argument("--max-restarts", type=_non_negative_int, metavar="R",
                    help=f"--local: lost workers bpslaunch replaces with fresh ones (default "
                         f"{DEFAULT_MAX_RESTARTS})")
    el.add_argument("--add-workers", type=_non_negative_int, metavar="N",
                    help="--local: start N more workers --add-after seconds into the run "
                         "(they join at the next commit; at most --max-workers run at once)")
    el.add_argument("--add-after", type=_seconds(True), metavar="SECONDS",
                    help="when --add-workers starts them (default 0)")
    bind = parser.add_argument_group("CPU binding and thread shares (docs/topology.md)")
    bind.add_argument("--no-bind", action="store_true",
                      help="start the processes without binding them to CPUs and a NUMA node "
                           "(by default each local rank is bound, and with several workers "
                           "or servers on this host each worker gets CPUs of its own, servers "
                           "float over all of them; see "
                           "BYTEPS_NUMA_ON, BYTEPS_VISIBLE_CPU_CORES, BYTEPS_CPU_BLACKLIST)")
    bind.add_argument("--no-thread-share", action="store_true",
                      help="with several workers or servers on this host, do not split its "
                           "cores among them: no CPU sets for servers and the scheduler, no "
                           "OMP_NUM_THREADS and the like (BYTEPS_THREAD_SHARE=0)")
    parser.add_argument(_ROLE_CMD_OPTION, type=_role_cmd, action="append", default=[],
                        dest="role_cmd", help=argparse.SUPPRESS)
    return parser


_VALUE_OPTIONS = frozenset({"--workers", "--servers", "--local-size", "--port", "--host",
                            "--timeout", "--grace", "--timeout-shutdown", "--log-dir",
                            "--server-restarts", "--scheduler-restarts", "--backup-workers",
                            "--min-workers", "--max-workers", "--elastic-timeout",
                            "--max-restarts", "--add-workers", "--add-after",
                            _ROLE_CMD_OPTION})
_LOCAL_ONLY = ("workers", "servers", "local_size", "port", "host", "auth", "no_auth", "status",
               "metrics", "max_restarts", "add_workers", "add_after")
#: Options that need --elastic.
_ELASTIC_ONLY = ("min_workers", "max_workers", "elastic_timeout", "max_restarts", "add_workers",
                 "add_after")
DEFAULT_MAX_RESTARTS = 3
#: What makes a job authenticated; --no-auth keeps both from the children.
AUTH_VARIABLES = ("BYTEPS_AUTH_SECRET", "BYTEPS_AUTH_SECRET_FILE")


#: Other launchers' options people type out of habit (torchrun's, horovodrun's), each with
#: whether it takes a value and what bpslaunch says instead (``{v}``: the value given).
FOREIGN_OPTIONS: dict[str, tuple[str, bool, str]] = {
    "--nproc_per_node": ("torchrun", True, "--local-size {v} with --local (bpslaunch --local "
                         "--workers 1 --local-size {v} -- COMMAND: {v} processes on this "
                         "machine), or BYTEPS_LOCAL_SIZE={v} on each machine of a job of "
                         "several"),
    "--nnodes": ("torchrun", True, "--workers {v} with --local ({v} worker machines simulated "
                 "on this one), or DMLC_NUM_WORKER={v} on every machine of a job of several"),
    "--node_rank": ("torchrun", True, "DMLC_WORKER_ID={v} in that machine's environment"),
    "--master_addr": ("torchrun", True, "DMLC_PS_ROOT_URI={v} (the scheduler's host) on every "
                      "machine, or --host {v} with --local"),
    "--master_port": ("torchrun", True, "--port {v} with --local, or DMLC_PS_ROOT_PORT={v} on "
                      "every machine"),
    "--standalone": ("torchrun", False, "--local (a whole job on this machine)"),
    "-np": ("horovodrun", True, "--local --workers {v} ({v} worker processes on this machine; "
            "or --workers W --local-size L with W x L = {v})"),
    "-H": ("horovodrun", True, "one bpslaunch per machine: DMLC_WORKER_ID=i "
           "BYTEPS_LOCAL_SIZE=<slots> bpslaunch COMMAND on host i, with DMLC_NUM_WORKER, "
           "DMLC_PS_ROOT_URI and DMLC_PS_ROOT_PORT set everywhere (or bpslaunch slurm / k8s)"),
}
for _name, _alias in (("--nproc_per_node", "--nproc-per-node"), ("--node_rank", "--node-rank"),
                      ("--master_addr", "--master-addr"), ("--master_port", "--master-port"),
                      ("-np", "--num-proc"), ("-H", "--hosts")):
    FOREIGN_OPTIONS[_alias] = FOREIGN_OPTIONS[_name]


def foreign_option_error(options: Sequence[str]) -> str | None:
    """The usage error for torchrun's or horovodrun's options among ``options`` (what
    bpslaunch says instead, for each), or None."""
    found, tools = [], set()
    i = 0
    while i < len(options):
        word, _, inline = options[i].partition("=")
        if word in FOREIGN_OPTIONS:
            tool, takes_value, instead = FOREIGN_OPTIONS[word]
            value = inline
            if takes_value and not inline and i + 1 < len(options):
                value = options[i + 1]
                i += 1
            given = f"{word} {value}" if value else word
            tools.add(tool)
            found.append(f"{given} is {tool}'s option; bpslaunch's is "
                         + instead.format(v=value or "N"))
        i += 1
    if not found:
        return None
    return "; ".join(found) + (". Or keep torchrun: a byteps_like script it starts joins its "
                               "job (docs/launcher.md, \"torchrun\")" if "torchrun" in tools
                               else "")


def split_command(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Split at ``--`` or at the first word that is neither an option nor an option's value
    (torchrun's and horovodrun's options count as options, so that their error names them)."""
    argv = list(argv)
    i = 0
    while i < len(argv):
        word = argv[i]
        if word == "--":
            return argv[:i], argv[i + 1:]
        if word.startswith("-") and word != "-":
            foreign = FOREIGN_OPTIONS.get(word)
            i += 2 if word in _VALUE_OPTIONS or (foreign and foreign[1]) else 1
            continue
        return argv[:i], argv[i:]
    return argv, []


@dataclass(frozen=True)
class Launch:
    """Everything run_job needs: what to start, from which environment, under which policy."""

    specs: tuple[ChildSpec, ...]
    base_env: Mapping[str, str]
    settings: JobSettings
    notes: tuple[str, ...] = ()
    #: The launch plan, printed at start: one line per bound worker (``worker 0 (local rank 0)
    #: -> CPUs 0-1, NUMA node 0 (numactl)``), and with thread shares one per process with its
    #: thread count (``...; 2 threads (OMP_NUM_THREADS)``), then notes.
    binding: tuple[str, ...] = ()
    #: (directory, name prefix) of the shared-memory segments this launch's workers may
    #: create, removed when the job ends (launcher/shm.py); None: no worker here.
    segments: tuple[str, str] | None = None
    #: ``--local --elastic``: the supervision of an elastic job (launcher/elastic.py).
    elastic: object | None = None


class CommandError(Exception):
    """The worker command cannot be executed; carries the exit status (126 or 127)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    options, command = split_command(argv)
    foreign = foreign_option_error(options)
    if foreign:
        raise UsageError(foreign)
    args = build_parser().parse_args(options)
    if not args.elastic:
        given = [f"--{name.replace('_', '-')}" for name in _ELASTIC_ONLY
                 if getattr(args, name) is not None]
        if given:
            raise UsageError(f"{', '.join(given)}: only valid with --elastic")
    if not args.local:
        given = [f"--{name.replace('_', '-')}" for name in _LOCAL_ONLY
                 if getattr(args, name) is not None]
        if given:
            raise UsageError(f"{', '.join(given)}: only valid with --local")
    return args, command


def plan_launch(args: argparse.Namespace, command: Sequence[str],
                env: Mapping[str, str], *, machine: Machine | None = None) -> Launch:
    """Validate the settings through byteps_like.config and plan the children.

    ``machine`` is what binding knows of this machine (default: :func:`binding.probe` of the
    real one). Raises ConfigError (bad setting), UsageError or CommandError.
    """
    role_overrides = dict(args.role_cmd)
    notes: list[str] = []
    elastic = None
    command = python_script(command, notes)
    if args.backup_workers is not None:  # every child: checked below with the others
        env = {**env, "BYTEPS_BACKUP_WORKERS": str(args.backup_workers)}
    if args.elastic:
        env, elastic = elastic_env(args, env)
    if args.local:
        if not command:
            raise UsageError("--local needs the worker command after --")
        env = local_job_env(args, env, notes)
        host = args.host or DEFAULT_HOST
        cluster = LocalCluster(
            command=tuple(command), port=port_free(host, args.port or 0),
            workers=args.workers or DEFAULT_WORKERS,
            servers=args.servers or default_servers(args, env),
            local_size=args.local_size or DEFAULT_LOCAL_SIZE, host=host,
            role_argv=role_overrides)
        note_overridden_sizes(cluster, env, notes)
        specs = local_cluster_plan(cluster)
        if elastic is not None:
            from .elastic import elastic_worker_specs
            specs = elastic_worker_specs(specs)
    else:
        cfg = _load(env, notes)
        resolve_root(cfg)  # an unresolvable scheduler host: now, not after the registration timeout
        if command and not any(k.startswith("DMLC_") or k == "BYTEPS_LOCAL_SIZE" for k in env):
            notes.append(f"note: no --local and no DMLC_* environment: running "
                         f"{' '.join(os.path.basename(c) for c in command)} as a job of one "
                         "worker process with no scheduler and no servers; "
                         "bpslaunch --local --workers N runs a "
                         "cluster on this machine, and a job of several machines needs "
                         "DMLC_ROLE, DMLC_NUM_WORKER, DMLC_NUM_SERVER, DMLC_PS_ROOT_URI and "
                         "DMLC_PS_ROOT_PORT on each (docs/launcher.md)")
        role = cfg.cluster.role
        if role == "worker" and not command:
            raise UsageError("missing the worker command (DMLC_ROLE is "
                             f"{env.get('DMLC_ROLE', 'unset, so worker')})")
        if role != "worker" and command:
            notes.append(f"note: DMLC_ROLE={role} runs python -m {ROLE_MODULES[role]}; "
                         f"ignoring the command {' '.join(command)!r}")
        specs = node_plan(role, command, worker_id=cfg.cluster.worker_id or 0,
                          local_size=cfg.cluster.local_size, role_overrides=role_overrides,
                          num_workers=cfg.cluster.num_worker)
    configs = [_load(child_environment(env, spec.env), notes) for spec in specs]
    for spec in specs:
        if spec.role == "worker":
            check_executable(spec.argv[0], child_environment(env, spec.env))
            check_script(spec.argv)
            break
    grace = args.grace
    if grace is None:
        grace = configs[0].timeouts.heartbeat_timeout + GRACE_MARGIN_S
    first = configs[0]
    settings = JobSettings(grace=grace, shutdown_timeout=args.timeout_shutdown,
                           timeout=args.timeout, log_dir=args.log_dir,
                           server_failover=first.can_lose_servers,
                           # an asynchronous job's keys stay where their snapshots put
                           # them (server/async_snapshots.py): a restart would be refused
                           server_restarts=0 if first.server.enable_async
                           else max(0, args.server_restarts),
                           scheduler_restarts=max(0, args.scheduler_restarts))
    lines: list[str] = []
    worker_cfg = next((c for s, c in zip(specs, configs) if s.role == "worker"), None)
    segments = None
    if worker_cfg is not None:
        c = worker_cfg.cluster
        segments = (c.shm_dir, shm.segment_prefix(c.job_id, c.root_port)
                    + ("" if args.local else f"m{c.worker_id or 0}-"))
    if configs[0].placement.thread_share and not args.no_thread_share and sharing(specs):
        specs, lines = _share(specs, worker_cfg or configs[0], env, machine, notes,
                              bind=not args.no_bind)
    elif worker_cfg is not None and not args.no_bind:
        specs, lines = _bind(specs, worker_cfg, env, machine, notes)
    return Launch(tuple(specs), dict(env), settings, tuple(notes), tuple(lines), segments,
                  elastic)


def elastic_env(args: argparse.Namespace, env: Mapping[str, str]):
    """The children's environment of an elastic job (BYTEPS_ELASTIC and its bounds) and, with
    --local, the supervision settings (launcher/elastic.py). Bounds that contradict each other
    (--min-workers > --workers, --max-workers < --workers) are usage errors."""
    env = dict(env)
    start = args.workers or DEFAULT_WORKERS if args.local else None
    lo = args.min_workers or 1
    hi = args.max_workers or (start if start is not None else 0)
    if start is not None and lo > start:
        raise UsageError(f"--min-workers {lo} is more than --workers {start} (the starting "
                         "count)")
    if start is not None and hi < start:
        raise UsageError(f"--max-workers {hi} is less than --workers {start} (the starting "
                         "count)")
    if hi and lo > hi:
        raise UsageError(f"--min-workers {lo} is more than --max-workers {hi}")
    if args.local and (args.local_size or 1) != 1:
        raise UsageError("--elastic runs one worker process per machine; leave --local-size "
                         "out")
    env["BYTEPS_ELASTIC"] = "1"
    env["BYTEPS_FORCE_DISTRIBUTED"] = "1"  # one worker left still pushes through the servers
    env["BYTEPS_ELASTIC_MIN_WORKERS"] = str(lo)
    if hi:
        env["BYTEPS_ELASTIC_MAX_WORKERS"] = str(hi)
    if args.elastic_timeout is not None:
        env["BYTEPS_ELASTIC_TIMEOUT_SECONDS"] = f"{args.elastic_timeout:g}"
    if not args.local:
        return env, None
    from .elastic import ElasticSettings
    return env, ElasticSettings(
        min_workers=lo, max_workers=hi,
        max_restarts=DEFAULT_MAX_RESTARTS if args.max_restarts is None else args.max_restarts,
        add_workers=args.add_workers or 0, add_after=args.add_after or 0.0)


def note_overridden_sizes(cluster: LocalCluster, env: Mapping[str, str],
                          notes: list[str]) -> None:
    """--local sets the job's sizes from its options (or their defaults): say so when the
    environment exported other ones, which the children do not get."""
    used = {"DMLC_NUM_WORKER": (cluster.workers, "--workers"),
            "DMLC_NUM_SERVER": (cluster.servers, "--servers"),
            "BYTEPS_LOCAL_SIZE": (cluster.local_size, "--local-size")}
    for name, (value, option) in used.items():
        exported = env.get(name, "").strip()
        if exported and exported != str(value):
            notes.append(f"note: --local runs {option} {value}: ignoring the exported "
                         f"{name}={exported} (pass {option} {exported} to use it)")


def local_job_env(args: argparse.Namespace, env: Mapping[str, str],
                  notes: list[str]) -> dict[str, str]:
    """The environment of a ``--local`` job: a job id of its own unless BYTEPS_JOB_ID is set
    (two local jobs never merge, even on one port), a one-time secret unless one is set or
    ``--no-auth`` (whatever the transport), and, on a loopback host, UCX on the loopback
    device only (UCX_NET_DEVICES=lo unless set)."""
    env = dict(env)
    if args.auth and args.no_auth:
        raise UsageError("--auth and --no-auth contradict each other")
    if not env.get("BYTEPS_JOB_ID", "").strip():
        env["BYTEPS_JOB_ID"] = shm.local_job_id()
    if args.no_auth:
        dropped = [name for name in AUTH_VARIABLES if env.pop(name, None)]
        if dropped:
            notes.append(f"note: --no-auth: not passing {' and '.join(dropped)} on")
    elif not any(env.get(name, "").strip() for name in AUTH_VARIABLES):
        # every transport: over UCX the data plane's streams prove the secret as TCP streams
        # do, and the control plane stays on ZeroMQ with CURVE (issue 41)
        import secrets
        env["BYTEPS_AUTH_SECRET"] = secrets.token_hex(32)  # 256 bits, this job only
    host = (args.host or DEFAULT_HOST).strip("[]")
    if ((host == "localhost" or host.startswith("127.") or host == "::1")
            and not env.get("UCX_NET_DEVICES")):
        # a job on loopback listens on loopback only: UCX's TCP transport would listen on
        # every interface's address, once per UCP worker (issue 41)
        env["UCX_NET_DEVICES"] = "lo"
    return env


def _bind(specs: list[ChildSpec], cfg, env: Mapping[str, str], machine: Machine | None,
          notes: list[str]) -> tuple[list[ChildSpec], list[str]]:
    """Bind the workers (binding.py). A placement the user's own CPU settings make impossible
    is a ConfigError; with the default settings, bpslaunch runs unbound with a note."""
    p = cfg.placement
    try:
        return bind_workers(specs, machine if machine is not None else probe(env),
                            local_size=cfg.cluster.local_size, numa_on=p.numa_on,
                            visible_cpus=p.visible_cpu_cores, blacklist=p.cpu_blacklist)
    except ValueError as exc:
        if p.visible_cpu_cores or p.cpu_blacklist:
            raise ConfigError(f"cannot bind the local workers with BYTEPS_VISIBLE_CPU_CORES="
                              f"{format_cpu_list(p.visible_cpu_cores)!r} and BYTEPS_CPU_BLACKLIST="
                              f"{format_cpu_list(p.cpu_blacklist)!r}: {exc}") from None
        reason = str(exc)
    except NoBinding as exc:
        reason = str(exc)
    notes.append(f"note: not binding the workers to CPUs: {reason} (--no-bind silences this)")
    return specs, []


def _share(specs: list[ChildSpec], cfg, env: Mapping[str, str], machine: Machine | None,
           notes: list[str], *, bind: bool) -> tuple[list[ChildSpec], list[str]]:
    """Split this host's cores among its workers and servers (shares.py). As with _bind, a
    split the user's own CPU settings make impossible is a ConfigError; otherwise the
    processes run unbound, with their thread counts and a note."""
    settings = ShareSettings.from_config(cfg)
    try:
        specs, lines = share_host(specs, machine if machine is not None else probe(env), env,
                                  settings, bind=bind)
    except ValueError as exc:
        p = cfg.placement
        raise ConfigError(f"cannot bind the local processes with BYTEPS_VISIBLE_CPU_CORES="
                          f"{format_cpu_list(p.visible_cpu_cores)!r} and BYTEPS_CPU_BLACKLIST="
                          f"{format_cpu_list(p.cpu_blacklist)!r}: {exc}") from None
    # as with _bind: why nothing is bound comes first, among the notes
    notes += [line + " (--no-bind silences this)" for line in lines
              if line.startswith("note: not binding")]
    return specs, [line for line in lines if not line.startswith("note: not binding")]


def _load(env: Mapping[str, str], notes: list[str]):
    """``byteps_like.config.load`` for one child's environment; unknown BYTEPS_*/DMLC_* names
    become a note, printed once for the whole launch: the children do not repeat it
    (BYTEPS_REPORT_UNKNOWN_SETTINGS=0, launcher/job.py)."""
    cfg = load(env=dict(env))
    note = f"warning: {unknown_settings_message(cfg)}"
    if cfg.unknown_settings and cfg.log.report_unknown and note not in notes:
        notes.append(note)
    return cfg


def port_free(host: str, port: int) -> int:
    """``port`` if the scheduler can bind it on ``host`` now (0: a free one the OS picks); else a
    usage error naming the port and the setting, before any process starts (not a ZeroMQ
    traceback from the scheduler)."""
    if not port:
        return _bind_probe(host, 0, f"cannot find a free port on --host {host}")
    return _bind_probe(host, port, f"port {port} on {host} is in use or not available "
                       "(--port / DMLC_PS_ROOT_PORT): stop what holds it, or leave --port out "
                       "to pick a free one")


def _bind_probe(host: str, port: int, what: str) -> int:
    try:
        return free_port(host, port)
    except OSError as exc:
        raise UsageError(f"{what}: {exc.strerror or exc}") from None


def python_script(command: Sequence[str], notes: list[str]) -> list[str]:
    """``bpslaunch train.py ...`` runs ``train.py`` with this Python, as torchrun does (a note
    says so in the launch plan); any other command is left as it is."""
    command = list(command)
    if command and command[0].endswith(".py"):
        notes.append(f"note: running {command[0]} with this Python: {sys.executable} "
                     f"{command[0]}")
        command.insert(0, sys.executable)
    return command


def check_executable(program: str, env: Mapping[str, str]) -> str:
    """Resolve ``program`` like exec would (PATH of the child's environment), or raise."""
    if os.sep in program or (os.altsep and os.altsep in program):
        if not os.path.exists(program):
            raise CommandError(f"command not found: {program!r} (no such file)", EXIT_NOT_FOUND)
        if os.path.isdir(program) or not os.access(program, os.X_OK):
            raise CommandError(f"command not executable: {program!r} (permission denied or "
                               "not a file)", EXIT_CANNOT_EXECUTE)
        return program
    found = shutil.which(program, path=env.get("PATH", os.defpath))
    if found is None:
        raise CommandError(f"command not found: {program!r} (not in PATH)", EXIT_NOT_FOUND)
    return found


def check_script(argv: Sequence[str]) -> None:
    """``python SCRIPT.py ...`` with no such script: the same 127 as a missing program, said at
    once instead of every worker failing with Python's own exit status 2 (a usage error's)."""
    if len(argv) < 2 or not os.path.basename(argv[0]).startswith("python"):
        return
    script = argv[1]
    if script.endswith(".py") and not os.path.exists(script):
        raise CommandError(f"script not found: {script!r} (from {os.getcwd()})", EXIT_NOT_FOUND)


def package_version() -> str:
    try:
        from importlib.metadata import PackageNotFoundError, version
        return version("byteps_like")
    except (ImportError, PackageNotFoundError):
        return "unknown"


#: ``bpslaunch SUBCOMMAND ...``: tools beside the launch itself (docs/deployment.md).
SUBCOMMANDS = {"plan": "recommend servers, placement and partition size (launcher/planner.py)",
               "k8s": "write Kubernetes manifests for a job (launcher/k8s.py)",
               "slurm": "run this SLURM task's share of a job (launcher/slurm.py)",
               "status": "a running job's status from its live page (launcher/status.py)"}


def run_subcommand(name: str, argv: Sequence[str], env: Mapping[str, str]) -> int:
    """``bpslaunch plan|k8s|slurm|status ...``; imported on use."""
    if name == "plan":
        from .planner import main as sub_main
        return sub_main(argv)
    if name == "k8s":
        from .k8s import main as sub_main
        return sub_main(argv)
    if name == "status":
        from .status import main as status_main
        return status_main(argv, env)
    from .slurm import main as slurm_main
    return slurm_main(argv, env)


def main(argv: Sequence[str] | None = None, *, environ: Mapping[str, str] | None = None) -> int:
    """Run bpslaunch; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    env = dict(os.environ if environ is None else environ)
    if argv and argv[0] in SUBCOMMANDS:
        return run_subcommand(argv[0], argv[1:], env)
    try:
        args, command = parse_args(argv)
        launch = plan_launch(args, command, env)
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else 0
    except UsageError as exc:
        print(f"usage: {_USAGE}\nbpslaunch: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ConfigError as exc:
        print(f"bpslaunch: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except CommandError as exc:
        print(f"bpslaunch: error: {exc}", file=sys.stderr)
        return exc.status
    for note in (*launch.notes, *launch.binding):
        print(f"bpslaunch: {note}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    if args.local and launch.segments is not None:  # what killed (SIGKILL) launches left
        removed = (shm.sweep_dead_local_jobs(launch.segments[0])
                   + shm.sweep_orphans(launch.segments[0]))   # of any launcher (issue 41)
        if removed:
            print(f"bpslaunch: removed {len(removed)} shared-memory segment(s) of dead jobs "
                  f"(their processes killed) from {launch.segments[0]}", file=sys.stderr,
                  flush=True)
    try:
        return _run(args, launch)
    finally:  # however the job ended: workers killed by a signal could not unlink them
        if launch.segments is not None:
            shm.sweep(*launch.segments)


def _run(args: argparse.Namespace, launch: Launch) -> int:
    if args.dashboard is not None:  # the live page (scheduler/dashboard.py)
        from .status import with_dashboard
        try:
            launch, url = with_dashboard(launch, args.dashboard, "127.0.0.1")
        except ValueError as exc:
            print(f"bpslaunch: error: {exc}", file=sys.stderr)
            return EXIT_USAGE
        print(f"bpslaunch: live job page: {url}", file=sys.stderr, flush=True)
    if args.local and (args.status or args.metrics):  # launcher/status.py
        import importlib.util
        if importlib.util.find_spec("prometheus_client") is None:  # before anything starts
            flag = "--status" if args.status else "--metrics"
            print(f"bpslaunch: error: {flag} reads every process's metrics, which needs "
                  "prometheus-client: pip install 'byteps_like[metrics]'", file=sys.stderr)
            return EXIT_USAGE
        from .status import run_with_status
        return run_with_status(launch, run_job, args.host or DEFAULT_HOST,
                               metrics_only=not args.status)
    if launch.elastic is not None:
        from .elastic import run_elastic_job
        return run_elastic_job(launch.specs, launch.base_env, launch.settings,
                               launch.elastic)  # type: ignore[arg-type]
    return run_job(launch.specs, launch.base_env, launch.settings)
