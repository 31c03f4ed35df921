"""Train a small PyTorch MLP on scikit-learn's handwritten-digits dataset, data-parallel over every
worker of a byteps_like job (the BytePS PyTorch recipe, with ``import byteps_like.torch as bps``).

    bpslaunch --local --workers 2 --servers 1 -- python examples/pytorch/train_digits.py
    python examples/pytorch/train_digits.py            # no launcher: one process, size() == 1

The recipe, as in BytePS's ``example/pytorch``:

1. ``bps.init()``; ``bps.DistributedSampler`` deals the training set over the workers: every
   epoch a new permutation of the whole set, the same on every worker, each taking its slice
   (PyTorch's ``DistributedSampler``; with backup workers, ``BYTEPS_BACKUP_WORKERS=b``, its
   epoch is counted in the samples the rounds average, so every sample still reaches the model:
   docs/reliability.md, "Backup workers"). ``--fixed-shards`` gives each worker the fixed shard
   ``data[rank::size]`` instead.
2. Wrap the optimizer in ``bps.DistributedOptimizer(opt, named_parameters=...)``: each
   gradient starts its push_pull as soon as backward has accumulated it, and ``step()`` waits
   for the averages.
3. ``bps.broadcast_parameters`` and ``bps.broadcast_optimizer_state`` from rank 0, so every
   worker starts from rank 0's weights (each worker seeds its own initialisation differently
   here, on purpose, to show that the broadcast is what makes them agree).
4. The learning rate is the per-worker one times ``bps.size()``: the gradients are averaged over
   a global batch ``size()`` times larger than a worker's, and the linear-scaling rule keeps
   the step per sample the same (BytePS's examples do this; ``--no-scale-lr`` turns it off).

Rank 0 prints progress and, at the end, ``final test accuracy: 0.XXXX (N workers, S steps)``.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import byteps_like.torch as bps

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # examples/: digits_data
sys.path.insert(0, str(Path(__file__).resolve().parent))   # digits_torch (Ray loads by path)
from digits_data import add_backup_options, parser, print_final, straggler_delay  # noqa: E402
from digits_torch import Net, accuracy, load_data  # noqa: E402


def make_compression(args):
    C = bps.Compression
    name = "fp16" if args.fp16_pushpull else args.compressor
    ef = {"error_feedback": args.error_feedback,
          "momentum": args.momentum if args.compressor_momentum else None}
    if name in ("none", "fp16", "bf16"):
        return getattr(C, name)
    if name == "onebit":
        return C.onebit(scaling=True, **ef)
    if name == "topk":
        return C.topk(args.k, **ef)
    if name == "randomk":
        return C.randomk(args.k, seed=args.seed, **ef)
    return C.dithering(levels=int(args.k) if args.k >= 1 else 16, seed=args.seed, **ef)


def main() -> None:
    ap = parser(__doc__, lr_help="per-worker learning rate")
    ap.add_argument("--no-scale-lr", action="store_true",
                    help="do not multiply the learning rate by bps.size()")
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--cosine", action="store_true",
                    help="decay the learning rate to 0 along a cosine over the run")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--fp16-pushpull", action="store_true",
                    help="gradients travel as float16 (Compression.fp16)")
    ap.add_argument("--compressor", default="none",
                    choices=("none", "fp16", "bf16", "onebit", "topk", "randomk", "dithering"),
                    help="gradient compressor (docs/compression.md); servers aggregate the "
                         "compressed pushes")
    ap.add_argument("--k", type=float, default=0.01,
                    help="topk/randomk: fraction (< 1) or count of elements kept; dithering: "
                         "levels")
    ap.add_argument("--error-feedback", action="store_true",
                    help="carry each step's compression error into the next step")
    ap.add_argument("--compressor-momentum", action="store_true",
                    help="apply the momentum (--momentum) as Nesterov momentum before "
                         "compression instead of in the optimizer (BytePS's recipe for onebit "
                         "and top-k)")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads per worker (0: torch's default alone, 1 in a job of "
                         "several workers: they usually share the machine's cores)")
    ap.add_argument("--seed", type=int, default=1)
    add_backup_options(ap, "bps.DistributedSampler")
    args = ap.parse_args()

    bps.init()
    rank, size = bps.rank(), bps.size()
    # several workers on one machine must not each start a thread per core (a tiny model
    # gains nothing from more than one thread anyway)
    if args.threads or size > 1:
        torch.set_num_threads(args.threads or 1)
    threads = torch.get_num_threads()

    xtr, ytr, xte, yte = load_data(seed=0)
    if args.fixed_shards:
        sampler = None
        n_mine = len(xtr[rank::size])                  # this worker's shard
        # the same number of steps on every worker: the smallest shard decides
        steps = (len(xtr) // size) // args.batch_size
    else:
        # a new deal of the whole training set every epoch (set_epoch), the same on every
        # worker; with backup workers each worker's part grows to size / (size - b) of its share
        sampler = bps.DistributedSampler(xtr, shuffle=True, seed=args.seed)
        n_mine = len(sampler)
        steps = n_mine // args.batch_size

    torch.manual_seed(args.seed + rank)                # differs per rank; the broadcast fixes it
    model = Net(args.hidden)
    lr = args.lr if args.no_scale_lr else args.lr * size
    compression = make_compression(args)
    # with --compressor-momentum the compressor applies the momentum, the optimizer must not
    momentum = 0.0 if args.compressor_momentum else args.momentum
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    opt = bps.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=compression)
    bps.broadcast_parameters(model.state_dict(), root_rank=0)
    bps.broadcast_optimizer_state(opt, root_rank=0)

    sched = (torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps * args.epochs)
             if args.cosine else None)
    if rank == 0:
        print(f"{size} worker(s), {n_mine} training samples on rank 0, {steps} steps/epoch, "
              f"compression {compression!r}, "
              f"batch {args.batch_size}/worker, lr {lr:g}"
              f"{'' if args.no_scale_lr else f' ({args.lr:g} x {size} workers)'}, "
              f"{threads} torch thread(s)", flush=True)
    slow = straggler_delay(args.straggler, rank)
    t0 = time.perf_counter()
    g = torch.Generator().manual_seed(100 + rank)
    for epoch in range(args.epochs):
        if sampler is None:
            order = torch.arange(rank, len(xtr), size)[torch.randperm(n_mine, generator=g)]
        else:
            sampler.set_epoch(epoch)
            order = torch.tensor(list(sampler))
        total = 0.0
        for s in range(steps):
            idx = order[s * args.batch_size:(s + 1) * args.batch_size]
            t_step = time.perf_counter()
            opt.zero_grad()
            loss = F.cross_entropy(model(xtr[idx]), ytr[idx])
            loss.backward()
            opt.step()
            if sched is not None:
                sched.step()
            total += loss.item()
            if slow:  # --straggler: this worker's steps take FACTOR times as long
                time.sleep(slow * (time.perf_counter() - t_step))
        if rank == 0:
            print(f"epoch {epoch + 1:3d}/{args.epochs}  loss {total / steps:.4f}  "
                  f"test accuracy {accuracy(model, xte, yte):.4f}  "
                  f"({time.perf_counter() - t0:.1f} s)", flush=True)

    # every worker must hold the same weights: compare with the average over workers
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    avg = bps.push_pull(flat.clone(), average=True, name="check.parameters")
    assert torch.allclose(avg, flat, atol=1e-5), "workers diverged"
    if rank == 0:
        print_final(accuracy(model, xte, yte), size, steps * args.epochs)
    bps.shutdown()


if __name__ == "__main__":
    main()
