"""push_pull on an emulated cluster: hosts in network namespaces with capped NICs, against gloo
all-reduce, Horovod and the BytePS analysis.

``python -m byteps_like.bench cluster [--rate 1gbit[,RATE...]] [--quick] [--json PATH]
[--plot PATH]``
(root only) builds one network namespace per host behind a bridge, caps every host's NIC in
both directions with ``tc`` (:mod:`.netns`), measures the achieved TCP rate B, and then, on the
same hosts:

1. byteps_like push_pull of VGG-16-shaped gradient lists (64 MiB and 256 MiB) with n = 2 and 4
   worker hosts and k = 0 (one server colocated on each worker host), 1, 2 and n dedicated
   server hosts; for 0 < k < n the worker hosts keep their colocated servers and the keys are
   split in BytePS's mixed-mode proportion (``BYTEPS_MIXED_MODE``);
2. torch.distributed gloo all_reduce of the same tensors on the same worker hosts;
3. Horovod (gloo) allreduce, with the interpreter of ``--horovod-python`` (see
   ``scripts/build_horovod.sh``), skipped with the reason when it is not importable;
4. the theory: 2n(n-1)S / ((n^2 + kn - 2k) B) for the parameter server, 2(n-1)S / (nB) for a
   ring all-reduce;
5. the training-step benchmark of priority scheduling (:mod:`.priority`).

``--compressors none,fp16,onebit,topk,randomk,dithering`` runs the compression benchmark instead
of 1-5: byteps_like push_pull of the same gradient list with n = 2 worker hosts and k = 2
dedicated server hosts (``--workers`` / ``--servers`` change them), one job per compressor
(fixed settings, named in the table), the uncompressed run of the same invocation as the
baseline; it reports time, wire bytes per worker per step and the algorithm bandwidth.

With a list of rates (``--rate 10gbit,25gbit,50gbit``) all of the above runs once per rate, each
on a cluster built with that cap (and its own measured B), and the table has a row per rate for
every system and configuration.

Every namespace, link and process it made is removed at the end, also on Ctrl-C or failure.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from . import links as uneven
from . import netns
from ._cluster_worker import COMPRESSORS, compressor_label
from .harness import (
    ChildFailed,
    Job,
    Proc,
    base_env,
    child_env,
    collect,
    local_job,
    slowest_median,
)
from .report import OthersMeter, markdown_table, num
from .servercpu import CpuSampler, core_seconds_per_gb, server_pids
from .vgg16 import model_tensors

PROG = "python -m byteps_like.bench cluster"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_HOROVOD_PYTHON = os.path.join(ROOT, ".venv-horovod", "bin", "python")
MiB = 1 << 20


# ------------------------------------------------------------------------------------- theory
def ps_time(n: int, k: float, nbytes: float, rate_bits: float) -> float:
    """BytePS analysis: push_pull of S bytes with n worker hosts, k dedicated server hosts and a
    server colocated on each worker host (mixed mode), every NIC at B bits/s."""
    if n == 1:
        return 0.0
    return 2 * n * (n - 1) * nbytes * 8 / ((n * n + k * n - 2 * k) * rate_bits)


def allreduce_time(n: int, nbytes: float, rate_bits: float) -> float:
    """Ring all-reduce of S bytes over n hosts: 2(n-1)S / (nB)."""
    return 2 * (n - 1) * nbytes * 8 / (n * rate_bits)


_RATE_UNITS = {"": 1, "bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "k": 1e3, "m": 1e6,
               "g": 1e9}


def parse_rate(text: str) -> float:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _RATE_UNITS:
        raise argparse.ArgumentTypeError(f"bad rate {text!r}: use e.g. 1gbit, 500mbit")
    v = float(m.group(1)) * _RATE_UNITS[m.group(2).lower()]
    if v < 1e6:
        raise argparse.ArgumentTypeError(f"rate {text!r} is below 1mbit")
    return v


def fmt_rate(bits: float) -> str:
    return f"{bits / 1e9:.3f} Gbit/s" if bits >= 1e9 else f"{bits / 1e6:.1f} Mbit/s"


def parse_rates(text: str) -> list[float] | uneven.RateSchedule:
    """``--rate``: one rate or a comma-separated list ('10gbit,25gbit,50gbit'), bits/s, in the
    order given, repeats dropped; or a schedule (RATE:DURATION,..., :mod:`.links`)."""
    if ":" in text:
        return uneven.parse_rate_schedule(text, parse_rate)
    parts = [t.strip() for t in text.split(",")]
    if not any(parts):
        raise argparse.ArgumentTypeError("--rate: give at least one rate (e.g. 1gbit)")
    if not all(parts):
        raise argparse.ArgumentTypeError(f"--rate {text!r}: an empty item in the list")
    return list(dict.fromkeys(parse_rate(t) for t in parts))


def fmt_cap(bits: float) -> str:
    """A NIC cap as given: '10 Gbit/s', '400 Mbit/s'."""
    return f"{bits / 1e9:g} Gbit/s" if bits >= 1e9 else f"{bits / 1e6:g} Mbit/s"


# ------------------------------------------------------------------------------------ the runs
def _switcher(a: argparse.Namespace, env: Env) -> uneven.RateSwitcher | None:
    """With a rate schedule: the switcher of the next run, started (its t0 is the run's)."""
    if not a.schedule:
        return None
    scale = {f"w{a.straggler.rank}": a.straggler.factor} if a.straggler else {}
    return uneven.RateSwitcher(env.cluster, a.schedule, scale).start()


def auto_report(res: list[dict], tag: str) -> list[dict]:
    """Print what auto compression chose in a run at one rate (rank 0's decisions that changed
    its table, with the predictions), and return them all."""
    decisions: list[dict] = next((r["auto_decisions"] for r in res if r.get("auto_decisions")),
                                 [])
    for d in decisions:
        if d["changed"]:
            print(f"[auto] {tag}bandwidth {d['bandwidth'] * 8 / 1e9:.3g} Gbit/s -> "
                  f"{d['table']}; predicted: {d['why']}", flush=True)
    return decisions


def schedule_report(schedule: uneven.RateSchedule, sw: uneven.RateSwitcher, res: list[dict],
                    compressor: str, size: int) -> dict:
    """Stop ``sw`` and print, for the run of ``compressor``: the median round in each segment
    of the schedule, and when auto compression re-decided after each switch."""
    switches = sw.stop()
    rounds = list(zip(res[0]["starts"][str(size)], slowest_median(res, size)[1]))
    meds = uneven.segment_medians(schedule, sw.t0, rounds)
    segs = ", ".join(f"{fmt_cap(r)} {secs:g} s: " + (f"{m * 1e3:.0f} ms" if m else "no round")
                     for (r, secs), m in zip(schedule.segments, meds))
    print(f"[schedule] {compressor}: median round per segment: {segs}", flush=True)
    out: dict[str, Any] = {"schedule": schedule.text, "segment_median_seconds": meds,
                           "switch_times": [t - sw.t0 for t, _r in switches]}
    decisions: list[dict] = next((r["auto_decisions"] for r in res if r.get("auto_decisions")),
                                 [])
    if compressor == "auto":
        delays = uneven.after_switches(switches, decisions)
        for (t, r), (delay, dec) in zip(switches, delays):
            print(f"[schedule] auto: switch to {fmt_cap(r)} at {t - sw.t0:.1f} s: "
                  + (f"re-decided after {delay:.2f} s (target <= 2 s): "
                     f"{'changed to ' + str(dec['table']) if dec['changed'] else 'unchanged'}"
                     if delay is not None and dec is not None
                     else "no decision before the next switch"), flush=True)
        for dec in decisions:
            if dec["changed"]:
                print(f"[schedule] auto decision at {dec['time'] - sw.t0:.2f} s: bandwidth "
                      f"{dec['bandwidth'] * 8 / 1e9:.3g} Gbit/s -> {dec['table']}", flush=True)
        out["auto_redecide_seconds"] = [delay for delay, _dec in delays]
        out["auto_decisions"] = [{**d, "time": d["time"] - sw.t0} for d in decisions]
    return out


@dataclass
class Env:
    cluster: netns.NetnsCluster
    base_env: dict
    timeout: float
    python: str = sys.executable

    def ip(self, host: str) -> str:
        return self.cluster.ip(host)

    def argv(self, host: str, kind: str, *extra: str, python: str | None = None) -> list[str]:
        return self.cluster.exec_argv(host, [python or self.python, "-m",
                                             "byteps_like.bench._cluster_worker", kind, *extra])


def measure_link(env: Env, a: str, b: str, seconds: float) -> float:
    """Achieved rate of one plain TCP stream from host b to host a, bits/s."""
    port = 5201
    with Job("link") as g:
        r = g.spawn("tcp-recv", env.argv(a, "tcp-recv", "--host", env.ip(a), "--port",
                                         str(port)), env.base_env)
        time.sleep(0.3)
        g.spawn("tcp-send", env.argv(b, "tcp-send", "--host", env.ip(a), "--port", str(port),
                                     "--seconds", str(seconds)), env.base_env)
        g.wait(seconds + 60)
        return float(collect([r], "tcp stream")[0]["bits_per_second"])


def _start_bps_job(g: Job, env: Env, n: int, k: int, port: int,
                   worker_argv: Callable[[str], list[str]], extra: dict | None = None
                   ) -> list[Proc]:
    """``bpslaunch --local``'s plan (:func:`.harness.local_job`), each process moved into its
    host: the scheduler on w0; a server on every worker host unless k >= n (mixed mode then
    gives the colocated servers nothing) and one on each of s0..s{k-1}; a worker on each of
    w0..w{n-1}. Every process advertises its host's address (DMLC_NODE_HOST)."""
    colocated = k == 0 or k < n
    servers = ([f"w{i}" for i in range(n)] if colocated else []) + [f"s{j}" for j in range(k)]
    specs = local_job(["<worker>"], port, workers=n, servers=len(servers), host=env.ip("w0"),
                      python=env.python)
    placed = []
    for spec in specs:
        host = ("w0" if spec.role == "scheduler" else servers[spec.rank or 0]
                if spec.role == "server" else f"w{spec.rank}")
        argv = worker_argv(host) if spec.role == "worker" else \
            env.cluster.exec_argv(host, spec.argv)
        placed.append(dataclasses.replace(spec, argv=tuple(argv),
                                          env={**spec.env, "DMLC_NODE_HOST": env.ip(host)}))
    return g.start(placed, {**env.base_env, **(extra or {})})


def run_bps(env: Env, n: int, k: int, sizes: list[int], repeats: int, warmup: int,
            port: int, partition_bytes: int, compressor: str = "",
            until: float = 0.0) -> list[dict]:
    """One byteps_like job; with ``compressor`` (a name of ``_cluster_worker.COMPRESSORS``)
    its workers push_pull with it and report their wire bytes. ``until``: rounds until then
    (a rate schedule's end, time.time()) instead of ``repeats``."""
    args = ["--sizes", ",".join(map(str, sizes)), "--repeats", str(repeats), "--warmup",
            str(warmup)] + (["--compressor", compressor] if compressor else []) + \
        (["--until", repr(until)] if until else [])
    what = f"compression {compressor}" if compressor else "byteps_like"
    with Job(f"bps-{compressor + '-' if compressor else ''}n{n}-k{k}") as g:
        ws = _start_bps_job(g, env, n, k, port, lambda h: env.argv(h, "bps", *args),
                            {"BYTEPS_PARTITION_BYTES": str(partition_bytes)})
        with CpuSampler(server_pids(g.procs.values())) as sampler:
            g.wait(env.timeout, relay=ws[0], relay_prefix=f"[cluster] {what} n={n} k={k}: ")
        got = collect(ws, f"byteps_like ({compressor})" if compressor else "byteps_like")
        for w in got:   # every worker's record carries the servers' CPU sampler
            w["server_cpu"] = sampler
        return got


def compression_records(per_worker: list[dict], compressor: str, n: int, k: int,
                        sizes: list[int], link: float, cap: float) -> list[dict]:
    """One record per size: median time (slowest worker per round) and the mean over workers of
    the wire bytes per step; ratios and bandwidth are filled in by :func:`add_ratios`."""
    out = []
    for s in sizes:
        med, reps = slowest_median(per_worker, s)
        ws = [w["wire"][str(s)] for w in per_worker]
        pushed = statistics.fmean(w["pushed"] / w["rounds"] for w in ws)
        pulled = statistics.fmean(w["pulled"] / w["rounds"] for w in ws)
        out.append({"system": "byteps_like_compressed", "compressor": compressor,
                    "setting": compressor_label(compressor), "n": n, "k": k, "bytes": s,
                    "seconds": med, "repeats_s": reps,
                    "bytes_pushed_per_step": pushed, "bytes_pulled_per_step": pulled,
                    "wire_bytes_per_step": pushed + pulled,
                    "algbw_bits_per_second": s * 8 / med,
                    # the network alone: the PS formula with the bytes that crossed per direction
                    "floor_seconds": ps_time(n, k, max(pushed, pulled), link),
                    "link_bits_per_second": link, "cap_bits_per_second": cap})
    return out


def add_ratios(records: list[dict]) -> None:
    """time / uncompressed time and wire bytes / uncompressed wire bytes, per (rate, n, k,
    size)."""
    base = {(r.get("cap_bits_per_second"), r["n"], r["k"], r["bytes"]): r for r in records
            if r["system"] == "byteps_like_compressed" and r["compressor"] == "none"}
    for r in records:
        if r["system"] != "byteps_like_compressed":
            continue
        b = base.get((r.get("cap_bits_per_second"), r["n"], r["k"], r["bytes"]))
        r["time_ratio"] = r["seconds"] / b["seconds"] if b else None
        r["bytes_ratio"] = r["wire_bytes_per_step"] / b["wire_bytes_per_step"] if b else None


def format_compression_table(records: list[dict], by_rate: bool = False) -> str:
    """One row per compressor and (n, k, size); ``by_rate``: also per NIC cap (columns cap and
    B, the rows of one compressor and configuration next to each other)."""
    cols = ("compressor (settings)", "n", "k", "size", *(("cap", "B Gbit/s") if by_rate else ()),
            "time s", "time/none", "MiB/step", "bytes/none", "algbw Gbit/s", "net floor s")
    rows = []
    comp = [r for r in records if r["system"] == "byteps_like_compressed"]
    if by_rate:
        order = {c: i for i, c in enumerate(dict.fromkeys(r["compressor"] for r in comp))}
        comp.sort(key=lambda r: (order[r["compressor"]], r["n"], r["k"], r["bytes"],
                                 r["cap_bits_per_second"]))
    for r in comp:
        rows.append((r["setting"], str(r["n"]), str(r["k"]), f"{r['bytes'] // MiB}MiB",
                     *((fmt_cap(r["cap_bits_per_second"]),
                        f"{r['link_bits_per_second'] / 1e9:.3f}") if by_rate else ()),
                     f"{r['seconds']:.3f}",
                     "n/a" if r.get("time_ratio") is None else f"{r['time_ratio']:.2f}",
                     f"{r['wire_bytes_per_step'] / MiB:.1f}",
                     "n/a" if r.get("bytes_ratio") is None else f"{r['bytes_ratio']:.4f}",
                     f"{r['algbw_bits_per_second'] / 1e9:.2f}", f"{r['floor_seconds']:.3f}"))
    return markdown_table(cols, rows, left=1)


def run_gloo(env: Env, n: int, sizes: list[int], repeats: int, warmup: int,
             port: int) -> list[dict]:
    e = {**env.base_env, "GLOO_SOCKET_IFNAME": "eth0", "TP_SOCKET_IFNAME": "eth0"}
    args = ("--sizes", ",".join(map(str, sizes)), "--repeats", str(repeats), "--warmup",
            str(warmup), "--world", str(n), "--host", env.ip("w0"), "--port", str(port))
    with Job(f"gloo-n{n}") as g:
        ws = [g.spawn(f"gloo-w{r}", env.argv(f"w{r}", "gloo", *args, "--rank", str(r)), e)
              for r in range(n)]
        g.wait(env.timeout, relay=ws[0], relay_prefix=f"[cluster] gloo n={n}: ")
        return collect(ws, "gloo")


def horovod_unavailable(python: str) -> str | None:
    if not os.path.exists(python):
        return (f"no Horovod interpreter at {python} (build one with scripts/build_horovod.sh, "
                f"or pass --horovod-python)")
    p = subprocess.run([python, "-c", "import horovod.torch as h; assert h.gloo_built()"],
                       env=child_env(dict(os.environ), always=True), stdin=subprocess.DEVNULL,
                       capture_output=True, text=True, timeout=120)
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["?"])[-1]
        return f"horovod.torch with gloo does not import with {python}: {last}"
    return None


