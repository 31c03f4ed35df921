"""An elastic PyTorch worker for tests/integration/test_elastic_frameworks.py.

Usage: elastic_torch.py STEPS [kill=STEP@RANK] [commit=EVERY] [slow=SECONDS] [join=SIZE]

A small MLP trained with ``bps.DistributedOptimizer`` inside ``@bps.elastic.run`` on a
``TorchState(model, optimizer, step=0)``. Each worker's batch depends on its rank and the step,
so the average (and the parameters) depend on who is in the job. After every step it prints
one JSON line: rank, size, epoch, step, a CRC of the parameters. ``kill=STEP@RANK``: the worker
of that rank in the first epoch SIGKILLs itself in the step after STEP steps are done, after
its forward pass and before its backward pass, while the others wait in the step's push_pulls.
``commit``: steps between commits (1). ``slow``: seconds each step sleeps. ``join=SIZE``: keep
stepping (past STEPS, up to 120 s) until the job has had SIZE workers for 3 steps.
"""
import json
import os
import signal
import sys
import time
import zlib

import torch

import byteps_like.torch as bps
from byteps_like.worker.runtime import default_runtime

steps = int(sys.argv[1])
opts = dict(a.split("=", 1) for a in sys.argv[2:])
kill_at, _, kill_rank = opts.get("kill", "-1@-1").partition("@")
kill_at, kill_rank = int(kill_at), int(kill_rank or 0)
every = int(opts.get("commit", 1))
slow = float(opts.get("slow", 0))
join_size = int(opts.get("join", 0))

rt = default_runtime()
torch.set_num_threads(1)
# the model and the plain optimizer before init(): a worker that joins is admitted ready to sync
# (torch.optim's first use alone takes seconds on a busy machine, which the others would wait)
torch.manual_seed(1000 + os.getpid())          # different everywhere: the sync must fix it
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
t_start = time.time()
bps.init()


def say(**kw):
    print(json.dumps({**kw, "t": time.time()}), flush=True)


def epoch():
    return rt.epoch


say(started=bps.rank(), size=bps.size(), epoch=epoch(), pid=os.getpid(),
    init=round(time.time() - t_start, 3))
opt = bps.DistributedOptimizer(opt, named_parameters=model.named_parameters())
state = bps.elastic.TorchState(model=model, optimizer=opt, step=0, big_enough=0)


def crc() -> int:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return zlib.crc32(flat.numpy().tobytes())


def on_reset():
    say(reset=True, rank=bps.rank(), size=bps.size(), epoch=epoch())


state.register_reset_callbacks([on_reset])
deadline = time.monotonic() + 120


@bps.elastic.run
def train(state):
    first = True
    while state.step < steps or (join_size and state.big_enough < 3
                                 and time.monotonic() < deadline):
        if first and state.last_reset is not None:
            say(resumed=round(state.last_reset[0], 3), rank=bps.rank(), size=bps.size())
        first = False
        g = torch.Generator().manual_seed(state.step * 100 + bps.rank())
        x = torch.randn(8, 16, generator=g)
        y = torch.randn(8, 4, generator=g)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        if state.step == kill_at and bps.rank() == kill_rank and epoch() <= 1:
            say(killing=state.step, rank=bps.rank())
            os.kill(os.getpid(), signal.SIGKILL)
        loss.backward()
        opt.step()
        state.step += 1
        if bps.size() >= join_size:
            state.big_enough += 1
        say(rank=bps.rank(), size=bps.size(), epoch=epoch(), step=state.step, crc=crc())
        if slow:
            time.sleep(slow)
        if state.step % every == 0:
            state.commit()


train(state)
say(done=True, rank=bps.rank(), size=bps.size(), step=state.step, crc=crc())
bps.shutdown()
