"""What each worker of ``python -m byteps_like.bench failover`` runs (under bpslaunch --local):
a real model (:mod:`.models`) on one synthetic batch with ``byteps_like.torch``'s
DistributedOptimizer and plain SGD, ``--steps`` steps, every step timed. With ``--kill
STEP:RANK:SIGNAL`` worker rank 0 sends SIGNAL to server rank RANK at the start of step STEP's
exchange (after backward began its push_pulls), so the loss lands mid-round. Rank 0 prints one
JSON line (``FAILOVER_RESULT``): the step times, the step at which a replacement server was
connected (bpslaunch --server-restarts), and the final parameters' file (.npy, float32, all of
them flattened) for the driver to compare with an uninterrupted run."""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="mlp")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=0)
    p.add_argument("--device", default="auto")
    p.add_argument("--kill", default="")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    import numpy as np
    import torch

    import byteps_like.torch as bps
    from byteps_like.worker.runtime import default_runtime

    from . import models
    bps.init()
    rank = bps.rank()
    dev = torch.device("cuda" if a.device == "auto" and torch.cuda.is_available()
                       else "cpu" if a.device == "auto" else a.device)
    work = models.build(a.model, dev, a.batch or None)
    model = work.model
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=work.lr),
                                   named_parameters=model.named_parameters())
    bps.broadcast_parameters(model.state_dict(), root_rank=0)
    kill = a.kill.split(":") if a.kill else None
    fo = default_runtime().failover
    times: list[float] = []
    replaced_at = -1
    for step in range(a.steps):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = work.loss(model, work.batch)
        loss.backward()
        if kill and rank == 0 and step == int(kill[0]):
            pid = [s.pid for s in default_runtime().members.servers if s.rank == int(kill[1])][0]
            os.kill(pid, getattr(signal, f"SIG{kill[2] if len(kill) > 2 else 'KILL'}"))
        opt.step()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t0)
        if replaced_at < 0 and fo is not None and fo.replacements:
            replaced_at = step
    flat = torch.cat([q.detach().float().flatten().cpu() for q in model.parameters()])
    if rank == 0:
        np.save(a.out, flat.numpy())
        print("FAILOVER_RESULT " + json.dumps({"times": times, "replaced_at": replaced_at,
                                               "stalls": fo.stalls if fo else [],
                                               "out": a.out}), flush=True)
    bps.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
