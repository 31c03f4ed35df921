"""Train a small Keras MLP with ``model.fit`` on scikit-learn's handwritten-digits dataset
(shipped inside scikit-learn: no download), data-parallel over every worker of a byteps_like job.

    bpslaunch --local --workers 2 --servers 1 -- python examples/keras/train_digits.py
    python examples/keras/train_digits.py          # no launcher: one process, size() == 1
    python examples/keras/train_digits.py --tf-keras   # the same through tf.keras

The BytePS/Horovod Keras recipe: each worker fits its part of the data
(``bps.DistributedPyDataset``: every epoch a new deal of the whole training set, the same on
every worker, each taking its slice; with backup workers, ``BYTEPS_BACKUP_WORKERS=b``, an epoch
is counted in the samples the rounds average: docs/reliability.md, "Backup workers";
``--fixed-shards`` fits each worker's fixed shard ``data[rank::size]`` instead); the optimizer is
wrapped in
``bps.DistributedOptimizer`` (gradients averaged before every update, also inside the compiled
step); the learning rate is scaled by ``size()`` and warmed up; rank 0's initial weights are
broadcast at the start and the epoch metrics averaged over the workers. Rank 0 prints
``final test accuracy: 0.XXXX (N workers)``.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # examples/: digits_data
from digits_data import add_backup_options, load_data, parser  # noqa: E402


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--warmup-epochs", type=int, default=2)
    p.add_argument("--tf-keras", action="store_true",
                   help="use tf.keras and byteps_like.tensorflow.keras")
    p.add_argument("--seed", type=int, default=1)
    add_backup_options(p, "bps.DistributedPyDataset", straggler=False)
    args = p.parse_args()
    if args.tf_keras:
        import tensorflow as tf
        keras = tf.keras
        import byteps_like.tensorflow.keras as bps
    else:
        import keras

        import byteps_like.keras as bps
    bps.init()
    rank, size = bps.rank(), bps.size()
    x_train, y_train, x_test, y_test = load_data()
    if args.fixed_shards:
        # a fixed shard: right while every push makes every round, not with backup workers
        data = {"x": x_train[rank::size], "y": y_train[rank::size],
                "batch_size": args.batch_size}
    else:
        # a new deal of the whole training set every epoch, the same on every worker; with
        # backup workers each worker's part grows to size / (size - b) of its share
        data = {"x": bps.DistributedPyDataset(x_train, y_train, args.batch_size,
                                              seed=args.seed)}
    keras.utils.set_random_seed(1000 + rank)   # different on purpose: the broadcast fixes it
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])
    lr = args.lr * size
    opt = bps.DistributedOptimizer(keras.optimizers.SGD(lr, momentum=0.9))
    model.compile(optimizer=opt, metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    callbacks = [bps.callbacks.BroadcastGlobalVariablesCallback(0),
                 bps.callbacks.MetricAverageCallback(),
                 bps.callbacks.LearningRateWarmupCallback(lr, warmup_epochs=args.warmup_epochs,
                                                          verbose=1)]
    model.fit(**data, epochs=args.epochs, callbacks=callbacks, verbose=2 if rank == 0 else 0)
    _, acc = model.evaluate(x_test, y_test, verbose=0)
    if rank == 0:
        print(f"final test accuracy: {acc:.4f} ({size} workers)", flush=True)
    bps.shutdown()


if __name__ == "__main__":
    main()
