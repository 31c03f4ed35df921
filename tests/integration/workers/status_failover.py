"""Worker: what ``bpslaunch status`` says of a server lost and replaced (issue 37 item 5).
Usage: status_failover.py PAGE OUT

Every worker push_pulls a few tensors (several partitions over 3 servers) for 10 steps. Worker
rank 0 notes where the keys live (key_owners, what its reports say), SIGKILLs server 1 in the
middle of step 3 and, before step 4, waits until the replacement bpslaunch starts
(--server-restarts 1) has taken its keys back. After its last step it reads the job page at PAGE
until it lists both failovers, finished, with the keys they moved, and the servers' keys are as
before; it writes {"before": owners, "state": page} to OUT and prints ``bpslaunch status``'s
text."""
import json
import os
import signal
import sys
import time

import numpy as np

import byteps_like as bps
from byteps_like.launcher.status import fetch_state, render_state
from byteps_like.worker.runtime import default_runtime
from byteps_like.worker.telemetry import key_owners

page, out = sys.argv[1], sys.argv[2]
bps.init()
rank = bps.rank()
rt = default_runtime()
sizes = [1000, 70_000, 250_000, 17, 600_000, 123_457]
params = [np.linspace(-1, 1, n, dtype=np.float32) for n in sizes]
before = None
for step in range(10):
    handles = [bps.push_pull_async(p * (rank + 1), name=f"w{i}", average=True)
               for i, p in enumerate(params)]
    if rank == 0 and step == 3:
        before = key_owners(rt)
        pid = [p.pid for p in rt.members.controller.peers
               if p.role == "server" and p.rank == 1][0]
        os.kill(pid, signal.SIGKILL)
    for h in handles:
        h.wait(timeout=120)
    if rank == 0 and step == 3:
        deadline = time.monotonic() + 90
        while rt.failover.replacements < 1 or rt.failover.current < 2:
            assert time.monotonic() < deadline, "no replacement took server 1's keys back"
            time.sleep(0.01)

if rank == 0:
    deadline = time.monotonic() + 60
    while True:
        state = fetch_state(page)
        fos = state.get("failovers", [])
        owned = {s["rank"]: s.get("keys_owned") for s in state["servers"]}
        if (len(fos) == 2 and all(f["stall"] is not None and f["keys_moved"] is not None
                                  for f in fos)
                and owned == {r[0]: r[1] for r in before}):
            break
        assert time.monotonic() < deadline, json.dumps({k: state.get(k) for k in ("failovers", "servers")})
        time.sleep(0.05)
    with open(out, "w") as f:
        json.dump({"before": before, "state": state}, f)
    print("\n".join(render_state(state)), flush=True)
bps.shutdown()
