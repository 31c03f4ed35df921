"""Conformance adapter: byteps_like.torch, and its own checks (EXTRAS).

API_DEVICE=cuda puts the tensors on cuda:<local rank> (docs/gpu.md):
``API_DEVICE=cuda bpslaunch --local --workers 2 --servers 1 -- python
tests/frameworks/workers/conformance.py torch dtypes average compression``.
"""
from __future__ import annotations

import os

import numpy as np
import torch
from case_common import AdapterBase

import byteps_like.torch as bps
from byteps_like.errors import BytePSError, MismatchError, NotInitializedError
from tests.support import expect

DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
          "bfloat16": torch.bfloat16, "int32": torch.int32, "int64": torch.int64}


def device() -> str:
    if os.environ.get("API_DEVICE") == "cuda":   # cuda:<local rank> on a GPU machine
        dev = f"cuda:{bps.local_rank() % torch.cuda.device_count()}"
        torch.cuda.set_device(dev)
        return dev
    return "cpu"


class Adapter(AdapterBase):
    name = "torch"
    bps = bps
    dtypes = list(DTYPES)
    broadcast_dtypes = ["float32", "bfloat16", "int64"]
    gather_dtypes = ["float32", "bfloat16", "int64"]

    EXTRA_CASES = ("horovod_names", "optimizer_errors", "broadcast_state", "broadcast_object",
                   "async_forms", "differentiable", "allgather_unnamed", "optimizer_join",
                   "reduce_op", "sync_batchnorm", "cross_rank")

    def __init__(self):
        super().__init__()
        self.dev = None

    def before_init(self):
        assert not bps.is_initialized()
        expect(NotInitializedError, lambda: bps.push_pull(torch.ones(1)), "call init() first")
        expect(NotInitializedError, lambda: bps.rank(), "init()")

    def tensor(self, values, dtype: str):
        if self.dev is None and bps.is_initialized():
            self.dev = device()
        return torch.tensor(np.asarray(values, np.float64), dtype=DTYPES[dtype],
                            device=self.dev or "cpu")

    def numpy(self, t) -> np.ndarray:
        return t.detach().to("cpu", torch.float64).numpy()

    def dtype_name(self, t) -> str:
        return str(t.dtype).removeprefix("torch.")

    def push_pull(self, t, name: str, average: bool | None):
        y = (bps.push_pull(t, name=name) if average is None
             else bps.push_pull(t, average=average, name=name))
        assert y.device == t.device, (y.device, t.device)
        if not t.dtype.is_floating_point or not t.requires_grad:   # in place too, same result
            u = t.clone()
            bps.push_pull_inplace(u, average=bool(average) if average is not None else True,
                                  name=f"{name}.inplace")
            assert torch.equal(u, y), (name, u, y)
        return y

    def push_pull_fp16(self, t, name: str):
        return bps.push_pull(t, average=False, name=name, compression=bps.Compression.fp16)

    def broadcast(self, t, root: int, name: str):
        before = t.clone()
        y = bps.broadcast(t, root, name=name)
        assert torch.equal(t, before), "broadcast changed its input"
        z = t.clone()
        assert bps.broadcast_(z, root, name=f"{name}_") is z and torch.equal(z, y)
        return y

    def allgather(self, t, name: str):
        return bps.allgather(t, name=name)

    def gradients(self):
        """4 Linear layers; backward produces the last layer's gradients first (checked through
        post-accumulate hooks); the optimizer's step waits."""
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
        opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       [(f"wire.{n}", p) for n, p in model.named_parameters()])
        params = [n for n, _ in model.named_parameters()]
        hooks: list[str] = []
        for n, p in model.named_parameters():
            p.register_post_accumulate_grad_hook(lambda _p, n=n: hooks.append(n))

        def finish():
            opt.step()
            assert hooks == params[::-1], hooks   # backward: the last layer first
        return ([f"Gradient.wire.{n}" for n in params],
                lambda: model(torch.randn(8, 64)).sum().backward(), finish)


# -- torch's own API ----------------------------------------------------------------------------
def horovod_names(rank, size):
    """Horovod's names: allreduce (differentiable), in place, async; barrier; and the argument
    errors of BytePS's order (average before name)."""
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
    expect(TypeError, lambda: bps.push_pull(torch.zeros(3, dtype=torch.bool), name="b"),
           "torch.bool")


def optimizer_errors(rank, size):
    """DistributedOptimizer's argument errors, and a model that differs on the last rank: every
    rank raises, naming the groups of ranks."""
    assert bps.is_initialized()
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    named = list(model.named_parameters())
    expect(ValueError, lambda: bps.DistributedOptimizer(opt, [("w", p) for _, p in named]),
           "duplicate names", "'w'")
    expect(ValueError, lambda: bps.DistributedOptimizer(opt, named[:2]),
           "2 parameters of the optimizer are not in named_parameters")
    layers = [torch.nn.Linear(4, 4)] + ([torch.nn.Linear(4, 4)] if rank == size - 1 else [])
    other = torch.nn.Sequential(*layers)
    msg = expect(MismatchError, lambda: bps.DistributedOptimizer(
        torch.optim.SGD(other.parameters(), lr=0.1), other.named_parameters()),
        "the model differs between workers")
    assert f"ranks [{size - 1}]" in msg, msg


