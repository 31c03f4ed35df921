"""Real models training on synthetic data: byteps_like against the same model with no
communication and against PyTorch DDP (and Horovod where it imports), in one run.

``python -m byteps_like.bench train [--models resnet50,vgg16,bert] [--workers N] [--servers K]
[--modes local,byteps_like,ddp,horovod] [--device cpu|cuda|auto] [--rate 25gbit] [--quick]
[--json PATH] [--plot PATH]``

For each model (:mod:`.models`: built from torch.nn / torchvision constructors, nothing
downloaded) and each mode (:mod:`._train_worker` is what each process runs):

- ``local``: one process, no communication: the bound;
- ``byteps_like``: a local job on bpslaunch's plan (:func:`.harness.local_job`: a scheduler,
  ``--servers`` servers, ``--workers`` worker machines of one process), each worker using
  ``byteps_like.torch``'s ``DistributedOptimizer``; ``BYTEPS_FORCE_DISTRIBUTED=1``, so one worker
  still goes through the servers. After its timed steps each worker also times the exchange of
  one step's gradients alone (``optimizer.synchronize()`` after a backward) and a single-tensor
  push_pull of the same bytes;
- ``ddp``: ``DistributedDataParallel`` with as many processes, NCCL when every worker has a GPU of
  its own, gloo otherwise (NCCL refuses two ranks on one GPU), rendezvous through
  MASTER_ADDR/MASTER_PORT;
- ``horovod``: ``horovod.torch.DistributedOptimizer``, only where ``horovod.torch`` imports
  (here, or with ``--horovod-python``); otherwise skipped with a line that says why.

Workers share GPUs when there are fewer GPUs than workers (worker i on ``cuda:(i % GPUs)``).
With ``--rate`` (root only) every worker host and server host is a network namespace with its
NIC capped (:mod:`.netns`, as ``bench cluster`` builds them), and DDP and Horovod run in the same
worker namespaces; without it everything is on loopback. Every process is started and watched by
the harness (:class:`.harness.Job`): a watchdog per run, all children torn down, a failing child
named with the tail of its stderr.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from contextlib import ExitStack

from ..transport.native import usable_cpus
from . import links as uneven
from . import models, netns
from .cluster import DEFAULT_HOROVOD_PYTHON, fmt_cap, horovod_unavailable, parse_rate
from .harness import (
    ChildFailed,
    Job,
    base_env,
    child_env,
    collect,
    free_port,
    local_job,
    on_hosts,
)
from .report import (
    OthersMeter,
    drive,
    exit_on_signals,
    machine_info,
    markdown_table,
    noisy_note,
    num,
    print_before_start,
    report_header,
)

PROG = "python -m byteps_like.bench train"
MODES = ("local", "byteps_like", "ddp", "horovod")
GPU_MODELS = "resnet50,vgg16,bert"
CPU_MODELS = "mlp,convnet"
COLUMNS = ("model", "mode", "device", "workers", "servers", "rate", "step ms", "samples/s",
           "vs local", "bound ms", "step/bound", "exchange ms", "exchange GB/s",
           "single GB/s", "exch/single")
#: --quick: a CPU configuration for a 2-core machine (a few minutes)
QUICK = {"models": "mlp,convnet", "workers": 2, "servers": 1, "modes": "local,byteps_like,ddp",
         "steps": 20, "warmup": 3, "exchange_repeats": 5, "timeout": 300.0}


# ------------------------------------------------------------------------------- the settings
@dataclasses.dataclass
class Setup:
    """What every run of one invocation shares."""
    device: str                   # "cpu" or "cuda"
    gpus: int                     # visible GPUs (0 on cpu)
    workers: int
    servers: int
    rate_bits: float | None       # None: loopback
    steps: int
    warmup: int
    batch: int                    # 0: each model's default
    amp: bool
    compression: str
    exchange_repeats: int
    cross_barrier: bool           # byteps_like through CrossBarrier
    threads_local: int            # torch threads of the local process (0: torch's default)
    threads_worker: int           # ... of each distributed worker
    timeout: float
    extra_env: dict[str, str]
    ddp_backend: str
    horovod_python: str | None
    cluster: netns.NetnsCluster | None = None
    straggler: uneven.Straggler | None = None      # --straggler (bench/links.py)
    schedule: uneven.RateSchedule | None = None    # --rate with a schedule

    @property
    def rate(self) -> str:
        return "loopback" if self.rate_bits is None else fmt_cap(self.rate_bits)

    @property
    def devices(self) -> int:
        """Compute units the workers of a distributed run have between them: the GPUs they use
        (workers beyond the GPU count share them), or on CPU one per worker (each gets its
        share of the cores, as many as the local run has)."""
        return min(self.workers, self.gpus) if self.device == "cuda" else self.workers

    def worker_args(self, model: str) -> list[str]:
        args = ["--model", model, "--steps", str(self.steps), "--warmup", str(self.warmup),
                "--device", self.device, "--compression", self.compression,
                "--exchange-repeats", str(self.exchange_repeats)]
        if self.batch:
            args += ["--batch", str(self.batch)]
        if not self.amp:
            args.append("--no-amp")
        if self.cross_barrier:
            args.append("--cross-barrier")
        if self.straggler and self.rate_bits is None:   # without --rate: its compute
            args += ["--straggler", self.straggler.arg()]
        return args

    def host_argv(self, host: str, argv: list[str]) -> list[str]:
        """``argv`` run inside ``host``'s namespace (with --rate), or as it is."""
        return argv if self.cluster is None else self.cluster.exec_argv(host, argv)

    def ip(self, host: str) -> str:
        return "127.0.0.1" if self.cluster is None else self.cluster.ip(host)

    @property
    def ifname(self) -> str:
        return "lo" if self.cluster is None else "eth0"


