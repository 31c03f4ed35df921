"""Worker: byteps_like.torch API behaviour. Usage: torch_api.py MODE; prints ``API OK MODE``.

errors     op before init, duplicate/missing names, a model that differs between workers
broadcast  parameters, optimizer state and objects from a non-zero root
ops        push_pull forms and dtypes, differentiable push_pull, fp16 compression, allgather
priority   the order gradients go on the wire: first layer first, not backward order
join       uneven steps: rank r runs 2 + (size - 1 - r) optimizer steps, then join()
"""
import os
import sys

import torch

import byteps_like.torch as bps
from byteps_like.errors import BytePSError, MismatchError, NotInitializedError
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


def errors(rank, size):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    named = list(model.named_parameters())
    expect(ValueError, lambda: bps.DistributedOptimizer(opt, [("w", p) for _, p in named]),
           "duplicate names", "'w'")
    expect(ValueError, lambda: bps.DistributedOptimizer(opt, named[:2]),
           "2 parameters of the optimizer are not in named_parameters")
    expect(TypeError, lambda: bps.push_pull(torch.zeros(3, dtype=torch.bool), name="b"),
           "torch.bool")
    assert bps.is_initialized()
    # Horovod's names: allreduce (differentiable), in place, async; barrier
    s = sum(range(1, size + 1))
    assert torch.equal(bps.allreduce(torch.full((4,), float(rank + 1)), average=False,
                                     name="hvd.ar"), torch.full((4,), float(s)))
    t = torch.full((4,), float(rank + 1))
    assert bps.allreduce_(t, name="hvd.ar_") is t and torch.equal(t, torch.full((4,), s / size))
    h = bps.allreduce_async(torch.ones(3), average=False, name="hvd.async")
    assert torch.equal(bps.synchronize(h), torch.full((3,), float(size)))
    u = torch.ones(3)
    bps.synchronize(bps.allreduce_async_(u, average=False, name="hvd.async_"))
    assert torch.equal(u, torch.full((3,), float(size)))
    bps.barrier()
    # a name passed where BytePS's order has `average`: refused, not a new key every call
    expect(TypeError, lambda: bps.push_pull(torch.ones(3), "w"), "average must be a bool",
           "name=")
    expect(TypeError, lambda: bps.push_pull_inplace(torch.ones(3), True, 7), "name must be")
    # a model that differs on the last rank: every rank raises, naming the groups of ranks
    layers = [torch.nn.Linear(4, 4)] + ([torch.nn.Linear(4, 4)] if rank == size - 1 else [])
    other = torch.nn.Sequential(*layers)
    msg = expect(MismatchError, lambda: bps.DistributedOptimizer(
        torch.optim.SGD(other.parameters(), lr=0.1), other.named_parameters()),
        "the model differs between workers")
    assert f"ranks [{size - 1}]" in msg, msg


def broadcast(rank, size):
    root = 1
    torch.manual_seed(100 + rank)  # different on every rank
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.BatchNorm1d(7),
                                torch.nn.Linear(7, 2))
    model(torch.randn(8, 5))  # moves batch-norm running stats (and num_batches_tracked)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    if rank == root:  # only the root has optimizer state
        model(torch.randn(8, 5)).sum().backward()
        opt.step()
    # Horovod's tensor broadcasts; the functions, not the submodule of the same name
    x = torch.full((3, 2), float(rank + 5))
    y = bps.broadcast(x, root)
    assert torch.equal(y, torch.full((3, 2), float(root + 5))), y
    assert torch.equal(x, torch.full((3, 2), float(rank + 5)))   # the input is left alone
    z = torch.arange(4, dtype=torch.int64) * (rank + 1)
    assert bps.broadcast_(z, root, name="z") is z
    assert torch.equal(z, torch.arange(4, dtype=torch.int64) * (root + 1)), z
    bps.broadcast_parameters(model.state_dict(), root_rank=root)
    bps.broadcast_optimizer_state(opt, root_rank=root)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    root_sd = bps.broadcast_object(sd if rank == root else None, root_rank=root)
    assert root_sd.keys() == sd.keys()
    for k in sd:
        assert torch.equal(root_sd[k], sd[k]), k
    st = opt.state_dict()["state"]
    root_st = bps.broadcast_object(st if rank == root else None, root_rank=root)
    assert st.keys() == root_st.keys() and len(st) == 6, (st.keys(), root_st.keys())
    for i in st:
        for k in st[i]:
            assert torch.equal(st[i][k], root_st[i][k]), (i, k)
    obj = {"epoch": 3, "lr": 0.5, "name": "x", (1, 2): [None, b"\x00\x01", float("inf")],
           "t": torch.arange(4, dtype=torch.bfloat16)}
    got = bps.broadcast_object(obj if rank == root else {"other": rank}, root_rank=root)
    assert got.keys() == obj.keys() and got["t"].dtype == torch.bfloat16
    assert got[(1, 2)][:2] == [None, b"\x00\x01"] and got["epoch"] == 3
    # the root cannot serialise: it raises TypeError, every other rank raises too (no hang)
    if rank == 0:
        expect(TypeError, lambda: bps.broadcast_object(object(), root_rank=0), "no pickle")
    else:
        expect(BytePSError, lambda: bps.broadcast_object(None, root_rank=0),
               "root rank 0 could not serialise")


