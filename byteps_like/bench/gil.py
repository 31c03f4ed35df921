"""GIL contention: push_pull while the training thread runs Python, and the other way round.

``python -m byteps_like.bench gil [--workers 1] [--servers 1] [--sizes 4,64] [--seconds 3]
[--repeat 3]`` starts a local job on loopback (scheduler, servers, worker processes, as
``bench pushpull`` does) and runs, in every worker, per tensor size and repetition, after a
barrier each:

A. loop alone: the main thread spins a pure-Python loop (``for _ in range(1000): n += 1``,
   the clock read every 1000 iterations) for ``--seconds``; no communication;
B. push_pull alone: a second thread runs ``bps.push_pull`` back to back while the main thread
   sleeps (it only waits);
C. both: the second thread runs push_pulls back to back while the main thread spins the loop;
D. control (unless ``--skip-control``): push_pulls back to back while a separate *process*
   spins the same loop. It takes the same CPU as C but shares no GIL, so C against D separates
   GIL contention from CPU contention (which dominates on a machine with few cores).

The push_pull rate of a phase counts the bytes of the rounds that ran inside its window (a
round only partly inside counts by the share of its time inside); the loop rate counts
iterations per second. Every phase starts with 0.2 s of communication before its window opens
(``--warmup-seconds``), as the probe of issue 17 does.

With several workers every worker must run the same number of push_pulls. No round count is
agreed beforehand: the last element of each push_pull's tensor carries the sender's stop vote
(1.0 once its window has closed), so the summed result tells every worker, after the same round,
that someone has finished. Each worker checks every result (the other elements sum to the number
of workers).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence

from .harness import ChildFailed, Job, base_env, collect, free_port, local_job
from .report import (
    OthersMeter,
    emit,
    exit_on_signals,
    fmt_size,
    machine_info,
    markdown_table,
    num,
    print_before_start,
    report_header,
    size_arg,
)

PROG = "python -m byteps_like.bench gil"
DEFAULT_SIZES = "4,64"
COLUMNS = ("size", "pp alone GB/s", "pp busy-main GB/s", "pp ratio", "pp busy-proc GB/s",
           "proc ratio", "loop alone M/s", "loop w/ comm M/s", "loop ratio", "proc loop ratio")

EXPLAIN = """\
columns (medians over repetitions; GB/s = 1e9 B/s of tensor bytes, slowest worker; M/s = million
loop iterations per second, mean over workers):
  pp alone GB/s       push_pull back to back in a second thread, main thread asleep (B)
  pp busy-main GB/s   the same while the main thread spins a pure-Python loop (C)
  pp ratio            busy-main / alone: 1.0 = communication does not need the main thread's GIL
  pp busy-proc GB/s   the same while a separate process spins the loop (D): as much CPU taken
                      as in C, but no GIL shared
  proc ratio          busy-proc / alone: the CPU-contention part; pp ratio well below it is GIL
  loop alone M/s      the loop in the main thread, nothing else running in the job (A)
  loop w/ comm M/s    the loop in the main thread while push_pull runs (C)
  loop ratio          w/ comm / alone: what communication takes from the training thread
  proc loop ratio     the loop's rate in the spinning process of D / loop alone: what
                      communication takes from a loop that shares no GIL with it (CPU only)"""


def parse_mib(text: str) -> int:
    """'64' -> 64 MiB; a unit is allowed too ('256K', '1M', '4096B'). Bytes of one float32
    tensor of at least 2 elements (the last one carries the stop vote)."""
    return size_arg(text, bare_unit="M", multiple=4, minimum=8)


# ---------------------------------------------------------------------------------------------
# In the worker
# ---------------------------------------------------------------------------------------------

def spin(deadline: float, done: threading.Event | None = None) -> int:
    """The pure-Python loop of the probe: iterations until ``deadline`` (perf_counter) or until
    ``done`` is set (both looked at every 1000 iterations)."""
    n = 0
    clock = time.perf_counter
    if done is None:
        done = threading.Event()
    while clock() < deadline and not done.is_set():
        for _ in range(1000):
            n += 1
    return n


class Comm(threading.Thread):
    """push_pull back to back until a round's summed stop vote is positive."""

    def __init__(self, x, out, name: str, timeout: float):
        super().__init__(name="bench-gil-comm", daemon=True)
        self.x, self.out, self.tensor, self.timeout = x, out, name, timeout
        self.stop = threading.Event()   # this worker's vote: its window has closed
        self.done = threading.Event()   # the group has stopped (or this thread failed)
        self.spans: list[tuple[float, float]] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        import byteps_like as bps
        clock = time.perf_counter
        try:
            while True:
                self.x[-1] = 1.0 if self.stop.is_set() else 0.0
                t = clock()
                bps.push_pull(self.x, name=self.tensor, average=False, out=self.out,
                              timeout=self.timeout)
                self.spans.append((t, clock()))
                if self.out[-1] > 0:
                    break
        except BaseException as exc:  # reported by the main thread
            self.error = exc
        finally:
            self.done.set()


