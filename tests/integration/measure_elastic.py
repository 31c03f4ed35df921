"""Time-to-resume of an elastic job (issue 22), median of N runs on this machine.

    python tests/integration/measure_elastic.py [--runs 5]

After a loss: 3 workers, one SIGKILLs (``--signal TERM``: SIGTERMs) itself mid-step
(tests/integration/workers/elastic_numpy.py kill=3@2); measured on each survivor from the kill to its first step of the
new epoch, split into detection (kill -> MembershipChangedError: bpslaunch's notice to the
scheduler) and re-forming (the error -> rejoin() returned). After a join: 2 workers and
``--add-workers 1``; measured from the survivors' MembershipChangedError(added=1) to their
first step with 3 workers. Heartbeat interval 0.5 s as in the tests, timeout 20 s (the
default): a SIGKILLed worker is reported to the scheduler by bpslaunch, its parent, at once.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "workers", "elastic_numpy.py")
ENV = {"BYTEPS_HEARTBEAT_INTERVAL_SECONDS": "0.5", "BYTEPS_HEARTBEAT_TIMEOUT_SECONDS": "20",
       "BYTEPS_REGISTER_TIMEOUT_SECONDS": "30", "BYTEPS_TIMEOUT_SECONDS": "60"}


def run(workers: int, args: list[str], extra: list[str]) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BYTEPS_", "DMLC_"))}
    env.update(ENV, BYTEPS_JOB_ID=f"measure-{uuid.uuid4().hex[:8]}",
               PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "byteps_like.launcher", "--local", "--no-bind", "--elastic",
           "--workers", str(workers), "--servers", "1", *extra, "--", sys.executable, WORKER,
           *args]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    if out.returncode != 0:
        raise SystemExit(f"run failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    recs = []
    for ln in out.stdout.splitlines():
        if ln.startswith("[worker") and "{" in ln:
            rec = json.loads(ln[ln.index("{"):])
            rec["who"] = ln[1:ln.index("]")]
            recs.append(rec)
    return recs


def after_loss(sig: str) -> tuple[float, float, float]:
    recs = run(3, ["30", f"kill=3@2:{sig}", "slow=0.02"], ["--max-restarts", "0"])
    kill = next(r["t"] for r in recs if "killing" in r)
    total, detect, reform = [], [], []
    for who in {r["who"] for r in recs if r.get("done")}:
        mine = [r for r in recs if r["who"] == who]
        changed = next(r["t"] for r in mine if "changed" in r)
        resumed = next(r["t"] for r in mine if "resumed" in r)
        first = next(r["t"] for r in mine if "ones" in r and r["epoch"] == 2)
        total.append(first - kill)
        detect.append(changed - kill)
        reform.append(resumed - changed)
    return max(total), max(detect), max(reform)


def after_join() -> float:
    recs = run(2, ["100", "slow=0.05"], ["--max-workers", "3", "--add-workers", "1",
                                        "--add-after", "1"])
    worst = 0.0
    for who in ("worker 0", "worker 1"):
        mine = [r for r in recs if r["who"] == who]
        changed = next(r["t"] for r in mine if "changed" in r)
        first = next(r["t"] for r in mine if "ones" in r and r["size"] == 3)
        worst = max(worst, first - changed)
    return worst


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--signal", default="KILL", choices=("KILL", "TERM"),
                   help="how the lost worker dies (TERM: a preempted machine, which tells the "
                        "scheduler as it goes)")
    a = p.parse_args()
    loss = [after_loss(a.signal) for _ in range(a.runs)]
    join = [after_join() for _ in range(a.runs)]
    med = statistics.median
    print(f"SIG{a.signal}, {a.runs} runs each, heartbeat timeout "
          f"{ENV['BYTEPS_HEARTBEAT_TIMEOUT_SECONDS']} s")
    print(f"after a loss: kill -> first step of the new epoch: median {med(x[0] for x in loss):.2f}"
          f" s (detection {med(x[1] for x in loss):.2f} s, re-forming "
          f"{med(x[2] for x in loss) * 1000:.0f} ms); all: "
          + ", ".join(f"{x[0]:.2f}" for x in loss))
    print(f"after a join: MembershipChangedError(added) -> first step with 3 workers: median "
          f"{med(join) * 1000:.0f} ms; all: " + ", ".join(f"{x * 1000:.0f}" for x in join))


if __name__ == "__main__":
    main()
