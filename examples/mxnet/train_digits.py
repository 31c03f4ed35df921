"""Train a small Gluon MLP on scikit-learn's handwritten-digits dataset, data-parallel over every
worker of a byteps_like job (the BytePS MXNet recipe, with ``import byteps_like.mxnet as bps``).

Runs in the MXNet environment (MXNet 1.9.1 needs numpy < 1.24; ``bash scripts/setup_mxnet.sh``):

    .venv-mxnet/bin/bpslaunch --local --workers 2 --servers 1 -- \\
        .venv-mxnet/bin/python examples/mxnet/train_digits.py
    .venv-mxnet/bin/python examples/mxnet/train_digits.py      # one process, size() == 1

The recipe, as in BytePS's ``example/mxnet``:

1. ``bps.init()``; ``bps.DistributedSampler`` deals the training set over the workers for
   Gluon's ``DataLoader``: every epoch a new permutation of the whole set, the same on every
   worker, each taking its slice (with backup workers, ``BYTEPS_BACKUP_WORKERS=b``, its epoch is
   counted in the samples the rounds average, so every sample still reaches the model:
   docs/reliability.md, "Backup workers"). ``--fixed-shards`` gives each worker the fixed shard
   ``data[rank::size]`` instead.
2. ``bps.DistributedTrainer(net.collect_params(), "sgd", {...})`` in place of
   ``gluon.Trainer``: ``trainer.step(batch_size)`` averages every gradient across workers, then
   updates. It also broadcasts rank 0's weights when it is built (each worker seeds its own
   initialisation differently here, on purpose, to show that the broadcast makes them agree).
3. The learning rate is the per-worker one times ``bps.size()`` (linear scaling for a global
   batch ``size()`` times larger; ``--no-scale-lr`` turns it off).

Rank 0 prints progress and, at the end, ``final test accuracy: 0.XXXX (N workers, S steps)``.
"""
from __future__ import annotations

import json
import sys
import time
import warnings
from pathlib import Path

import numpy as np

import byteps_like.mxnet as bps

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # examples/: digits_data
from digits_data import (  # noqa: E402
    add_backup_options,
    load_data,
    parser,
    print_final,
    straggler_delay,
)

with warnings.catch_warnings():  # MXNet 1.9.1 touches numpy's deprecated aliases
    warnings.simplefilter("ignore", DeprecationWarning)
    import mxnet as mx
from mxnet import autograd, gluon


def make_net(hidden: int) -> gluon.nn.HybridSequential:
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(hidden, in_units=64, activation="relu"),
            gluon.nn.Dense(hidden, in_units=hidden, activation="relu"),
            gluon.nn.Dense(10, in_units=hidden))
    return net


def accuracy(net, x: np.ndarray, y: np.ndarray) -> float:
    pred = net(mx.nd.array(x)).argmax(axis=1).asnumpy()
    return float((pred == y).mean())


def main() -> None:
    ap = parser(__doc__, lr_help="per-worker learning rate")
    ap.add_argument("--no-scale-lr", action="store_true",
                    help="do not multiply the learning rate by bps.size()")
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--fp16-pushpull", action="store_true",
                    help="gradients travel as float16 (compression_params={'compressor': 'fp16'})")
    ap.add_argument("--compression-params", type=json.loads, default=None, metavar="JSON",
                    help="BytePS's compression_params, e.g. '{\"compressor\": \"onebit\", "
                         "\"ef\": \"vanilla\", \"momentum\": \"nesterov\", \"scaling\": true}' "
                         "(docs/compression.md)")
    ap.add_argument("--seed", type=int, default=1)
    add_backup_options(ap, "bps.DistributedSampler")
    args = ap.parse_args()

    bps.init()
    rank, size = bps.rank(), bps.size()
    xtr, ytr, xte, yte = load_data(seed=0)
    ytr, yte = ytr.astype(np.float32), yte.astype(np.float32)
    train = gluon.data.ArrayDataset(xtr, ytr)
    if args.fixed_shards:
        # a fixed shard: right while every push makes every round, not with backup workers
        shard = np.arange(rank, len(xtr), size)
        sampler = None
        n_mine = len(shard)
        # the same number of steps on every worker: the smallest shard decides
        steps = (len(xtr) // size) // args.batch_size
    else:
        # a new deal of the whole training set every epoch (set_epoch), the same on every
        # worker; with backup workers each worker's part grows to size / (size - b) of its share
        sampler = bps.DistributedSampler(len(train), shuffle=True, seed=args.seed)
        loader = gluon.data.DataLoader(train, batch_size=args.batch_size, sampler=sampler,
                                       last_batch="discard")
        n_mine = len(sampler)
        steps = n_mine // args.batch_size

    mx.random.seed(args.seed + rank)                   # differs per rank; the trainer's broadcast
    net = make_net(args.hidden)                        # makes every worker start from rank 0's
    net.initialize(mx.init.Xavier())
    net.hybridize()
    lr = args.lr if args.no_scale_lr else args.lr * size
    comp = args.compression_params or ({"compressor": "fp16"} if args.fp16_pushpull else None)
    # with "momentum": "nesterov" the trainer moves the optimizer's momentum into the compressor
    trainer = bps.DistributedTrainer(
        net.collect_params(), "sgd", {"learning_rate": lr, "momentum": args.momentum},
        compression_params=comp)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()

    if rank == 0:
        print(f"{size} worker(s), {n_mine} training samples on rank 0, {steps} steps/epoch, "
              f"batch {args.batch_size}/worker, lr {lr:g}"
              f"{'' if args.no_scale_lr else f' ({args.lr:g} x {size} workers)'}", flush=True)
    slow = straggler_delay(args.straggler, rank)
    t0 = time.perf_counter()
    rng = np.random.default_rng(100 + rank)
    for epoch in range(args.epochs):
        if sampler is None:   # this worker's shard, reshuffled
            order = shard[rng.permutation(n_mine)].tolist()
            loader = gluon.data.DataLoader(train, batch_size=args.batch_size, sampler=order,
                                           last_batch="discard")
        else:
            sampler.set_epoch(epoch)   # a new deal of the whole set, the same on every worker
        total = 0.0
        for s, (x, y) in enumerate(loader):
            if s == steps:
                break
            t_step = time.perf_counter()
            with autograd.record():
                loss = loss_fn(net(x), y)
            loss.backward()
            trainer.step(x.shape[0])                   # average over workers, then update
            total += float(loss.mean().asscalar())
            if slow:  # --straggler: this worker's steps take FACTOR times as long
                time.sleep(slow * (time.perf_counter() - t_step))
        if rank == 0:
            print(f"epoch {epoch + 1:3d}/{args.epochs}  loss {total / steps:.4f}  "
                  f"test accuracy {accuracy(net, xte, yte):.4f}  "
                  f"({time.perf_counter() - t0:.1f} s)", flush=True)

    # every worker must hold the same weights: compare with the average over workers
    flat = np.concatenate([p.data().asnumpy().ravel()
                           for _, p in sorted(net.collect_params().items())])
    avg = mx.nd.array(flat)
    bps.byteps_push_pull(avg, name="check.parameters", is_average=True)
    assert np.allclose(avg.asnumpy(), flat, atol=1e-5), "workers diverged"
    if rank == 0:
        print_final(accuracy(net, xte, yte), size, steps * args.epochs)
    bps.shutdown()


if __name__ == "__main__":
    main()
