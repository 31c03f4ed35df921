"""Issue 37's chaos measurement: the PyTorch digits example (examples/pytorch/train_digits.py)
on 4 workers and 3 servers under `bpslaunch --local`, once uninterrupted and once while a
killer SIGKILLs a random live server every INTERVAL seconds, KILLS times in all (bpslaunch
starts each one again: --server-restarts). Prints both final test accuracies and their
difference.

    python -m tests.faults.chaos_digits [--kills 10] [--interval 1.5] [--epochs 10]

The killer finds the job's servers by its BYTEPS_JOB_ID in /proc (this machine's processes
only) and never kills the last live one."""
from __future__ import annotations

import argparse
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def servers_of(job: str) -> list[int]:
    """The live server processes of the job (their command line names the server role)."""
    pids = []
    for d in Path("/proc").glob("[0-9]*"):
        try:
            env = (d / "environ").read_bytes()
            cmd = (d / "cmdline").read_bytes()
        except OSError:
            continue
        if f"BYTEPS_JOB_ID={job}".encode() in env and b"byteps_like.server" in cmd:
            pids.append(int(d.name))
    return pids


def run(args: argparse.Namespace, kills: int) -> tuple[float, str]:
    job = f"chaos-{uuid.uuid4().hex[:10]}"
    cmd = [sys.executable, "-m", "byteps_like.launcher", "--local", "--workers", "4",
           "--servers", "3", "--server-restarts", str(kills), "--", sys.executable,
           str(ROOT / "examples" / "pytorch" / "train_digits.py"), "--epochs", str(args.epochs)]
    env = {**os.environ, "BYTEPS_JOB_ID": job, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    done = []

    def killer() -> None:
        rng = random.Random(7)
        time.sleep(args.interval * 2)
        while len(done) < kills and proc.poll() is None:
            live = servers_of(job)
            if len(live) >= 2:
                victim = rng.choice(live)
                try:
                    os.kill(victim, signal.SIGKILL)
                    done.append(victim)
                except ProcessLookupError:
                    pass
            time.sleep(args.interval)

    t = threading.Thread(target=killer, daemon=True)
    if kills:
        t.start()
    out, _ = proc.communicate(timeout=args.timeout)
    m = re.search(r"final test accuracy: ([\d.]+)", out)
    if proc.returncode != 0 or not m:
        print(out[-6000:])
        raise SystemExit(f"the job failed (exit {proc.returncode}) after {len(done)} kills")
    print(f"[chaos] {'uninterrupted' if not kills else f'{len(done)} servers killed'}: "
          f"accuracy {m.group(1)}; failovers logged: {out.count('stalled')}", flush=True)
    return float(m.group(1)), out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=10)
    p.add_argument("--interval", type=float, default=1.5)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--timeout", type=float, default=900)
    a = p.parse_args()
    base, _ = run(a, 0)
    hit, out = run(a, a.kills)
    stalls = [float(x) for x in re.findall(r"the job stalled ([\d.]+) s", out)]
    print(f"[chaos] accuracy uninterrupted {base:.4f}, with kills {hit:.4f}: difference "
          f"{abs(base - hit):.4f}; stalls (s) {stalls}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