def bytes_in_window(spans: list[tuple[float, float]], t0: float, t1: float,
                    nbytes: int) -> float:
    """Bytes of the rounds inside [t0, t1]; a round partly inside counts by its share of time
    inside (progress within a round taken as uniform)."""
    total = 0.0
    for s, e in spans:
        inside = min(e, t1) - max(s, t0)
        if inside > 0 and e > s:
            total += nbytes * inside / (e - s)
    return total


def _spinner_argv(seconds: float) -> list[str]:
    return [sys.executable, "-m", "byteps_like.bench.gil", "--_spin", repr(seconds)]


def _spinner_main(seconds: float) -> int:
    """The control process of phase D: say "ready", spin ``seconds``, print iterations/s."""
    print("ready", flush=True)
    t0 = time.perf_counter()
    n = spin(t0 + seconds)
    print(json.dumps({"iterations": n, "seconds": time.perf_counter() - t0}), flush=True)
    return 0


def _check(out, nworkers: int, label: str) -> None:
    import numpy as np
    body = out[:-1]
    if not (body == nworkers).all():
        bad = int(np.flatnonzero(body != nworkers)[0])
        raise AssertionError(f"{label}: wrong push_pull result: out[{bad}] = {body[bad]}, "
                             f"expected {nworkers}")
    if not 1 <= out[-1] <= nworkers or out[-1] != int(out[-1]):
        raise AssertionError(f"{label}: stop votes summed to {out[-1]} (1..{nworkers} expected)")


def _comm_phase(bps, x, out, name: str, nbytes: int, seconds: float, warm: float,
                timeout: float, busy: str) -> dict:
    """One window of push_pulls from a second thread; the main thread sleeps (busy="none"),
    spins the loop ("main") or sleeps while a spinner process runs ("process")."""
    bps.barrier()
    comm = Comm(x, out, name, timeout)
    spinner = None
    if busy == "process":
        spinner = subprocess.Popen(_spinner_argv(warm + seconds), stdin=subprocess.DEVNULL,
                                   stdout=subprocess.PIPE, text=True)
        assert spinner.stdout is not None
        if spinner.stdout.readline().strip() != "ready":
            raise RuntimeError("the control spinner process did not start")
    comm.start()
    try:
        comm.done.wait(warm)
        t0 = time.perf_counter()
        loops = 0
        if busy == "main":
            loops = spin(t0 + seconds, comm.done)
        else:
            comm.done.wait(max(0.0, t0 + seconds - time.perf_counter()))
        t1 = time.perf_counter()
    finally:
        comm.stop.set()
        comm.join(timeout)
    if comm.is_alive():
        raise RuntimeError(f"{name}: the push_pull thread did not stop within {timeout:g} s")
    if comm.error is not None:
        raise comm.error
    result = {"window_s": t1 - t0, "rounds": len(comm.spans),
              "gbps": bytes_in_window(comm.spans, t0, t1, nbytes) / (t1 - t0) / 1e9}
    if busy == "main":
        result["loop_per_s"] = loops / (t1 - t0)
    if spinner is not None:
        text, _ = spinner.communicate(timeout=timeout)
        if spinner.returncode != 0:
            raise RuntimeError(f"the control spinner exited with status {spinner.returncode}")
        got = json.loads(text.strip().splitlines()[-1])
        result["spinner_loop_per_s"] = got["iterations"] / got["seconds"]
    return result


