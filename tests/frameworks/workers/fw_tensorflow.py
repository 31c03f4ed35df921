"""Conformance adapter: byteps_like.tensorflow (eager), and its own checks (EXTRAS):
tf.function, gradients of push_pull, broadcast_variables, DistributedGradientTape (dense and
IndexedSlices, eager and tf.function; its equivalence with one process on the whole batch),
join through the tape, a model that differs between ranks."""
from __future__ import annotations

import warnings

import numpy as np
import tensorflow as tf
from case_common import AdapterBase

import byteps_like.tensorflow as bps
from byteps_like.errors import MismatchError
from tests.support import expect


class Adapter(AdapterBase):
    name = "tensorflow"
    bps = bps
    dtypes = ["float32", "float64", "float16", "bfloat16", "int32", "int64"]
    broadcast_dtypes = ["float32", "bfloat16", "int64"]
    gather_dtypes = ["float32", "bfloat16", "int64"]

    EXTRA_CASES = ("tf_function", "gradient", "broadcast_variables", "tape", "tape_join",
                   "model_differs")

    def tensor(self, values, dtype: str):
        return tf.cast(tf.constant(np.asarray(values, np.float64)), dtype)

    def numpy(self, t) -> np.ndarray:
        return tf.cast(t, tf.float64).numpy()

    def dtype_name(self, t) -> str:
        return t.dtype.name

    def push_pull(self, t, name: str, average: bool | None):
        y = (bps.push_pull(t, name=name) if average is None
             else bps.push_pull(t, average=average, name=name))
        assert y.shape == t.shape, (y.shape, t.shape)
        return y

    def push_pull_fp16(self, t, name: str):
        return bps.push_pull(t, average=False, name=name, compression=bps.Compression.fp16)

    def broadcast(self, t, root: int, name: str):
        return bps.broadcast(t, root_rank=root, name=name)

    def allgather(self, t, name: str):
        return bps.allgather(t, name=name)

    def gradients(self):
        """4 Dense layers; DistributedGradientTape.gradient queues every gradient, then waits."""
        from byteps_like.tensorflow.ops import var_name
        tf.random.set_seed(0)
        model = tf.keras.Sequential([tf.keras.Input((64,))]
                                    + [tf.keras.layers.Dense(64) for _ in range(4)])
        variables = model.trainable_variables
        x = tf.ones([8, 64])

        def start():
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(model(x))
            bps.DistributedGradientTape(tape).gradient(loss, variables)
        return ([f"DistributedGradientTape.{var_name(v, i)}" for i, v in enumerate(variables)],
                start, None)


# -- TensorFlow's own API -----------------------------------------------------------------------
def tf_function(rank, size):
    """push_pull (the default is average), allgather and broadcast inside tf.function, traced
    once and run twice (the same keys)."""
    assert 0 <= bps.local_rank() < bps.local_size()
    s = (size - 1) * size // 2
    x = tf.constant([rank, 10.0 * rank])
    assert np.allclose(bps.push_pull(x, name="eager").numpy(), [s / size, 10 * s / size])

    @tf.function
    def f(v):
        return bps.push_pull(v, name="graph") + bps.push_pull(v * 2, average=False)

    for _ in range(2):
        assert np.allclose(f(x).numpy(), [s / size + 2 * s, 10 * s / size + 20 * s]), f(x)
    got = tf.function(lambda: bps.allgather(tf.fill([rank + 1], 1.0 * rank), name="gfn"))()
    assert np.array_equal(got.numpy(), np.concatenate([np.full(q + 1, q) for q in range(size)]))
    root = 1
    g = tf.function(lambda t: bps.broadcast(t, root_rank=root, name="bg"))
    assert np.array_equal(g(tf.fill([4, 3], float(rank + 7))).numpy(),
                          np.full((4, 3), root + 7.0))


def gradient(rank, size):
    """d(sum over workers of 3 x_w)/dx = 3 size, eager and in tf.function."""
    v = tf.Variable(tf.fill([5], float(rank)))

    def grad():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(bps.push_pull(v * 3.0, average=False, name="diff"))
        return tape.gradient(loss, v)

    assert np.array_equal(grad().numpy(), np.full(5, 3.0 * size)), grad()
    assert np.array_equal(tf.function(grad)().numpy(), np.full(5, 3.0 * size))


