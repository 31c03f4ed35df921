"""An elastic numpy worker for tests/integration/test_elastic.py.

Usage: elastic_numpy.py STEPS [kill=STEP@RANK[:TERM]] [killserver=STEP] [slow=SECONDS] [table=1]

Every step push_pulls (sum, not average) a vector of 1s from every worker and a vector holding
rank + 1, over a few tensors, and prints one JSON line: rank, size, epoch, step and the sums, so
the test checks every sum is exact for the epoch's size (size and size*(size+1)/2). After a
MembershipChangedError it rejoins, prints how long the resume took, takes the step from rank 0
and goes on. ``kill=STEP@RANK``: the worker of that rank in epoch 1 SIGKILLs itself at that
step, mid-step (one tensor pushed, the other not), while the others wait for the round
(``:TERM``: with SIGTERM, as a preempted machine gets first).
``killserver=STEP``: rank 0 SIGKILLs server 0 at that step. ``slow``: seconds each step sleeps
(a window to join or lose). ``table=1``: every step also pulls row 0 of a server-held table
(zeros, SGD with lr 1) before the push_pulls and pushes a row of 1s between them (after the
kill point), and prints the row's value (``table``): each round of an epoch takes it down by
the epoch's size, and a round cut short by a change is dropped, not applied.
"""
import json
import os
import signal
import sys
import time

import numpy as np

import byteps_like as bps
from byteps_like.errors import MembershipChangedError, TooFewWorkersError
from byteps_like.worker.runtime import default_runtime

steps = int(sys.argv[1])
opts = dict(a.split("=", 1) for a in sys.argv[2:])
kill_at, _, kill_rank = opts.get("kill", "-1@-1").partition("@")
kill_rank, _, kill_sig = kill_rank.partition(":")   # STEP@RANK:TERM sends SIGTERM
kill_at, kill_rank = int(kill_at), int(kill_rank or 0)
kill_sig = signal.SIGTERM if kill_sig == "TERM" else signal.SIGKILL
kill_server = int(opts.get("killserver", -1))
slow = float(opts.get("slow", 0))

rt = default_runtime()
t_init = time.monotonic()
bps.init()
assert rt.elastic, "run me in an elastic job (bpslaunch --elastic)"


def epoch() -> int:
    return rt.epoch


def say(**kw):
    print(json.dumps({**kw, "t": time.time()}), flush=True)


say(init=round(time.monotonic() - t_init, 3), rank=bps.rank(), size=bps.size(), epoch=epoch(),
    pid=os.getpid())
table = (bps.embedding_table("emb", 16, 4, init="zeros", optimizer="sgd", lr=1.0)
         if opts.get("table") else None)
step = 0
synced = False
while step < steps:
    try:
        if not synced:  # the step, from rank 0 (a sum where the others add 0)
            got = bps.push_pull(np.array([step if bps.rank() == 0 else 0], np.int64),
                                name="step", average=False)
            step = int(got[0])
            # a name first used in this epoch declares its key at the epoch's first round
            fresh = bps.push_pull(np.ones(10, np.float32), name=f"fresh.{epoch()}",
                                  average=False)
            # a name of every epoch whose shape follows the size: declared afresh each time
            vary = bps.push_pull(np.ones(bps.size(), np.float32), name="vary", average=False)
            say(rank=bps.rank(), size=bps.size(), epoch=epoch(), fresh=float(fresh.min()),
                fresh_max=float(fresh.max()), vary=float(vary.min()), vary_max=float(vary.max()),
                vary_len=int(vary.size))
            synced = True
            if step >= steps:
                break
        n = bps.size()
        row = float(table.pull([0])[0, 0]) if table is not None else None
        ones = np.ones(1000, np.float32)
        mine = np.full(300_000, bps.rank() + 1, np.float64)   # several partitions
        h1 = bps.push_pull_async(ones, name="ones", average=False)
        if step == kill_server and bps.rank() == 0:
            srv = next(p for p in rt.control.peers if p.role == "server")
            say(killing_server=srv.pid)
            os.kill(srv.pid, signal.SIGKILL)
        if step == kill_at and bps.rank() == kill_rank and epoch() == 1:  # mid-step: "ones" pushed, "ranks" not; the others wait for it
            bps.synchronize(h1)
            time.sleep(0.2)
            say(killing=step, rank=bps.rank())
            os.kill(os.getpid(), kill_sig)
            time.sleep(30)  # SIGTERM: the handler (the default action after it) ends it
        if table is not None:   # the round stays open until every worker of the epoch pushes
            table.push([0], np.ones((1, 4), np.float32))
        h2 = bps.push_pull_async(mine, name="ranks", average=False)
        s1, s2 = bps.synchronize(h1), bps.synchronize(h2)
        say(rank=bps.rank(), size=n, epoch=epoch(), step=step,
            ones=float(s1.min()), ones_max=float(s1.max()),
            ranks=float(s2.min()), ranks_max=float(s2.max()),
            **({"table": row} if row is not None else {}))
        step += 1
        if slow:
            time.sleep(slow)
        rt.check_membership()   # the commit point: admits workers waiting to join
    except MembershipChangedError as exc:
        t0 = time.monotonic()
        say(changed=exc.epoch, lost=list(exc.lost), added=exc.added, rank=bps.rank())
        try:
            rt.rejoin()
        except TooFewWorkersError as tf:
            say(too_few=str(tf), lost=list(tf.lost), min_workers=tf.min_workers)
            sys.exit(3)
        say(resumed=round(time.monotonic() - t0, 3), rank=bps.rank(), size=bps.size(),
            epoch=epoch())
        synced = False
say(done=True, rank=bps.rank(), size=bps.size(), epoch=epoch(), step=step)
bps.shutdown()
