"""Cost of the CPU local reduction: push_pull on one machine of L local ranks vs one process.

``python -m byteps_like.bench local [--local-sizes 2,4] [--sizes 4M,64M] [--servers 1]``
measures, in one invocation and on loopback:

(a) byteps_like push_pull on ONE machine of L local ranks (``DMLC_NUM_WORKER=1``,
    ``BYTEPS_LOCAL_SIZE=L``, ``DMLC_WORKER_ID=0``, ``BYTEPS_LOCAL_RANK=i``, as ``bpslaunch
    --local --local-size L`` sets them) against M servers: the ranks reduce in shared memory,
    the local root pushes once and every rank copies the result out (byteps_like.local);
(b) the same tensor with L=1, one worker process: the network round trip alone;
(c) in the driver, between the jobs: memcpy (``np.copyto``) and numpy add of the same bytes.

Every timed repetition starts after a barrier of the job's workers; its time is the slowest
rank's and the table shows the median over repetitions. Every rank checks every timed result
(the sum over ranks, element by element). a - b is what the local reduction adds to a
push_pull; S / (a - b) is the rate at which it handles the tensor, compared with memcpy.

With torch and a CUDA device, a GPU section adds D2H and H2D copies of S bytes (pinned and
pageable host memory) and ``byteps_like.torch.push_pull`` of a CUDA tensor with 1 worker and
M servers; without one it says why it was skipped.
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence

from .harness import (
    Case,
    ChildFailed,
    Job,
    base_env,
    collect,
    decode_cases,
    encode_cases,
    free_port,
    local_job,
    summarize,
)
from .report import (
    OthersMeter,
    emit,
    exit_on_signals,
    fmt_size,
    machine_info,
    markdown_table,
    noisy_note,
    num,
    print_before_start,
    progress,
    report_header,
    size_list,
)

PROG = "python -m byteps_like.bench local"
DEFAULT_LOCAL_SIZES = "2,4"
DEFAULT_SIZES = "4M,64M"
PATTERN = 251  # element j of rank r holds (r + 1) * (j % PATTERN + 1): a misplaced slice shows

COLUMNS = ("L", "size", "push_pull ms", "algbw GB/s", "single-process ms", "overhead ms",
           "local red. GB/s", "memcpy GB/s", "ratio to memcpy")
HOST_COLUMNS = ("size", "memcpy ms", "memcpy GB/s", "numpy add ms", "numpy add GB/s")
GPU_COLUMNS = ("size", "D2H pinned GB/s", "D2H pageable GB/s", "H2D pinned GB/s",
               "H2D pageable GB/s", "cuda push_pull ms", "cpu push_pull ms", "cuda extra ms")

EXPLAIN = """\
columns (S = tensor bytes, float32; times are medians over repetitions of the slowest rank):
  L                  local ranks (worker processes) on the one machine, 1 worker machine
  push_pull ms       (a) one push_pull of S bytes with L local ranks (reduce in shared memory,
                     one push and pull by the local root, every rank copies the result out)
  algbw GB/s         S / (a), 1e9 B/s
  single-process ms  (b) the same push_pull with L=1: one worker process, no local reduction
  overhead ms        (a) - (b): what the local reduction adds to the network round trip
  local red. GB/s    S / ((a) - (b)); n/a when (a) - (b) <= 0 (within noise)
  memcpy GB/s        S / time of np.copyto of S bytes in one process, measured in this run
  ratio to memcpy    local red. GB/s / memcpy GB/s. 1.0: the local reduction costs as much
                     as one memcpy of S. Its critical path is about three: every rank copies
                     S into its slot, sums its S/L slice over the L slots, and copies S out,
                     so ~0.33 with a core per process; overlap with the network (the
                     pipeline works partition by partition) can raise it, fewer cores than
                     processes lower it"""

GPU_EXPLAIN = """\
GPU columns: GB/s = S / median time of one copy (torch.Tensor.copy_ then
torch.cuda.synchronize), between a CUDA tensor and host memory allocated pinned
(torch.empty(pin_memory=True)) or pageable (torch.empty). cuda push_pull ms: one
byteps_like.torch.push_pull(average=False) of a CUDA tensor of S bytes, synchronize included,
in a job of 1 worker process and the same servers; cpu push_pull ms: byteps_like.push_pull of a
numpy array of S bytes in the same job, alternating with the CUDA one; cuda extra ms: the
difference (staging through pinned host memory: D2H, H2D)."""


def _expected(nbytes: int, ranks: int):
    import numpy as np
    pat = (np.arange(nbytes // 4, dtype=np.int64) % PATTERN + 1).astype(np.float32)
    return pat, pat * np.float32(ranks * (ranks + 1) // 2)


# ---------------------------------------------------------------------------------------------
# Child entry points (python -m byteps_like.bench.local --_worker KIND ...)
# ---------------------------------------------------------------------------------------------

def _local_worker(cases: list[Case]) -> int:
    import numpy as np

    import byteps_like as bps
    bps.init()
    rank, n = bps.rank(), bps.size()
    if bps.local_size() != n:
        raise AssertionError(f"rank {rank}: local_size {bps.local_size()} != size {n}: the "
                             "benchmark wants one machine")
    out_times: dict[str, list[float]] = {}
    for case in cases:
        pat, expect = _expected(case.nbytes, n)
        arr = pat * np.float32(rank + 1)
        out = np.empty_like(arr)
        name = f"bench.local.{case.nbytes}"
        for _ in range(case.warmup):
            bps.barrier()
            bps.push_pull(arr, name=name, average=False, out=out)
        times = []
        for rep in range(case.repeats):
            out.fill(0)  # untimed: each timed round must produce its own result
            bps.barrier()
            t0 = time.perf_counter()
            bps.push_pull(arr, name=name, average=False, out=out)
            times.append(time.perf_counter() - t0)
            if not np.array_equal(out, expect):
                bad = int(np.flatnonzero(out != expect)[0])
                raise AssertionError(
                    f"rank {rank} of {n} (local rank {bps.local_rank()}): wrong push_pull "
                    f"result for {name}, repetition {rep}: out[{bad}] = {out[bad]}, expected "
                    f"{expect[bad]}")
        out_times[str(case.nbytes)] = times
        if rank == 0:
            progress(f"L={n} {fmt_size(case.nbytes)}: median "
                      f"{statistics.median(times) * 1e3:.1f} ms on rank 0 "
                      f"({case.repeats} repeats)")
        del arr, out, pat, expect
    bps.shutdown()
    emit({"rank": rank, "times": out_times})
    return 0


def _median_time(fn: Callable[[], object], repeats: int,
                 sync: Callable[[], object] | None = None) -> float:
    ts = []
    for _ in range(repeats):
        if sync:
            sync()
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _gpu_worker(cases: list[Case]) -> int:
    """D2H/H2D copies, then (in a 1-worker job) byteps_like.torch.push_pull of CUDA tensors."""
    import numpy as np
    import torch

    import byteps_like as bps
    import byteps_like.torch as bpt
    sync = torch.cuda.synchronize
    copies: dict[str, dict] = {}
    for case in cases:
        n = case.nbytes // 4
        reps = max(case.repeats, 5)
        dev = torch.ones(n, dtype=torch.float32, device="cuda")
        res = {}
        for kind, pinned in (("pinned", True), ("pageable", False)):
            host = torch.empty(n, dtype=torch.float32, pin_memory=pinned)
            host.fill_(1.0)  # touch every page before timing
            for _ in range(max(case.warmup, 1)):
                host.copy_(dev)
                dev.copy_(host)
            sync()
            # partial binds the tensors now: a lambda would look them up when called, after
            # the `del` below had unbound them (only the call order made it work)
            res[f"d2h_{kind}_s"] = _median_time(functools.partial(host.copy_, dev), reps, sync)
            res[f"h2d_{kind}_s"] = _median_time(functools.partial(dev.copy_, host), reps, sync)
            del host
        copies[str(case.nbytes)] = res
        del dev
        progress(f"GPU copies {fmt_size(case.nbytes)}: D2H pinned "
                  f"{case.nbytes / res['d2h_pinned_s'] / 1e9:.1f} GB/s, pageable "
                  f"{case.nbytes / res['d2h_pageable_s'] / 1e9:.1f} GB/s")
    bpt.init()
    # the CUDA tensor and a numpy array of the same bytes, alternately, in the same job: the
    # difference is what the device path adds, without the noise between two jobs
    times: dict[str, list[float]] = {}
    cpu_times: dict[str, list[float]] = {}
    for case in cases:
        pat, expect = _expected(case.nbytes, bpt.size())
        arr = pat * np.float32(bpt.rank() + 1)
        host_out = np.empty_like(arr)
        t = torch.from_numpy(arr).cuda()
        want = torch.from_numpy(expect).cuda()
        name = f"bench.local.cuda.{case.nbytes}"
        cpu_name = f"bench.local.cpu.{case.nbytes}"
        for _ in range(case.warmup):
            bps.barrier()
            bps.push_pull(arr, name=cpu_name, average=False, out=host_out)
            bps.barrier()
            bpt.push_pull(t, average=False, name=name)
        sync()
        ts, cts = [], []
        for rep in range(case.repeats):
            host_out.fill(0)
            bps.barrier()
            t0 = time.perf_counter()
            bps.push_pull(arr, name=cpu_name, average=False, out=host_out)
            cts.append(time.perf_counter() - t0)
            if not np.array_equal(host_out, expect):
                raise AssertionError(f"push_pull of {cpu_name}, repetition {rep}: wrong result")
            bps.barrier()
            sync()
            t0 = time.perf_counter()
            out = bpt.push_pull(t, average=False, name=name)
            sync()
            ts.append(time.perf_counter() - t0)
            if out.device != t.device or not torch.equal(out, want):
                raise AssertionError(f"CUDA push_pull of {name}, repetition {rep}: wrong result "
                                     f"(device {out.device})")
        times[str(case.nbytes)] = ts
        cpu_times[str(case.nbytes)] = cts
        progress(f"CUDA push_pull {fmt_size(case.nbytes)}: median "
                  f"{statistics.median(ts) * 1e3:.1f} ms, numpy push_pull "
                  f"{statistics.median(cts) * 1e3:.1f} ms")
        del t, want, out, arr, host_out
    bpt.shutdown()
    emit({"rank": 0, "times": times, "cpu_times": cpu_times, "copies": copies,
           "device": torch.cuda.get_device_name(0)})
    return 0


def _worker_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog=f"{PROG} --_worker")
    p.add_argument("kind", choices=("local", "gpu"))
    p.add_argument("--cases", default="")
    a = p.parse_args(argv)
    cases = decode_cases(a.cases)
    return _local_worker(cases) if a.kind == "local" else _gpu_worker(cases)


# ---------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------

def _worker_argv(kind: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "byteps_like.bench.local", "--_worker", kind, *extra]


def run_job(cases: list[Case], local_size: int, servers: int, timeout: float, *,
            kind: str = "local") -> tuple[list[dict], int]:
    """One machine of ``local_size`` worker processes (worker id 0) and ``servers`` servers;
    returns every rank's result and the scheduler's port (part of the shm segment names)."""
    port = free_port()
    specs = local_job(_worker_argv(kind, "--cases", encode_cases(cases)), port, workers=1,
                      servers=servers, local_size=local_size)
    label = f"L={local_size}" if kind == "local" else "gpu"
    with Job(f"local-{label}") as g:
        ws = g.start(specs, base_env())
        g.wait(timeout, relay=ws[0], relay_prefix="[local] ")
        return collect(ws, f"local {label}"), port


def host_baselines(sizes: list[int], repeats: int) -> dict[int, dict]:
    """memcpy (np.copyto) and numpy add (np.add(a, b, out=a)) of each size, median seconds."""
    import numpy as np
    out = {}
    for n in sizes:
        a = np.ones(n // 4, dtype=np.float32)
        b = np.ones(n // 4, dtype=np.float32)
        np.copyto(a, b)  # fault both in before timing
        copy_s = _median_time(functools.partial(np.copyto, a, b), repeats)
        add_s = _median_time(functools.partial(np.add, a, b, out=a), repeats)
        out[n] = {"memcpy_s": copy_s, "memcpy_gbps": n / copy_s / 1e9,
                  "add_s": add_s, "add_gbps": n / add_s / 1e9}
        del a, b
    return out


def _gpu_skip_reason() -> str | None:
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed"
    import torch
    if not torch.cuda.is_available():
        return (f"torch {torch.__version__} sees no CUDA device "
                f"(built with CUDA {torch.version.cuda or 'none'})")
    return None


def build_rows(cases: list[Case], local_sizes: list[int], measured: dict[int, list[dict]],
               host: dict[int, dict]) -> list[dict]:
    rows = []
    for L in local_sizes:
        for case in cases:
            a = summarize(measured[L], case)
            b = summarize(measured[1], case)
            over = a["median_s"] - b["median_s"]
            red = case.nbytes / over / 1e9 if over > 0 else None
            mem = host[case.nbytes]["memcpy_gbps"]
            rows.append({"local_size": L, "nbytes": case.nbytes, "pushpull": a,
                         "single": b, "overhead_s": over, "local_gbps": red,
                         "memcpy_gbps": mem, "ratio_to_memcpy": red / mem if red else None})
    return rows


def main_table(rows: list[dict]) -> str:
    return markdown_table(COLUMNS, [
        (str(r["local_size"]), fmt_size(r["nbytes"]),
         f"{r['pushpull']['median_s'] * 1e3:.2f}", f"{r['pushpull']['gbps']:.3f}",
         f"{r['single']['median_s'] * 1e3:.2f}", f"{r['overhead_s'] * 1e3:.2f}",
         num(r["local_gbps"], ".3g"), f"{r['memcpy_gbps']:.2f}",
         num(r["ratio_to_memcpy"], ".3g")) for r in rows])


def host_table(host: dict[int, dict]) -> str:
    return markdown_table(HOST_COLUMNS, [
        (fmt_size(n), f"{h['memcpy_s'] * 1e3:.3f}", f"{h['memcpy_gbps']:.2f}",
         f"{h['add_s'] * 1e3:.3f}", f"{h['add_gbps']:.2f}") for n, h in host.items()])


def gpu_rows(cases: list[Case], gpu: list[dict]) -> list[dict]:
    rows = []
    for case in cases:
        c = gpu[0]["copies"][str(case.nbytes)]
        pp = summarize(gpu, case)
        cpu = summarize([{"times": g["cpu_times"]} for g in gpu], case)
        rows.append({"nbytes": case.nbytes,
                     **{k[:-2] + "_gbps": case.nbytes / v / 1e9 for k, v in c.items()},
                     "copies_s": c, "cuda_pushpull": pp, "cpu_pushpull": cpu,
                     "cuda_extra_s": pp["median_s"] - cpu["median_s"]})
    return rows


def gpu_table(rows: list[dict]) -> str:
    return markdown_table(GPU_COLUMNS, [
        (fmt_size(r["nbytes"]), f"{r['d2h_pinned_gbps']:.2f}", f"{r['d2h_pageable_gbps']:.2f}",
         f"{r['h2d_pinned_gbps']:.2f}", f"{r['h2d_pageable_gbps']:.2f}",
         f"{r['cuda_pushpull']['median_s'] * 1e3:.2f}",
         f"{r['cpu_pushpull']['median_s'] * 1e3:.2f}", f"{r['cuda_extra_s'] * 1e3:.2f}")
        for r in rows])


def _int_list(text: str, what: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what} {text!r}: use comma-separated integers") \
            from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"{what} {text!r}: every value must be >= 1")
    return vals


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--_worker"]:
        return _worker_main(argv[1:])
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                epilog=EXPLAIN,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--local-sizes", default=DEFAULT_LOCAL_SIZES,
                   help=f"comma-separated local sizes L (default {DEFAULT_LOCAL_SIZES}); L=1 "
                        "always runs as the baseline")
    p.add_argument("--sizes", default=DEFAULT_SIZES,
                   help=f"comma-separated bytes of one float32 tensor, K/M/G binary "
                        f"(default {DEFAULT_SIZES})")
    p.add_argument("--repeats", type=int, default=5, help="timed repetitions per size (5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed repetitions per size (2)")
    p.add_argument("--servers", type=int, default=1, help="server processes (1)")
    p.add_argument("--skip-gpu", action="store_true", help="do not run the GPU section")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="watchdog per job, seconds: on expiry every child is killed (300)")
    p.add_argument("--json", metavar="PATH", help="also write every measurement here")
    a = p.parse_args(argv)
    try:
        sizes = size_list(a.sizes, multiple=4)
        local_sizes = _int_list(a.local_sizes, "--local-sizes")
    except argparse.ArgumentTypeError as exc:
        p.error(str(exc))
    if not sizes:
        p.error("--sizes is empty")
    if a.servers < 1 or a.repeats < 1 or a.warmup < 0:
        p.error("--servers and --repeats must be >= 1, --warmup >= 0")
    local_sizes = [L for L in dict.fromkeys(local_sizes) if L != 1]
    cases = [Case(n, a.repeats, a.warmup) for n in dict.fromkeys(sizes)]

    info = machine_info()
    command = report_header("local", argv, info)
    print(f"job: 1 worker machine of L local ranks, {a.servers} server(s), float32, "
          f"average=False, loopback tcp; L in {[1, *local_sizes]} (L=1 is the baseline); "
          f"{a.repeats} repeats + {a.warmup} warm-up per size")
    over = [L for L in local_sizes if L + a.servers + 1 > info["nproc"]]
    if over:
        print(f"note: L={','.join(map(str, over))} plus {a.servers} server(s) and the scheduler "
              f"oversubscribe the {info['nproc']} CPUs")
    gpu_skip = "--skip-gpu given" if a.skip_gpu else _gpu_skip_reason()
    _load, busy = print_before_start()
    exit_on_signals()

    print("[local] host memcpy and numpy add", file=sys.stderr, flush=True)
    host = host_baselines([c.nbytes for c in cases], max(10, a.repeats))
    measured: dict[int, list[dict]] = {}
    ports: dict[str, int] = {}
    gpu: list[dict] | None = None
    phases = [(f"L={L}", L, "local") for L in [1, *local_sizes]]
    if gpu_skip is None:
        phases.append(("gpu", 1, "gpu"))
    others: dict[str, float] = {}
    for label, L, kind in phases:
        print(f"[local] {label}: starting", file=sys.stderr, flush=True)
        try:
            with OthersMeter() as meter:
                res, ports[label] = run_job(cases, L, a.servers, a.timeout, kind=kind)
        except ChildFailed as exc:
            print(f"[local] {label} failed:\n{exc}", file=sys.stderr, flush=True)
            return 1
        if meter.others is not None:
            others[label] = meter.others
        print(f"[local] {label}: done in {meter.wall:.1f} s", file=sys.stderr, flush=True)
        if kind == "gpu":
            gpu = res
        else:
            measured[L] = res

    rows = build_rows(cases, local_sizes, measured, host)
    print()
    if rows:
        print(main_table(rows))
    else:
        print("(no L > 1 given: only the single-process baseline ran)")
        print(markdown_table(("size", "single-process ms"), [
            (fmt_size(c.nbytes), f"{summarize(measured[1], c)['median_s'] * 1e3:.2f}")
            for c in cases]))
    print()
    print(EXPLAIN)
    note = noisy_note(dict(others), "job")
    if note:
        print("\n" + note)
    print()
    print("host memory, one process (numpy add: np.add(a, b, out=a); GB/s = S / time):")
    print(host_table(host))
    print()
    grows = None
    if gpu is None:
        print(f"GPU section skipped: {gpu_skip}")
    else:
        grows = gpu_rows(cases, gpu)
        print(f"GPU section ({gpu[0].get('device', 'CUDA device')}):")
        print(gpu_table(grows))
        print()
        print(GPU_EXPLAIN)
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump({"command": command, "machine": info, "servers": a.servers,
                       "local_sizes": local_sizes, "repeats": a.repeats, "warmup": a.warmup,
                       "busy_before": busy, "scheduler_ports": ports,
                       "others_share": others, "host": {str(k): v for k, v in host.items()},
                       "results": rows, "gpu": grows, "gpu_skipped": gpu_skip}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