def broadcast_variables(rank, size):
    root = 1
    flags = tf.constant([rank == root, rank != root])
    assert bps.broadcast(flags, root_rank=root, name="bool").numpy().tolist() == [True, False]
    tf.random.set_seed(rank)
    model = tf.keras.Sequential([tf.keras.Input((3,)), tf.keras.layers.Dense(4),
                                 tf.keras.layers.Dense(2)])
    step = tf.Variable(rank * 10, dtype=tf.int64)
    bps.broadcast_variables(model.variables + [step], root_rank=root)
    flat = np.concatenate([v.numpy().reshape(-1) for v in model.variables])
    assert np.array_equal(bps.push_pull(tf.constant(flat), name="check").numpy(), flat)
    assert step.numpy() == root * 10
    x = tf.fill([4, 3], 1.0)
    expect(ValueError, lambda: bps.broadcast(x, root_rank=size, name="bad"), "out of range")
    expect(TypeError, lambda: bps.push_pull(tf.constant([True]), name="bool"), "bool")


def tape(rank, size):
    """DistributedGradientTape: each worker's shard gives the gradient of one process on the
    whole batch (a dense gradient and an IndexedSlices one, with a warning), eager and in
    tf.function; the context-manager form with one source and fp16 compression."""
    tf.random.set_seed(0)
    w = tf.Variable(tf.random.normal([4, 3]), name="w")
    emb = tf.Variable(tf.random.normal([10, 3]), name="emb")
    xs = tf.constant(np.arange(size * 8, dtype=np.float32).reshape(size * 2, 4) / 10)
    ids = tf.constant(([[1, 2], [3, 4], [5, 1], [7, 7]] * size)[:size * 2])

    def loss_on(x, i):
        return tf.reduce_sum(tf.matmul(x, w) ** 2) + tf.reduce_sum(tf.gather(emb, i) ** 3)

    with tf.GradientTape() as t:  # the whole batch, one process
        full = loss_on(xs, ids) / size
    want = [tf.convert_to_tensor(g).numpy() for g in t.gradient(full, [w, emb])]
    mine = slice(2 * rank, 2 * rank + 2)

    def dist_grads():
        with tf.GradientTape() as t:
            loss = loss_on(xs[mine], ids[mine])
        return bps.DistributedGradientTape(t).gradient(loss, [w, emb])

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = dist_grads()
    assert any("IndexedSlices" in str(c.message) for c in caught), [str(c.message) for c in caught]
    for g, e in zip(got, want):
        assert np.allclose(g.numpy(), e, rtol=1e-5, atol=1e-5), (g, e)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = tf.function(dist_grads)()
    for g, e in zip(got, want):
        assert np.allclose(g.numpy(), e, rtol=1e-5, atol=1e-5), (g, e)
    with bps.DistributedGradientTape(tf.GradientTape(), compression=bps.Compression.fp16) as t:
        loss = tf.reduce_sum(w * float(rank))
    g1 = t.gradient(loss, w)
    assert np.allclose(g1.numpy(), np.full((4, 3), (size - 1) / 2)), g1


def tape_join(rank, size):
    """Uneven steps through the tape: rank r runs size - r steps, then join(); a step's
    average is over the ranks still in; join() returns 0 (rank 0 joins last)."""
    v = tf.Variable(tf.zeros([3]), name="joined")
    for step in range(size - rank):
        with tf.GradientTape() as t:
            loss = tf.reduce_sum(v) * float(rank + 1)
        (g,) = bps.DistributedGradientTape(t).gradient(loss, [v])
        still_in = [q for q in range(size) if size - q > step]
        want = sum(q + 1 for q in still_in) / len(still_in)
        np.testing.assert_allclose(g.numpy(), np.full(3, want, np.float32))
    assert bps.join() == 0


def model_differs(rank, size):
    """A model that differs on the last rank: every rank raises, naming the groups of ranks."""
    vs = [tf.Variable(tf.zeros([2, 2]), name="a")]
    if rank == size - 1:
        vs.append(tf.Variable(tf.zeros([2]), name="b"))
    with tf.GradientTape() as t:
        loss = sum(tf.reduce_sum(v) for v in vs)
    msg = expect(MismatchError, lambda: bps.DistributedGradientTape(t).gradient(loss, vs),
                 "the model differs between workers")
    assert f"ranks [{size - 1}]" in msg, msg
