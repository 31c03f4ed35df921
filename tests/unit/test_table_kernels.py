"""The compiled kernels of an embedding table's shard (csrc/table_kernels.cc) against the numpy
code they replaced (embedding.reference_sum_rows, reference_initial_rows, NumpyTableShard): the
same bits on random inputs for every optimizer and initializer, repeated ids, empty pushes,
dim 1 and a large dim; and a clear ValueError, with nothing changed, on every bad shape, dtype
or id."""
from __future__ import annotations

import zlib

import numpy as np
import pytest

from byteps_like import _core
from byteps_like import embedding as E

OPTIMIZERS = {
    "sgd": {"lr": 0.05},
    "adagrad": {"lr": 0.1, "eps": 1e-10, "initial_accumulator_value": 0.1},
    "adam": {"lr": 0.01, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8},
}
INITS = {"zeros": {}, "uniform": {"low": -0.3, "high": 0.7}, "normal": {"mean": 0.1, "std": 0.5}}
STATE = ("weights", "made", "changed", "acc", "m", "v", "t")


def bits(a: np.ndarray) -> np.ndarray:
    """The array's bytes, so that equal means the same bits (NaN and -0.0 included)."""
    return np.ascontiguousarray(a).view(np.uint8)


def same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(bits(a), bits(b))


