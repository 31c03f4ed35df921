"""Uneven inputs: rank r runs STEPS[r] steps of push_pull, then joins (or, with ``nojoin``,
just ends; a rank that meets PeerLeftError then exits 7, or with ``nojoin-uncaught`` dies of
it). Prints one JSON line per step with what it got, so the test checks every value, and how
long its shutdown() took."""
import json
import sys
import time

import numpy as np

import byteps_like as bps
from byteps_like.errors import PeerLeftError

steps = [int(s) for s in sys.argv[1].split(",")]
mode = sys.argv[2] if len(sys.argv) > 2 else "join"
dtype = sys.argv[3] if len(sys.argv) > 3 else "float32"

bps.init()
r, n = bps.rank(), bps.size()
x = np.full(1 << 16, r + 1, dtype=dtype)   # 256 KiB of float32: several partitions
y = np.full(1000, 10 * (r + 1), dtype=dtype)
try:
    for step in range(steps[r]):
        a = bps.push_pull(x, name="x", average=True)
        b = bps.push_pull(y, name="y", average=False)
        print(json.dumps({"rank": r, "step": step, "avg": float(a[0]), "avg_uniform":
                          bool((a == a[0]).all()), "sum": float(b[0])}), flush=True)
    if mode == "join":
        t0 = time.monotonic()
        last = bps.join()
        print(json.dumps({"rank": r, "joined": last, "waited": time.monotonic() - t0}),
              flush=True)
        # after every rank joined, all are back in: a full round again
        c = bps.push_pull(y, name="y", average=False)
        print(json.dumps({"rank": r, "after": float(c[0])}), flush=True)
except PeerLeftError as exc:
    print(json.dumps({"rank": r, "peer_left": exc.rank, "last_round": exc.last_round,
                      "message": str(exc)}), flush=True)
    if mode == "nojoin-uncaught":
        raise
    sys.exit(7)
t0 = time.monotonic()
bps.shutdown()
print(json.dumps({"rank": r, "shutdown": time.monotonic() - t0, "t": time.time()}), flush=True)
