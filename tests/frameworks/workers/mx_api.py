"""Worker: byteps_like.mxnet API behaviour. Usage: mx_api.py MODE; prints ``API OK MODE``.

errors     op before init, unsummable dtype, wrong types, duplicate names, differing models
broadcast  broadcast_parameters of a ParameterDict and of Module-style dicts from root 1
ops        byteps_push_pull in place for every dtype, sum and average, declare
priority   the order DistributedTrainer's gradients go on the wire: first parameter first
join       uneven steps: rank r runs size - r push_pulls, then join()
"""
import sys
import threading

import mxnet as mx
import numpy as np

import byteps_like.mxnet as bps
from byteps_like.errors import MismatchError, NotInitializedError
from byteps_like.worker.pipeline import PUSH
from byteps_like.worker.runtime import default_runtime

MODE = sys.argv[1]


def expect(exc_type, fn, *needles):
    try:
        fn()
    except exc_type as exc:
        for n in needles:
            assert n in str(exc), f"{n!r} not in {exc}"
        return str(exc)
    raise AssertionError(f"{fn} did not raise {exc_type.__name__}")


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


def broadcast(rank, size):
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


def ops(rank, size):
    s = sum(range(size))
    for dt in ("float32", "float64", "float16", "int32", "int64"):
        x = mx.nd.full((1000,), rank, dtype=dt)
        ident = id(x)
        bps.byteps_declare_tensor(f"sum.{dt}")
        bps.byteps_push_pull(x, name=f"sum.{dt}", is_average=False)
        assert id(x) == ident and x.dtype == np.dtype(dt)
        assert (x.asnumpy() == s).all(), (dt, x)
    y = mx.nd.arange(12, dtype="float64").reshape((3, 4)) * (rank + 1)
    bps.byteps_push_pull(y, name="avg", priority=5)
    expect_avg = np.arange(12).reshape(3, 4) * (sum(range(1, size + 1)) / size)
    assert np.allclose(y.asnumpy(), expect_avg), y
    view = mx.nd.ones((4, 4))
    bps.byteps_push_pull(view[1], name="row", is_average=False)  # a row view: in its parent
    assert (view.asnumpy()[1] == size).all() and (view.asnumpy()[0] == 1).all(), view
    z = mx.nd.full((7,), rank)
    bps.byteps_push_pull(z, is_average=False)  # no name: BytePS-style automatic names
    assert (z.asnumpy() == s).all()


def join(rank, size):
    for step in range(size - rank):
        x = mx.nd.full((100,), rank + 1, dtype="float32")
        bps.byteps_push_pull(x, name="grad")
        still_in = [q for q in range(size) if size - q > step]
        assert np.allclose(x.asnumpy(), sum(q + 1 for q in still_in) / len(still_in)), x
    assert bps.join() == 0


def priority(rank, size):
    mx.random.seed(0)
    net = mx.gluon.nn.Sequential(prefix="p_")
    with net.name_scope():
        for _ in range(4):
            net.add(mx.gluon.nn.Dense(64, in_units=64))
    net.initialize()
    trainer = bps.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
    rt = default_runtime()
    wire = []
    rt.pipeline.observers.append(
        lambda task, stage, ev, t: stage == PUSH and ev == "start"
        and task.handle.name.startswith("Gradient.") and wire.append(
            task.handle.name.removeprefix("Gradient.")))
    with mx.autograd.record():
        loss = net(mx.nd.ones((8, 64))).sum()
    loss.backward()
    trainer._bps_synchronizer()  # declares the gradients before the credit is held
    if rt.native is not None:  # the native data plane schedules partitions in C++
        rt.native.take_dispatch_log()
        rt.native.set_paused(True)  # hold them: every gradient queues first
        threading.Timer(0.5, rt.native.set_paused, (False,)).start()
        trainer.step(8)
        by_key = {st.parts[0][2]: name for name, st in rt.tensors().items() if st.parts}
        wire = [by_key[k].removeprefix("Gradient.") for k in rt.native.take_dispatch_log()
                if k in by_key and by_key[k].startswith("Gradient.")]
    else:
        q = rt.pipeline.queues[PUSH]
        q.inflight += 1 << 40  # hold the credit: every gradient queues first
        threading.Timer(0.5, q.release, (1 << 40,)).start()
        trainer.step(8)
    names = [p.name for p in trainer._params]
    assert wire == names, wire    # the first parameter first
    if rank == 0:
        print("PRIORITY wire order:", " ".join(wire))


def main():
    if MODE == "errors":
        expect(NotInitializedError, lambda: bps.byteps_push_pull(mx.nd.ones(1)), "init()")
        expect(NotInitializedError, lambda: bps.rank(), "init()")
    bps.init()
    rank, size = bps.rank(), bps.size()
    {"errors": errors, "broadcast": broadcast, "ops": ops, "priority": priority,
     "join": join}[MODE](rank, size)
    print(f"API OK {MODE} rank {rank}", flush=True)
    bps.shutdown()


if __name__ == "__main__":
    main()
