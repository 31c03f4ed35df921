"""SGD on many tensors of mixed sizes with byteps_like's numpy API, deterministic, for the
server-loss tests. Usage: lose_server.py OUT STEPS [KILL_STEP [SIGNAL [SERVER]]]

Each step every worker computes a gradient from its parameters, its rank and the step, and
push_pulls every tensor (async, several in flight). With KILL_STEP, worker rank 0 sends SIGNAL
(KILL or TERM; default KILL) to server rank SERVER (default 1) once it has started that step's
push_pulls and before it waits for them: the loss lands mid-round. Rank 0 writes the final
parameters to OUT (.npz), and prints ``STEP_TIMES`` (seconds per step)."""
import os
import signal
import sys
import time

import numpy as np

import byteps_like as bps

out, steps = sys.argv[1], int(sys.argv[2])
kill_step = int(sys.argv[3]) if len(sys.argv) > 3 else -1
signame = sys.argv[4] if len(sys.argv) > 4 else "KILL"
victim = int(sys.argv[5]) if len(sys.argv) > 5 else 1

bps.init()
rank = bps.rank()
sizes = [3, 1000, 70_000, 250_000, 17, 600_000, 4096, 123_457]  # partitions of 64 KiB..
params = [np.linspace(-1, 1, n, dtype=np.float32) for n in sizes]
times = []
for step in range(steps):
    t0 = time.monotonic()
    grads = [np.sin(p * (1.0 + 0.01 * step) + rank).astype(np.float32) for p in params]
    handles = [bps.push_pull_async(g, name=f"w{i}", average=True) for i, g in enumerate(grads)]
    if step == kill_step and rank == 0:
        from byteps_like.worker.runtime import default_runtime
        pid = [p.pid for p in default_runtime().members.servers if p.rank == victim][0]
        os.kill(pid, getattr(signal, f"SIG{signame}"))
        print(f"KILLED server {victim} pid {pid} at step {step}", flush=True)
    for p, h in zip(params, handles):
        p -= np.float32(0.1) * h.wait(timeout=120)
    times.append(time.monotonic() - t0)
if rank == 0:
    np.savez(out, *params)
    print("STEP_TIMES " + " ".join(f"{t:.4f}" for t in times), flush=True)
bps.shutdown()