def _worker(sizes: list[int], seconds: float, repeat: int, warm: float, control: bool,
            timeout: float) -> int:
    import numpy as np

    import byteps_like as bps
    bps.init()
    rank, nworkers = bps.rank(), bps.size()
    switch = sys.getswitchinterval()   # the runtime may have set it (BYTEPS_GIL_SWITCH_INTERVAL)
    results: dict[str, dict] = {}
    for nbytes in sizes:
        name = f"bench.gil.{nbytes}"
        x = np.ones(nbytes // 4, dtype=np.float32)
        out = np.empty_like(x)
        x[-1] = 1.0  # the declaring round: every worker votes "stop", one round exactly
        bps.barrier()
        bps.push_pull(x, name=name, average=False, out=out, timeout=timeout)
        _check(out, nworkers, f"worker {rank} {name} warm-up")
        reps: dict[str, list] = {"loop_alone": [], "comm_alone": [], "busy_main": [],
                                 "busy_process": []}
        for r in range(repeat):
            bps.barrier()
            t0 = time.perf_counter()
            n = spin(t0 + seconds)
            reps["loop_alone"].append(n / (time.perf_counter() - t0))
            phases = [("comm_alone", "none"), ("busy_main", "main")]
            if control:
                phases.append(("busy_process", "process"))
            for key, busy in phases:
                out.fill(0)
                res = _comm_phase(bps, x, out, name, nbytes, seconds, warm, timeout, busy)
                _check(out, nworkers, f"worker {rank} {name} {key} repetition {r}")
                reps[key].append(res)
            if rank == 0:
                b, m = reps["comm_alone"][-1], reps["busy_main"][-1]
                print(f"progress: {fmt_size(nbytes)} repetition {r + 1}/{repeat}: push_pull "
                      f"{b['gbps']:.3f} GB/s alone, {m['gbps']:.3f} GB/s with a busy main "
                      f"thread; loop {m['loop_per_s'] / reps['loop_alone'][-1]:.2f} of alone",
                      file=sys.stderr, flush=True)
        results[str(nbytes)] = reps
        del x, out
    from byteps_like.worker.runtime import default_runtime
    pushed = default_runtime().bytes_pushed   # 0 would mean nothing reached a server
    bps.shutdown()
    emit({"rank": rank, "workers": nworkers, "switch_interval_s": switch,
          "bytes_pushed": pushed, "results": results})
    return 0


def _worker_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog=f"{PROG} --_worker")
    p.add_argument("--sizes", required=True)
    p.add_argument("--seconds", type=float, required=True)
    p.add_argument("--repeat", type=int, required=True)
    p.add_argument("--warmup-seconds", type=float, required=True)
    p.add_argument("--control", type=int, required=True)
    p.add_argument("--timeout", type=float, required=True)
    a = p.parse_args(argv)
    return _worker([int(s) for s in a.sizes.split(",")], a.seconds, a.repeat,
                   a.warmup_seconds, bool(a.control), a.timeout)


# ---------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------

