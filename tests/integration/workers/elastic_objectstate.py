"""An elastic numpy worker on ``byteps_like.elastic`` (ObjectState and run), for
tests/integration/test_elastic_frameworks.py.

Usage: elastic_objectstate.py STEPS [kill=STEP@RANK] [commit=EVERY]

Least squares by gradient descent on ``state.w`` (a numpy array kept in place), each worker's
gradient from its own rows (rank and step); after every step one JSON line: rank, size, step,
a CRC of ``w``. ``kill=STEP@RANK``: the worker of that rank in the first epoch SIGKILLs itself
in the step after STEP steps are done, before it pushes, while the others wait for the sum.
"""
import json
import os
import signal
import sys
import time
import zlib

import numpy as np

import byteps_like as bps
from byteps_like import elastic
from byteps_like.worker.runtime import default_runtime

steps = int(sys.argv[1])
opts = dict(a.split("=", 1) for a in sys.argv[2:])
kill_at, _, kill_rank = opts.get("kill", "-1@-1").partition("@")
kill_at, kill_rank = int(kill_at), int(kill_rank or 0)
every = int(opts.get("commit", 1))

bps.init()
rt = default_runtime()


def say(**kw):
    print(json.dumps({**kw, "t": time.time()}), flush=True)


say(started=bps.rank(), size=bps.size(), epoch=rt.epoch)
rng = np.random.default_rng(os.getpid())
w = rng.normal(size=64)                       # different everywhere: the sync must fix it
state = elastic.ObjectState(w=w, step=0)
state.register_reset_callbacks([lambda: say(reset=True, rank=bps.rank(), size=bps.size())])


@elastic.run
def train(state):
    while state.step < steps:
        g = np.random.default_rng(state.step * 100 + bps.rank())
        a = g.normal(size=(16, 64))
        b = g.normal(size=16)
        if state.step == kill_at and bps.rank() == kill_rank and rt.epoch <= 1:
            say(killing=state.step, rank=bps.rank())
            os.kill(os.getpid(), signal.SIGKILL)
        grad = a.T @ (a @ state.w - b) / 16
        state.w -= 0.01 * bps.push_pull(grad, name="grad", average=True)
        state.step += 1
        say(rank=bps.rank(), size=bps.size(), step=state.step,
            crc=zlib.crc32(state.w.tobytes()))
        if state.step % every == 0:
            state.commit()


train(state)
assert state.w is w   # kept in place through restore and sync
say(done=True, rank=bps.rank(), size=bps.size(), step=state.step,
    crc=zlib.crc32(state.w.tobytes()))
bps.shutdown()