def worker_argv(mode: str, *args: str, python: str | None = None) -> list[str]:
    return [python or sys.executable, "-m", "byteps_like.bench._train_worker", mode, *args]


# ------------------------------------------------------------------------------------ the runs
def run_local(s: Setup, model: str) -> list[dict]:
    args = s.worker_args(model) + ["--threads", str(s.threads_local)]
    with Job(f"train-{model}-local") as g:
        w = g.spawn("local", worker_argv("local", *args), base_env())
        g.wait(s.timeout, relay=w, relay_prefix=f"[train] {model} local: ")
        return collect([w], "local")


def run_bps(s: Setup, model: str) -> list[dict]:
    """A byteps_like job on bpslaunch's plan; with --rate the scheduler and worker i on host
    w{i}, server j on host s{j}, each process advertising its host's address."""
    args = s.worker_args(model) + ["--threads", str(s.threads_worker)]
    placed = on_hosts(local_job(worker_argv("byteps_like", *args), free_port(),
                                workers=s.workers, servers=s.servers, host=s.ip("w0")),
                      s.cluster)
    with Job(f"train-{model}-bps") as g:
        ws = g.start(placed, {**base_env(), **s.extra_env})
        g.wait(s.timeout, relay=ws[0], relay_prefix=f"[train] {model} byteps_like: ")
        return collect(ws, "byteps_like")


def _net_env(s: Setup) -> dict[str, str]:
    """What makes gloo and NCCL use the hosts' NICs: their interface; with --rate NCCL must not
    take the GPUs' own paths (NVLink, PCIe peer-to-peer, shared memory) past the capped NIC."""
    env = {"GLOO_SOCKET_IFNAME": s.ifname}
    if s.cluster is not None:
        env.update({"NCCL_SOCKET_IFNAME": s.ifname, "NCCL_P2P_DISABLE": "1",
                    "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1"})
    return env


def ddp_backend(s: Setup) -> str:
    if s.ddp_backend != "auto":
        return s.ddp_backend
    return "nccl" if s.device == "cuda" and s.workers <= s.gpus else "gloo"


