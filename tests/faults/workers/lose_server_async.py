"""Asynchronous mode losing a server (BYTEPS_ASYNC_SNAPSHOT_SECONDS), for
tests/faults/test_lose_server.py. Usage: lose_server_async.py STEPS MARK KILL

Every step each worker push_pulls (average=False) 8 tensors of 50,000 floats (their keys spread
over the servers): rank 0 pushes ones, the other ranks zeros, so an answer counts rank 0's pushes
the servers have applied. After step MARK rank 0 waits until lost server 1's snapshot file is
copied after that step's answer came (so it holds at least MARK + 1 of its pushes); at step KILL it
SIGKILLs server 1 once its pushes are on their way (MARK -1: no snapshot waited for). Rank 0 prints ``FINAL`` with the least and
largest value of its last answers and ``EXPECT`` the bounds: a key that stayed holds STEPS; a
moved key went back to the snapshot (at least MARK + 1, at most KILL + 1 pushes) and then took
every push after KILL (and KILL's own, unless the lost server had applied it already: a push
in flight at the loss is sent again), so it ends between MARK + STEPS - KILL and STEPS (+ 1 when
the lost server had applied and snapshotted the push in flight but not answered it); starting
again from zero would give at most STEPS - KILL."""
import glob
import os
import signal
import sys
import time

import numpy as np

import byteps_like as bps
from byteps_like.server.async_snapshots import read
from byteps_like.worker.runtime import default_runtime

steps, mark, kill = (int(a) for a in sys.argv[1:4])
bps.init()
rank = bps.rank()
grads = [np.full(50_000, 1.0 if rank == 0 else 0.0, np.float32) for _ in range(8)]
directory = os.environ["BYTEPS_SPARSE_CHECKPOINT_DIR"]
answers: list = []
for step in range(steps):
    handles = [bps.push_pull_async(g, name=f"w{i}", average=False) for i, g in enumerate(grads)]
    if rank == 0 and step == kill:
        peers = default_runtime().members.controller.peers
        pid = [p.pid for p in peers if p.role == "server" and p.rank == 1][0]
        os.kill(pid, signal.SIGKILL)
        print(f"KILLED server 1 pid {pid} at step {step}", flush=True)
    answers = [h.wait(timeout=120) for h in handles]
    if step > kill:
        time.sleep(0.01)   # the rest of the run gives a restarted server time to register
    if rank == 0 and step == mark:   # MARK -1: no snapshots to wait for
        done = time.time()
        deadline = time.monotonic() + 60
        while not any(read(p, 1 << 30)[0]["time"] > done   # copied after that answer
                      for p in glob.glob(os.path.join(directory, "async-*", "server1.bpsa"))):
            if time.monotonic() > deadline:
                raise SystemExit("server 1 wrote no snapshot within 60 s")
            time.sleep(0.01)
        print(f"SNAPSHOT of server 1 after step {step}", flush=True)
if rank == 0:
    low = min(float(a.min()) for a in answers)
    high = max(float(a.max()) for a in answers)
    print(f"FINAL {low:g} {high:g}", flush=True)
    print(f"EXPECT {mark + steps - kill} {steps}", flush=True)
bps.shutdown()
