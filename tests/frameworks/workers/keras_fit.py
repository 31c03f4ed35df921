"""Worker: Keras model.fit with byteps_like.keras / byteps_like.tensorflow.keras.

Usage: keras_fit.py; prints ``KERAS OK <check>`` per check and ``KERAS DONE``.
  eager      byteps_like.keras, run_eagerly=True, SGD with momentum: the weights after fit on
             this worker's shards equal one process's fit on the whole batches (float64,
             tolerance 1e-9), and every worker holds the same weights
  graph      the same through byteps_like.tensorflow.keras (tf.keras), compiled steps
             (tf.function), Adam
  callbacks  BroadcastGlobalVariablesCallback, MetricAverageCallback,
             LearningRateWarmupCallback and LearningRateScheduleCallback do what they say
"""
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import byteps_like.keras as bps  # noqa: E402
import byteps_like.tensorflow.keras as tfbps  # noqa: E402

TOL = 1e-9
PER, STEPS, EPOCHS = 4, 3, 2


def make_model(k):
    k.utils.set_random_seed(0)
    return k.Sequential([k.Input((6,)), k.layers.Dense(8, activation="tanh"),
                         k.layers.Dense(3)])


def data(size):
    rng = np.random.default_rng(42)
    n = PER * size * STEPS
    return rng.normal(size=(n, 6)), rng.integers(0, 3, n)


def shard(a, rank, size):
    b = PER * size  # global batch k holds rows [k*b, (k+1)*b); this worker the rank-th part
    idx = [k * b + rank * PER + j for k in range(STEPS) for j in range(PER)]
    return a[idx]


def flat(model):
    return np.concatenate([np.asarray(w).reshape(-1) for w in model.get_weights()])


def equivalence(check, k, plugin, make_opt, run_eagerly):
    rank, size = bps.rank(), bps.size()
    x, y = data(size)
    loss = k.losses.SparseCategoricalCrossentropy(from_logits=True)
    ref = make_model(k)
    ref.compile(optimizer=make_opt(), loss=loss, run_eagerly=run_eagerly)
    ref.fit(x, y, batch_size=PER * size, epochs=EPOCHS, shuffle=False, verbose=0)
    model = make_model(k)
    if rank != 0:  # the broadcast callback must undo this
        model.set_weights([w + 1.0 for w in model.get_weights()])
    model.compile(optimizer=plugin.DistributedOptimizer(make_opt()), loss=loss,
                  run_eagerly=run_eagerly)
    model.fit(shard(x, rank, size), shard(y, rank, size), batch_size=PER, epochs=EPOCHS,
              shuffle=False, verbose=0,
              callbacks=[plugin.callbacks.BroadcastGlobalVariablesCallback(0)])
    mine, want = flat(model), flat(ref)
    diff = np.abs(mine - want).max()
    assert diff < TOL, f"{check}: rank {rank} differs from one process by {diff}"
    assert np.array_equal(bps.push_pull(mine, name=f"check.{check}"), mine), "workers differ"
    print(f"KERAS OK {check} rank {rank}: max diff {diff:.1e} (tolerance {TOL})", flush=True)


class Recorder(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.epochs, self.lrs = [], []

    def on_train_batch_begin(self, batch, logs=None):
        self.lrs.append(float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)))

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append(dict(logs or {}))


def callbacks():
    rank, size = bps.rank(), bps.size()
    x, y = data(size)
    xs, ys = shard(x, rank, size), shard(y, rank, size)
    spe = STEPS

    def fit(*cbs, epochs=3):
        model = make_model(keras)
        model.compile(optimizer=bps.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
        model.fit(xs, ys, batch_size=PER, epochs=epochs, shuffle=False, verbose=0,
                  callbacks=list(cbs))
        return model

    # metrics: before the callback each rank has its own, after it all have the average
    before, after = Recorder(), Recorder()
    fit(before, bps.callbacks.MetricAverageCallback(), after, epochs=2)
    for b, a in zip(before.epochs, after.epochs):
        assert set(a) >= {"loss", "accuracy"}, a
        for key in ("loss", "accuracy"):
            want = bps.push_pull(b[key], name=f"m.{key}")
            assert abs(a[key] - want) < 1e-12, (key, a[key], want)
            assert bps.push_pull(a[key], name=f"m2.{key}") == a[key]
        assert before.epochs[0]["loss"] != a["loss"] or size == 1
    print(f"KERAS OK metric_average rank {rank}", flush=True)
    # warmup: batch by batch from lr/size to lr over 2 epochs, then unchanged
    rec = Recorder()
    fit(bps.callbacks.LearningRateWarmupCallback(0.1, warmup_epochs=2), rec)
    want = [0.1 / size * ((e + b / spe + 1 / spe) * (size - 1) / 2 + 1)
            for e in range(2) for b in range(spe)]
    want += [want[-1]] * spe
    assert np.allclose(rec.lrs, want, rtol=1e-6), (rec.lrs, want)
    assert abs(want[-1] - 0.1) < 1e-12
    print(f"KERAS OK lr_warmup rank {rank}", flush=True)
    # schedule: from epoch 1, lr = 0.2 * 0.5**epoch, at each epoch's first batch
    rec = Recorder()
    fit(bps.callbacks.LearningRateScheduleCallback(0.2, lambda e: 0.5 ** e, start_epoch=1), rec)
    want = [0.1] * spe + [0.1] * spe + [0.05] * spe
    assert np.allclose(rec.lrs, want, rtol=1e-6), (rec.lrs, want)
    assert np.allclose([e["lr"] for e in rec.epochs], [0.1, 0.1, 0.05]), rec.epochs
    print(f"KERAS OK lr_schedule rank {rank}", flush=True)
    # broadcast_global_variables: the root's weights everywhere
    model = make_model(keras)
    model.set_weights([w + rank for w in model.get_weights()])
    bps.broadcast_global_variables(1, model=model)
    assert np.allclose(flat(model), flat(make_model(keras)) + 1)
    print(f"KERAS OK broadcast_global_variables rank {rank}", flush=True)


def main():
    bps.init()
    keras.config.set_floatx("float64")
    equivalence("eager", keras, bps, lambda: keras.optimizers.SGD(0.1, momentum=0.9), True)
    equivalence("graph", tf.keras, tfbps, lambda: tf.keras.optimizers.Adam(0.01), False)
    keras.config.set_floatx("float32")
    callbacks()
    print(f"KERAS DONE rank {bps.rank()}", flush=True)
    bps.shutdown()


if __name__ == "__main__":
    sys.exit(main())