def run_horovod(env: Env, n: int, sizes: list[int], repeats: int, warmup: int,
                python: str) -> list[dict]:
    e = child_env(env.base_env, always=True)   # another interpreter: it needs byteps_like too
    with Job(f"horovod-n{n}") as g:
        port_file = os.path.join(g.dir, "rendezvous.port")
        hosts = ",".join(f"w{i}:1" for i in range(n))
        rdv = g.spawn("hvd-rendezvous", env.argv("w0", "hvd-rendezvous", "--hosts", hosts,
                                                 "--world", str(n), "--port-file", port_file,
                                                 python=python), e, service=True)
        port = g.read_when_written(rdv, port_file, "Horovod rendezvous server")
        args = ("--sizes", ",".join(map(str, sizes)), "--repeats", str(repeats), "--warmup",
                str(warmup))
        ws = []
        for r in range(n):
            he = {**e, "HOROVOD_RANK": str(r), "HOROVOD_SIZE": str(n), "HOROVOD_LOCAL_RANK": "0",
                  "HOROVOD_LOCAL_SIZE": "1", "HOROVOD_CROSS_RANK": str(r),
                  "HOROVOD_CROSS_SIZE": str(n), "HOROVOD_HOSTNAME": f"w{r}",
                  "HOROVOD_GLOO_RENDEZVOUS_ADDR": env.ip("w0"),
                  "HOROVOD_GLOO_RENDEZVOUS_PORT": port, "HOROVOD_GLOO_IFACE": "eth0",
                  "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo",
                  "GLOO_SOCKET_IFNAME": "eth0"}
            ws.append(g.spawn(f"horovod-w{r}", env.argv(f"w{r}", "horovod", *args,
                                                         python=python), he))
        # the rendezvous server never exits by itself: no grace period for it
        g.wait(env.timeout, relay=ws[0], relay_prefix=f"[cluster] horovod n={n}: ",
               service_grace=0.0)
        return collect(ws, "horovod")