def run_ddp(s: Setup, model: str) -> list[dict]:
    backend = ddp_backend(s)
    args = s.worker_args(model) + ["--threads", str(s.threads_worker), "--backend", backend,
                                   "--world", str(s.workers)]
    env = {**base_env(force_distributed=False), **_net_env(s),
           "MASTER_ADDR": s.ip("w0"), "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": str(s.workers)}
    with Job(f"train-{model}-ddp") as g:
        ws = []
        for r in range(s.workers):
            local_rank = 0 if s.cluster is not None else r
            ws.append(g.spawn(f"ddp {r}", s.host_argv(f"w{r}", worker_argv(
                "ddp", *args, "--rank", str(r))), {**env, "RANK": str(r),
                                                   "LOCAL_RANK": str(local_rank)}))
        g.wait(s.timeout, relay=ws[0], relay_prefix=f"[train] {model} ddp ({backend}): ")
        return collect(ws, "ddp")


def run_horovod(s: Setup, model: str) -> list[dict]:
    """Horovod's gloo controller with its HTTP rendezvous (what horovodrun starts), as
    ``bench cluster`` runs it: one rank per worker host with --rate, all on this host
    otherwise."""
    python = s.horovod_python or sys.executable
    n = s.workers
    env = child_env({**base_env(drop=("DMLC_", "HOROVOD_"), force_distributed=False),
                     **_net_env(s)}, always=True)
    args = s.worker_args(model) + ["--threads", str(s.threads_worker)]
    with Job(f"train-{model}-horovod") as g:
        port_file = os.path.join(g.dir, "rendezvous.port")
        hosts = ",".join(f"w{i}:1" for i in range(n)) if s.cluster else f"localhost:{n}"
        rdv = g.spawn("horovod rendezvous", s.host_argv("w0", [
            python, "-m", "byteps_like.bench._cluster_worker", "hvd-rendezvous", "--hosts", hosts,
            "--world", str(n), "--port-file", port_file]), env, service=True)
        port = g.read_when_written(rdv, port_file, "the Horovod rendezvous server")
        ws = []
        for r in range(n):
            per_host = s.cluster is not None
            he = {**env, "HOROVOD_RANK": str(r), "HOROVOD_SIZE": str(n),
                  "HOROVOD_LOCAL_RANK": "0" if per_host else str(r),
                  "HOROVOD_LOCAL_SIZE": "1" if per_host else str(n),
                  "HOROVOD_CROSS_RANK": str(r) if per_host else "0",
                  "HOROVOD_CROSS_SIZE": str(n) if per_host else "1",
                  "HOROVOD_HOSTNAME": f"w{r}" if per_host else "localhost",
                  "HOROVOD_GLOO_RENDEZVOUS_ADDR": s.ip("w0"),
                  "HOROVOD_GLOO_RENDEZVOUS_PORT": port, "HOROVOD_GLOO_IFACE": s.ifname,
                  "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo"}
            ws.append(g.spawn(f"horovod {r}", s.host_argv(f"w{r}", worker_argv(
                "horovod", *args, python=python)), he))
        # the rendezvous server never exits by itself: no grace period for it
        g.wait(s.timeout, relay=ws[0], relay_prefix=f"[train] {model} horovod: ",
               service_grace=0.0)
        return collect(ws, "horovod")


RUNNERS = {"local": run_local, "byteps_like": run_bps, "ddp": run_ddp, "horovod": run_horovod}


# ------------------------------------------------------------------------------------ records
def _slowest_median(series: list[list[float]]) -> tuple[float, list[float]]:
    """The slowest worker's time of each repetition, and the median of those."""
    slowest = [max(rep) for rep in zip(*series)]
    return statistics.median(slowest), slowest


