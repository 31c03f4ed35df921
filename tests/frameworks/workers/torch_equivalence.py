"""Worker: data-parallel training with byteps_like.torch against one process on the whole batch.

Usage: torch_equivalence.py MODE[,MODE...] [STEPS]   (the modes run one after another)
  sgd, adam        DistributedOptimizer, plain SGD / Adam
  bpps2            backward_passes_per_step=2 (two micro-batches per step)
  skipsync         synchronize(), clip the averaged gradients, step under skip_synchronize()
  ddp              DistributedDataParallel with no_sync() accumulation, plain optimizer
  fp16             DistributedOptimizer(compression=fp16), float32 model, loose tolerance
Every worker also trains the single-process reference itself and checks, after every step, that
its parameters equal the reference's and every other worker's. Prints ``EQUIV OK MODE`` per
mode. The tensor names carry the mode, so one process runs several.
"""
import os
import sys

import torch

import byteps_like.torch as bps

MODES = sys.argv[1].split(",")
STEPS = int(sys.argv[2]) if len(sys.argv) > 2 else 5
DEVICE = torch.device("cpu")  # EQUIV_DEVICE=cuda: cuda:<local rank> on a GPU machine


def make_model(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 3)).to(dtype).to(DEVICE)


def make_opt(mode, params):
    if mode == "adam":
        return torch.optim.Adam(params, lr=0.01)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def loss_fn(model, x, y):
    return torch.nn.functional.cross_entropy(model(x), y)


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def main():
    global DEVICE
    bps.init()
    if os.environ.get("EQUIV_DEVICE") == "cuda":
        DEVICE = torch.device("cuda", bps.local_rank() % torch.cuda.device_count())
        torch.cuda.set_device(DEVICE)
    for mode in MODES:
        train(mode, bps.rank(), bps.size())
    bps.shutdown()


def train(MODE, rank, size):  # noqa: N803 - the mode, as in the usage
    DTYPE = torch.float32 if MODE == "fp16" else torch.float64  # noqa: N806
    TOL = 2e-3 if MODE == "fp16" else 1e-9  # noqa: N806
    g = torch.Generator().manual_seed(42)
    per_worker = 4
    micro = 2 if MODE in ("bpps2", "ddp") else 1
    X = torch.randn(STEPS, micro, per_worker * size, 10, generator=g, dtype=DTYPE).to(DEVICE)
    Y = torch.randint(0, 3, (STEPS, micro, per_worker * size), generator=g).to(DEVICE)

    ref = make_model(DTYPE)
    ref_opt = make_opt(MODE, ref.parameters())
    model = make_model(DTYPE)
    if MODE == "ddp":
        dmodel = bps.DistributedDataParallel(model)
        opt = make_opt(MODE, model.parameters())
    else:
        compression = bps.Compression.fp16 if MODE == "fp16" else bps.Compression.none
        opt = bps.DistributedOptimizer(make_opt(MODE, model.parameters()),
                                       [(f"{MODE}.{n}", p) for n, p in model.named_parameters()],
                                       compression=compression,
                                       backward_passes_per_step=2 if MODE == "bpps2" else 1)
    shard = slice(rank * per_worker, (rank + 1) * per_worker)
    for step in range(STEPS):
        # reference: the whole batch in one process
        ref_opt.zero_grad()
        for m in range(micro):
            loss_fn(ref, X[step, m], Y[step, m]).backward()
        if MODE == "skipsync":
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        ref_opt.step()
        # data parallel: this worker's shard
        opt.zero_grad()
        if MODE == "ddp":
            with dmodel.no_sync():
                loss_fn(dmodel, X[step, 0, shard], Y[step, 0, shard]).backward()
            loss_fn(dmodel, X[step, 1, shard], Y[step, 1, shard]).backward()
            opt.step()
        elif MODE == "skipsync":
            loss_fn(model, X[step, 0, shard], Y[step, 0, shard]).backward()
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            with opt.skip_synchronize():
                opt.step()
        else:
            for m in range(micro):
                loss_fn(model, X[step, m, shard], Y[step, m, shard]).backward()
            opt.step()
        mine = flat(model)
        diff = (mine - flat(ref)).abs().max().item()
        assert diff < TOL, f"step {step}: rank {rank} differs from the reference by {diff}"
        avg = bps.push_pull(mine.clone(), average=True, name=f"check.{MODE}")
        assert torch.equal(avg, mine) or MODE == "fp16", f"step {step}: workers differ"
    print(f"EQUIV OK {MODE} rank {rank} of {size}: {STEPS} steps, max diff {diff:.2e}", flush=True)


if __name__ == "__main__":
    main()
