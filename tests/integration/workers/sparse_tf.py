"""Worker: a tf.Variable table's IndexedSlices gradient through DistributedGradientTape with
sparse_as_dense=False travels as rows (no densify warning, an IndexedSlices comes back) and
equals the average of every worker's dense gradient; applied by a Keras SGD it keeps every
worker's table equal to a one-process reference. Eager and in tf.function; then the same
through the Keras DistributedOptimizer(sparse_as_dense=False) on local gradients; rows over
the allgather's bound stop every worker.
Prints ``OK rank R of N: rows`` on success."""
import warnings

import numpy as np
import tensorflow as tf

import byteps_like.tensorflow as bps

ROWS, DIM, LR = 1000, 4, 0.5


def ids_of(rank: int, step: int) -> np.ndarray:
    rng = np.random.default_rng([rank, step])
    return np.minimum(rng.zipf(1.5, 40), ROWS) - 1   # repeats within the batch, overlaps


def local_grad(table: np.ndarray, ids: np.ndarray) -> np.ndarray:
    g = np.zeros_like(table)
    np.add.at(g, ids, 2 * table[ids])
    return g


def main():
    bps.init()
    rank, size = bps.rank(), bps.size()
    start = np.arange(ROWS * DIM, dtype=np.float32).reshape(ROWS, DIM) / 1000
    for mode in ("eager", "function"):
        emb = tf.Variable(start)
        ref = start.copy()
        opt = tf.keras.optimizers.SGD(LR)

        def grad_of(ids, emb=emb):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.gather(emb, ids) ** 2)
            tape = bps.DistributedGradientTape(tape, sparse_as_dense=False,
                                               prefix=f"{mode}.")
            return tape.gradient(loss, [emb])[0]
        fn = grad_of if mode == "eager" else tf.function(grad_of)
        for step in range(3):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                g = fn(tf.constant(ids_of(rank, step)))
            assert isinstance(g, tf.IndexedSlices), type(g)
            assert not any("IndexedSlices" in str(c.message) for c in caught)
            assert len(g.indices) <= sum(len(np.unique(ids_of(r, step))) for r in range(size))
            want = sum(local_grad(ref, ids_of(r, step)) for r in range(size)) / size
            np.testing.assert_allclose(tf.convert_to_tensor(g).numpy(), want, rtol=1e-6,
                                       atol=1e-7)
            opt.apply_gradients([(g, emb)])
            ref -= LR * want
            np.testing.assert_allclose(emb.numpy(), ref, rtol=1e-6, atol=1e-6)
    # the Keras DistributedOptimizer averages the local IndexedSlices as rows
    emb = tf.Variable(start)
    ref = start.copy()
    opt = bps.DistributedOptimizer(tf.keras.optimizers.SGD(LR), sparse_as_dense=False)
    for step in range(3):
        ids = tf.constant(ids_of(rank, step))
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.gather(emb, ids) ** 2)
        g = tape.gradient(loss, [emb])[0]
        assert isinstance(g, tf.IndexedSlices), type(g)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.apply_gradients([(g, emb)])
        assert not any("IndexedSlices" in str(c.message) for c in caught)
        ref -= LR * sum(local_grad(ref, ids_of(r, step)) for r in range(size)) / size
        np.testing.assert_allclose(emb.numpy(), ref, rtol=1e-6, atol=1e-6)
    # a server-held table: bps.SparseEmbedding, in tf.function
    layer = bps.SparseEmbedding(ROWS, DIM, table="layer", init="uniform", seed=3, lr=LR)
    ref = layer.table.pull(np.arange(ROWS))

    @tf.function
    def train(ids):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(layer(ids) ** 2)
        return tape.gradient(loss, layer.trainable_variables)
    for step in range(3):
        (g,) = train(tf.constant(ids_of(rank, step).reshape(4, 10)))
        assert float(g) == 0.0   # the anchor's
        ref -= LR * sum(local_grad(ref, ids_of(r, step)) for r in range(size)) / size
    np.testing.assert_allclose(layer.table.pull(np.arange(ROWS)), ref, rtol=1e-6, atol=1e-6)
    assert layer(tf.constant([[1, 2]])).shape == (1, 2, DIM)   # no tape: reads only
    # and in a Keras model trained by fit (jit_compile=False: XLA cannot compile the pull)
    inp = tf.keras.Input((3,), dtype="int64")
    fit_layer = bps.SparseEmbedding(ROWS, DIM, table="fit", lr=0.1)
    model = tf.keras.Model(inp, tf.keras.layers.Dense(1)(tf.keras.layers.Flatten()(
        fit_layer(inp))))
    model.compile(optimizer=bps.DistributedOptimizer(tf.keras.optimizers.SGD(0.1)), loss="mse",
                  jit_compile=False)
    bps.broadcast_variables(model.variables, root_rank=0)
    before = fit_layer.table.pull(np.arange(ROWS))
    x = np.random.default_rng(rank).integers(0, ROWS, (64, 3))
    model.fit(x, np.ones((64, 1), np.float32), batch_size=16, epochs=1, verbose=0)
    assert fit_layer.table.step == 4
    assert not np.array_equal(fit_layer.table.pull(np.arange(ROWS)), before)
    # bounded: a worker with more unique rows than the bound stops every worker, naming it
    from byteps_like.tensorflow.ops import push_pull_rows
    n = 100 + rank                                       # 128 rows once padded
    big = tf.IndexedSlices(tf.ones([n, DIM]), tf.range(n, dtype=tf.int64),
                           tf.constant([ROWS, DIM], tf.int64))
    try:
        push_pull_rows(big, "bounded", max_rows=64)
        raise AssertionError("push_pull_rows over its bound did not raise")
    except ValueError as exc:
        assert (f"worker rank(s) {list(range(size))} bring {[128] * size} rows, more than 64 "
                "(max_rows); nothing was gathered") in str(exc), exc
    print(f"OK rank {rank} of {size}: rows", flush=True)
    bps.shutdown()


if __name__ == "__main__":
    main()