def make_record(s: Setup, model: str, mode: str, per_worker: list[dict], wall: float) -> dict:
    """One run's record: the step time is the median over the timed steps of the slowest
    worker's time of that step."""
    w0 = per_worker[0]
    workers = 1 if mode == "local" else s.workers
    step, steps = _slowest_median([w["step_times_s"] for w in per_worker])
    rec = {"model": model, "mode": mode, "device": s.device, "gpu": w0.get("gpu"),
           "gpus_used": (min(workers, s.gpus) if s.device == "cuda" else 0),
           "workers": workers, "servers": s.servers if mode == "byteps_like" else 0,
           "rate": s.rate, "rate_bits": s.rate_bits, "batch": w0["batch"],
           "batch_total": w0["batch"] * workers, "steps": s.steps, "warmup": s.warmup,
           "step_s": step, "step_times_s": steps,
           "samples_per_s": w0["batch"] * workers / step,
           "amp": "bf16" if w0["amp"] else "off", "gradients": w0["gradients"],
           "gradient_bytes": w0["gradient_bytes"], "loss": w0.get("loss"),
           "threads": s.threads_local if mode == "local" else s.threads_worker,
           "wall_s": wall, "max_memory_bytes": max((w.get("max_memory_bytes") or 0)
                                                   for w in per_worker) or None}
    if mode in ("byteps_like", "horovod"):
        rec["compression"] = s.compression
    if mode == "byteps_like":
        rec["extra_env"] = dict(s.extra_env)
        rec["cross_barrier"] = s.cross_barrier
        ex, ex_reps = _slowest_median([w["exchange_s"] for w in per_worker])
        si, si_reps = _slowest_median([w["single_tensor_s"] for w in per_worker])
        rec.update({"exchange_s": ex, "exchange_repeats_s": ex_reps,
                    "exchange_gbps": rec["gradient_bytes"] / ex / 1e9,
                    "single_tensor_s": si, "single_tensor_repeats_s": si_reps,
                    "single_tensor_gbps": rec["gradient_bytes"] / si / 1e9})
    if mode == "ddp":
        rec["backend"] = w0["backend"]
    return rec


def add_ratios(s: Setup, records: list[dict]) -> None:
    """Against the local run of the same model:

    - ``compute_s`` = local step x workers / devices: each worker's compute when the workers
      share ``devices`` compute units (GPUs; on CPU each worker has its share of the cores,
      as the local run had) and nothing else costs time;
    - ``vs_local`` = samples/s / (local samples/s x devices) = compute_s / step_s: 1.0 means
      the run is as fast as its compute alone (for one worker: local step / step);
    - ``bound_s`` (byteps_like) = max(compute_s, gradient bytes / single-tensor bandwidth):
      what the step would take if the exchange overlapped compute perfectly at the engine's
      single-tensor speed; ``step_over_bound`` = step_s / bound_s."""
    local = {r["model"]: r for r in records if r["mode"] == "local"}
    for r in records:
        base = local.get(r["model"])
        if base is None:
            continue
        devices = 1 if r["mode"] == "local" else s.devices
        r["devices"] = devices
        r["compute_s"] = base["step_s"] * r["workers"] / devices
        r["vs_local"] = r["compute_s"] / r["step_s"]
        if r["mode"] == "byteps_like":
            r["bound_s"] = max(r["compute_s"], r["single_tensor_s"])
            r["step_over_bound"] = r["step_s"] / r["bound_s"]


def device_label(r: dict) -> str:
    return "cpu" if r["device"] == "cpu" else f"cuda x{r['gpus_used']}"


def format_table(records: list[dict]) -> str:
    rows = []
    for r in records:
        ms = lambda key: num(r[key] * 1e3 if r.get(key) is not None else None, ".1f")
        mode = r["mode"] + (f" ({r['backend']})" if r.get("backend") else "") + (
            f" {r['compression']}" if r.get("compression", "none") != "none" else "") + (
            " xb" if r.get("cross_barrier") else "")
        bw = r.get("exchange_gbps"), r.get("single_tensor_gbps")
        rows.append((r["model"], mode, device_label(r), str(r["workers"]),
                     str(r["servers"]) if r["mode"] == "byteps_like" else "-", r["rate"],
                     ms("step_s"), num(r["samples_per_s"], ".1f"),
                     num(r.get("vs_local"), ".2f"), ms("bound_s"),
                     num(r.get("step_over_bound"), ".2f"), ms("exchange_s"),
                     num(bw[0], ".3f"), num(bw[1], ".3f"),
                     num(bw[0] / bw[1] if bw[0] and bw[1] else None, ".2f")))
    return markdown_table(COLUMNS, rows, left=3)


