"""Backup workers against a straggler (issue 38's target; docs/performance.md, "Stragglers and
changing links"): the others' step time with one worker's compute FACTOR times slower over the
same job with no slow worker.

    python scripts/backup_straggler.py [--workers 3] [--servers 1] [--factor 3] [--backup 1]

runs three local jobs through ``bpslaunch --local`` (same steps, tensor and compute): every
worker healthy; the last worker FACTOR times slower with BYTEPS_BACKUP_WORKERS=BACKUP; and the
same with BYTEPS_BACKUP_WORKERS=0 (the others wait for it: today's behaviour). A step is a
compute (a sleep of --compute seconds, FACTOR times that on the slow worker) and a push_pull of
--mb MiB of float32, averaged. Prints each job's mean step time of the other workers (after
--warmup steps) and the two ratios; the target is ``backup/healthy <= 1.3``.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time


def worker(steps: int, warmup: int, compute: float, factor: float, mb: float) -> None:
    """One worker of a job (bpslaunch runs this script with --worker)."""
    import numpy as np

    import byteps_like as bps
    bps.init()
    rank, size = bps.rank(), bps.size()
    slow = factor != 1 and rank == size - 1
    g = np.ones(int(mb * (1 << 20)) // 4, np.float32)
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        time.sleep(compute * (factor if slow else 1))
        bps.push_pull(g, name="grad", average=True)
        if step >= warmup:
            times.append(time.perf_counter() - t0)
    print(f"STEP rank {rank} slow {int(slow)}: {statistics.mean(times):.6f}", flush=True)
    bps.shutdown()


def job(args: argparse.Namespace, factor: float, backup: int) -> float:
    """The mean step time of the workers that are not slow, over one local job."""
    env = dict(os.environ, BYTEPS_BACKUP_WORKERS=str(backup), BYTEPS_SERVER_FAILOVER="0",
               BYTEPS_BACKUP_MAX_LAG=str(args.steps))
    cmd = [sys.executable, "-m", "byteps_like.launcher", "--local", "--workers",
           str(args.workers), "--servers", str(args.servers), "--", sys.executable,
           os.path.abspath(__file__), "--worker", str(args.steps), str(args.warmup),
           str(args.compute), str(factor), str(args.mb)]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if run.returncode != 0:
        sys.exit(f"job (factor {factor}, backup {backup}) failed: exit {run.returncode}\n"
                 f"{run.stdout[-4000:]}\n{run.stderr[-4000:]}")
    fast = [float(m.group(1)) for m in re.finditer(r"STEP rank \d+ slow 0: ([\d.]+)",
                                                   run.stdout)]
    if len(fast) != args.workers - (factor != 1):
        sys.exit(f"job (factor {factor}, backup {backup}): missing step times\n{run.stdout}")
    return statistics.mean(fast)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        steps, warmup, compute, factor, mb = sys.argv[2:7]
        worker(int(steps), int(warmup), float(compute), float(factor), float(mb))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--servers", type=int, default=1)
    p.add_argument("--factor", type=float, default=3.0, help="the slow worker's compute factor")
    p.add_argument("--backup", type=int, default=1, help="BYTEPS_BACKUP_WORKERS of the run")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--compute", type=float, default=0.1, help="seconds of a healthy step's "
                   "compute")
    p.add_argument("--mb", type=float, default=4.0, help="MiB pushed and pulled a step")
    p.add_argument("--timeout", type=float, default=600)
    args = p.parse_args()
    healthy = job(args, 1.0, 0)
    backup = job(args, args.factor, args.backup)
    waiting = job(args, args.factor, 0)
    print(f"{args.workers} workers + {args.servers} server(s), {args.mb:g} MiB a step, compute "
          f"{args.compute:g} s, worker {args.workers - 1} x{args.factor:g}")
    print(f"  healthy, the others' step:            {healthy * 1e3:8.1f} ms")
    print(f"  slow worker, b={args.backup}:                  {backup * 1e3:8.1f} ms")
    print(f"  slow worker, b=0 (they wait):         {waiting * 1e3:8.1f} ms")
    print(f"ratio b={args.backup} / healthy: {backup / healthy:.2f} (target <= 1.3); "
          f"b=0 / healthy: {waiting / healthy:.2f}")


if __name__ == "__main__":
    main()