def ops(rank, size):
    s = (size - 1) * size // 2  # sum of ranks
    dev = "cpu"
    if os.environ.get("API_DEVICE") == "cuda":  # cuda:<local rank> on a GPU machine
        dev = f"cuda:{bps.local_rank() % torch.cuda.device_count()}"
        torch.cuda.set_device(dev)
    for dt in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32,
               torch.int64):
        x = torch.full((1000,), rank, dtype=dt, device=dev)
        y = bps.push_pull(x, average=False, name=f"sum.{dt}")
        assert y.device == x.device, (y.device, x.device)
        assert torch.equal(y, torch.full((1000,), s, dtype=dt, device=dev)), (dt, y[:3])
        assert torch.equal(x, torch.full((1000,), rank, dtype=dt, device=dev))  # untouched
        bps.push_pull_inplace(x, average=False, name=f"inplace.{dt}")
        assert torch.equal(x, torch.full((1000,), s, dtype=dt, device=dev)), dt
    h = bps.push_pull_async(torch.ones(3, 4), average=True, name="async")
    out = bps.synchronize(h)
    assert bps.poll(h) and torch.equal(out, torch.ones(3, 4))
    t = torch.arange(6.0).reshape(2, 3).t()  # not contiguous
    assert torch.equal(bps.push_pull(t, average=True, name="noncontig"), t)
    # differentiable: d(sum over workers)/dx = number of workers
    x = torch.full((5,), float(rank), requires_grad=True)
    bps.push_pull(x, average=False, name="diff").sum().backward()
    assert torch.equal(x.grad, torch.full((5,), float(size))), x.grad
    # fp16 compression: values exact in half precision come back exact
    z = bps.push_pull(torch.full((100,), rank + 0.5), average=False, name="fp16",
                      compression=bps.Compression.fp16)
    assert z.dtype == torch.float32 and torch.equal(z, torch.full((100,), s + 0.5 * size))
    # allgather: rank r contributes r + 1 rows; rows arrive in rank order, exact, any dtype
    for dt in (torch.float32, torch.bfloat16, torch.int64):
        mine = torch.full((rank + 1, 3), rank - 0.5 if dt.is_floating_point else rank, dtype=dt)
        got = bps.allgather(mine, name=f"gather.{dt}")
        want = torch.cat([torch.full((q + 1, 3), q - 0.5 if dt.is_floating_point else q,
                                     dtype=dt) for q in range(size)])
        assert got.dtype == dt and torch.equal(got, want), (dt, got)
    assert torch.equal(bps.allgather(torch.arange(2) + 10 * rank),  # unnamed: numbered
                       torch.cat([torch.arange(2) + 10 * q for q in range(size)]))
    expect(MismatchError, lambda: bps.allgather(torch.zeros(2, 3 + rank), name="gather.bad"),
           "only the first dimension may differ", f"worker ranks [{1 - rank}]")


def priority(rank, size):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   model.named_parameters())
    rt = default_runtime()
    wire, hooks = [], []
    rt.pipeline.observers.append(
        lambda task, stage, ev, t: stage == PUSH and ev == "start" and wire.append(
            task.handle.name.removeprefix("Gradient.")))
    for n, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _p, n=n: hooks.append(n))
    if rt.native is not None:  # the native data plane schedules partitions in C++
        rt.native.take_dispatch_log()
        rt.native.set_paused(True)  # hold them: every gradient queues during backward
        model(torch.randn(8, 64)).sum().backward()
        rt.native.set_paused(False)
        opt.step()
        by_key = {st.parts[0][2]: name for name, st in rt.tensors().items() if st.parts}
        wire = [by_key[k].removeprefix("Gradient.") for k in rt.native.take_dispatch_log()
                if k in by_key and by_key[k].startswith("Gradient.")]
    else:
        q = rt.pipeline.queues[PUSH]
        q.inflight += 1 << 40  # hold the credit: every gradient queues during backward
        model(torch.randn(8, 64)).sum().backward()
        q.release(1 << 40)
        opt.step()
    names = [n for n, _ in model.named_parameters()]
    assert hooks == names[::-1], hooks             # backward produces the last layer first
    assert wire == names, wire                     # the wire carries the first layer first
    if rank == 0:
        print("PRIORITY backward order:", " ".join(hooks))
        print("PRIORITY wire order:    ", " ".join(wire))


def join(rank, size):
    """Horovod's join semantics: a joined rank contributes nothing; averages divide by the ranks
    still in; join() returns the rank that joined last (rank 0: it runs the most steps)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                   model.named_parameters())
    steps = 2 + (size - 1 - rank)
    for step in range(steps):
        opt.zero_grad()
        # d(loss)/dw = (rank + 1) everywhere: the averaged gradient is the mean of (q + 1)
        # over the ranks q still in at this step
        (model(torch.ones(1, 4)) * (rank + 1)).sum().backward()
        opt.step()
    assert bps.join() == 0
    want = 0.0
    for step in range(steps):
        still_in = [q for q in range(size) if 2 + (size - 1 - q) > step]
        want -= sum(q + 1 for q in still_in) / len(still_in)
    assert torch.allclose(model.weight, torch.full((1, 4), want)), (model.weight, want)
    # everyone is back in after the join: a full average again
    y = bps.push_pull(torch.full((3,), float(rank)), average=True, name="after.join")
    assert torch.equal(y, torch.full((3,), (size - 1) / 2)), y


def main():
    if MODE == "errors":
        assert not bps.is_initialized()
        expect(NotInitializedError, lambda: bps.push_pull(torch.ones(1)), "call init() first")
        expect(NotInitializedError, lambda: bps.rank(), "init()")
    bps.init()
    rank, size = bps.rank(), bps.size()
    {"errors": errors, "broadcast": broadcast, "ops": ops, "priority": priority,
     "join": join}[MODE](rank, size)
    print(f"API OK {MODE} rank {rank}", flush=True)
    bps.shutdown()


if __name__ == "__main__":
    main()
