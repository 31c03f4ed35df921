"""Worker: byteps_like.tensorflow conformance, all checks in one process (TF imports slowly).

Usage: tf_api.py; prints ``TF API OK <check>`` per check and ``TF API DONE``.
Checks: push_pull averages and sums (eager and tf.function), dtypes, gradients of push_pull,
broadcast from a non-zero root, broadcast_variables, DistributedGradientTape (eager and
tf.function, dense and IndexedSlices), fp16 compression, join() with uneven steps, and mismatch
errors.
"""
import os
import sys
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import byteps_like.tensorflow as bps  # noqa: E402
from byteps_like.errors import MismatchError, NotInitializedError  # noqa: E402


def expect(exc_type, fn, *needles):
    try:
        fn()
    except exc_type as exc:
        for n in needles:
            assert n in str(exc), f"{n!r} not in {exc}"
        return str(exc)
    raise AssertionError(f"{fn} did not raise {exc_type.__name__}")


def ok(check):
    print(f"TF API OK {check} rank {bps.rank()}", flush=True)


def push_pulls(rank, size):
    s = (size - 1) * size // 2
    for dt in (tf.float32, tf.float64, tf.float16, tf.bfloat16, tf.int32, tf.int64):
        x = tf.fill([1000], tf.cast(rank, dt))
        y = bps.push_pull(x, average=False, name=f"sum.{dt.name}")
        assert y.dtype == dt and y.shape == x.shape
        assert np.array_equal(tf.cast(y, tf.float64).numpy(), np.full(1000, float(s))), dt
        a = bps.push_pull(tf.fill([3, 4], tf.cast(2 * rank, dt)), name=f"avg.{dt.name}")
        assert np.array_equal(tf.cast(a, tf.float64).numpy(), np.full((3, 4), float(s))), dt
    ok("dtypes")
    # the default is average, in eager mode and inside tf.function
    x = tf.constant([rank, 10.0 * rank])
    assert np.allclose(bps.push_pull(x, name="eager").numpy(), [s / size, 10 * s / size])

    @tf.function
    def f(v):
        return bps.push_pull(v, name="graph") + bps.push_pull(v * 2, average=False)

    for _ in range(2):  # traced once, run twice: same keys
        assert np.allclose(f(x).numpy(), [s / size + 2 * s, 10 * s / size + 20 * s]), f(x)
    ok("average")
    # gradient of push_pull: d(sum over workers of x_w)/dx = size, eager and tf.function
    v = tf.Variable(tf.fill([5], float(rank)))

    def grad():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(bps.push_pull(v * 3.0, average=False, name="diff"))
        return tape.gradient(loss, v)

    assert np.array_equal(grad().numpy(), np.full(5, 3.0 * size)), grad()
    assert np.array_equal(tf.function(grad)().numpy(), np.full(5, 3.0 * size))
    ok("gradient")
    z = bps.push_pull(tf.fill([100], rank + 0.5), average=False, name="fp16",
                      compression=bps.Compression.fp16)
    assert z.dtype == tf.float32 and np.array_equal(z.numpy(), np.full(100, s + 0.5 * size))
    ok("fp16")
    # allgather: rank r contributes r + 1 rows, in rank order, eager and in tf.function
    for dt in (tf.float32, tf.bfloat16, tf.int64):
        mine = tf.cast(tf.fill([rank + 1, 2], rank + 1), dt)
        want = np.concatenate([np.full((q + 1, 2), q + 1) for q in range(size)])
        got = bps.allgather(mine, name=f"gather.{dt.name}")
        assert got.dtype == dt and np.array_equal(tf.cast(got, tf.float64).numpy(), want)
    got = tf.function(lambda: bps.allgather(tf.fill([rank + 1], 1.0 * rank), name="gfn"))()
    assert np.array_equal(got.numpy(), np.concatenate([np.full(q + 1, q) for q in range(size)]))
    ok("allgather")


