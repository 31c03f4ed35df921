"""Backup workers (tests/integration/test_backup.py): every rank applies the same sums.

argv: STEPS SLOW_RANK GATE SLEEP GATE_DIR. Each step every rank push_pulls (averages) a gradient
that depends on its rank and the step, (rank + 1) * (step + 1) + i % 7 at element i, and
applies it to a model (w -= 0.01 * average). Rank SLOW_RANK first waits until every other rank
has completed GATE steps (each writes GATE_DIR/rank<r>.<step> after it; the ranks of other
machines, with several processes per machine; a bounded wait, so a job
whose rounds wait for the slow rank fails here instead of hanging), then sleeps SLEEP seconds a
step before it pushes. Every rank prints each step's first element (``VALS``) and a digest of
all its averages and its final model (``SEQ``).
"""
import hashlib
import os
import sys
import time

import numpy as np

import byteps_like as bps

steps, slow, gate, sleep = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
gate_dir = sys.argv[5]
bps.init()
rank, size = bps.rank(), bps.size()
n = 70001  # several partitions (BYTEPS_PARTITION_BYTES=64K): keys on every server
pattern = (np.arange(n) % 7).astype(np.float32)
w = np.zeros(n, np.float32)
digest = hashlib.sha256()
vals = []
if rank == slow and gate:
    deadline = time.monotonic() + 90
    # the ranks of other machines (this machine's wait for it in the local reduction)
    ls = bps.local_size()
    others = [r for r in range(size) if r // ls != slow // ls]
    while not all(os.path.exists(os.path.join(gate_dir, f"rank{r}.{gate}")) for r in others):
        if time.monotonic() > deadline:
            print(f"GATE TIMEOUT rank {rank}: the others never completed {gate} steps "
                  "without this rank", flush=True)
            sys.exit(3)
        time.sleep(0.01)
    print(f"GATE rank {rank}: the others completed {gate} steps without it", flush=True)
for step in range(steps):
    if rank == slow:
        time.sleep(sleep)
    g = np.float32((rank + 1) * (step + 1)) + pattern
    avg = bps.push_pull(g, name="grad", average=True)
    digest.update(avg.tobytes())
    vals.append(float(avg[0]))
    w -= np.float32(0.01) * avg
    if rank != slow:  # (written after the step: the gate waits for the file of step GATE)
        open(os.path.join(gate_dir, f"rank{rank}.{step + 1}"), "w").close()
digest.update(w.tobytes())
print(f"VALS rank {rank}: " + ",".join(repr(v) for v in vals), flush=True)
print(f"SEQ rank {rank}: {digest.hexdigest()}", flush=True)
bps.shutdown()
