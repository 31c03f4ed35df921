"""SGD on many tensors of mixed sizes with byteps_like's numpy API, deterministic, for the
server-loss tests. Usage: lose_server.py OUT STEPS [KILLS [COMPRESSOR]]

Each step every worker computes a gradient from its parameters, its rank and the step, and
push_pulls every tensor (async, all in flight at once). KILLS is a comma-separated list of
STEP:SERVER:SIGNAL (SIGNAL KILL, TERM or STOP; SERVER a server rank or ``scheduler``): worker rank 0 sends SIGNAL to server rank SERVER
once it has started that step's push_pulls and before it waits for them, so the loss lands
mid-round; SIGNAL WAIT (after a loss) first waits until the worker has connected to a
replacement server (bpslaunch --server-restarts) before going on; SIGNAL NOTICE writes the
server's spot-preemption notice (BYTEPS_PREEMPTION_NOTICE_FILE, ``{rank}`` standing for SERVER)
instead of a signal and waits until this worker has seen a failover. COMPRESSOR (onebit, fp16, ...) compresses the largest tensor. Every rank writes its
final parameters to OUT.<rank>.npz; rank 0 prints ``STEP_TIMES`` (seconds per step)."""
import os
import signal
import sys
import time

import numpy as np

import byteps_like as bps
from byteps_like.worker.runtime import default_runtime

out, steps = sys.argv[1], int(sys.argv[2])
kills = {}
for item in filter(None, (sys.argv[3] if len(sys.argv) > 3 else "").split(",")):
    step, server, sig = item.split(":")  # SERVER: a server rank, or "scheduler"
    kills.setdefault(int(step), []).append((server, sig))
compressor = sys.argv[4] if len(sys.argv) > 4 else ""

bps.init()
rank = bps.rank()
sizes = [3, 1000, 70_000, 250_000, 17, 600_000, 4096, 123_457]  # 1 to 10 partitions each
params = [np.linspace(-1, 1, n, dtype=np.float32) for n in sizes]
comp = {}
if compressor:  # the largest tensor (10 partitions); onebit and top-k with error feedback
    from byteps_like.compression import Compression
    comp = {5: getattr(Compression, compressor) if compressor in ("fp16", "bf16")
            else Compression.onebit(error_feedback=True) if compressor == "onebit"
            else Compression.topk(0.01, error_feedback=True)}
times = []
for step in range(steps):
    t0 = time.monotonic()
    grads = [np.sin(p * (1.0 + 0.01 * step) + rank).astype(np.float32) for p in params]
    handles = [bps.push_pull_async(g, name=f"w{i}", average=True,
                                   **({"compression": comp[i]} if i in comp else {}))
               for i, g in enumerate(grads)]
    for server, sig in kills.get(step, []) if rank == 0 else []:
        if sig == "WAIT":
            fo = default_runtime().failover
            t_wait = time.monotonic()
            while fo.replacements < int(server) and time.monotonic() - t_wait < 60:
                time.sleep(0.01)
            print(f"REPLACED {fo.replacements} after {time.monotonic() - t_wait:.2f} s", flush=True)
            continue
        if sig == "NOTICE":
            path = os.environ["BYTEPS_PREEMPTION_NOTICE_FILE"].replace("{rank}", server)
            with open(path + ".tmp", "w") as f:
                f.write("TERMINATE at 2026-12-04T21:00:00Z (spot instance-action)\n")
            os.replace(path + ".tmp", path)
            fo, t_wait = default_runtime().failover, time.monotonic()
            while fo.current < 1 and time.monotonic() - t_wait < 60:
                time.sleep(0.005)
            print(f"NOTICE for server {server} at step {step}: failover {fo.current} after "
                  f"{time.monotonic() - t_wait:.2f} s", flush=True)
            continue
        peers = default_runtime().members.controller.peers
        pid = [p.pid for p in peers if (p.role == "scheduler" if server == "scheduler" else
                                        p.role == "server" and p.rank == int(server))][0]
        os.kill(pid, getattr(signal, f"SIG{sig}"))
        print(f"KILLED server {server} pid {pid} at step {step} (SIG{sig})", flush=True)
    for p, h in zip(params, handles):
        p -= np.float32(0.1) * h.wait(timeout=120)
    times.append(time.monotonic() - t0)
np.savez(f"{out}.{rank}.npz", *params)
if rank == 0:
    print("STEP_TIMES " + " ".join(f"{t:.4f}" for t in times), flush=True)
bps.shutdown()