def broadcasts(rank, size):
    root = 1
    x = tf.fill([4, 3], float(rank + 7))
    assert np.array_equal(bps.broadcast(x, root_rank=root, name="b").numpy(),
                          np.full((4, 3), root + 7.0))
    g = tf.function(lambda t: bps.broadcast(t, root_rank=root, name="bg"))
    assert np.array_equal(g(x).numpy(), np.full((4, 3), root + 7.0))
    flags = tf.constant([rank == root, rank != root])
    assert bps.broadcast(flags, root_rank=root, name="bool").numpy().tolist() == [True, False]
    tf.random.set_seed(rank)
    model = tf.keras.Sequential([tf.keras.Input((3,)), tf.keras.layers.Dense(4),
                                 tf.keras.layers.Dense(2)])
    step = tf.Variable(rank * 10, dtype=tf.int64)
    bps.broadcast_variables(model.variables + [step], root_rank=root)
    vals = [v.numpy() for v in model.variables]
    flat = np.concatenate([w.reshape(-1) for w in vals])
    assert np.array_equal(bps.push_pull(tf.constant(flat), name="check").numpy(), flat)
    assert step.numpy() == root * 10
    expect(ValueError, lambda: bps.broadcast(x, root_rank=size, name="bad"), "out of range")
    ok("broadcast")


def tapes(rank, size):
    tf.random.set_seed(0)
    w = tf.Variable(tf.random.normal([4, 3]), name="w")
    emb = tf.Variable(tf.random.normal([10, 3]), name="emb")
    xs = tf.constant(np.arange(size * 8, dtype=np.float32).reshape(size * 2, 4) / 10)
    ids = tf.constant([[1, 2], [3, 4], [5, 1], [7, 7]][:size * 2])

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
    # the context-manager form, a single source, compression
    with bps.DistributedGradientTape(tf.GradientTape(), compression=bps.Compression.fp16) as t:
        loss = tf.reduce_sum(w * float(rank))
    g1 = t.gradient(loss, w)
    assert np.allclose(g1.numpy(), np.full((4, 3), (size - 1) / 2)), g1
    ok("tape")


def joins(rank, size):
    """Uneven steps: rank r runs size - r gradient steps, then join(); a step's average is over
    the ranks still in, and join() returns the rank that joined last (rank 0)."""
    v = tf.Variable(tf.zeros([3]))
    for step in range(size - rank):
        with tf.GradientTape() as t:
            loss = tf.reduce_sum(v) * float(rank + 1)
        (g,) = bps.DistributedGradientTape(t).gradient(loss, [v])
        still_in = [q for q in range(size) if size - q > step]
        want = sum(q + 1 for q in still_in) / len(still_in)
        np.testing.assert_allclose(g.numpy(), np.full(3, want, np.float32))
    assert bps.join() == 0
    ok("join")


def errors(rank, size):
    expect(TypeError, lambda: bps.push_pull(tf.constant([True]), name="bool"), "bool")
    bps.push_pull(tf.zeros([3]), name="shape")
    expect(MismatchError, lambda: bps.push_pull(tf.zeros([4]), name="shape"), "shape")
    # a model that differs on the last rank: every rank raises, naming the groups of ranks
    vs = [tf.Variable(tf.zeros([2, 2]), name="a")]
    if rank == size - 1:
        vs.append(tf.Variable(tf.zeros([2]), name="b"))
    with tf.GradientTape() as t:
        loss = sum(tf.reduce_sum(v) for v in vs)
    msg = expect(MismatchError, lambda: bps.DistributedGradientTape(t).gradient(loss, vs),
                 "the model differs between workers")
    assert f"ranks [{size - 1}]" in msg, msg
    ok("errors")


def main():
    expect(NotInitializedError, lambda: bps.push_pull(tf.ones([1])), "init()")
    bps.init()
    rank, size = bps.rank(), bps.size()
    assert 0 <= bps.local_rank() < bps.local_size()
    push_pulls(rank, size)
    broadcasts(rank, size)
    tapes(rank, size)
    joins(rank, size)
    errors(rank, size)
    print(f"TF API DONE rank {rank}", flush=True)
    bps.shutdown()


if __name__ == "__main__":
    sys.exit(main())