def run_job(sizes: list[int], workers: int, servers: int, seconds: float, repeat: int,
            warm: float, control: bool, partition_bytes: int, timeout: float) -> list[dict]:
    env = base_env()
    env["BYTEPS_PARTITION_BYTES"] = str(partition_bytes)
    wargv = [sys.executable, "-m", "byteps_like.bench.gil", "--_worker",
             "--sizes", ",".join(map(str, sizes)), "--seconds", repr(seconds),
             "--repeat", str(repeat), "--warmup-seconds", repr(warm),
             "--control", str(int(control)), "--timeout", repr(timeout)]
    with Job("gil") as g:
        ws = g.start(local_job(wargv, free_port(), workers=workers, servers=servers), env)
        g.wait(timeout, relay=ws[0], relay_prefix="[gil] ")
        return collect(ws, "gil")


def summarize(per_worker: list[dict], sizes: list[int], control: bool) -> list[dict]:
    """Per size: each repetition's push_pull rate of the slowest worker and loop rate averaged
    over workers; then medians over repetitions and their ratios."""
    rows = []
    for nbytes in sizes:
        reps = [w["results"][str(nbytes)] for w in per_worker]
        nrep = len(reps[0]["loop_alone"])

        def pp(key: str) -> list[float]:
            return [min(w[key][i]["gbps"] for w in reps) for i in range(nrep)]

        def loop(values: Iterable[Iterable[float]]) -> list[float]:
            return [statistics.fmean(v) for v in zip(*values)]

        row = {"nbytes": nbytes, "repeat": nrep,
               "pp_alone_gbps": pp("comm_alone"), "pp_busy_main_gbps": pp("busy_main"),
               "pp_busy_process_gbps": pp("busy_process") if control else None,
               "loop_alone_per_s": loop(w["loop_alone"] for w in reps),
               "loop_with_comm_per_s": loop([x["loop_per_s"] for x in w["busy_main"]]
                                            for w in reps),
               "spinner_with_comm_per_s": loop([x["spinner_loop_per_s"]
                                                for x in w["busy_process"]] for w in reps)
               if control else None,
               "rounds": {k: [[x["rounds"] for x in w[k]] for w in reps]
                          for k in ("comm_alone", "busy_main", "busy_process")
                          if k != "busy_process" or control}}
        med = {k: statistics.median(v) for k, v in row.items()
               if k.endswith(("_gbps", "_per_s")) and isinstance(v, list)}
        row["median"] = med
        row["pp_ratio"] = med["pp_busy_main_gbps"] / med["pp_alone_gbps"]
        row["proc_ratio"] = (med["pp_busy_process_gbps"] / med["pp_alone_gbps"]
                             if control else None)
        row["loop_ratio"] = med["loop_with_comm_per_s"] / med["loop_alone_per_s"]
        row["proc_loop_ratio"] = (med["spinner_with_comm_per_s"] / med["loop_alone_per_s"]
                                  if control else None)
        rows.append(row)
    return rows


