"""Checkpoint/resume worker (the documented recipe of docs/reliability.md).

Usage: ckpt_train.py CKPT FINAL END_STEP [CRASH_AT]

Trains a small float64 torch model with byteps_like.torch on a fixed global batch of 12
samples per step, each worker taking an equal slice (so the averaged gradient, hence the
trajectory, does not depend on the number of workers). If CKPT exists, rank 0 loads the model,
optimizer state and step from it and broadcasts them; else training starts from step 0. After
every step rank 0 writes the checkpoint (atomically: temp file + rename). At END_STEP rank 0
writes the parameters to FINAL. With CRASH_AT, the last rank SIGKILLs itself before that step.
"""
import os
import signal
import sys

import torch

import byteps_like.torch as bps

GLOBAL_BATCH = 12


def data(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 8, generator=g, dtype=torch.float64)
    y = x[:, :1] * 0.5 - x[:, 1:2] + 0.1 * torch.randn(GLOBAL_BATCH, 1, generator=g,
                                                        dtype=torch.float64)
    return x, y


def main():
    ckpt, final, end = sys.argv[1], sys.argv[2], int(sys.argv[3])
    crash_at = int(sys.argv[4]) if len(sys.argv) > 4 else None
    bps.init()
    rank, size = bps.rank(), bps.size()
    assert GLOBAL_BATCH % size == 0
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Tanh(),
                                torch.nn.Linear(6, 1)).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    start = 0
    if rank == 0 and os.path.exists(ckpt):
        state = torch.load(ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = int(state["step"])
        print(f"RESUMED from step {start} with {size} workers", flush=True)
    # rank 0's (loaded or initial) state goes to everyone, then the wrapper is built
    bps.broadcast_parameters(model.state_dict(), root_rank=0)
    bps.broadcast_optimizer_state(opt, root_rank=0)
    start = int(bps.broadcast_object(start, root_rank=0, name="resume.step"))
    dopt = bps.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    per = GLOBAL_BATCH // size
    for step in range(start, end):
        if crash_at is not None and step == crash_at and rank == size - 1:
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = data(step)
        xs, ys = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        dopt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(xs), ys)
        loss.backward()
        dopt.step()
        if rank == 0:
            tmp = ckpt + ".tmp"
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                        "step": step + 1}, tmp)
            os.replace(tmp, ckpt)
    if rank == 0:
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, final)
        print(f"DONE at step {end}", flush=True)
    bps.shutdown()


if __name__ == "__main__":
    main()