def broadcast_state(rank, size):
    """broadcast_parameters (batch-norm buffers included) and broadcast_optimizer_state from
    root 1, where only the root has optimizer state."""
    root = 1
    torch.manual_seed(100 + rank)  # different on every rank
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.BatchNorm1d(7),
                                torch.nn.Linear(7, 2))
    model(torch.randn(8, 5))  # moves batch-norm running stats (and num_batches_tracked)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    if rank == root:
        model(torch.randn(8, 5)).sum().backward()
        opt.step()
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


def broadcast_object(rank, size):
    root = 1
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


def async_forms(rank, size):
    h = bps.push_pull_async(torch.ones(3, 4), average=True, name="async")
    out = bps.synchronize(h)
    assert bps.poll(h) and torch.equal(out, torch.ones(3, 4))
    t = torch.arange(6.0).reshape(2, 3).t()  # not contiguous
    assert torch.equal(bps.push_pull(t, average=True, name="noncontig"), t)


def differentiable(rank, size):
    """d(sum over workers)/dx = the number of workers."""
    x = torch.full((5,), float(rank), requires_grad=True)
    bps.push_pull(x, average=False, name="diff").sum().backward()
    assert torch.equal(x.grad, torch.full((5,), float(size))), x.grad


def allgather_unnamed(rank, size):
    """Unnamed allgathers are numbered in call order; values with a fraction stay exact."""
    assert torch.equal(bps.allgather(torch.arange(2) + 10 * rank),
                       torch.cat([torch.arange(2) + 10 * q for q in range(size)]))
    mine = torch.full((rank + 1, 3), rank - 0.5, dtype=torch.bfloat16)
    want = torch.cat([torch.full((q + 1, 3), q - 0.5, dtype=torch.bfloat16)
                      for q in range(size)])
    assert torch.equal(bps.allgather(mine, name="gather.half"), want)


def optimizer_join(rank, size):
    """Horovod's join semantics through DistributedOptimizer: rank r runs 2 + (size - 1 - r)
    steps; a joined rank contributes nothing; averages divide by the ranks still in; join()
    returns the rank that joined last (rank 0)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                   [(f"join.{n}", p) for n, p in model.named_parameters()])
    steps = 2 + (size - 1 - rank)
    for _ in range(steps):
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


def reduce_op(rank, size):
    """Horovod's op=: Average and Sum on push_pull and its forms, on allreduce and its forms, on
    DistributedOptimizer and DistributedDataParallel (op=Sum: gradients summed, not averaged);
    op with average, Horovod's other ops and a non-op are refused before anything travels."""
    s = float(sum(range(1, size + 1)))
    dev = device()

    def x():
        return torch.full((4,), float(rank + 1), device=dev)

    def is_(t, v):
        return torch.equal(t, torch.full((4,), v, device=dev))
    assert bps.Average == 0 and bps.Sum == 1   # Horovod's values
    assert is_(bps.push_pull(x(), name="op.sum", op=bps.Sum), s)
    assert is_(bps.push_pull(x(), name="op.avg", op=bps.Average), s / size)
    assert is_(bps.synchronize(bps.push_pull_async(x(), name="op.async", op=bps.Sum)), s)
    t = x()
    assert bps.push_pull_inplace(t, name="op.inplace", op=bps.Sum) is t and is_(t, s)
    t = x()
    bps.synchronize(bps.push_pull_async_inplace(t, name="op.async_inplace", op=bps.Sum))
    assert is_(t, s)
    assert is_(bps.allreduce(x(), name="op.ar", op=bps.Sum), s)
    assert is_(bps.allreduce(x(), name="op.ar.default"), s / size)   # neither: average
    t = x()
    assert bps.allreduce_(t, name="op.ar_", op=bps.Sum) is t and is_(t, s)
    assert is_(bps.synchronize(bps.allreduce_async(x(), name="op.ar.async", op=bps.Sum)), s)
    t = x()
    bps.synchronize(bps.allreduce_async_(t, name="op.ar.async_", op=bps.Sum))
    assert is_(t, s)
    xg = x().requires_grad_()   # differentiable: d(sum over workers)/dx = the worker count
    bps.allreduce(xg, name="op.diff", op=bps.Sum).sum().backward()
    assert is_(xg.grad, float(size)), xg.grad
    expect(ValueError, lambda: bps.allreduce(x(), average=True, name="op.both", op=bps.Sum),
           "not both")
    expect(ValueError, lambda: bps.push_pull(x(), name="op.adasum", op=2), "op=Adasum",
           "Average or Sum")
    for other in ("Adasum", "Min", "Max", "Product"):   # hvd.Adasum: there, and refused
        expect(ValueError, lambda: bps.allreduce(x(), name="op.hvd", op=getattr(bps, other)),
               f"op={other} is not supported")
    expect(TypeError, lambda: bps.push_pull(x(), name="op.bool", op=True), "op must be")
    # gradients: d(loss)/dw = rank + 1 everywhere; weight and bias share a fused bucket
    for op, want in ((bps.Sum, s), (bps.Average, s / size)):
        model = torch.nn.Linear(4, 2).to(dev)
        torch.nn.init.zeros_(model.weight)
        torch.nn.init.zeros_(model.bias)
        opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                       [(f"op{int(op)}.{n}", p)
                                        for n, p in model.named_parameters()], op=op)
        (model(torch.ones(1, 4, device=dev)) * (rank + 1)).sum().backward()
        opt.step()
        assert torch.equal(model.weight, torch.full((2, 4), -want, device=dev)), (op, model.weight)
        assert torch.equal(model.bias, torch.full((2,), -want, device=dev)), (op, model.bias)
    ddp = bps.DistributedDataParallel(torch.nn.Linear(4, 2).to(dev), op=bps.Sum)
    (ddp(torch.ones(1, 4, device=dev)) * (rank + 1)).sum().backward()
    w, b = ddp.module.weight.grad, ddp.module.bias.grad
    assert torch.equal(w, torch.full((2, 4), s, device=dev)), w
    assert torch.equal(b, torch.full((2,), s, device=dev)), b
    model = torch.nn.Linear(4, 2)
    expect(ValueError, lambda: bps.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0), model.named_parameters(), op=2), "Adasum")
    expect(ValueError, lambda: bps.DistributedDataParallel(model, op=5), "op=Product")


