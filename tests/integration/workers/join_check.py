"""Uneven inputs: rank r runs STEPS[r] steps of push_pull, then joins (or, with ``nojoin``,
just ends; a rank that meets PeerLeftError then exits 7, or with ``nojoin-uncaught`` dies of
it). Prints one JSON line per step with what it got, so the test checks every value, and how
long its shutdown() took. ``table`` (the fourth argument): every step first pulls row 0 of a
server-held table (zeros, SGD with lr 1) and pushes rank + 1 to it, averaged (``row``: the
value pulled); after the join every rank pulls it (``row_after``), pushes 1s and pulls it again
(``row_end``). ``tableonly``: the table alone, no push_pull."""
import json
import sys
import time

import numpy as np

import byteps_like as bps
from byteps_like.errors import PeerLeftError

steps = [int(s) for s in sys.argv[1].split(",")]
mode = sys.argv[2] if len(sys.argv) > 2 else "join"
dtype = sys.argv[3] if len(sys.argv) > 3 else "float32"
with_table = len(sys.argv) > 4 and sys.argv[4] in ("table", "tableonly")
dense = not (len(sys.argv) > 4 and sys.argv[4] == "tableonly")

bps.init()
r, n = bps.rank(), bps.size()
x = np.full(1 << 16, r + 1, dtype=dtype)   # 256 KiB of float32: several partitions
y = np.full(1000, 10 * (r + 1), dtype=dtype)
table = (bps.embedding_table("emb", 8, 2, init="zeros", optimizer="sgd", lr=1.0)
         if with_table else None)
try:
    for step in range(steps[r]):
        row = None
        if table is not None:   # first, so that a round never completed is the table's
            row = float(table.pull([0])[0, 0])
            table.push([0], np.full((1, 2), r + 1, np.float32), average=True)
        if dense:
            a = bps.push_pull(x, name="x", average=True)
            b = bps.push_pull(y, name="y", average=False)
            print(json.dumps({"rank": r, "step": step, "avg": float(a[0]), "avg_uniform":
                              bool((a == a[0]).all()), "sum": float(b[0]),
                              **({"row": row} if row is not None else {})}), flush=True)
    if mode == "join":
        t0 = time.monotonic()
        last = bps.join()
        print(json.dumps({"rank": r, "joined": last, "waited": time.monotonic() - t0}),
              flush=True)
        # after every rank joined, all are back in: a full round again
        c = bps.push_pull(y, name="y", average=False)
        print(json.dumps({"rank": r, "after": float(c[0])}), flush=True)
        if table is not None:   # every rank continues at the round the job reached
            row_after = float(table.pull([0])[0, 0])
            table.push([0], np.ones((1, 2), np.float32))
            print(json.dumps({"rank": r, "row_after": row_after,
                              "row_end": float(table.pull([0])[0, 0])}), flush=True)
except PeerLeftError as exc:
    print(json.dumps({"rank": r, "peer_left": exc.rank, "last_round": exc.last_round,
                      "message": str(exc)}), flush=True)
    if mode == "nojoin-uncaught":
        raise
    sys.exit(7)
t0 = time.monotonic()
bps.shutdown()
print(json.dumps({"rank": r, "shutdown": time.monotonic() - t0, "t": time.time()}), flush=True)
