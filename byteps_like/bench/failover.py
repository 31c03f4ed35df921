"""Losing a server while a real model trains: the stall, the steps lost, the step time once a
replacement holds its keys again, and how far the final parameters are from an uninterrupted
run with the same seed (docs/reliability.md, "Losing a server").

``python -m byteps_like.bench failover [--model mlp|convnet|resnet50|...] [--workers 2]
[--servers 2] [--steps 40] [--kill STEP:RANK[:SIGNAL]] [--server-restarts 1] [--device auto]
[--json PATH]``

Two jobs under ``bpslaunch --local`` (:mod:`._failover_worker` is what each worker runs), the
same model, batch and seed: one uninterrupted, one whose worker rank 0 sends SIGNAL (KILL or
TERM, default KILL) to server rank RANK during step STEP's exchange. bpslaunch starts the lost
server again (``--server-restarts``; 0: the job finishes on the servers left). Reported:

- the median step before the loss, the stall (the longest step from the loss on, minus that
  median), and the steps lost (a synchronous job loses none: every step's sums are the ones it
  would have had);
- the median of the last quarter of the steps, after the replacement was connected, against
  the median before (the step time is back when the ratio is near 1);
- the largest absolute difference between the two runs' final parameters (0 on the CPU, where
  the model's own arithmetic is deterministic; on a GPU cuDNN's may not be: the uninterrupted
  run is compared with a second uninterrupted one to show what that costs alone).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence

from .report import markdown_table


def _job(a: argparse.Namespace, out: str, kill: str) -> dict:
    cmd = [sys.executable, "-m", "byteps_like.launcher", "--local", "--workers", str(a.workers),
           "--servers", str(a.servers), "--server-restarts", str(a.server_restarts), "--",
           sys.executable, "-m", "byteps_like.bench._failover_worker", "--model", a.model,
           "--steps", str(a.steps), "--device", a.device, "--out", out]
    if a.batch:
        cmd += ["--batch", str(a.batch)]
    if kill:
        cmd += ["--kill", kill]
    print(f"[failover] {'kill ' + kill if kill else 'uninterrupted'}: {' '.join(cmd[3:9])} ...",
          file=sys.stderr, flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
    lines = [ln for ln in r.stdout.splitlines() if "FAILOVER_RESULT " in ln]
    if r.returncode != 0 or not lines:
        sys.stderr.write(r.stdout[-4000:] + r.stderr[-4000:])
        raise SystemExit(f"bench failover: the job {'with ' + kill if kill else ''} failed "
                         f"(exit {r.returncode})")
    for ln in r.stdout.splitlines() + r.stderr.splitlines():
        if "stalled" in ln or "replaces" in ln or "restarted" in ln:
            print(f"[failover]   {ln.strip()}", file=sys.stderr)
    return json.loads(lines[-1].split("FAILOVER_RESULT ", 1)[1])


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m byteps_like.bench failover",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="mlp")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=0)
    p.add_argument("--kill", default="", metavar="STEP:RANK[:SIGNAL]",
                   help="default: step steps/4, server 1, KILL")
    p.add_argument("--server-restarts", type=int, default=1)
    p.add_argument("--device", default="auto")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--json", metavar="PATH")
    a = p.parse_args(argv)
    import numpy as np
    kill = a.kill or f"{a.steps // 4}:1:KILL"
    k = int(kill.split(":")[0])
    with tempfile.TemporaryDirectory() as tmp:
        ref = _job(a, os.path.join(tmp, "ref.npy"), "")
        ref2 = _job(a, os.path.join(tmp, "ref2.npy"), "")
        hit = _job(a, os.path.join(tmp, "hit.npy"), kill)
        base = np.load(ref["out"])
        diff = float(np.abs(np.load(hit["out"]) - base).max())
        noise = float(np.abs(np.load(ref2["out"]) - base).max())
    t = hit["times"]
    before = statistics.median(t[2:k]) if k > 3 else statistics.median(ref["times"][2:])
    stall = max(t[k:]) - before
    tail = t[max(k + 1, hit["replaced_at"] + 1, len(t) - len(t) // 4):] or t[-1:]
    after = statistics.median(tail)
    rec = {"model": a.model, "workers": a.workers, "servers": a.servers, "kill": kill,
           "server_restarts": a.server_restarts, "median_step_before_s": before,
           "stall_s": stall, "steps_lost": a.steps - len(t), "replaced_at_step": hit["replaced_at"],
           "median_step_after_s": after, "after_over_before": after / before,
           "max_param_diff": diff, "max_param_diff_two_uninterrupted": noise,
           "worker_stalls_s": hit["stalls"]}
    print(markdown_table(
        ["model", "kill", "step before ms", "stall s", "steps lost", "replaced at",
         "step after ms", "after/before", "max |dparam|", "run-to-run |dparam|"],
        [[a.model, kill, f"{before * 1e3:.1f}", f"{stall:.2f}", str(rec["steps_lost"]),
          str(hit["replaced_at"]), f"{after * 1e3:.1f}", f"{after / before:.2f}",
          f"{diff:.3g}", f"{noise:.3g}"]]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rec, f, indent=1)
    return 0