def run_step(env: Env, n: int, k: int, nbytes: int, compute_s: float, priority: bool,
             iters: int, warmup: int, port: int, partition_bytes: int) -> list[dict]:
    params = json.dumps({"bytes": nbytes, "compute_s": compute_s, "priority": priority,
                         "iters": iters, "warmup": warmup})
    extra = {"BYTEPS_PARTITION_BYTES": str(partition_bytes)}
    if not priority:
        extra["BYTEPS_SCHEDULING_CREDIT"] = "0"   # FIFO: no priorities, no credit limit
    mode = "priority" if priority else "fifo"
    with Job(f"step-{mode}") as g:
        ws = _start_bps_job(g, env, n, k, port, lambda h: env.argv(h, "step", "--step", params),
                            extra)
        g.wait(env.timeout, relay=ws[0], relay_prefix=f"[cluster] step n={n} k={k}: ")
        return collect(ws, f"step ({mode})")


# ------------------------------------------------------------------------------ report / plot
def format_table(records: list[dict], by_rate: bool = False) -> str:
    """One row per (n, k, bytes) of byteps_like, and one per n and bytes for gloo / horovod;
    ``by_rate``: one such row per NIC cap, next to each other, with the cap and the measured
    B (records of several rates, each with its ``cap_bits_per_second``)."""
    gloo = {(r.get("cap_bits_per_second"), r["n"], r["bytes"]): r["seconds"] for r in records
            if r["system"] == "gloo"}
    cols = ("system", "n", "k", "size", *(("cap", "B Gbit/s") if by_rate else ()), "time s",
            "theory s", "of optimum", "vs gloo", "server core-s/GB")
    rows = []
    order = {"byteps_like": 0, "gloo": 1, "horovod": 2}
    meas = [r for r in records if r["system"] in order]
    meas.sort(key=lambda r: (r["bytes"], r["n"], order[r["system"]], r["k"] if r["k"] is not None
                             else -1, r.get("cap_bits_per_second") or 0))
    for r in meas:
        g = gloo.get((r.get("cap_bits_per_second"), r["n"], r["bytes"]))
        rows.append((r["system"], str(r["n"]), "-" if r["k"] is None else str(r["k"]),
                     f"{r['bytes'] // MiB}MiB",
                     *((fmt_cap(r["cap_bits_per_second"]),
                        f"{r['link_bits_per_second'] / 1e9:.3f}") if by_rate else ()),
                     f"{r['seconds']:.3f}",
                     f"{r['theory_seconds']:.3f}", f"{r['theory_seconds'] / r['seconds']:.2f}",
                     f"{g / r['seconds']:.2f}x" if g else "n/a",
                     num(r.get("server_core_s_per_gb"), ".3f")))
    return markdown_table(cols, rows)


