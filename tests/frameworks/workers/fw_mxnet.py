"""Conformance adapter: byteps_like.mxnet (MXNet 1.9.1, in .venv-mxnet), and its own checks
(EXTRAS): argument errors and a model that differs between ranks, broadcast_parameters of a
ParameterDict and of Module-style dicts, the forms of byteps_push_pull.

byteps_push_pull works in place; compression goes through DistributedTrainer's
compression_params (BytePS's API), so the compression case does too.
"""
from __future__ import annotations

import warnings

import numpy as np

with warnings.catch_warnings():  # MXNet 1.9.1 touches numpy's deprecated aliases
    warnings.simplefilter("ignore", DeprecationWarning)
    import mxnet as mx

from case_common import AdapterBase

import byteps_like.mxnet as bps  # noqa: E402
from byteps_like.errors import MismatchError, NotInitializedError  # noqa: E402
from tests.support import expect  # noqa: E402


class Adapter(AdapterBase):
    name = "mxnet"
    bps = bps
    dtypes = ["float32", "float64", "float16", "int32", "int64"]
    broadcast_dtypes = ["float32", "float16", "int64", "uint8"]
    gather_dtypes: list = []
    in_place = True

    EXTRA_CASES = ("errors", "broadcast_parameters", "push_pull_forms")

    def before_init(self):
        expect(NotInitializedError, lambda: bps.rank(), "init()")

    def tensor(self, values, dtype: str):
        return mx.nd.array(np.asarray(values, np.float64), dtype=dtype)

    def numpy(self, t) -> np.ndarray:
        return t.asnumpy().astype(np.float64)

    def dtype_name(self, t) -> str:
        return np.dtype(t.dtype).name

    def push_pull(self, t, name: str, average: bool | None):
        ident = id(t)
        if average is None:
            bps.byteps_push_pull(t, name=name)
        else:
            bps.byteps_push_pull(t, name=name, is_average=average)
        assert id(t) == ident
        return t

    def push_pull_fp16(self, t, name: str):
        """DistributedTrainer(sgd, lr 1, compression fp16) on a zero parameter whose gradient
        is ``t``: it ends at minus the average; times size, the sum."""
        p = mx.gluon.Parameter(name, shape=t.shape, dtype="float32", init=mx.init.Zero())
        p.initialize()
        trainer = bps.DistributedTrainer([p], "sgd", {"learning_rate": 1.0},
                                         compression_params={"compressor": "fp16"})
        with mx.autograd.record():
            loss = (p.data() * t).sum()
        loss.backward()
        trainer.step(1)
        return -p.data() * bps.size()

    def broadcast(self, t, root: int, name: str):
        params = {name: t}
        bps.broadcast_parameters(params, root_rank=root)
        return params[name]

    def allgather(self, t, name: str):
        fn = getattr(bps, "allgather", None)   # once it exists, the strict xfail says so
        if fn is None:
            raise NotImplementedError("byteps_like.mxnet has no allgather")
        return fn(t, name=name)

    def gradients(self):
        """DistributedTrainer.step of 4 Dense layers: every gradient queued, then waited for."""
        mx.random.seed(0)
        net = mx.gluon.nn.Sequential(prefix="p_")
        with net.name_scope():
            for _ in range(4):
                net.add(mx.gluon.nn.Dense(64, in_units=64))
        net.initialize()
        trainer = bps.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
        with mx.autograd.record():
            loss = net(mx.nd.ones((8, 64))).sum()
        loss.backward()
        trainer._bps_synchronizer()  # declares the gradients before the credit is held
        return [f"Gradient.{p.name}" for p in trainer._params], lambda: trainer.step(8), None


# -- MXNet's own API ----------------------------------------------------------------------------
def dense_net(layers, seed=0, prefix="net_"):
    mx.random.seed(seed)
    net = mx.gluon.nn.Sequential(prefix=prefix)
    with net.name_scope():
        for _ in range(layers):
            net.add(mx.gluon.nn.Dense(4, in_units=4))
    net.initialize()
    return net


