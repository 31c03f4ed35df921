"""Train a small TensorFlow 2 model with a custom ``tf.function`` training step and
``bps.DistributedGradientTape`` on scikit-learn's handwritten-digits dataset (shipped inside
scikit-learn: no download), data-parallel over every worker of a byteps_like job.

    bpslaunch --local --workers 2 --servers 1 -- python examples/tensorflow/train_digits.py
    python examples/tensorflow/train_digits.py     # no launcher: one process, size() == 1

Every epoch ``bps.epoch_dataset`` deals the whole training set anew over the workers, the same
deal on every worker, each taking its slice (with backup workers, ``BYTEPS_BACKUP_WORKERS=b``,
an epoch is counted in the samples the rounds average, so every sample still reaches the model:
docs/reliability.md, "Backup workers"). ``--fixed-shards`` gives each worker the fixed shard
``data[rank::size]`` instead.

Rank 0 prints ``final test accuracy: 0.XXXX (N workers, S steps)``.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import byteps_like.tensorflow as bps  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # examples/: digits_data
import digits_data  # noqa: E402
from digits_data import add_backup_options, load_data, parser, print_final  # noqa: E402


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--momentum", type=float, default=0.9,
                   help="SGD momentum; 0 when BYTEPS_COMPRESSOR_MOMENTUM applies it before "
                        "compression instead (docs/compression.md)")
    p.add_argument("--cosine", action="store_true",
                   help="decay the learning rate to 0 along a cosine over the run")
    p.add_argument("--deterministic", action="store_true",
                   help="deterministic TF ops on one thread: the same run gives the same result")
    p.add_argument("--seed", type=int, default=1000)
    add_backup_options(p, "bps.epoch_dataset")
    args = p.parse_args()
    if args.deterministic:
        tf.config.experimental.enable_op_determinism()
        tf.config.threading.set_inter_op_parallelism_threads(1)
        tf.config.threading.set_intra_op_parallelism_threads(1)
    bps.init()
    rank, size = bps.rank(), bps.size()
    x_train, y_train, x_test, y_test = load_data()
    if args.fixed_shards:
        # a fixed shard: right while every push makes every round, not with backup workers
        shard = (tf.data.Dataset.from_tensor_slices((x_train[rank::size], y_train[rank::size]))
                 .batch(args.batch_size, drop_remainder=True))
        n_mine = len(x_train) // size
    else:   # every worker's samples an epoch (the same number on every worker)
        n_mine = len(bps.epoch_indices(len(x_train), 0, seed=args.seed))

    def epoch_data(epoch: int) -> tf.data.Dataset:
        if args.fixed_shards:
            return shard
        # a new deal of the whole training set every epoch, the same on every worker; with
        # backup workers each worker's part grows to size / (size - b) of its share
        return (bps.epoch_dataset((x_train, y_train), epoch, seed=args.seed)
                .batch(args.batch_size, drop_remainder=True))

    tf.random.set_seed(args.seed + rank)   # different on purpose: the broadcast fixes it
    model = tf.keras.Sequential([tf.keras.Input((64,)),
                                 tf.keras.layers.Dense(64, activation="relu"),
                                 tf.keras.layers.Dense(64, activation="relu"),
                                 tf.keras.layers.Dense(10)])
    lr = args.lr * size
    if args.cosine:
        lr = tf.keras.optimizers.schedules.CosineDecay(
            lr, decay_steps=args.epochs * (n_mine // args.batch_size))
    opt = tf.keras.optimizers.SGD(lr, momentum=args.momentum)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = bps.DistributedGradientTape(tape)   # averaged across workers
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    bps.broadcast_variables(model.variables, root_rank=0)
    slow = digits_data.straggler_delay(args.straggler, rank)
    steps = 0
    for epoch in range(args.epochs):
        for x, y in epoch_data(epoch):
            t_step = time.perf_counter()
            loss = train_step(x, y)
            steps += 1
            if slow:  # --straggler: this worker's steps take FACTOR times as long
                time.sleep(slow * (time.perf_counter() - t_step))
        if rank == 0:
            print(f"epoch {epoch + 1}: loss {float(loss):.4f}", flush=True)
    acc = float(np.mean(np.argmax(model(x_test).numpy(), 1) == y_test))
    if rank == 0:
        print_final(acc, size, steps)
    bps.shutdown()


if __name__ == "__main__":
    main()
