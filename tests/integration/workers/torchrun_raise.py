"""Worker started by torchrun (tests/integration/test_torchrun.py): a few push_pulls, then rank 1
raises ``RuntimeError: rank 1 fails on purpose`` while rank 0 goes on push_pulling (and so
fails with PeerLostError, because of rank 1)."""
import time

import numpy as np

import byteps_like as bps

bps.init()
rank = bps.rank()
x = np.ones(1000, np.float32)
for step in range(10_000):
    if step == 5 and rank == 1:
        raise RuntimeError("rank 1 fails on purpose")
    bps.push_pull(x, name="x")
    time.sleep(0.01)
