"""Conformance adapter: byteps_like.keras (Keras 3, TensorFlow backend), and its own checks
(EXTRAS):

  optimizer_dtypes  DistributedOptimizer averages float16 / float32 / float64 gradients exactly
                    and keeps each variable's dtype
  fit_eager         byteps_like.keras, run_eagerly=True, SGD with momentum: the weights after
                    fit on this worker's shards equal one process's fit on the whole batches
                    (float64, tolerance 1e-9), and every worker holds the same weights; rank 1
                    starts from other weights, so BroadcastGlobalVariablesCallback is checked
  fit_graph         the same through byteps_like.tensorflow.keras (tf.keras), compiled steps
                    (tf.function), Adam
  metric_average, lr_warmup, lr_schedule, broadcast_global_variables
                    the callbacks and broadcast_global_variables do what they say
  horovod_api       hvd.keras's collectives: allreduce of numbers, numpy arrays, tensors and
                    variables (dtype kept, in tf.function too), broadcast, barrier, and
                    byteps_like.tensorflow.keras is the same API (a re-export)

The common cases go through byteps_like.keras.allreduce / allgather (Horovod's API: numpy in,
tensors out, the dtype kept); byteps_like.keras.push_pull (metrics: float64 numbers and arrays)
is checked by metric_average and horovod_api.
"""
from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf
from case_common import NumpyTensors

import byteps_like.keras as bps
import byteps_like.tensorflow.keras as tfbps


class Adapter(NumpyTensors):
    name = "keras"
    bps = bps
    dtypes = ["float32", "float64", "float16", "int32", "int64"]
    broadcast_dtypes = ["float32", "int64"]
    gather_dtypes = ["float32", "float64", "int32", "int64"]

    EXTRA_CASES = ("optimizer_dtypes", "fit_eager", "fit_graph", "metric_average", "lr_warmup",
                   "lr_schedule", "broadcast_global_variables", "horovod_api")

    # names of their own: byteps_like.tensorflow's adapter runs the same cases in this process
    def push_pull(self, t, name: str, average: bool | None):
        if average is None:
            return bps.allreduce(t, name=f"keras.{name}")
        return bps.allreduce(t, name=f"keras.{name}", average=average)

    def push_pull_fp16(self, t, name: str):
        """Through DistributedOptimizer(SGD(1.0), compression=fp16) on a zero variable: it
        ends at minus the average; times size, the sum."""
        v = keras.Variable(np.zeros_like(t), name=name)
        opt = bps.DistributedOptimizer(keras.optimizers.SGD(1.0), name=f"fp16_{name}",
                                       compression=bps.Compression.fp16)
        opt.apply([tf.constant(t)], [v])
        return -v.numpy() * bps.size()

    def broadcast(self, t, root: int, name: str):
        v = keras.Variable(t, dtype=t.dtype.name, name=name)
        bps.broadcast_global_variables(root, variables=[v])
        return v.numpy()

    def allgather(self, t, name: str):
        return bps.allgather(t, name=f"keras.{name}")

    def gradients(self):
        """4 Dense layers; DistributedOptimizer.apply queues every gradient, then waits."""
        from byteps_like.tensorflow.ops import var_name
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((64,))]
                                 + [keras.layers.Dense(64) for _ in range(4)])
        opt = bps.DistributedOptimizer(keras.optimizers.SGD(0.1), name="wire")
        variables = model.trainable_variables
        x = tf.ones([8, 64])

        def start():
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(model(x))
            opt.apply(tape.gradient(loss, variables), variables)
        return ([f"{opt._bps_prefix}{var_name(v, i)}" for i, v in enumerate(variables)],
                start, None)


# -- Keras's own API ----------------------------------------------------------------------------
def optimizer_dtypes(rank, size):
    s = (size - 1) * size // 2
    for dt in ("float16", "float32", "float64"):
        v = keras.Variable(np.zeros(8, dt), dtype=dt, name=f"dt_{dt}")
        opt = bps.DistributedOptimizer(keras.optimizers.SGD(1.0), name=f"dt_{dt}")
        opt.apply([tf.constant(np.full(8, rank * size, dt))], [v])
        assert v.dtype == dt, (dt, v.dtype)
        assert np.array_equal(v.numpy(), np.full(8, -float(s), dt)), (dt, v.numpy())


def float64(fn):
    """``fn`` with float64 layers (the global dtype policy is fixed by the first layer made
    unless set: set it too)."""
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    try:
        fn()
    finally:
        keras.config.set_floatx("float32")
        keras.config.set_dtype_policy("float32")


def fit_eager(rank, size):
    float64(lambda: equivalence("eager", keras, bps,
                                lambda: keras.optimizers.SGD(0.1, momentum=0.9), True))


