"""Worker: data-parallel Gluon training with byteps_like.mxnet against one process on the whole
batch.

Usage: mx_equivalence.py MODE[,MODE...] [STEPS]   (the modes run one after another)
  sgd, adam    DistributedTrainer (SGD with momentum / Adam)
  optimizer    gluon.Trainer(kvstore=None) over DistributedOptimizer(mx.optimizer.SGD)
  fp16         DistributedTrainer(compression_params={"compressor": "fp16"}), float32 model
Every rank but 0 starts from different weights, so the trainer's broadcast from root 0 is part of
what is checked. After every step each worker checks that its parameters equal the reference's
and every other worker's. Prints ``EQUIV OK MODE`` per mode.
"""
import sys

import mxnet as mx
import numpy as np

import byteps_like.mxnet as bps

MODES = sys.argv[1].split(",")
STEPS = int(sys.argv[2]) if len(sys.argv) > 2 else 5
MODE, DTYPE, TOL = "", "float64", 1e-9   # set per mode by main()


def make_net(seed):
    mx.random.seed(seed)
    net = mx.gluon.nn.HybridSequential()
    net.add(mx.gluon.nn.Dense(16, in_units=10, activation="tanh"),
            mx.gluon.nn.Dense(16, in_units=16, activation="tanh"),
            mx.gluon.nn.Dense(3, in_units=16))
    net.initialize(mx.init.Xavier())
    net.cast(DTYPE)
    return net


def opt_args():
    if MODE == "adam":
        return "adam", {"learning_rate": 0.01}
    return "sgd", {"learning_rate": 0.1, "momentum": 0.9}


def flat(net):
    return np.concatenate([p.data().asnumpy().ravel()
                           for _, p in sorted(net.collect_params().items())])


def main():
    global MODE, DTYPE, TOL
    bps.init()
    for MODE in MODES:
        DTYPE = "float32" if MODE == "fp16" else "float64"
        TOL = 2e-3 if MODE == "fp16" else 1e-9
        train(bps.rank(), bps.size())
    bps.shutdown()


def train(rank, size):
    rng = np.random.default_rng(42)
    per_worker = 4
    X = rng.standard_normal((STEPS, per_worker * size, 10)).astype(DTYPE)
    Y = rng.integers(0, 3, (STEPS, per_worker * size)).astype(DTYPE)
    loss_fn = mx.gluon.loss.SoftmaxCrossEntropyLoss()

    ref = make_net(0)
    ref_trainer = mx.gluon.Trainer(ref.collect_params(), *opt_args(), kvstore=None)
    net = make_net(0 if rank == 0 else 100 + rank)  # the trainer broadcasts rank 0's weights
    if MODE == "optimizer":
        name, args = opt_args()
        opt = bps.DistributedOptimizer(mx.optimizer.create(name, **args))
        trainer = mx.gluon.Trainer(net.collect_params(), opt, kvstore=None)
        bps.broadcast_parameters(net.collect_params(), root_rank=0)
    else:
        comp = {"compressor": "fp16"} if MODE == "fp16" else None
        trainer = bps.DistributedTrainer(net.collect_params(), *opt_args(),
                                         compression_params=comp)
    shard = slice(rank * per_worker, (rank + 1) * per_worker)
    for step in range(STEPS):
        x, y = mx.nd.array(X[step], dtype=DTYPE), mx.nd.array(Y[step], dtype=DTYPE)
        with mx.autograd.record():
            loss = loss_fn(ref(x), y)
        loss.backward()
        ref_trainer.step(per_worker * size)
        with mx.autograd.record():
            loss = loss_fn(net(x[shard.start:shard.stop]), y[shard.start:shard.stop])
        loss.backward()
        trainer.step(per_worker)
        mine = flat(net)
        diff = float(np.abs(mine - flat(ref)).max())
        assert diff < TOL, f"step {step}: rank {rank} differs from the reference by {diff}"
        avg = mx.nd.array(mine, dtype=mine.dtype)
        bps.byteps_push_pull(avg, name=f"check.{MODE}", is_average=True)
        assert MODE == "fp16" or np.array_equal(avg.asnumpy(), mine), f"step {step}: workers differ"
    print(f"EQUIV OK {MODE} rank {rank} of {size}: {STEPS} steps, max diff {diff:.2e}", flush=True)


if __name__ == "__main__":
    main()
