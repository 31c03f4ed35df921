"""Worker: bounded staleness in asynchronous mode (BYTEPS_ASYNC_STALENESS). Usage:
stale.py S STEPS0 STEPS1 SYNC_DIR

Every worker push_pulls (average=False) a vector of 300,000 floats (several partitions over the
servers) holding 1 at the positions i with i % size == rank: the answer counts, per worker and
partition, the pushes applied before it. Rank 0 runs STEPS0 steps and checks after each that it
is at most S rounds ahead of the slowest other worker in every partition (S=0: no bound; nor
once rank 1 has made its last push);
before each step it writes its step to SYNC_DIR/rank0. Rank 1 runs STEPS1 steps:

* S > 0: before its second step it waits until rank 0 has begun step S + 1, the first one the
  bound holds back, so rank 0 meets the bound exactly (AHEAD S); after its last step it
  finishes, and rank 0's later steps must not wait for it (the scheduler tells the servers).
* S = 0: after its first step it waits until rank 0 has done every step (SYNC_DIR/done):
  nothing held rank 0 back.

Rank 0 prints ``AHEAD <most rounds ahead while rank 1 pushed>``; every rank ``DONE``.
"""
import os
import sys
import time

import numpy as np

import byteps_like as bps

N = 300_000
WATCHDOG_S = 60.0


def wait_for(path: str, at_least: int) -> None:
    deadline = time.monotonic() + WATCHDOG_S
    while True:
        try:
            with open(path) as f:
                if int(f.read() or -1) >= at_least:
                    return
        except (OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"{path} did not reach {at_least} within {WATCHDOG_S:g} s")
        time.sleep(0.005)


def write(path: str, value: int) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(str(value))
    os.replace(path + ".tmp", path)


def main() -> None:
    s, steps0, steps1, sync = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    bps.init()
    rank, size = bps.rank(), bps.size()
    x = np.zeros(N, np.float32)
    x[rank::size] = 1.0
    if rank == 0:
        most = 0
        for step in range(steps0):
            write(os.path.join(sync, "rank0"), step)
            y = bps.push_pull(x, name="counts", average=False, timeout=60).reshape(-1, size)
            assert (y[:, 0] == step + 1).all(), (step, y[:3])
            slowest = int(y[:, 1:].min())
            ahead = step + 1 - slowest
            if slowest < steps1:
                most = max(most, ahead)
            # (once rank 1 made its last push it is finishing: nobody is bound to it)
            assert s == 0 or ahead <= s or slowest == steps1, \
                f"step {step}: {ahead} rounds ahead of the slowest"
        write(os.path.join(sync, "done"), 1)
        print(f"AHEAD {most}", flush=True)
    else:
        for step in range(steps1 if rank == 1 else steps0):
            if step == 1 and rank == 1:
                if s:
                    wait_for(os.path.join(sync, "rank0"), s + 1)
                else:
                    wait_for(os.path.join(sync, "done"), 1)
            bps.push_pull(x, name="counts", average=False, timeout=60)
    print("DONE", flush=True)
    bps.shutdown()


if __name__ == "__main__":
    main()