def fit_graph(rank, size):
    float64(lambda: equivalence("graph", tf.keras, tfbps,
                                lambda: tf.keras.optimizers.Adam(0.01), False))


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
    print(f"KERAS fit {check} rank {rank}: max diff {diff:.1e} (tolerance {TOL})", flush=True)


class Recorder(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.epochs, self.lrs = [], []

    def on_train_batch_begin(self, batch, logs=None):
        self.lrs.append(float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)))

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append(dict(logs or {}))


def _fit(*cbs, epochs=3):
    rank, size = bps.rank(), bps.size()
    x, y = data(size)
    model = make_model(keras)
    model.compile(optimizer=bps.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    model.fit(shard(x, rank, size), shard(y, rank, size), batch_size=PER, epochs=epochs,
              shuffle=False, verbose=0, callbacks=list(cbs))
    return model


def metric_average(rank, size):
    """Before the callback each rank has its own metrics, after it all have the average."""
    before, after = Recorder(), Recorder()
    _fit(before, bps.callbacks.MetricAverageCallback(), after, epochs=2)
    for b, a in zip(before.epochs, after.epochs):
        assert set(a) >= {"loss", "accuracy"}, a
        for key in ("loss", "accuracy"):
            want = bps.push_pull(b[key], name=f"m.{key}")
            assert abs(a[key] - want) < 1e-12, (key, a[key], want)
            assert bps.push_pull(a[key], name=f"m2.{key}") == a[key]
        assert before.epochs[0]["loss"] != a["loss"] or size == 1


def lr_warmup(rank, size):
    """Batch by batch from lr/size to lr over 2 epochs, then unchanged."""
    spe = STEPS
    rec = Recorder()
    _fit(bps.callbacks.LearningRateWarmupCallback(0.1, warmup_epochs=2), rec)
    want = [0.1 / size * ((e + b / spe + 1 / spe) * (size - 1) / 2 + 1)
            for e in range(2) for b in range(spe)]
    want += [want[-1]] * spe
    assert np.allclose(rec.lrs, want, rtol=1e-6), (rec.lrs, want)
    assert abs(want[-1] - 0.1) < 1e-12


def lr_schedule(rank, size):
    """From epoch 1, lr = 0.2 * 0.5**epoch, at each epoch's first batch."""
    spe = STEPS
    rec = Recorder()
    _fit(bps.callbacks.LearningRateScheduleCallback(0.2, lambda e: 0.5 ** e, start_epoch=1), rec)
    want = [0.1] * spe + [0.1] * spe + [0.05] * spe
    assert np.allclose(rec.lrs, want, rtol=1e-6), (rec.lrs, want)
    assert np.allclose([e["lr"] for e in rec.epochs], [0.1, 0.1, 0.05]), rec.epochs


def broadcast_global_variables(rank, size):
    """The root's weights everywhere."""
    model = make_model(keras)
    model.set_weights([w + rank for w in model.get_weights()])
    bps.broadcast_global_variables(1, model=model)
    assert np.allclose(flat(model), flat(make_model(keras)) + 1)


def horovod_api(rank, size):
    """allreduce / broadcast / barrier as hvd.keras has them; tensorflow.keras re-exports."""
    s = (size - 1) * size // 2
    got = bps.allreduce(float(rank), name="api.float")   # a Python float: floatx
    assert got.dtype == "float32" and float(got) == s / size, got
    got = bps.allreduce(np.full((2, 3), rank, np.int64), name="api.int", average=False)
    assert got.dtype == "int64" and np.array_equal(got.numpy(), np.full((2, 3), s)), got
    v = keras.Variable(np.full(4, rank + 1.0), dtype="float64", name="api_var")
    got = bps.allreduce(v, name="api.var")
    assert got.dtype == "float64" and np.allclose(got.numpy(), (s + size) / size), got
    fn = tf.function(lambda t: bps.allreduce(t, name="api.graph", average=False) * 2)
    for _ in range(2):   # traced once, one name
        assert np.array_equal(fn(tf.fill([3], float(rank))).numpy(), np.full(3, 2.0 * s))
    got = bps.broadcast(np.full(3, rank + 7, np.int32), root_rank=size - 1, name="api.bcast")
    assert got.dtype == "int32" and np.array_equal(got.numpy(), np.full(3, size + 6)), got
    assert bps.push_pull(float(rank), name="api.metric") == s / size
    bps.barrier()
    for name in bps.__all__:   # one implementation, two names
        assert getattr(tfbps, name) is getattr(bps, name) or name == "callbacks", name
    for name in bps.callbacks.__all__:
        assert getattr(tfbps.callbacks, name) is getattr(bps.callbacks, name), name
    assert callable(bps.load_model) and tfbps.load_model is bps.load_model