def write_plot(records: list[dict], path: str, links: float | dict[float, float]) -> str | None:
    """Time against k per (n, size), with the theoretical curve at the measured B. ``links``:
    the measured B, or {NIC cap: measured B} for several rates (one row of panels per rate;
    records are matched by their ``cap_bits_per_second``)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'byteps_like[bench]'); no plot"
    by_cap: dict[float | None, float] = {None: links} if not isinstance(links, dict) else {}
    if isinstance(links, dict):
        by_cap.update(links.items())
    combos = sorted({(r["n"], r["bytes"]) for r in records if r["system"] == "byteps_like"})
    if not combos:
        return "nothing to plot"
    caps = list(by_cap)
    fig, axes = plt.subplots(len(caps), len(combos),
                             figsize=(4.6 * len(combos), 4.2 * len(caps)), squeeze=False)
    for row, cap in zip(axes, caps):
        rate_bits = by_cap[cap]
        mine = [r for r in records if cap is None or r.get("cap_bits_per_second") == cap]
        for ax, (n, nbytes) in zip(row, combos):
            _plot_panel(ax, mine, n, nbytes, rate_bits,
                        None if cap is None or len(caps) == 1 else cap)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def _plot_panel(ax, records: list[dict], n: int, nbytes: int, rate_bits: float,
                cap: float | None) -> None:
    ks = [x / 20 * n for x in range(21)]
    ax.plot(ks, [ps_time(n, k, nbytes, rate_bits) for k in ks], "-", color="0.3",
            label="PS theory 2n(n-1)S/((n²+kn-2k)B)")
    ax.axhline(allreduce_time(n, nbytes, rate_bits), color="0.6", ls=":",
               label="ring all-reduce theory")
    pts = sorted((r["k"], r["seconds"]) for r in records
                 if r["system"] == "byteps_like" and r["n"] == n and r["bytes"] == nbytes)
    ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color="C0",
            label="byteps_like (measured)")
    for sysname, color, ls in (("gloo", "C1", "--"), ("horovod", "C2", "-.")):
        for r in records:
            if r["system"] == sysname and r["n"] == n and r["bytes"] == nbytes:
                ax.axhline(r["seconds"], color=color, ls=ls, label=f"{sysname} all-reduce")
    ax.set_title(f"n = {n} workers, {nbytes // MiB} MiB, "
                 + (f"cap {fmt_cap(cap)}, " if cap is not None else "")
                 + f"B = {fmt_rate(rate_bits)}", fontsize=9 if cap is not None else None)
    ax.set_xlabel("k (dedicated server hosts; 0 = colocated)")
    ax.set_ylabel("push_pull time (s)")
    ax.set_xticks(sorted({p[0] for p in pts} | {0, n}))
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")


# ----------------------------------------------------------------------------------- the driver
def _parse_list(text: str, what: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--{what}: comma-separated integers") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--straggler", type=uneven.parse_straggler, default=None,
                   metavar="RANK:FACTOR", help="worker RANK's NIC alone is capped at the rate "
                   "/ FACTOR (the others at the rate; bench/links.py)")
    p.add_argument("--rate", type=parse_rates, default=[1e9],
                   help="a schedule RATE:DURATION,... (e.g. 25gbit:20s,1gbit:20s,25gbit:20s) "
                        "changes every NIC's cap mid-run: the runs go on until it ends (one "
                        "size), and the report places rounds and auto's decisions relative "
                        "to each switch; or the NIC cap of every host, both directions (e.g. "
                        "1gbit, 500mbit), or a "
                        "comma-separated list (10gbit,25gbit,50gbit): every phase runs once "
                        "per rate, on a cluster built for it, and the table gets a row per "
                        "rate (default 1gbit)")
    p.add_argument("--partition-bytes", type=int, default=1 << 20,
                   help="BYTEPS_PARTITION_BYTES of the byteps_like jobs (smaller partitions "
                        "pipeline push and pull better: less fill and drain per round)")
    p.add_argument("--queue-ms", type=float, default=20.0,
                   help="queue of each NIC's token bucket (tc tbf latency), milliseconds")
    p.add_argument("--workers", default=None,
                   help="values of n (worker hosts); default 2,4 (with --compressors: 2)")
    p.add_argument("--servers", default=None,
                   help="values of k (dedicated server hosts; 0 = colocated; n = as many as "
                        "workers); default 0,1,2,n (with --compressors: n)")
    p.add_argument("--compressors", default=None, metavar="LIST",
                   help="run the compression benchmark instead: byteps_like push_pull with each "
                        f"of these compressors (of {','.join(COMPRESSORS)}; 'none' is always "
                        "run first, as the baseline); no gloo, Horovod, step benchmark or plot")
    p.add_argument("--sizes", default="64,256", help="gradient sizes in MiB")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds per size")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds per size")
    p.add_argument("--quick", action="store_true",
                   help="reduced set: n = 4, k = 0 and 4, 64 MiB, short step benchmark")
    p.add_argument("--skip-gloo", action="store_true")
    p.add_argument("--skip-horovod", action="store_true")
    p.add_argument("--skip-priority", action="store_true")
    p.add_argument("--horovod-python", default=DEFAULT_HOROVOD_PYTHON,
                   help="interpreter that imports horovod.torch (scripts/build_horovod.sh)")
    p.add_argument("--priority-workers", type=int, default=2, help="n of the step benchmark")
    p.add_argument("--priority-servers", type=int, default=2, help="k of the step benchmark")
    p.add_argument("--priority-mib", type=int, default=64, help="model size of the step "
                   "benchmark, MiB")
    p.add_argument("--priority-iters", type=int, default=6, help="timed iterations")
    p.add_argument("--compute-ratio", type=float, default=1.0,
                   help="synthetic compute per iteration / theoretical communication time")
    p.add_argument("--link-seconds", type=float, default=4.0, help="TCP stream duration")
    p.add_argument("--timeout", type=float, default=900.0, help="watchdog per phase, seconds")
    p.add_argument("--json", metavar="PATH", help="write every measurement as JSON records")
    p.add_argument("--plot", metavar="PATH", default="cluster.png", help="PNG plot of time "
                   "against k with the theoretical curve")
    p.add_argument("--sweep", action="store_true",
                   help="only remove leftovers (namespaces, processes) of earlier crashed runs")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = build_parser()
    a = p.parse_args(argv)
    reason = netns.why_unavailable()
    if reason:
        print(f"{PROG}: {reason}", file=sys.stderr)
        return 2
    if a.sweep:
        gone = netns.sweep(sys.stderr, all_runs=False)
        print(f"removed {len(gone)} leftover namespace(s)")
        return 0
    comps: list[str] = []
    if a.compressors is not None:
        comps = [c.strip() for c in a.compressors.split(",") if c.strip()]
        bad = sorted(set(comps) - set(COMPRESSORS))
        if bad or not comps:
            p.error(f"--compressors: unknown {bad} (choose from {','.join(COMPRESSORS)})"
                    if bad else "--compressors: give at least one")
        comps = ["none"] + [c for i, c in enumerate(comps) if c != "none" and c not in comps[:i]]
        if a.quick:
            p.error("--quick does not apply to --compressors")
        a.skip_gloo = a.skip_priority = True
        a.plot = None
    if a.quick:
        ns_, ks_, sizes_mib = [4], ["0", "n"], [64]
        a.priority_iters = min(a.priority_iters, 4)
    else:
        ns_ = _parse_list(a.workers or ("2" if comps else "2,4"), "workers")
        ks_ = [x.strip() for x in (a.servers or ("n" if comps else "0,1,2,n")).split(",")
               if x.strip()]
        sizes_mib = _parse_list(a.sizes, "sizes")
    if not ns_ or min(ns_) < 2:
        p.error("--workers: every n must be >= 2")
    sizes = [m * MiB for m in sizes_mib]
    for s in sizes:
        model_tensors(s)            # validates the size
    configs: list[tuple[int, int]] = []
    for n in ns_:
        for kt in ks_:
            k = n if kt == "n" else int(kt)
            if k < 0:
                p.error("--servers: k must be >= 0 or n")
            if (n, k) not in configs:
                configs.append((n, k))
    max_n = max(ns_ + ([a.priority_workers] if not a.skip_priority else []))
    max_k = max([k for _n, k in configs] + ([a.priority_servers] if not a.skip_priority else []))
    hosts = [f"w{i}" for i in range(max_n)] + [f"s{j}" for j in range(max_k)]
    a.schedule = a.rate if isinstance(a.rate, uneven.RateSchedule) else None
    rates = [a.schedule.first] if a.schedule else a.rate
    if a.schedule and len(sizes) != 1:
        p.error("--rate with a schedule: give one size (--sizes), the runs last the schedule")
    why = uneven.check_straggler(a.straggler, min(ns_))
    if why:
        p.error(why)
    multi = len(rates) > 1
    command = shlex.join(["python", "-m", "byteps_like.bench", "cluster", *argv])
    print(f"command: {command}")
    print(f"hosts: {', '.join(hosts)} (one network namespace each), NIC cap "
          f"{', '.join(fmt_rate(r) for r in rates)} each way (tc tbf, {a.queue_ms:g} ms queue"
          f"{'; one cluster per rate, one after another' if multi else ''}), {os.cpu_count()} "
          f"CPUs shared by all of them; byteps_like partition {a.partition_bytes} B")
    hvd_reason = None if comps else "skipped (--skip-horovod)" if a.skip_horovod else \
        horovod_unavailable(a.horovod_python)
    if hvd_reason:
        print(f"horovod: {hvd_reason}")
    sys.stdout.flush()

    job_env = base_env(drop=("DMLC_", "HOROVOD_"), force_distributed=False)
    records: list[dict] = []
    cpu: dict[str, float | None] = {}
    links: dict[float, float] = {}
    step_lines: list[str] = []
    leftovers: list[str] = []
    port = 9100

    def next_port() -> int:
        nonlocal port
        port += 1
        return port

    try:
        for rate in rates:
            tag = f"{fmt_cap(rate)} " if multi else ""     # names the phases of each rate
            if multi:
                print(f"[cluster] NIC cap {fmt_rate(rate)} ({rates.index(rate) + 1}/"
                      f"{len(rates)})", file=sys.stderr, flush=True)
            with uneven.emulated_cluster(max_n, max_k, rate, a.straggler, a.queue_ms) as cl:
                env = Env(cl, job_env, a.timeout)
                link = measure_link(env, "w0", "w1", a.link_seconds)
                links[rate] = link
                print(f"link: one TCP stream w1 -> w0 achieved {fmt_rate(link)} "
                      f"({link / rate:.1%} of the {fmt_rate(rate)} cap); B = this rate "
                      f"{'for its rows' if multi else 'below'}", flush=True)
                hvd_reason = _run_rate(a, env, rate, link, comps, configs, ns_, sizes, records,
                                       cpu, step_lines, tag, hvd_reason, next_port)
            leftovers += cl.leftovers()
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; everything it made was removed", file=sys.stderr)
        return 130
    except (ChildFailed, netns.NetnsError) as exc:
        print(f"{PROG}: failed: {exc}\n(every namespace and process it made was removed)",
              file=sys.stderr)
        return 1

    at_b = ("each rate's measured B (column B)" if multi
            else f"B = {fmt_rate(links[rates[0]])}")
    print()
    if comps:
        add_ratios(records)
        print(format_compression_table(records, by_rate=multi))
        print(f"\ntime: median over {a.repeats} rounds of the slowest worker (push_pull of the "
              f"whole list, compression included); MiB/step: bytes pushed + pulled per worker "
              f"per step (payloads on the wire, the runtime's counters, mean over workers); "
              f"x/none: ratio to the uncompressed run {'of the same rate' if multi else 'above'}"
              f"; algbw = model bytes / time; net floor = the PS formula at {at_b} with the "
              f"bytes that crossed each way. Tensors below BYTEPS_MIN_COMPRESS_BYTES travel "
              f"uncompressed (not the casts).")
    else:
        print(format_table(records, by_rate=multi))
        print(f"\ntime: median over {a.repeats} rounds of the slowest worker; theory at "
              f"{at_b}; 'of optimum' = theory / time; 'vs gloo' = gloo time / time; server "
              "core-s/GB = the servers' CPU time (every thread) over the timed rounds / the GB "
              "the workers pushed to them"
              + ("; cap = the tc rate of every NIC, B = one TCP stream's achieved rate at that "
                 "cap" if multi else ""))
    for line in step_lines:
        print(line)
    print("CPU busy (whole machine) per phase: " + ", ".join(
        f"{name} {v:.0%}" for name, v in cpu.items() if v is not None))
    print(f"teardown: {'clean' if not leftovers else f'LEFT {leftovers}'}")
    if hvd_reason:
        print(f"horovod: {hvd_reason}")
    if a.plot:
        why = write_plot(records, a.plot, links)
        print(f"plot: {a.plot}" if why is None else f"plot: {why}")
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(records, f, indent=1)
        print(f"json: {a.json}")
    return 0


def _run_rate(a: argparse.Namespace, env: Env, rate: float, link: float, comps: list[str],
              configs: list[tuple[int, int]], ns_: list[int], sizes: list[int],
              records: list[dict], cpu: dict[str, float | None], step_lines: list[str], tag: str,
              hvd_reason: str | None, next_port) -> str | None:
    """Every phase on one cluster (NICs capped at ``rate``, measured ``link``): appends the
    records, the CPU shares (phase names prefixed with ``tag``) and the step-benchmark lines;
    returns why Horovod is skipped (None: it ran)."""
    for n, k in configs:
        if comps:
            for i, c in enumerate(comps):
                print(f"[cluster] compression n={n} k={k}: {compressor_label(c)} "
                      f"({i + 1}/{len(comps)})", file=sys.stderr, flush=True)
                sw = _switcher(a, env)
                with OthersMeter() as m:
                    res = run_bps(env, n, k, sizes, a.repeats, a.warmup, next_port(),
                                  a.partition_bytes, c,
                                  sw.t0 + a.schedule.duration if sw else 0.0)
                cpu[f"{tag}{c} n={n} k={k}"] = m.busy
                records += compression_records(res, c, n, k, sizes, link, rate)
                if sw is not None:
                    records[-1].update(schedule_report(a.schedule, sw, res, c, sizes[0]))
                elif c == "auto":
                    records[-1]["auto_decisions"] = auto_report(res, tag)
            continue
        with OthersMeter() as m:
            res = run_bps(env, n, k, sizes, a.repeats, a.warmup, next_port(), a.partition_bytes)
        cpu[f"{tag}byteps_like n={n} k={k}"] = m.busy
        for s in sizes:
            med, reps = slowest_median(res, s)
            # every worker pushes the model's bytes to the servers each repetition
            cost = core_seconds_per_gb(res[0].get("server_cpu"), res, s, n * s)
            records.append({"system": "byteps_like", "n": n, "k": k, "bytes": s,
                            "seconds": med, "repeats_s": reps, "server_core_s_per_gb": cost,
                            "placement": "colocated" if k == 0 else
                            ("dedicated" if k >= n else "mixed"),
                            "theory_seconds": ps_time(n, k, s, link),
                            "link_bits_per_second": link, "cap_bits_per_second": rate})
    def allreduce_records(system: str, n: int, res) -> None:
        """One record per size of an all-reduce baseline (gloo, Horovod) at this rate."""
        for s in sizes:
            med, reps = slowest_median(res, s)
            records.append({"system": system, "n": n, "k": None, "bytes": s,
                            "seconds": med, "repeats_s": reps,
                            "theory_seconds": allreduce_time(n, s, link),
                            "link_bits_per_second": link, "cap_bits_per_second": rate})

    for n in ns_:
        if a.skip_gloo:
            break
        with OthersMeter() as m:
            res = run_gloo(env, n, sizes, a.repeats, a.warmup, next_port())
        cpu[f"{tag}gloo n={n}"] = m.busy
        allreduce_records("gloo", n, res)
    for n in ns_:
        if hvd_reason or comps:
            break
        try:
            with OthersMeter() as m:
                res = run_horovod(env, n, sizes, a.repeats, a.warmup, a.horovod_python)
        except ChildFailed as exc:
            hvd_reason = f"failed: {str(exc).splitlines()[0]}"
            print(f"[cluster] horovod n={n} failed; skipping Horovod:\n{exc}", file=sys.stderr)
            break
        cpu[f"{tag}horovod n={n}"] = m.busy
        allreduce_records("horovod", n, res)
    if not comps:
        for n, k in configs:
            for s in sizes:
                records.append({"system": "theory", "n": n, "k": k, "bytes": s,
                                "seconds": ps_time(n, k, s, link), "model": "ps",
                                "link_bits_per_second": link, "cap_bits_per_second": rate})
        for n in ns_:
            for s in sizes:
                records.append({"system": "theory", "n": n, "k": None, "bytes": s,
                                "seconds": allreduce_time(n, s, link), "model": "allreduce",
                                "link_bits_per_second": link, "cap_bits_per_second": rate})
    if a.skip_priority:
        return hvd_reason
    pn, pk, pbytes = a.priority_workers, a.priority_servers, a.priority_mib * MiB
    comm = ps_time(pn, pk, pbytes, link)
    compute = a.compute_ratio * comm
    step_lines.append(
        f"step benchmark{' at ' + fmt_rate(rate) if tag else ''}: VGG-16-shaped "
        f"{a.priority_mib} MiB model, n={pn} k={pk}, partition {a.partition_bytes} B, synthetic "
        f"compute {compute * 1e3:.0f} ms/iteration (fwd:bwd 1:2, by VGG-16 FLOPs) = "
        f"{a.compute_ratio:g} x theoretical push_pull {comm * 1e3:.0f} ms")
    step_med: dict[str, float] = {}
    for prio in (False, True):
        mode = "priority" if prio else "fifo"
        with OthersMeter() as m:
            res = run_step(env, pn, pk, pbytes, compute, prio, a.priority_iters, 1,
                           next_port(), a.partition_bytes)
        cpu[f"{tag}step {mode}"] = m.busy
        per_iter = [max(x) for x in zip(*(r["iter_times"] for r in res))]
        step_med[mode] = statistics.median(per_iter)
        wait = statistics.median(res[0]["forward_wait_s"])
        records.append({"system": "byteps_like_step", "scheduling": mode, "n": pn,
                        "k": pk, "bytes": pbytes, "seconds": step_med[mode],
                        "iterations_s": per_iter, "compute_seconds": compute,
                        "forward_wait_seconds": wait, "link_bits_per_second": link,
                        "cap_bits_per_second": rate})
        step_lines.append(f"  {mode:>8}: median iteration {step_med[mode] * 1e3:.0f} ms "
                          f"(worker 0 waits {wait * 1e3:.0f} ms for gradients in forward)")
    step_lines.append(f"  priority speed-up: {step_med['fifo'] / step_med['priority']:.2f}x "
                      f"(target >= 1.15x)")
    return hvd_reason


if __name__ == "__main__":
    raise SystemExit(main())
