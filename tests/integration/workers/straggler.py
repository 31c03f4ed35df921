"""Straggler worker (tests/integration/test_dashboard.py, docs/observability.md): a known
training-like loop, one rank slower than the others.

argv: STEPS SLOW_RANK SLEEP [LEAVE_RANK LEAVE_AFTER]. Each step push_pulls two tensors (one of
several partitions) and declares its progress (bps.set_progress, 32 samples a step); rank
SLOW_RANK sleeps SLEEP seconds a step before it pushes (its "compute" is slower); the others
sleep 0.02 s. LEAVE_RANK, if given, stops after LEAVE_AFTER steps and leaves with join()."""
import sys
import time

import numpy as np

import byteps_like as bps

steps, slow, sleep = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
leave = int(sys.argv[4]) if len(sys.argv) > 4 else -1
leave_after = int(sys.argv[5]) if len(sys.argv) > 5 else steps
bps.init()
rank = bps.rank()
a = np.ones(1000, np.float32)
b = np.ones(300_000, np.float32)
mine = leave_after if rank == leave else steps
for step in range(mine):
    time.sleep(sleep if rank == slow else 0.02)  # the step's compute
    ha = bps.push_pull_async(a, name="grad.a", priority=1)
    hb = bps.push_pull_async(b, name="grad.b", priority=0)
    ha.wait()
    hb.wait()
    bps.set_progress(step + 1, steps, 32)
    if step % 20 == 0:
        print(f"rank {rank} step {step}", flush=True)
if rank == leave:
    print(f"rank {rank} leaves after {mine} steps", flush=True)
    bps.join()
print(f"DONE rank {rank}", flush=True)
bps.shutdown()