def sync_batchnorm(rank, size):
    """SyncBatchNorm (from convert_sync_batchnorm) on each rank's batch (of rank + 2 samples,
    channel means far from 0) equals BatchNorm on the concatenated batch: the output, the input
    gradient, the running statistics, and the weight/bias gradients summed over the ranks;
    over two steps, the second calling the layer twice. Eval mode uses the running statistics.
    """
    import copy
    c = 3
    dev = device()
    torch.manual_seed(7)   # the same model and data on every rank
    ref = torch.nn.Sequential(torch.nn.BatchNorm2d(c)).to(dev)
    with torch.no_grad():
        ref[0].weight.uniform_(0.5, 1.5)
        ref[0].bias.uniform_(-1.0, 1.0)
    model = bps.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(ref))
    bn = model[0]
    assert isinstance(bn, bps.SyncBatchNorm) and bn.training, type(bn)
    mine = slice(sum(q + 2 for q in range(rank)), sum(q + 2 for q in range(rank + 1)))

    def close(a, b, what):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5), (what, (a - b).abs().max().item())

    for step, calls in ((0, 1), (1, 2)):
        ref.zero_grad()
        model.zero_grad()
        xs = [torch.randn(sum(q + 2 for q in range(size)), c, 3, 2, device=dev) * 2 + 50 + 10 * k
              for k in range(calls)]
        ws = [torch.randn_like(x) for x in xs]
        xr = [x.clone().requires_grad_() for x in xs]
        yr = [ref(x) for x in xr]
        sum((y * w).sum() for y, w in zip(yr, ws)).backward()
        xm = [x[mine].clone().requires_grad_() for x in xs]
        ym = [model(x) for x in xm]
        sum((y * w[mine]).sum() for y, w in zip(ym, ws)).backward()
        for k in range(calls):
            close(ym[k], yr[k][mine], f"step {step} output {k}")
            close(xm[k].grad, xr[k].grad[mine], f"step {step} input gradient {k}")
        close(bn.running_mean, ref[0].running_mean, "running_mean")
        close(bn.running_var, ref[0].running_var, "running_var")
        assert torch.equal(bn.num_batches_tracked, ref[0].num_batches_tracked)
        for p, pr in ((bn.weight, ref[0].weight), (bn.bias, ref[0].bias)):
            close(bps.push_pull(p.grad, name=f"sbn.check.{step}", op=bps.Sum), pr.grad,
                  "parameter gradient")
    model.eval()
    ref.eval()
    x = torch.randn(4, c, 3, 2, device=dev) + 50
    close(model(x), ref(x), "eval")
    expect(ValueError, lambda: bps.SyncBatchNorm(3, process_group=object()), "process_group")


def cross_rank(rank, size):
    """cross_rank() is this worker's machine (its local ranks share it), cross_size() the number
    of machines; the same in the numpy API."""
    import byteps_like
    ls = bps.local_size()
    assert bps.cross_size() == size // ls == byteps_like.cross_size(), (bps.cross_size(), ls)
    assert bps.cross_rank() == rank // ls == byteps_like.cross_rank(), (bps.cross_rank(), ls)
    machines = bps.allgather(torch.tensor([[rank, bps.cross_rank(), bps.local_rank()]]),
                             name="cross.ranks")
    print(f"CROSS rank {rank} cross_rank {bps.cross_rank()} cross_size {bps.cross_size()} "
          f"all {machines.tolist()}", flush=True)