def write_plot(records: list[dict], path: str) -> str | None:
    """Samples/s per mode, one panel per model, with the local run x devices as the dashed line
    (perfect scaling); None when written, else why not."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib); no plot"
    names = list(dict.fromkeys(r["model"] for r in records))
    if not names:
        return "nothing to plot"
    widths = [max(4.2, 1.5 * sum(r["model"] == n for r in records)) for n in names]
    fig, axes = plt.subplots(1, len(names), figsize=(sum(widths), 4.0), squeeze=False,
                             gridspec_kw={"width_ratios": widths})
    for ax, name in zip(axes[0], names):
        mine = [r for r in records if r["model"] == name]
        mixed = len({(r["workers"], r["servers"], r.get("compression")) for r in mine
                     if r["mode"] != "local"}) > 1
        labels = [r["mode"] + (f"\n{r['backend']}" if r.get("backend") else "")
                  + (f"\n{r['workers']}w {r['servers']}s b{r['batch']}"
                     if mixed and r["mode"] != "local" else "")
                  + (f" {r['compression']}" if r.get("compression") not in (None, "none")
                     else "") + (" xb" if r.get("cross_barrier") else "") for r in mine]
        vals = [r["samples_per_s"] for r in mine]
        bars = ax.bar(range(len(mine)), vals, color=["0.6" if r["mode"] == "local" else "C0"
                                                      for r in mine])
        for b, r in zip(bars, mine):
            if r.get("vs_local") is not None and r["mode"] != "local":
                ax.annotate(f"{r['vs_local']:.2f}", (b.get_x() + b.get_width() / 2,
                                                     b.get_height()),
                            ha="center", va="bottom", fontsize=8)
        local = [r["samples_per_s"] for r in mine if r["mode"] == "local"]
        dist = [r for r in mine if r["mode"] != "local"]
        if local and dist:
            ax.axhline(local[0] * dist[0].get("devices", 1), ls="--", color="0.3",
                       label="local x devices")
            ax.legend(fontsize=8)
        ax.set_xticks(range(len(mine)), labels, fontsize=8)
        r0 = dist[0] if dist else mine[0]
        ax.set_title(f"{name}: {device_label(r0)}, {r0['rate']}" if mixed else
                     f"{name}: {device_label(r0)}, {r0['workers']} workers, {r0['rate']}",
                     fontsize=9)
        ax.set_ylabel("samples/s (all workers)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


# ------------------------------------------------------------------------------------ the CLI
def _env_pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key or not key.replace("_", "").isalnum():
        raise argparse.ArgumentTypeError(f"--env {text!r}: use NAME=VALUE")
    return key, value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--models", default=None,
                   help=f"comma-separated, of {', '.join(models.MODELS)}; default "
                        f"{GPU_MODELS} on CUDA, {CPU_MODELS} on CPU")
    p.add_argument("--modes", default=None,
                   help=f"comma-separated, of {', '.join(MODES)}; default every one available")
    p.add_argument("--workers", type=int, default=None, help="worker processes (default 1)")
    p.add_argument("--servers", type=int, default=None, help="byteps_like servers (default 1)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: cuda when a GPU is visible")
    p.add_argument("--batch", type=int, default=0,
                   help="samples per worker per step; 0 = each model's default ("
                        + ", ".join(f"{m.name} {m.batch}" for m in models.MODELS.values()) + ")")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 30)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 10)")
    p.add_argument("--exchange-repeats", type=int, default=None,
                   help="timed repetitions of the exchange-alone and single-tensor "
                        "measurements (default 5)")
    p.add_argument("--no-amp", action="store_true",
                   help="on CUDA: float32 forward instead of bf16 autocast")
    p.add_argument("--cross-barrier", action="store_true",
                   help="byteps_like through CrossBarrier (updates during the next forward "
                        "pass; shown as 'xb')")
    p.add_argument("--compression", choices=("none", "fp16"), default="none",
                   help="DistributedOptimizer(compression=...) of byteps_like (and Horovod)")
    p.add_argument("--env", action="append", type=_env_pair, default=[], metavar="NAME=VALUE",
                   help="extra environment of the byteps_like processes (repeatable), e.g. "
                        "BYTEPS_PARTITION_BYTES=4M")
    uneven.add_link_options(p, parse_rate, "each worker and server host")
    p.add_argument("--threads", type=int, default=0,
                   help="torch CPU threads per process; 0 = on CPU the usable CPUs / workers "
                        "for every process (the local run too, so it computes as one worker "
                        "does), torch's default on CUDA")
    p.add_argument("--ddp-backend", choices=("auto", "nccl", "gloo"), default="auto",
                   help="auto: nccl when every worker has a GPU of its own, else gloo")
    p.add_argument("--horovod-python", default=None,
                   help="interpreter that imports horovod.torch (default: this one if it does, "
                        f"else {DEFAULT_HOROVOD_PYTHON} if present)")
    p.add_argument("--quick", action="store_true",
                   help="a CPU run for a small machine: " + ", ".join(
                       f"{k.replace('_', '-')} {v}" for k, v in QUICK.items())
                   + " (options given explicitly win)")
    p.add_argument("--timeout", type=float, default=None,
                   help="watchdog per run (model x mode), seconds (default 1800)")
    p.add_argument("--json", metavar="PATH", help="write the records (one per run) here")
    p.add_argument("--plot", metavar="PATH", help="bar chart of samples/s (PNG, matplotlib)")
    return p


def _pick_horovod(a: argparse.Namespace) -> tuple[str | None, str | None]:
    """(interpreter, None) when Horovod can run, else (None, why not)."""
    if a.horovod_python:
        why = horovod_unavailable(a.horovod_python)
        return (None, why) if why else (a.horovod_python, None)
    if importlib.util.find_spec("horovod") is not None:
        why = horovod_unavailable(sys.executable)
        return (None, why) if why else (sys.executable, None)
    if os.path.exists(DEFAULT_HOROVOD_PYTHON):
        why = horovod_unavailable(DEFAULT_HOROVOD_PYTHON)
        return (None, why) if why else (DEFAULT_HOROVOD_PYTHON, None)
    return None, ("horovod.torch does not import here (and no --horovod-python; "
                  "scripts/build_horovod.sh builds one)")


@dataclasses.dataclass
class Plan:
    """What one invocation runs, once the options are checked."""
    setup: Setup
    names: list[str]
    modes: list[str]
    skipped: dict[str, str]       # mode -> why it does not run
    usable_cpus: int


def plan_run(p: argparse.ArgumentParser, a: argparse.Namespace) -> Plan:
    """Defaults (``--quick``'s first), checks (``p.error`` on a bad option), the device, the
    models and the modes that can run here."""
    if a.quick:
        for key, value in QUICK.items():
            if getattr(a, key) is None:
                setattr(a, key, value)
        if a.device == "auto":
            a.device = "cpu"
    defaults = {"workers": 1, "servers": 1, "steps": 30, "warmup": 10, "exchange_repeats": 5,
                "timeout": 1800.0}
    for key, value in defaults.items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    if a.workers < 1 or a.servers < 1 or a.steps < 1 or a.warmup < 0 \
            or a.exchange_repeats < 1 or a.batch < 0 or a.threads < 0:
        p.error("--workers, --servers, --steps, --exchange-repeats must be >= 1; --warmup, "
                "--batch, --threads >= 0")
    modes = [m.strip() for m in (a.modes or ",".join(MODES)).split(",") if m.strip()]
    if not modes or set(modes) - set(MODES):
        p.error(f"--modes: choose from {', '.join(MODES)}")
    if importlib.util.find_spec("torch") is None:
        p.error("needs torch (pip install torch)")
    import torch
    # device_count creates no CUDA context in this process (the workers own the GPUs)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = a.device if a.device != "auto" else ("cuda" if gpus else "cpu")
    if device == "cuda" and not gpus:
        p.error("--device cuda: no CUDA device is visible")
    names = [m.strip() for m in (a.models or (GPU_MODELS if device == "cuda" else CPU_MODELS))
             .split(",") if m.strip()]
    if not names:
        p.error("--models is empty")
    for name in names:
        why = models.unavailable(name)
        if why:
            p.error(f"--models: {why}")
    modes = [m for m in MODES if m in modes]          # local first: the others compare with it
    skipped: dict[str, str] = {}
    if "ddp" in modes and not torch.distributed.is_available():
        skipped["ddp"] = "torch.distributed is not available in this torch build"
    hvd_python = None
    if "horovod" in modes:
        hvd_python, why = _pick_horovod(a)
        if why:
            skipped["horovod"] = why
    if a.rate is not None:
        why = netns.why_unavailable()
        if why:
            p.error(f"--rate: {why}")
    schedule = a.rate if isinstance(a.rate, uneven.RateSchedule) else None
    why = uneven.check_straggler(a.straggler, a.workers or 1)
    if why:
        p.error(why)
    usable = usable_cpus()
    threads = a.threads or (max(1, usable // a.workers) if device == "cpu" else 0)
    setup = Setup(device=device, gpus=gpus if device == "cuda" else 0,
                  workers=a.workers, servers=a.servers,
                  rate_bits=schedule.first if schedule else a.rate, steps=a.steps,
                  warmup=a.warmup, batch=a.batch, amp=not a.no_amp, compression=a.compression,
                  exchange_repeats=a.exchange_repeats, cross_barrier=a.cross_barrier,
                  threads_local=threads,
                  threads_worker=threads, timeout=a.timeout, extra_env=dict(a.env),
                  ddp_backend=a.ddp_backend, horovod_python=hvd_python,
                  straggler=a.straggler, schedule=schedule)
    return Plan(setup, names, [m for m in modes if m not in skipped], skipped, usable)


def print_job(plan: Plan, a: argparse.Namespace) -> None:
    s = plan.setup
    if s.device == "cuda":
        share = ("" if s.workers <= s.gpus
                 else f"; workers share them: worker i on cuda:(i % {s.gpus})")
        print(f"device: cuda, {s.gpus} GPU(s){share}; "
              f"{'bf16 autocast' if s.amp else 'float32 (--no-amp)'}; cudnn.benchmark on")
    else:
        print(f"device: cpu, {s.threads_worker} torch thread(s) per process "
              f"({plan.usable_cpus} usable CPUs, {s.workers} worker(s))")
    print(f"job: {s.workers} worker(s), {s.servers} byteps_like server(s), {s.rate}"
          + ("" if s.rate_bits is None else " NIC cap per host, each host a network namespace")
          + f"; {s.warmup} warm-up + {s.steps} timed steps; exchange {s.exchange_repeats} "
          f"repeats; compression {s.compression}"
          + ("; CrossBarrier" if s.cross_barrier else "")
          + (f"; straggler: worker {s.straggler.rank} "
             f"{'NIC at rate' if s.rate_bits is not None else 'compute x'}"
             f"{' / ' if s.rate_bits is not None else ''}{s.straggler.factor:g}"
             if s.straggler else "")
          + (f"; rate schedule {s.schedule.text}" if s.schedule else "")
          + (f"; byteps_like env {' '.join(f'{k}={v}' for k, v in a.env)}" if a.env else ""))
    for mode, why in plan.skipped.items():
        print(f"{mode}: skipped: {why}")


def run_all(plan: Plan, queue_ms: float) -> tuple[list[dict], list[str]]:
    """Every (model, mode), one after the other: the records, and a line per failed run. A
    failed run is reported (its children named, with their stderr tails) and the others go on;
    a failed Horovod run drops Horovod for the rest."""
    s = plan.setup
    records: list[dict] = []
    failures: list[str] = []
    modes = list(plan.modes)
    with ExitStack() as stack:
        if s.rate_bits is not None:
            s.cluster = stack.enter_context(uneven.emulated_cluster(
                s.workers, s.servers, s.rate_bits, s.straggler, queue_ms))
        for name in plan.names:
            for mode in list(modes):
                label = f"[train] {name} {mode}"
                nproc = 1 if mode == "local" else s.workers
                print(f"{label}: starting ({nproc} process{'es' if nproc > 1 else ''})",
                      file=sys.stderr, flush=True)
                sw = uneven.start_schedule(s.cluster, s.schedule, s.straggler)
                try:
                    with OthersMeter() as meter:
                        res = RUNNERS[mode](s, name)
                except ChildFailed as exc:
                    first = str(exc).splitlines()[0]
                    if mode == "horovod":
                        plan.skipped["horovod"] = f"failed: {first}"
                        print(f"{label} failed; skipping Horovod:\n{exc}", file=sys.stderr,
                              flush=True)
                        modes.remove("horovod")
                        continue
                    failures.append(f"{name} {mode}: {first}")
                    print(f"{label} failed:\n{exc}", file=sys.stderr, flush=True)
                    continue
                finally:
                    switches = sw.stop() if sw else []
                rec = make_record(s, name, mode, res, meter.wall)
                if sw is not None:
                    rec["rate_switches"] = [(t - sw.t0, r) for t, r in switches]
                rec["straggler"] = s.straggler.arg() if s.straggler else None
                rec["others_cpu_share"] = meter.others
                records.append(rec)
                print(f"{label}: done in {meter.wall:.1f} s: step {rec['step_s'] * 1e3:.1f} ms, "
                      f"{rec['samples_per_s']:.1f} samples/s", file=sys.stderr, flush=True)
    if s.cluster is not None:    # closed with the stack: every namespace and process gone
        left = s.cluster.leftovers()
        print(f"teardown: {'clean' if not left else f'LEFT {left}'}", file=sys.stderr)
    return records, failures


def print_notes(plan: Plan, records: list[dict]) -> None:
    s = plan.setup
    print(f"\nstep: median over {s.steps} timed steps (after {s.warmup} warm-up) of the slowest "
          "worker's step (zero_grad, forward, backward, optimizer step; CUDA synchronised "
          "around each); samples/s = workers x batch / step. vs local = samples/s / (local "
          "samples/s x devices) = compute / step, where compute = local step x workers / "
          f"devices and devices = {s.devices} (" + (
              "the GPUs the workers use" if s.device == "cuda"
              else "on CPU each worker has its share of the cores, as the local run does")
          + "): 1.00 = no cost beyond the model's own compute. byteps_like only: exchange = "
          "optimizer.synchronize() alone after a backward (every gradient's push_pull, fusion "
          "included), single = one push_pull_inplace of a flat float32 tensor of the same "
          "bytes on the same device; GB/s = gradient bytes / time (1e9 B), slowest worker, "
          f"median of {s.exchange_repeats}; bound = max(compute, gradient bytes / single "
          "GB/s).")
    for name in plan.names:
        mine = [r for r in records if r["model"] == name]
        if mine:
            r0 = mine[0]
            losses = ", ".join(f"{r['mode']} {num(r['loss'], '.3f')}" for r in mine)
            print(f"{name}: {models.MODELS[name].what}; batch {r0['batch']} per worker, "
                  f"{r0['gradients']} gradient tensors, {r0['gradient_bytes'] / (1 << 20):.1f} "
                  f"MiB; loss after the last step: {losses}")
    gpu_names = sorted({r["gpu"] for r in records if r.get("gpu")})
    if gpu_names:
        print(f"gpu: {', '.join(gpu_names)}")
    note = noisy_note({f"{r['model']} {r['mode']}": r["others_cpu_share"] for r in records},
                      "run")
    if note:
        print(note)
    for mode, why in plan.skipped.items():
        print(f"{mode}: skipped: {why}")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = build_parser()
    a = p.parse_args(argv)
    plan = plan_run(p, a)
    command = report_header("train", argv, machine_info())
    print_job(plan, a)
    print_before_start()
    sys.stdout.flush()
    exit_on_signals()
    t_all = time.monotonic()
    ran = drive(PROG, lambda: run_all(plan, a.queue_ms), netns.NetnsError)
    if isinstance(ran, int):
        return ran
    records, failures = ran
    add_ratios(plan.setup, records)
    print()
    if records:
        print(format_table(records))
    print_notes(plan, records)
    print(f"total: {time.monotonic() - t_all:.1f} s")
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump([{**r, "command": command} for r in records], f, indent=1)
        print(f"json: {a.json}")
    if a.plot:
        why = write_plot(records, a.plot)
        print(f"plot: {a.plot}" if why is None else f"plot: {why}")
    if failures:
        print(f"{PROG}: {len(failures)} run(s) failed (their stderr above): "
              + "; ".join(failures), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
