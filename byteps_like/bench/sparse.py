"""Sparse models: server-held embedding tables against the same tables pushed dense.

``python -m byteps_like.bench sparse [--rows 1000000] [--tables 4] [--dim 64] [--batch 4096]
[--zipf 1.2] [--workers 2] [--servers 2] [--modes sparse,dense] [--rate 1gbit] [--quick]
[--optimizer sgd] [--modes sparse,replicate,snapshot --kill 1:8 --snapshot-steps 10]
[--json PATH]``

A DLRM-shaped model (:mod:`._sparse_worker`: tables of rows, rows/10, ... rows, one Zipf id per
table per sample, an MLP on top) trained by a byteps_like job on bpslaunch's plan
(:func:`.harness.local_job`), once per mode:

- ``sparse``: the tables held and updated on the servers (``byteps_like.torch.SparseEmbedding``);
- ``dense``: the same tables as ``nn.Embedding`` whose whole gradient goes through push_pull;
- ``ddp``: the dense model under DistributedDataParallel with gloo (no servers; its bytes are
  the ring all-reduce's, computed);
- ``local``: the same model and batch with no communication (as many processes as workers,
  each training its own copy at once): the model's compute on the same share of the machine,
  the baseline of the others.

It reports per step (median over the timed steps of the slowest worker): the step time,
samples/s, the wire bytes of one worker (tables, push_pull) against the floor (each table's
unique ids x (2 x row bytes + 8 bytes of id)), and the servers' peak resident memory against
the bytes their tables and stores hold. With ``--rate`` (root) every worker and server is a
network namespace with its NIC capped (:mod:`.netns`), as ``bench train`` builds them.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from contextlib import ExitStack

from ..embedding import PHASES_TAG, TableSpec, shard_rows, state_bytes
from ..transport.native import usable_cpus
from . import links as uneven
from . import netns
from ._sparse_worker import table_rows
from .cluster import fmt_cap, parse_rate
from .harness import ChildFailed, Job, Proc, base_env, collect, free_port, local_job, on_hosts
from .report import drive, exit_on_signals, machine_info, markdown_table, num, report_header

PROG = "python -m byteps_like.bench sparse"
MODES = ("sparse", "replicate", "snapshot", "dense", "ddp", "local")
#: the modes with server-held tables: replicate and snapshot set BYTEPS_SPARSE_SURVIVAL so
SPARSE_MODES = ("sparse", "replicate", "snapshot")
#: --quick: 2 workers, 2 servers, a 1M-row table (+ 3 smaller), 1 Gbit/s NICs
QUICK: dict[str, int | str] = {"rows": 1_000_000, "workers": 2, "servers": 2, "rate": "1gbit",
                               "steps": 10, "warmup": 2, "dense_steps": 3, "dense_warmup": 1}
COLUMNS = ("mode", "rows", "dim", "workers", "servers", "rate", "step ms", "samples/s",
           "MB/step", "table MB/step", "floor MB/step", "tables/floor", "server peak RSS MB",
           "step / sparse step")


@dataclasses.dataclass
class Setup:
    rows: int
    tables: int
    dim: int
    batch: int
    zipf: float
    workers: int
    servers: int
    rate_bits: float | None
    steps: int
    warmup: int
    dense_steps: int
    dense_warmup: int
    timeout: float
    optimizer: str = "sgd"
    cluster: netns.NetnsCluster | None = None
    kill: str = ""              # SERVER:STEP, in the replicate and snapshot runs
    snapshot_steps: int = 10
    work: str = ""              # a directory for the runs' files (samples, snapshots)
    straggler: uneven.Straggler | None = None      # --straggler (bench/links.py)
    schedule: uneven.RateSchedule | None = None    # --rate with a schedule
    prefetch: bool = False      # the model prefetches every table's rows (--prefetch)
    threads: int = 1            # each worker's torch threads (--threads)

    @property
    def rate(self) -> str:
        return "loopback" if self.rate_bits is None else fmt_cap(self.rate_bits)

    def worker_argv(self, mode: str) -> list[str]:
        steps, warmup = ((self.steps, self.warmup) if mode in (*SPARSE_MODES, "local")
                         else (self.dense_steps, self.dense_warmup))   # dense and ddp
        extra = (["--kill", self.kill] if self.kill and mode in ("replicate", "snapshot")
                 else [])
        if mode in SPARSE_MODES and self.work:
            extra += ["--sample-out", os.path.join(self.work, f"{mode}.npy")]
        return [sys.executable, "-m", "byteps_like.bench._sparse_worker", mode,
                "--rows", str(self.rows), "--tables", str(self.tables), "--dim", str(self.dim),
                "--batch", str(self.batch), "--zipf", str(self.zipf), "--steps", str(steps),
                "--optimizer", self.optimizer,
                "--warmup", str(warmup), *extra,
                "--threads", str(self.threads),
                *(["--prefetch"] if self.prefetch else [])] + (
                    ["--straggler", self.straggler.arg()]   # without --rate: its compute
                    if self.straggler and self.rate_bits is None else [])

    def env(self, mode: str) -> dict[str, str]:
        """A run's environment: the tables' survival mode (and its snapshots' directory)."""
        env = base_env()
        if mode not in ("replicate", "snapshot"):
            return env
        return {**env, "BYTEPS_SPARSE_SURVIVAL": mode,
                "BYTEPS_SPARSE_SNAPSHOT_STEPS": str(self.snapshot_steps),
                "BYTEPS_SPARSE_CHECKPOINT_DIR": os.path.join(self.work, "checkpoints")}


class PeakRss:
    """The largest resident set (VmHWM) each of some processes reached, read while they run."""

    def __init__(self, procs: list[Proc]):
        self.procs, self.peak = procs, {p.name: 0 for p in procs}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _read(self) -> None:
        for p in self.procs:
            try:
                with open(f"/proc/{p.pid}/status", encoding="ascii") as f:
                    for line in f:
                        if line.startswith("VmHWM:"):
                            self.peak[p.name] = max(self.peak[p.name],
                                                    int(line.split()[1]) * 1024)
            except (OSError, ValueError):
                pass

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self._read()

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def run_ddp(s: Setup) -> tuple[list[dict], dict[str, int]]:
    """DDP-gloo, one process per worker host (with --rate), rendezvous on w0's address."""
    ip = (lambda h: "127.0.0.1") if s.cluster is None else s.cluster.ip
    env = {**base_env(force_distributed=False), "MASTER_ADDR": ip("w0"),
           "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(s.workers),
           "GLOO_SOCKET_IFNAME": "lo" if s.cluster is None else "eth0"}
    with Job("sparse-ddp") as g:
        ws = []
        for r in range(s.workers):
            argv = s.worker_argv("ddp") + ["--rank", str(r), "--world", str(s.workers)]
            if s.cluster is not None:
                argv = s.cluster.exec_argv(f"w{r}", argv)
            ws.append(g.spawn(f"ddp {r}", argv, {**env, "RANK": str(r)}))
        g.wait(s.timeout, relay=ws[0], relay_prefix="[sparse] ddp: ")
        return collect(ws, "ddp"), {}


def run_local(s: Setup) -> tuple[list[dict], dict[str, int]]:
    """The model with no communication: one process per worker, at once (no servers, no
    network: with --rate they run in the root namespace, on the same cores)."""
    with Job("sparse-local") as g:
        ws = [g.spawn(f"local {r}", s.worker_argv("local") + ["--rank", str(r)],
                      base_env(force_distributed=False)) for r in range(s.workers)]
        g.wait(s.timeout, relay=ws[0], relay_prefix="[sparse] local: ")
        return collect(ws, "local"), {}


def run_mode(s: Setup, mode: str) -> tuple[list[dict], dict[str, int]]:
    """One job; the workers' results and the servers' peak RSS. With --rate the scheduler
    and worker i on host w{i}, server j on host s{j}."""
    host0 = "127.0.0.1" if s.cluster is None else s.cluster.ip("w0")
    placed = on_hosts(local_job(s.worker_argv(mode), free_port(), workers=s.workers,
                                servers=s.servers, host=host0), s.cluster)
    env = s.env(mode)
    if mode in SPARSE_MODES and "BYTEPS_LOG_LEVEL" not in env:   # (unless the user set one)
        # the servers log the line with their phases (INFO) as they exit
        placed = [dataclasses.replace(p, env={"BYTEPS_LOG_LEVEL": "INFO", **p.env})
                  if p.role == "server" else p for p in placed]
    with Job(f"sparse-{mode}") as g:
        ws = g.start(placed, env)
        servers = [p for name, p in g.procs.items() if name.startswith("server")]
        if s.kill and mode in ("replicate", "snapshot"):
            g.may_die = {p.name for p in servers}
        with PeakRss(servers) as rss:
            g.wait(s.timeout, relay=ws[0], relay_prefix=f"[sparse] {mode}: ")
        res = collect(ws, mode)
        if mode in SPARSE_MODES and res:
            res[0]["server_phases"] = server_phases(servers)
        return res, rss.peak


def server_phases(servers: list[Proc]) -> list[dict]:
    """Each server's table-service phases, from the line it logs as it exits (INFO:
    server/sparse.py PHASES_TAG); a server killed or still running has none."""
    out = []
    for p in servers:
        p.drain()
        for line in reversed(p.err):
            _, tag, rest = line.partition(PHASES_TAG)
            if tag:
                try:
                    out.append(json.loads(rest))
                except ValueError:
                    pass
                break
    return out


RUNNERS = {"sparse": run_mode, "replicate": run_mode, "snapshot": run_mode, "dense": run_mode,
           "ddp": lambda s, _mode: run_ddp(s), "local": lambda s, _mode: run_local(s)}


def make_record(s: Setup, mode: str, res: list[dict], rss: dict[str, int]) -> dict:
    steps = [max(rep) for rep in zip(*[r["step_times_s"] for r in res])]
    step = statistics.median(steps)
    n = res[0]["steps"]
    tables = max(r["table_bytes"] for r in res) / n
    pushpull = max(r["pushpull_bytes"] for r in res) / n
    floor = max(r["floor_bytes"] for r in res) / n
    table_rows_ = res[0]["table_rows"]
    # the largest server's tables: rows, optimizer state and the charged overhead
    shard = max(sum(state_bytes(TableSpec.make(f"t{i}", n, s.dim, optimizer=s.optimizer),
                                shard_rows(n, srv, s.servers))
                    for i, n in enumerate(table_rows_)) for srv in range(s.servers))
    return {"mode": mode, "rows": s.rows, "tables": table_rows_, "dim": s.dim,
            "batch": s.batch, "zipf": s.zipf, "workers": s.workers,
            "optimizer": s.optimizer if mode in SPARSE_MODES else "sgd",
            "servers": 0 if mode in ("ddp", "local") else s.servers,
            "bytes_computed": mode == "ddp",   # the ring all-reduce's, not measured
            "rate": s.rate, "rate_bits": s.rate_bits, "steps": n, "step_s": step,
            "step_times_s": steps, "samples_per_s": s.batch * s.workers / step,
            "bytes_per_step": tables + pushpull, "table_bytes_per_step": tables,
            "pushpull_bytes_per_step": pushpull, "floor_bytes_per_step": floor,
            "tables_over_floor": (None if mode == "local" else tables / floor
                                  if mode in SPARSE_MODES else (tables + pushpull) / floor),
            "server_peak_rss_bytes": max(rss.values()) if rss else None,
            "table_shard_bytes": shard if mode in SPARSE_MODES else None,
            "dense_param_bytes": res[0]["dense_param_bytes"], "loss": res[0]["loss"],
            "threads": res[0].get("threads"),   # a worker's torch threads
            # a server killed (--kill): the longest step over the median, the steps the
            # tables went back (snapshot), and (add_ratios) the tables' largest difference
            "killed": s.kill if s.kill and mode in ("replicate", "snapshot") else None,
            "stall_s": max(steps) - step,
            "rolled_back_steps": max(r.get("rolled_back", 0) for r in res),
            "breakdown": breakdown(res, n) if mode in SPARSE_MODES else None}


def breakdown(res: list[dict], steps: int) -> list[tuple[str, str, float, float]]:
    """Where a sparse step's table time goes: (side, phase, ms per step, calls per step):
    a worker's mean over its timed steps, a server's median over its last 256 steps (rounds
    of the first table), each the mean of the workers or of the servers."""
    rows = []
    for r in res:
        for phase, (sec, calls) in r.get("table_phases", {}).items():
            if calls:   # (a table created before the timed steps: its phases are 0)
                rows.append(("worker", phase, 1e3 * sec / steps / len(res),
                             calls / steps / len(res)))
    srv = [sp for sp in res[0].get("server_phases") or [] if sp["steps"]]
    for sp in srv:
        for phase, (sec, calls) in sp["phases"].items():
            rows.append(("server", phase, 1e3 * sec / len(srv), calls / len(srv)))
    merged: dict[tuple[str, str], list[float]] = {}
    for side, phase, ms, calls in rows:
        m = merged.setdefault((side, phase), [0.0, 0.0])
        m[0] += ms
        m[1] += calls
    return [(side, phase, v[0], v[1]) for (side, phase), v in sorted(merged.items())]


def format_breakdown(records: list[dict]) -> str:
    """The breakdown of each sparse run (:func:`breakdown`)."""
    rows = [(r["mode"], side, phase, num(ms, ".2f"), num(calls, ".1f"))
            for r in records if r.get("breakdown") for side, phase, ms, calls in r["breakdown"]]
    return markdown_table(("mode", "side", "phase", "ms/step", "calls/step"), rows, left=3)


def add_ratios(records: list[dict]) -> None:
    """``dense_over_sparse``: a dense run's step time over the sparse run's (same rate)."""
    sparse = {r["rate"]: r["step_s"] for r in records if r["mode"] == "sparse"}
    for r in records:
        r["dense_over_sparse"] = (r["step_s"] / sparse[r["rate"]]
                                  if r["mode"] != "sparse" and r["rate"] in sparse else None)


def add_differences(records: list[dict], work: str) -> None:
    """``max_abs_diff``: the largest difference between the first 512 rows of every table at
    the end of a replicate or snapshot run and of the sparse run (the same seeds)."""
    import numpy as np
    ref_path = os.path.join(work, "sparse.npy")
    for r in records:
        r["max_abs_diff"] = None
        path = os.path.join(work, f"{r['mode']}.npy")
        if r["mode"] in ("replicate", "snapshot") and os.path.exists(ref_path) \
                and os.path.exists(path):
            r["max_abs_diff"] = float(np.abs(np.load(path) - np.load(ref_path)).max())


def format_survival(records: list[dict]) -> str:
    """The replicate and snapshot runs against the sparse run."""
    rows = [(r["mode"], r["killed"] or "-", num(r["step_s"] * 1e3, ".1f"),
             num(r["dense_over_sparse"], ".3f"), num(r["stall_s"], ".3f"),
             str(r["rolled_back_steps"]), num(r["max_abs_diff"], ".3g"))
            for r in records if r["mode"] in ("replicate", "snapshot")]
    return markdown_table(("mode", "killed SERVER:STEP", "step ms", "step / sparse step",
                           "stall s", "steps rolled back", "max |diff| vs sparse"), rows, left=2)


def format_table(records: list[dict]) -> str:
    rows = []
    for r in records:
        mb = lambda v: num(v / 1e6 if v is not None else None, ".2f")  # noqa: E731
        rows.append((r["mode"], f"{r['rows']:,}", str(r["dim"]), str(r["workers"]),
                     str(r["servers"]), r["rate"], num(r["step_s"] * 1e3, ".1f"),
                     num(r["samples_per_s"], ".0f"), mb(r["bytes_per_step"]),
                     mb(r["table_bytes_per_step"] if r["mode"] in SPARSE_MODES else
                        r["pushpull_bytes_per_step"]),
                     mb(r["floor_bytes_per_step"]), num(r["tables_over_floor"], ".3f"),
                     mb(r["server_peak_rss_bytes"]),
                     num(r["dense_over_sparse"], ".1f")))
    return markdown_table(COLUMNS, rows, left=1)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--rows", type=int, default=None, help="rows of the largest table "
                   "(default 1000000); the others have rows/10, rows/100, ...")
    p.add_argument("--tables", type=int, default=4, help="tables of the model")
    p.add_argument("--dim", type=int, default=64, help="row width (float32)")
    p.add_argument("--batch", type=int, default=4096, help="samples per worker per step")
    p.add_argument("--zipf", type=float, default=1.2, help="Zipf exponent of the ids (> 1)")
    p.add_argument("--optimizer", default="sgd", choices=("sgd", "adagrad", "adam"),
                   help="the server-side optimizer of the sparse tables (its state counts in "
                        "their shard bytes); the dense model trains with SGD")
    p.add_argument("--workers", type=int, default=None, help="worker processes (default 2)")
    p.add_argument("--servers", type=int, default=None, help="servers (default 2)")
    p.add_argument("--modes", default="sparse,dense,ddp,local",
                   help=f"of {', '.join(MODES)}")
    uneven.add_link_options(p, parse_rate, "each worker and server")
    p.add_argument("--steps", type=int, default=None, help="timed sparse steps (default 20)")
    p.add_argument("--warmup", type=int, default=None, help="untimed sparse steps (default 3)")
    p.add_argument("--dense-steps", type=int, default=None, help="timed dense steps (default 5)")
    p.add_argument("--dense-warmup", type=int, default=None,
                   help="untimed dense steps (default 1)")
    p.add_argument("--quick", action="store_true", help="a run for a 2-core machine: " + ", ".join(
        f"{k.replace('_', '-')} {v}" for k, v in QUICK.items()) + " (explicit options win)")
    p.add_argument("--kill", default="", metavar="SERVER:STEP",
                   help="in the replicate and snapshot runs, worker 0 SIGKILLs server rank "
                        "SERVER as step STEP begins (warm-up steps count); the job goes on "
                        "and the run reports the stall, the steps the tables went back and "
                        "their largest difference from the sparse run's")
    p.add_argument("--snapshot-steps", type=int, default=10,
                   help="snapshot runs: BYTEPS_SPARSE_SNAPSHOT_STEPS")
    p.add_argument("--prefetch", action="store_true",
                   help="the model prefetches every table's rows before its forward "
                        "(SparseEmbedding.prefetch); by default each table pulls in its forward, "
                        "one after another")
    p.add_argument("--threads", type=int, default=0,
                   help="torch CPU threads of each worker (byteps_like and DDP alike); 0 "
                        "(default): the usable CPUs / workers, as bench train gives them "
                        "(until 2026-12-05: always 1)")
    p.add_argument("--timeout", type=float, default=900.0, help="watchdog per run, seconds")
    p.add_argument("--json", metavar="PATH", help="write the records (one per run) here")
    return p


