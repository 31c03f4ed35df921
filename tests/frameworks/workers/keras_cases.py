"""Worker: byteps_like.keras beyond the conformance suite (tests/frameworks/test_keras.py).

Usage: keras_cases.py DIR CASE [CASE ...]; each case prints ``CASE keras <case> OK rank <r>``
(or ``FAIL`` with its traceback, and the process ends: bpslaunch stops the job).

  save          fit 2 steps with DistributedOptimizer(SGD with momentum), rank 0 saves
                DIR/m.keras and DIR/weights.npz (the weights and the optimizer's iterations)
  load          byteps_like.keras.load_model(DIR/m.keras): the weights and the optimizer's
                state are the saved ones, the optimizer is distributed again (one fit step on
                data that differs per rank leaves every rank with the same weights, the
                average's), compression= reaches it
  uneven_fit    fit on 2,049 samples split 1,025 / 1,024 (33 / 32 batches of 32), 2 epochs,
                with JoinCallback and MetricAverageCallback (they join once per epoch): fit
                completes on every rank; afterwards every rank holds the weights and optimizer
                state of the rank that ran 33 steps (iterations 66), and the same averaged logs
  uneven_metric fit on uneven shards with MetricAverageCallback alone: it joins too
  uneven_loop   a custom training loop on uneven shards: join() when the data ends (returns
                rank 0, the one that ran the most steps), then broadcast_global_variables from
                it: every rank holds the same weights (TensorFlow backend)
  collectives   allreduce, allgather and broadcast give tensors of the backend, dtype kept

Every case but uneven_loop runs on any Keras backend (KERAS_BACKEND).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root: tests.*
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from case_common import run_reported  # noqa: E402

import byteps_like.keras as bps  # noqa: E402
from byteps_like.worker.api import barrier  # noqa: E402


def model_of(seed: int = 0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"),
                             keras.layers.Dense(2)])


def numpy(t) -> np.ndarray:
    return np.asarray(keras.ops.convert_to_numpy(t))


def steps_of(optimizer) -> int:
    return int(numpy(optimizer.iterations))


def flat(model) -> np.ndarray:
    return np.concatenate([np.asarray(w, np.float64).reshape(-1) for w in model.get_weights()])


def same_on_every_rank(values: np.ndarray, what: str) -> None:
    """Every rank holds ``values``: the sum over the ranks is size() times them."""
    got = bps.push_pull(values, name=f"check.{what}", average=False)
    assert np.allclose(got, values * bps.size(), rtol=0, atol=1e-12), f"{what} differ"


def save(d: Path, rank: int, size: int) -> None:
    model = model_of()
    model.compile(optimizer=bps.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)),
                  loss="mse")
    rng = np.random.default_rng(rank)
    model.fit(rng.normal(size=(8, 4)), rng.normal(size=(8, 2)), batch_size=4, epochs=1,
              verbose=0, callbacks=[bps.callbacks.BroadcastGlobalVariablesCallback(0)])
    same_on_every_rank(flat(model), "saved")
    if rank == 0:
        model.save(d / "m.keras")
        np.savez(d / "weights.npz", w=flat(model),
                 slots=np.concatenate([numpy(v).reshape(-1)
                                       for v in model.optimizer.variables]))
    barrier()   # a load in the same launch finds the file


def load(d: Path, rank: int, size: int) -> None:
    model = bps.load_model(d / "m.keras", compression=bps.Compression.fp16)
    saved = np.load(d / "weights.npz")
    opt = model.optimizer
    assert isinstance(opt, keras.optimizers.SGD) and type(opt).__name__ == "SGD", type(opt)
    assert hasattr(type(opt), "_bps_ops"), f"{type(opt)} is not a distributed optimizer"
    assert opt._bps_compression is bps.Compression.fp16, opt._bps_compression
    assert np.array_equal(flat(model), saved["w"]), "weights differ from the saved ones"
    slots = np.concatenate([numpy(v).reshape(-1) for v in opt.variables])
    assert np.array_equal(slots, saved["slots"]), "the optimizer's state is not the saved one"
    assert steps_of(opt) == 2, opt.iterations
    # data that differs per rank: without averaging every rank would end elsewhere
    rng = np.random.default_rng(100 + rank)
    model.fit(rng.normal(size=(4, 4)), rng.normal(size=(4, 2)), batch_size=4, epochs=1,
              verbose=0)
    assert steps_of(opt) == 3, opt.iterations
    same_on_every_rank(flat(model), "loaded")
    assert not np.array_equal(flat(model), saved["w"]), "the fit step changed nothing"


N, BATCH, EPOCHS = 2049, 32, 2


def shard(rank: int, size: int):
    """Rank r's share of N samples: N // size, plus one for the first N % size ranks."""
    rng = np.random.default_rng(7)
    x, y = rng.normal(size=(N, 4)), rng.normal(size=(N, 2))
    return x[rank::size], y[rank::size]