def pushes(rng: np.random.Generator, rows: int, dim: int, workers: int, *, repeat: bool = False,
           empty: bool = False, shard: int = 0, shards: int = 1):
    """One round's pushes: per worker Zipf-like ids of one shard (a few repeated within a push
    when ``repeat``; the second worker's empty when ``empty``) and random float32 rows."""
    ids, grads = [], []
    mine = np.arange(shard, rows, shards)
    for w in range(workers):
        n = 0 if empty and w == 1 else int(rng.integers(1, 3 * len(mine) // 4 + 2))
        p = np.unique(mine[np.minimum(rng.zipf(1.3, n) - 1, len(mine) - 1)])
        rng.shuffle(p)
        if repeat and len(p):
            p = np.concatenate([p, rng.choice(p, 1 + len(p) // 3)])
        ids.append(p.astype(np.int64))
        grads.append(rng.standard_normal((len(p), dim)).astype(np.float32))
    return ids, grads


# -- summing a round ------------------------------------------------------------------------------
@pytest.mark.parametrize("dim", [1, 7, 64, 1024])
@pytest.mark.parametrize("repeat", [False, True])
def test_sum_rows_is_the_reference_bit_for_bit(dim, repeat):
    rng = np.random.default_rng(dim * 2 + repeat)
    for workers in (1, 2, 4):
        ids, grads = pushes(rng, 500, dim, workers, repeat=repeat)
        u1, s1 = E.sum_rows(ids, grads, dim)
        u2, s2 = E.reference_sum_rows(ids, grads, dim)
        assert same(u1, u2) and same(s1, s2)
        assert np.all(np.diff(u1) > 0)


def test_sum_rows_adds_in_list_order_then_row_order():
    # float32 addition is not associative: 1e8 + 1 - 1e8 is 0 in this order, 1 in another
    g = [np.array([[1e8]], np.float32), np.array([[1.0]], np.float32),
         np.array([[-1e8], [1.0]], np.float32)]
    ids = [np.array([5]), np.array([5]), np.array([5, 5])]
    u, s = E.sum_rows(ids, g, 1)
    assert u.tolist() == [5] and s.tolist() == [[1.0]]   # ((1e8 + 1) - 1e8) + 1
    assert same(s, E.reference_sum_rows(ids, g, 1)[1])


def test_sum_rows_of_empty_pushes_and_no_pushes():
    rng = np.random.default_rng(3)
    ids, grads = pushes(rng, 100, 8, 3, empty=True)
    assert len(ids[1]) == 0
    for a, b in zip(E.sum_rows(ids, grads, 8), E.reference_sum_rows(ids, grads, 8)):
        assert same(a, b)
    u, s = E.sum_rows([], [], 8)
    assert u.shape == (0,) and u.dtype == np.int64 and s.shape == (0, 8) and s.dtype == np.float32
    u, s = E.sum_rows([np.zeros(0, np.int64)] * 2, [np.zeros((0, 8), np.float32)] * 2, 8)
    assert u.shape == (0,) and s.shape == (0, 8)


def test_sum_rows_keeps_nan_inf_and_signed_zero_as_numpy_does():
    g = [np.array([[-0.0, np.nan, np.inf, 1.0]], np.float32),
         np.array([[-0.0, 1.0, -np.inf, np.float32(3e38)]], np.float32),
         np.array([[-0.0, 2.0, 1.0, np.float32(3e38)]], np.float32)]
    ids = [np.array([9])] * 3
    with np.errstate(all="ignore"):    # inf - inf and 3e38 + 3e38: numpy warns, gives nan, inf
        want = E.reference_sum_rows(ids, g, 4)[1]
    assert same(E.sum_rows(ids, g, 4)[1], want)
    assert np.isnan(want[0, 2]) and np.isinf(want[0, 3])


def test_sum_rows_takes_a_flat_push_of_whole_rows():
    rng = np.random.default_rng(4)
    ids, grads = pushes(rng, 200, 5, 2)
    flat = [g.ravel() for g in grads]
    assert same(E.sum_rows(ids, flat, 5)[1], E.reference_sum_rows(ids, grads, 5)[1])


# -- initial values -------------------------------------------------------------------------------
@pytest.mark.parametrize("init", list(INITS))
@pytest.mark.parametrize("dim", [1, 3, 64, 1000])
def test_initial_rows_are_the_reference_bit_for_bit(init, dim):
    rng = np.random.default_rng(dim)
    for seed in (0, 1, 12345, (1 << 63) - 1):
        spec = E.TableSpec.make("t", 1 << 40, dim, init=init, init_args=INITS[init], seed=seed)
        ids = np.concatenate([rng.integers(0, 1 << 40, 200), np.arange(50),
                              [0, (1 << 40) - 1]]).astype(np.int64)
        got = E.initial_rows(spec, ids)
        assert same(got, E.reference_initial_rows(spec, ids))
        assert got.shape == (len(ids), dim)


def test_initial_rows_of_the_default_normal_on_many_rows():
    """The default initializer over 2M values (Box-Muller's log and cos in float64)."""
    spec = E.TableSpec.make("t", 100_000, 64, seed=7)
    ids = np.arange(0, 100_000, 3, dtype=np.int64)
    assert same(E.initial_rows(spec, ids), E.reference_initial_rows(spec, ids))


# -- a shard: made rows, pulls and the optimizer step ---------------------------------------------
def both(optimizer: str, init: str, dim: int, shard: int = 0, shards: int = 1, rows: int = 400):
    spec = E.TableSpec.make("t", rows, dim, init=init, init_args=INITS[init], seed=11,
                            optimizer=optimizer, **OPTIMIZERS[optimizer])
    return E.TableShard(spec, shard, shards), E.NumpyTableShard(spec, shard, shards)


def assert_same_state(a: E.TableShard, b: E.TableShard) -> None:
    for name in STATE:
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert same(x, y), f"{name} differs"


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("init", list(INITS))
@pytest.mark.parametrize("dim,shard,shards", [(1, 0, 1), (16, 1, 3), (1024, 0, 2)])
def test_shard_rounds_are_the_reference_bit_for_bit(optimizer, init, dim, shard, shards):
    rng = np.random.default_rng(zlib.crc32(f"{optimizer} {init} {dim}".encode()))
    rows = 400 if dim < 1024 else 60
    a, b = both(optimizer, init, dim, shard, shards, rows)
    mine = np.arange(shard, rows, shards)
    for step in range(12):
        ids, grads = pushes(rng, rows, dim, 3, repeat=step % 3 == 0, empty=step % 4 == 1,
                            shard=shard, shards=shards)
        u, s = E.sum_rows(ids, grads, dim)
        if step % 2:
            s /= np.float32(3)                               # an averaged round
        a.apply(u, s)
        b.apply(u, s.copy())
        pull = rng.choice(mine, 40)                           # repeats allowed in a pull
        assert same(a.rows(pull), b.rows(pull))
    assert_same_state(a, b)
    assert a.made.any() and a.changed.any()


def test_adam_over_many_steps_of_one_row():
    """Lazy Adam's per-row step count and float64 bias corrections over 300 steps."""
    a, b = both("adam", "normal", 8)
    rng = np.random.default_rng(5)
    for _ in range(300):
        ids = np.array([3, 17], np.int64)
        g = (rng.standard_normal((2, 8)) * 10.0 ** rng.integers(-6, 3)).astype(np.float32)
        a.apply(ids, g)
        b.apply(ids, g)
    assert a.t[3] == 300
    assert_same_state(a, b)


def test_unsorted_unique_ids_apply_as_the_reference():
    for optimizer in OPTIMIZERS:
        a, b = both(optimizer, "uniform", 4)
        ids = np.array([9, 2, 300, 5], np.int64)
        g = np.random.default_rng(6).standard_normal((4, 4)).astype(np.float32)
        a.apply(ids, g)
        b.apply(ids, g)
        assert_same_state(a, b)


def test_forgotten_and_restored_rows_are_made_again():
    a, b = both("adagrad", "normal", 6, 1, 2)
    rng = np.random.default_rng(8)
    for s in (a, b):
        ids = np.arange(1, 200, 2)
        s.apply(ids, np.ones((len(ids), 6), np.float32))
    saved = a.state()
    for s in (a, b):
        s.forget()
        s.restore({k: v[: len(v) // 2] for k, v in saved.items()})   # half the rows back
    ids = np.arange(1, 200, 2)
    g = rng.standard_normal((len(ids), 6)).astype(np.float32)
    a.apply(ids, g)
    b.apply(ids, g)
    assert_same_state(a, b)


@pytest.mark.parametrize("init", list(INITS))
def test_rows_made_on_several_threads_are_the_same_bits(init):
    """New rows made on up to 4 threads: each row by one of them, values as the reference."""
    spec = E.TableSpec.make("t", 40_000, 64, init=init, init_args=INITS[init], seed=3,
                            optimizer="adam")
    rng = np.random.default_rng(9)
    ref = E.NumpyTableShard(spec, 1, 2)
    shards = [E.TableShard(spec, 1, 2, threads=n) for n in (2, 4)]
    for _ in range(3):
        ids = np.unique(rng.integers(0, 20_000, 6000)) * 2 + 1     # thousands of new rows
        g = rng.standard_normal((len(ids), 64)).astype(np.float32)
        ref.apply(ids, g)
        for s in shards:
            s.apply(ids, g)
        pull = rng.integers(0, 20_000, 3000) * 2 + 1               # new rows, repeated ones
        want = ref.rows(pull)
        for s in shards:
            assert same(s.rows(pull), want)
    for s in shards:
        assert_same_state(s, ref)


def test_empty_apply_and_pull_change_nothing():
    a, _ = both("adam", "normal", 4)
    a.apply(np.zeros(0, np.int64), np.zeros((0, 4), np.float32))
    assert a.rows(np.zeros(0, np.int64)).shape == (0, 4)
    assert not a.made.any() and not a.changed.any()


# -- bad input: a clear ValueError, and nothing changed -------------------------------------------
def test_bad_ids_are_refused_before_anything_changes():
    a, _ = both("adam", "normal", 4, 1, 3, rows=30)
    g = np.ones((3, 4), np.float32)
    for ids, what in (([1, 4, 30], "id 30"), ([1, 5, 7], "id 5"), ([1, -2, 4], "id -2"),
                      ([1, 4, 1], "repeat")):
        with pytest.raises(ValueError, match=what):
            a.apply(np.array(ids, np.int64), g)
        assert not a.made.any() and not a.changed.any() and not a.t.any()
    with pytest.raises(ValueError, match="id 3 is not a row of shard 1 of 3"):
        a.rows(np.array([1, 3], np.int64))
    assert not a.made.any()


def test_bad_gradient_shapes_and_dtypes_are_refused():
    a, _ = both("sgd", "zeros", 4)
    ids = np.array([1, 2], np.int64)
    with pytest.raises(ValueError, match=r"grad has shape \(2, 5\), expected \(2, 4\)"):
        a.apply(ids, np.ones((2, 5), np.float32))
    with pytest.raises(ValueError, match=r"grad has shape \(3, 4\)"):
        a.apply(ids, np.ones((3, 4), np.float32))
    with pytest.raises(ValueError, match="grad must be a numpy array of float32, not one of "
                       "float64"):
        a.apply(ids, np.ones((2, 4)))
    with pytest.raises(ValueError, match="C-contiguous"):
        a.apply(ids, np.ones((4, 2), np.float32).T)
    with pytest.raises(ValueError, match="ids must be a numpy array of int64"):
        a._kernels.apply(ids.astype(np.int32), np.ones((2, 4), np.float32))
    assert not a.made.any() and not a.weights.any()


def test_bad_pushes_are_refused_by_sum_rows():
    ids = [np.array([1, 2], np.int64)]
    with pytest.raises(ValueError, match=r"push 0's gradients has shape \(3, 4\), expected "
                       r"\(2, 4\)"):
        E.sum_rows(ids, [np.ones((3, 4), np.float32)], 4)
    with pytest.raises(ValueError, match=r"push 0's gradients has shape \(9,\)"):
        E.sum_rows(ids, [np.ones(9, np.float32)], 4)
    with pytest.raises(ValueError, match="1 id arrays but 2 gradient arrays"):
        _core.table_sum_rows(ids, [np.ones((2, 4), np.float32)] * 2, 4)
    with pytest.raises(ValueError, match="push 0's ids must be a numpy array of int64"):
        _core.table_sum_rows([np.array([1.0, 2.0])], [np.ones((2, 4), np.float32)], 4)
    with pytest.raises(ValueError, match=r"push 0's ids has shape \(1, 2\)"):
        _core.table_sum_rows([np.array([[1, 2]])], [np.ones((2, 4), np.float32)], 4)
    with pytest.raises(ValueError, match="dim must be >= 1"):
        _core.table_sum_rows(ids, [np.ones((2, 4), np.float32)], 0)


def test_bad_initial_rows_calls_are_refused():
    with pytest.raises(ValueError, match="row id -1 is negative"):
        _core.table_initial_rows(np.array([0, -1]), 4, "normal", 0.0, 1.0, 0)
    with pytest.raises(ValueError, match="unknown initializer 'ones'"):
        _core.table_initial_rows(np.array([0]), 4, "ones", 0.0, 1.0, 0)
    with pytest.raises(ValueError, match="dim must be >= 1"):
        _core.table_initial_rows(np.array([0]), 0, "normal", 0.0, 1.0, 0)


def kernels(n=10, d=4, optimizer="sgd", **over):
    arrays = {"weights": np.zeros((n, d), np.float32), "made": np.zeros(n, np.bool_),
              "changed": np.zeros(n, np.bool_), "acc": None, "m": None, "v": None, "t": None}
    arrays.update(over)
    opt = {"optimizer": optimizer, "lr": 0.1, "eps": 0.0, "beta1": 0.9, "beta2": 0.99,
           "acc0": 0.0}
    return _core.TableKernels(**arrays, shard=0, shards=1,
                              init={"init": "zeros", "a": 0.0, "b": 0.0, "seed": 0}, opt=opt)


def test_the_kernels_refuse_arrays_that_are_not_the_shards():
    assert kernels().nrows == 10 and kernels().dim == 4
    ro = np.zeros((10, 4), np.float32)
    ro.flags.writeable = False
    cases = [({"weights": ro}, "weights must be writable"),
             ({"weights": np.zeros((10, 4))}, "weights must be a numpy array of float32"),
             ({"weights": np.zeros(40, np.float32)}, "weights must be a 2-d numpy array"),
             ({"made": np.zeros(9, np.bool_)}, r"made has shape \(9,\), expected \(10,\)"),
             ({"changed": np.zeros(10, np.uint8)}, "changed must be a numpy array of bool"),
             ({"acc": np.zeros((10, 4), np.float32)}, "sgd keeps no acc"),
             ({"optimizer": "adagrad"}, "adagrad needs acc"),
             ({"optimizer": "adam", "m": np.zeros((10, 4), np.float32),
               "v": np.zeros((10, 4), np.float32), "t": np.zeros(10, np.int64)},
              "t must be a numpy array of int32"),
             ({"optimizer": "rmsprop"}, "unknown optimizer 'rmsprop'")]
    for over, match in cases:
        with pytest.raises(ValueError, match=match):
            kernels(**over)
    with pytest.raises(ValueError, match="threads must be >= 1, not 0"):
        E.TableShard(E.TableSpec.make("t", 10, 2), threads=0)
    with pytest.raises(ValueError, match="shard 3 of 2 is not a shard"):
        _core.TableKernels(np.zeros((2, 2), np.float32), np.zeros(2, np.bool_),
                           np.zeros(2, np.bool_), None, None, None, None, shard=3, shards=2,
                           init={"init": "zeros", "a": 0.0, "b": 0.0, "seed": 0},
                           opt={"optimizer": "sgd", "lr": 0.1, "eps": 0.0, "beta1": 0.0,
                                "beta2": 0.0, "acc0": 0.0})