def plan(p: argparse.ArgumentParser, a: argparse.Namespace) -> tuple[Setup, list[str]]:
    if a.quick:
        for key, value in QUICK.items():
            if getattr(a, key) is None:
                setattr(a, key, parse_rate(str(value)) if key == "rate" else value)
    defaults = {"rows": 1_000_000, "workers": 2, "servers": 2, "steps": 20, "warmup": 3,
                "dense_steps": 5, "dense_warmup": 1}
    for key, value in defaults.items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    if min(a.rows, a.tables, a.dim, a.batch, a.workers, a.servers, a.steps,
           a.dense_steps) < 1 or a.warmup < 0 or a.dense_warmup < 0 or a.zipf <= 1 \
            or a.threads < 0:
        p.error("sizes, counts and steps must be >= 1, warm-ups and --threads >= 0, --zipf > 1")
    if a.kill and (len(a.kill.split(":")) != 2 or not all(x.isdigit() for x in a.kill.split(":"))
                   or int(a.kill.split(":")[0]) >= a.servers or a.servers < 2):
        p.error("--kill SERVER:STEP: a server rank below --servers (two servers or more) and a "
                "step")
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    if not modes or set(modes) - set(MODES):
        p.error(f"--modes: choose from {', '.join(MODES)}")
    if a.rate is not None:
        why = netns.why_unavailable()
        if why:
            p.error(f"--rate: {why}")
    why = uneven.check_straggler(a.straggler, a.workers)
    if why:
        p.error(why)
    schedule = a.rate if isinstance(a.rate, uneven.RateSchedule) else None
    return Setup(a.rows, a.tables, a.dim, a.batch, a.zipf, a.workers, a.servers,
                 schedule.first if schedule else a.rate,
                 a.steps, a.warmup, a.dense_steps, a.dense_warmup, a.timeout,
                 a.optimizer, kill=a.kill, snapshot_steps=a.snapshot_steps,
                 straggler=a.straggler, schedule=schedule, prefetch=a.prefetch,
                 threads=a.threads or max(1, usable_cpus() // a.workers)), \
        [m for m in MODES if m in modes]


def run_all(s: Setup, modes: list[str], queue_ms: float) -> tuple[list[dict], list[str]]:
    """Each mode's job, one after the other: the records, and a line per failed job (reported
    with its children's stderr tails; the other modes go on)."""
    records: list[dict] = []
    failures: list[str] = []
    with ExitStack() as stack:
        if s.rate_bits is not None:
            s.cluster = stack.enter_context(uneven.emulated_cluster(
                s.workers, s.servers, s.rate_bits, s.straggler, queue_ms))
        for mode in modes:
            print(f"[sparse] {mode}: starting", file=sys.stderr, flush=True)
            sw = uneven.start_schedule(s.cluster, s.schedule, s.straggler)
            try:
                res, rss = RUNNERS[mode](s, mode)
            except ChildFailed as exc:
                failures.append(f"{mode}: {str(exc).splitlines()[0]}")
                print(f"[sparse] {mode} failed:\n{exc}", file=sys.stderr, flush=True)
                continue
            finally:
                switches = sw.stop() if sw else []
            rec = make_record(s, mode, res, rss)
            if sw is not None:
                rec["rate_switches"] = [(t - sw.t0, r) for t, r in switches]
            rec["straggler"] = s.straggler.arg() if s.straggler else None
            records.append(rec)
            print(f"[sparse] {mode}: step {rec['step_s'] * 1e3:.1f} ms", file=sys.stderr,
                  flush=True)
    return records, failures


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = build_parser()
    a = p.parse_args(argv)
    s, modes = plan(p, a)
    command = report_header("sparse", argv, machine_info())
    print(f"job: {s.workers} worker(s), {s.servers} server(s), {s.rate}; tables "
          f"{table_rows(s.rows, s.tables)} x {s.dim} float32; batch {s.batch} per worker, Zipf "
          f"{s.zipf}; sparse ({s.optimizer}) {s.warmup}+{s.steps} steps, dense {s.dense_warmup}+"
          f"{s.dense_steps} steps"
          + (f"; straggler: worker {s.straggler.rank} "
             f"{'NIC at rate / ' if s.rate_bits is not None else 'compute x'}"
             f"{s.straggler.factor:g}" if s.straggler else "")
          + (f"; rate schedule {s.schedule.text}" if s.schedule else "")
          + ("; the tables prefetched" if s.prefetch else "")
          + f"; {s.threads} torch thread(s) a worker",
          flush=True)
    exit_on_signals()
    t_all = time.monotonic()
    s.work = tempfile.mkdtemp(prefix="bpsl-bench-sparse-")
    ran = drive(PROG, lambda: run_all(s, modes, a.queue_ms), netns.NetnsError)
    if isinstance(ran, int):
        return ran
    records, failures = ran
    print()
    add_ratios(records)
    add_differences(records, s.work)
    shutil.rmtree(s.work, ignore_errors=True)
    if records:
        print(format_table(records))
    if any(r["mode"] in ("replicate", "snapshot") for r in records):
        print("\n" + format_survival(records))
    if any(r.get("breakdown") for r in records):
        print("\nwhere the tables' time goes, per step (a worker's: mean over the timed steps; "
              "a server's: median over its last 256 steps; mean of the workers, of the "
              "servers): 'whole call' contains the other phases of its kind; 'wait for the "
              "answers' the transport both ways, the servers' work and the wait for the other "
              "workers' pushes; 'CPU' CPU seconds, not wall:\n"
              + format_breakdown(records))
    print("\nstep: median over the timed steps of the slowest worker's step (forward with the "
          "tables' pulls, backward with their pushes, the dense push_pull); MB/step: one "
          "worker's bytes each way together (tables: request and answer messages with their "
          "headers; push_pull: payload); floor: each table's unique ids of the worker's batch "
          "x (2 x row bytes + 8 bytes of id); tables/floor: table bytes / floor (dense: all "
          "bytes / floor); server peak RSS: the largest VmHWM of the servers (a server's "
          "Python, numpy and ZeroMQ included).")
    print(f"total: {time.monotonic() - t_all:.1f} s")
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump([{**r, "command": command} for r in records], f, indent=1)
        print(f"json: {a.json}")
    if failures:
        print(f"{PROG}: {len(failures)} run(s) failed: " + "; ".join(failures), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