def errors(rank, size):
    expect(TypeError, lambda: bps.byteps_push_pull(mx.nd.zeros(3, dtype="uint8"), name="u8"),
           "uint8", "cannot be summed")
    expect(TypeError, lambda: bps.byteps_push_pull(np.zeros(3), name="np"), "NDArray")
    expect(ValueError, lambda: bps.DistributedTrainer(
        {}, "sgd", compression_params={"compressor": "topk"}), "needs k")
    expect(ValueError, lambda: bps.DistributedTrainer(
        {}, "sgd", compression_params={"compressor": "onebit", "ef": "sparse"}), "vanilla")
    expect(TypeError, lambda: bps.broadcast_parameters([mx.nd.ones(2)]), "dict")
    a, b = dense_net(1, prefix="same_"), dense_net(1, prefix="same_")
    params = list(a.collect_params().values()) + list(b.collect_params().values())
    expect(ValueError, lambda: bps.DistributedTrainer(params, "sgd"), "duplicate names")
    # a model that differs on the last rank: every rank raises, naming the groups of ranks
    net = dense_net(2 if rank == size - 1 else 1, prefix="differs_")
    msg = expect(MismatchError, lambda: bps.DistributedTrainer(
        net.collect_params(), "sgd", {"learning_rate": 0.1}), "the model differs between workers")
    assert f"ranks [{size - 1}]" in msg, msg


def broadcast_parameters(rank, size):
    root = 1
    net = dense_net(2, seed=100 + rank)  # different on every rank
    root_vals = {k: v.data().asnumpy() for k, v in net.collect_params().items()}
    bps.broadcast_parameters(net.collect_params(), root_rank=root)
    after = {k: v.data().asnumpy() for k, v in net.collect_params().items()}
    # every rank now holds the root's: the sum over ranks is size times it
    for k in sorted(after):
        total = mx.nd.array(after[k])
        bps.byteps_push_pull(total, name=f"check.{k}", is_average=False)
        assert np.allclose(total.asnumpy(), size * after[k]), k
        if rank == root:
            assert np.array_equal(after[k], root_vals[k]), k
    # Module-style dicts, with dtypes the wire cannot sum directly
    arg = {"w": mx.nd.full((3, 2), rank + 1.5, dtype="float32"),
           "flag": mx.nd.full((4,), rank, dtype="uint8"),
           "half": mx.nd.full((5,), rank + 0.25, dtype="float16"),
           "count": mx.nd.full((2,), 10 * rank, dtype="int64")}
    bps.broadcast_parameters(arg, root_rank=root)
    assert np.array_equal(arg["w"].asnumpy(), np.full((3, 2), root + 1.5, np.float32))
    assert arg["flag"].dtype == np.uint8 and (arg["flag"].asnumpy() == root).all()
    assert arg["half"].dtype == np.float16 and (arg["half"].asnumpy() == root + 0.25).all()
    assert (arg["count"].asnumpy() == 10 * root).all()
    expect(ValueError, lambda: bps.broadcast_parameters(arg, root_rank=size), "out of range")


def push_pull_forms(rank, size):
    """byteps_declare_tensor first; a priority; a row view (written back into its parent); no
    name (BytePS-style automatic names)."""
    s = sum(range(size))
    bps.byteps_declare_tensor("declared")
    x = mx.nd.full((10,), rank, dtype="float32")
    bps.byteps_push_pull(x, name="declared", is_average=False)
    assert (x.asnumpy() == s).all(), x
    y = mx.nd.arange(12, dtype="float64").reshape((3, 4)) * (rank + 1)
    bps.byteps_push_pull(y, name="avg", priority=5)
    expect_avg = np.arange(12).reshape(3, 4) * (sum(range(1, size + 1)) / size)
    assert np.allclose(y.asnumpy(), expect_avg), y
    view = mx.nd.ones((4, 4))
    bps.byteps_push_pull(view[1], name="row", is_average=False)
    assert (view.asnumpy()[1] == size).all() and (view.asnumpy()[0] == 1).all(), view
    z = mx.nd.full((7,), rank)
    bps.byteps_push_pull(z, is_average=False)
    assert (z.asnumpy() == s).all()
