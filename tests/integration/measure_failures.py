"""How fast a failing job ends (issue 40's targets), N runs of each case on this machine, with
the jobs of tests/integration/test_failures.py. One JSON line per case.

    .venv/bin/python -m tests.integration.measure_failures [--runs 5] [CASE ...]

CASE (default all):
  scheduler        2 workers, 1 server, --scheduler-restarts 0, the heartbeat timeout 20 s:
                   rank 0 SIGKILLs the scheduler mid-training; seconds from the kill to each
                   worker's PeerLostError, and to bpslaunch's exit; whether every worker named
                   the scheduler and bpslaunch blamed it
  used-up          the same with --scheduler-restarts 1: the restarted scheduler SIGKILLed again
  worker-after-restart  --scheduler-restarts 1: after the restart, a worker SIGKILLs itself
  mismatch         worker 1 told DMLC_NUM_WORKER=3 in a job of 2 (registration timeout 120 s):
                   seconds from the first worker's start to bpslaunch's exit, and the blame
"""
from __future__ import annotations

import argparse
import json
import re
import signal
import statistics
import time

from tests.integration.harness import bpslaunch, worker

SLOW_HEARTBEAT = {"BYTEPS_HEARTBEAT_TIMEOUT_SECONDS": "20"}


def _scheduler(mode: str, restarts: int, killed_line: str) -> dict:
    run = bpslaunch(worker("faults.py", mode), workers=2, servers=1, timeout=90,
                    env=SLOW_HEARTBEAT, extra=["--scheduler-restarts", str(restarts)])
    ended = time.time()
    killed = float(run.lines(killed_line)[-1].split()[-1])
    lost = run.lines("PEER_LOST")
    last = run.err.splitlines()[-1] if run.err else ""
    return {"end_s": round(ended - killed, 2), "rc": run.rc,
            "raised_s": [round(float(re.search(r" at ([\d.]+) step", ln).group(1)) - killed, 2)
                         for ln in lost],
            "named": all("lost the scheduler" in ln for ln in lost) if mode != (
                "restart-then-kill-worker") else all("worker rank 1" in ln for ln in lost),
            "blamed": last[:120]}


CASES = {
    "scheduler": lambda: _scheduler("kill-scheduler", 0, "KILLING scheduler at"),
    "used-up": lambda: _scheduler("restart-then-kill-scheduler", 1,
                                  "KILLING scheduler again at"),
    "worker-after-restart": lambda: _scheduler("restart-then-kill-worker", 1,
                                               "KILLING MYSELF at"),
}


def _mismatch() -> dict:
    run = bpslaunch(worker("wrong_size.py"), workers=2, servers=1, timeout=150,
                    env={"BYTEPS_REGISTER_TIMEOUT_SECONDS": "120"})
    ended = time.time()
    started = min(float(ln.split()[-1]) for ln in run.lines("STARTED"))
    last = run.err.splitlines()[-1] if run.err else ""
    return {"end_s": round(ended - started, 2), "rc": run.rc,
            "named": "DMLC_NUM_WORKER=3" in last and last.startswith(
                "bpslaunch: error: worker 1 (pid"), "blamed": last[:120]}


CASES["mismatch"] = _mismatch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("cases", nargs="*", metavar="CASE", help=" ".join(CASES))
    args = ap.parse_args()
    bad = [c for c in args.cases if c not in CASES]
    if bad:
        ap.error(f"unknown case(s) {bad}: choose from {list(CASES)}")
    args.cases = args.cases or list(CASES)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for case in args.cases:
        runs = [CASES[case]() for _ in range(args.runs)]
        ends = [r["end_s"] for r in runs]
        print(json.dumps({"case": case, "runs": args.runs, "end_s_median": statistics.median(
            ends), "end_s_min": min(ends), "end_s_max": max(ends),
            "all_named": all(r["named"] for r in runs), "each": runs}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