def format_table(rows: list[dict]) -> str:
    cells = []
    for r in rows:
        m = r["median"]
        cells.append((fmt_size(r["nbytes"]), f"{m['pp_alone_gbps']:.3f}",
                      f"{m['pp_busy_main_gbps']:.3f}", f"{r['pp_ratio']:.2f}",
                      num(m.get("pp_busy_process_gbps"), ".3f"), num(r["proc_ratio"], ".2f"),
                      f"{m['loop_alone_per_s'] / 1e6:.2f}",
                      f"{m['loop_with_comm_per_s'] / 1e6:.2f}", f"{r['loop_ratio']:.2f}",
                      num(r["proc_loop_ratio"], ".2f")))
    return markdown_table(COLUMNS, cells)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                epilog=EXPLAIN,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=1, help="worker processes (1)")
    p.add_argument("--servers", type=int, default=1, help="server processes (1)")
    p.add_argument("--sizes", default=DEFAULT_SIZES,
                   help=f"comma-separated tensor sizes in MiB, float32 ({DEFAULT_SIZES}); "
                        "0.25 or 256K for smaller ones")
    p.add_argument("--seconds", type=float, default=3.0,
                   help="window of each phase, seconds (3)")
    p.add_argument("--repeat", "--repeats", dest="repeat", type=int, default=3,
                   help="repetitions of the phases per size; the table shows medians (3)")
    p.add_argument("--warmup-seconds", type=float, default=0.2,
                   help="push_pulls before each window opens, seconds (0.2)")
    p.add_argument("--skip-control", action="store_true",
                   help="do not run phase D (a separate spinning process instead of the main "
                        "thread)")
    p.add_argument("--partition-bytes", type=int, default=4096000,
                   help="BYTEPS_PARTITION_BYTES of the job (4096000)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="watchdog for the whole job, seconds: on expiry every child is "
                        "killed (600)")
    p.add_argument("--json", metavar="PATH", help="also write every measurement here")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--_worker"]:
        return _worker_main(argv[1:])
    if argv[:1] == ["--_spin"]:
        return _spinner_main(float(argv[1]))
    p = build_parser()
    a = p.parse_args(argv)
    try:
        sizes = list(dict.fromkeys(parse_mib(s) for s in a.sizes.split(",") if s.strip()))
    except argparse.ArgumentTypeError as exc:
        p.error(str(exc))
    if not sizes:
        p.error("--sizes is empty")
    if a.workers < 1 or a.servers < 1:
        p.error("--workers and --servers must be >= 1")
    if a.repeat < 1 or a.seconds <= 0 or a.warmup_seconds < 0:
        p.error("--repeat must be >= 1, --seconds > 0 and --warmup-seconds >= 0")
    control = not a.skip_control

    info = machine_info()
    command = report_header("gil", argv, info, torch=False)
    print(f"job: {a.workers} worker(s), {a.servers} server(s), partition {a.partition_bytes} B, "
          f"float32, average=False, loopback tcp; windows of {a.seconds:g} s after "
          f"{a.warmup_seconds:g} s of push_pull, {a.repeat} repetition(s) per size; phases: "
          f"loop alone, push_pull alone, both" + (", push_pull + spinning process" if control
                                                  else ""))
    _load, busy = print_before_start()
    exit_on_signals()

    print("[gil] starting the job", file=sys.stderr, flush=True)
    try:
        with OthersMeter() as meter:
            per_worker = run_job(sizes, a.workers, a.servers, a.seconds, a.repeat,
                                 a.warmup_seconds, control, a.partition_bytes, a.timeout)
    except ChildFailed as exc:
        print(f"[gil] failed:\n{exc}", file=sys.stderr, flush=True)
        return 1
    wall, others = meter.wall, meter.others
    print(f"[gil] done in {wall:.1f} s", file=sys.stderr, flush=True)

    rows = summarize(per_worker, sizes, control)
    switch = sorted({float(w["switch_interval_s"]) for w in per_worker
                     if w.get("switch_interval_s") is not None})
    print("workers' thread switch interval (sys.getswitchinterval() after bps.init(), "
          "BYTEPS_GIL_SWITCH_INTERVAL): "
          + (", ".join(f"{x * 1e3:g} ms" for x in switch) or "not reported"))
    print()
    print(format_table(rows))
    print()
    print(EXPLAIN)
    if others is not None:
        print(f"\nCPU taken by other processes (or the hypervisor) during the job: {others:.0%}"
              + (" (WARNING: noisy; run again on an idle machine)" if others > 0.1 else ""))
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump({"command": command, "machine": info, "workers": a.workers,
                       "servers": a.servers, "partition_bytes": a.partition_bytes,
                       "seconds": a.seconds, "repeat": a.repeat,
                       "warmup_seconds": a.warmup_seconds, "control": control,
                       "worker_switch_interval_s": switch[0] if len(switch) == 1 else switch,
                       "busy_before": busy,
                       "others_share": others, "wall_s": wall, "results": rows,
                       "per_worker": per_worker}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