def steps(rank: int, size: int) -> int:
    return -(-len(shard(rank, size)[0]) // BATCH)


class Logs(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.epochs: list[dict] = []

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append(dict(logs or {}))


def uneven(rank: int, size: int, callbacks: list, what: str) -> None:
    assert [steps(r, size) for r in range(size)] == [33, 32], "the data is not uneven"
    from byteps_like.worker.runtime import default_runtime
    rt = default_runtime()
    joins = []
    rt.join = lambda join=rt.join: joins.append(join()) or joins[-1]   # type: ignore[method-assign]
    x, y = shard(rank, size)
    model = model_of(rank)  # other weights on rank 1: the broadcast callback undoes it
    model.compile(optimizer=bps.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.5)),
                  loss="mse", metrics=["mae"])
    after = Logs()
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
              callbacks=[bps.callbacks.BroadcastGlobalVariablesCallback(0), *callbacks, after])
    most = max(steps(r, size) for r in range(size))
    assert steps_of(model.optimizer) == EPOCHS * most, (
        steps_of(model.optimizer), "the rank that ran more steps did not lead")
    same_on_every_rank(flat(model), f"{what}.weights")
    same_on_every_rank(np.concatenate([numpy(v).astype(np.float64).reshape(-1)
                                       for v in model.optimizer.variables]), f"{what}.slots")
    del rt.join
    assert joins == [0] * EPOCHS, f"joins {joins}: once per epoch, rank 0 (33 steps) last"
    assert len(after.epochs) == EPOCHS, after.epochs
    for e, logs in enumerate(after.epochs):
        vals = np.array([logs["loss"], logs["mae"]])
        same_on_every_rank(vals, f"{what}.logs.{e}")


def uneven_fit(d: Path, rank: int, size: int) -> None:
    uneven(rank, size, [bps.callbacks.JoinCallback(), bps.callbacks.MetricAverageCallback()],
           "fit")


def uneven_metric(d: Path, rank: int, size: int) -> None:
    uneven(rank, size, [bps.callbacks.MetricAverageCallback()], "metric")


def uneven_loop(d: Path, rank: int, size: int) -> None:
    """The documented custom-loop pattern: join() when this rank's data ends."""
    import tensorflow as tf
    x, y = shard(rank, size)
    model = model_of(0)
    opt = bps.DistributedOptimizer(keras.optimizers.SGD(0.05), name="loop")
    loss_fn = keras.losses.MeanSquaredError()
    for i in range(0, len(x), BATCH):
        with tf.GradientTape() as tape:
            loss = loss_fn(y[i:i + BATCH], model(x[i:i + BATCH]))
        opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
    last = bps.join()
    assert last == 0, f"join() returned {last}: rank 0 ran the most steps"
    bps.broadcast_global_variables(last, model=model, optimizer=opt)
    same_on_every_rank(flat(model), "loop.weights")


def collectives(d: Path, rank: int, size: int) -> None:
    s = size * (size - 1) // 2
    got = bps.allreduce(np.full(3, rank, np.int32), name="c.int", average=False)
    assert keras.ops.is_tensor(got) and numpy(got).dtype == np.int32, got
    assert np.array_equal(numpy(got), np.full(3, s)), got
    got = bps.allreduce(keras.ops.convert_to_tensor(np.full(2, rank + 1.0)), name="c.avg")
    assert numpy(got).dtype == np.float64 and np.allclose(numpy(got), (s + size) / size), got
    got = bps.allgather(np.full((rank + 1, 2), rank, np.int64), name="c.gather")
    want = np.concatenate([np.full((q + 1, 2), q) for q in range(size)])
    assert np.array_equal(numpy(got), want), got
    got = bps.broadcast(np.float32(rank + 5), root_rank=size - 1, name="c.bcast")
    assert numpy(got).shape == () and numpy(got) == size + 4, got


CASES = {f.__name__: f for f in (save, load, uneven_fit, uneven_metric, uneven_loop,
                                 collectives)}


def main() -> None:
    d = Path(sys.argv[1])
    bps.init()
    rank, size = bps.rank(), bps.size()
    print(f"backend {keras.backend.backend()} rank {rank}", flush=True)
    for case in sys.argv[2:]:
        run_reported("keras", case, rank, lambda: CASES[case](d, rank, size))
    bps.shutdown()


if __name__ == "__main__":
    main()
