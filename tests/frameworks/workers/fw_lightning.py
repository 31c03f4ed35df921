"""Conformance adapter: byteps_like.lightning.BytePSStrategy, through the calls Lightning makes
on its strategy (``reduce`` for ``self.log(..., sync_dist=True)``, ``all_gather``,
``broadcast``, ``barrier``) and a Trainer's ``fit`` (its own cases, EXTRAS).

The common cases map onto the strategy's collectives where Lightning has one: push_pull is
``reduce`` (sum or mean; keys named by the strategy, not the caller), broadcast is
``broadcast``. Lightning's API has no call before the job exists (the strategy joins it when it
is made), no all-gather of tensors of different lengths (its ``all_gather`` stacks same-shape
tensors: case ``all_gather_stack``), no compression of a collective (the strategy compresses
gradients: case ``fit_compressed``), no tensor names to mismatch and no join: those cases say
MISSING, with why (test_conformance.py's XFAIL). The strategy's gradients go through
``byteps_like.torch.DistributedOptimizer``, whose wire order the torch adapter checks.
"""
from __future__ import annotations

import numpy as np
import torch
from fw_torch import Adapter as TorchAdapter

import byteps_like.torch as bps
from tests.support import expect


class Adapter(TorchAdapter):
    name = "lightning"
    bps = bps
    # the average of an integer tensor is a float in Lightning (DDP's semantics): reduce_ops
    dtypes = ["float32", "float64", "float16", "bfloat16"]
    broadcast_dtypes = ["float32", "float64", "int64"]
    gather_dtypes = ["float32"]

    LACKS = {"mismatch": "Lightning's collectives take no tensor name (the strategy names "
                         "each key by its dtype and shape), so no name can differ between ranks",
             "join": "Lightning has no join(): its DistributedSampler evens out the ranks' "
                     "inputs (it pads the shorter shards)"}
    EXTRA_CASES = ("reduce_ops", "all_gather_stack", "all_gather_grads", "broadcast_objects",
                   "barrier", "fit_same_weights", "fit_compressed")

    @property
    def strategy(self):
        if not bps.is_initialized():
            raise NotImplementedError("BytePSStrategy joins the job when it is made (it calls "
                                      "init()): Lightning has no collective before it")
        return _s()

    def before_init(self):
        pass

    def push_pull(self, t, name: str, average: bool | None):
        s = self.strategy
        if average is None:
            return s.reduce(t)   # Lightning's default reduce_op: mean
        return s.reduce(t, reduce_op="mean" if average else "sum")

    def push_pull_fp16(self, t, name: str):
        raise NotImplementedError("the strategy's collectives are not compressed; its gradients "
                                  "are (BytePSStrategy(compression=...): fit_compressed)")

    def broadcast(self, t, root: int, name: str):
        before = t.clone()
        y = self.strategy.broadcast(t, src=root)
        assert torch.equal(t, before), "broadcast changed its input"
        return y

    def allgather(self, t, name: str):
        raise NotImplementedError("Lightning's all_gather stacks tensors of one shape along a "
                                  "new dimension (all_gather_stack), it does not concatenate "
                                  "tensors of different lengths")

    def gradients(self):
        raise NotImplementedError("a Trainer's fit runs backward and the step in one call, so "
                                  "the push credit cannot be held between them; the strategy's "
                                  "gradients go through DistributedOptimizer, the torch "
                                  "adapter's wire_order")


_STRATEGY = []   # the one strategy of the process, made once the job exists


def _s():
    """The strategy Lightning would call (made after init(): it would join the job itself)."""
    if not _STRATEGY:
        from byteps_like.lightning import BytePSStrategy
        _STRATEGY.append(BytePSStrategy())
    return _STRATEGY[0]


# -- the strategy's own contract ----------------------------------------------------------------
def reduce_ops(rank, size):
    """Every reduce_op Lightning passes (strings, torch.distributed.ReduceOp, None), integer
    and boolean tensors as Lightning's DDP strategy reduces them, anything but a tensor back as
    it is, and the refusals (a process group, an unknown op)."""
    from torch.distributed import ReduceOp
    s, st = sum(range(size)), _s()
    x = torch.tensor([float(rank), 2.0 * rank + 1])
    want = {"sum": [s, 2.0 * s + size], "mean": [s / size, (2.0 * s + size) / size],
            "max": [size - 1.0, 2.0 * size - 1], "min": [0.0, 1.0]}
    for op, values in want.items():
        assert torch.equal(st.reduce(x, reduce_op=op), torch.tensor(values)), op
    for op, key in ((ReduceOp.SUM, "sum"), (ReduceOp.AVG, "mean"), (ReduceOp.MAX, "max"),
                    (ReduceOp.MIN, "min"), ("avg", "mean"), ("SUM", "sum"), (None, "mean")):
        assert torch.equal(st.reduce(x, reduce_op=op), torch.tensor(want[key])), op
    # integers: sums keep the dtype, a mean is the sum over the world size, a float
    n = torch.tensor([rank, 3], dtype=torch.int64)
    total = st.reduce(n, reduce_op="sum")
    assert total.dtype == torch.int64 and total.tolist() == [s, 3 * size], total
    mean = st.reduce(n, reduce_op="mean")
    assert mean.is_floating_point() and torch.allclose(
        mean, torch.tensor([s / size, 3.0], dtype=mean.dtype)), mean
    flags = st.reduce(torch.tensor([rank == 0, True]), reduce_op="sum")
    assert flags.tolist() == [1, size], flags
    assert st.reduce(3.5) == 3.5 and st.reduce("text") == "text"
    expect(ValueError, lambda: st.reduce(x, reduce_op="prod"), "not supported")
    expect(ValueError, lambda: st.reduce(x, group=object()), "process groups")


def all_gather_stack(rank, size):
    """Lightning's all_gather: every rank's tensor (one shape) stacked along a new first
    dimension, in rank order, its dtype kept; a scalar becomes a vector."""
    st = _s()
    for dt in (torch.float32, torch.int64, torch.bfloat16):
        got = st.all_gather(torch.full((2, 3), rank + 1, dtype=dt))
        want = torch.stack([torch.full((2, 3), q + 1, dtype=dt) for q in range(size)])
        assert got.dtype == dt and torch.equal(got, want), (dt, got)
    got = st.all_gather(torch.tensor(float(rank)))
    assert torch.equal(got, torch.arange(size, dtype=torch.float32)), got
    expect(ValueError, lambda: st.all_gather(torch.ones(2), group=object()), "process groups")


def all_gather_grads(rank, size):
    """all_gather(sync_grads=True) is differentiable: rank r's slice gets the gradient every
    rank computed for it, summed (torch.distributed.nn's all_gather)."""
    x = torch.full((3,), float(rank), requires_grad=True)
    gathered = _s().all_gather(x, sync_grads=True)
    weights = torch.arange(1.0, size + 1).reshape(size, 1)   # slot q weighted q + 1
    (gathered * weights).sum().backward()
    assert torch.equal(x.grad, torch.full((3,), float(size * (rank + 1)))), x.grad


def broadcast_objects(rank, size):
    """What Lightning broadcasts: paths (checkpoint directories), strings, numbers, dicts of
    tensors; from any source rank; an object it cannot carry is refused (no pickle)."""
    from pathlib import Path
    st = _s()
    got = st.broadcast(Path(f"/ckpt/rank{rank}"), src=0)
    assert isinstance(got, Path) and got == Path("/ckpt/rank0"), got
    got = st.broadcast({"epoch": rank, "loss": torch.tensor([rank + 0.5]), "tag": f"r{rank}"},
                       src=size - 1)
    assert got["epoch"] == size - 1 and got["tag"] == f"r{size - 1}", got
    assert torch.equal(got["loss"], torch.tensor([size - 0.5])), got
    assert st.broadcast(None, src=0) is None


def barrier(rank, size):
    """barrier() returns on every rank, and the job goes on after it."""
    st = _s()
    st.barrier("conformance")
    assert torch.equal(st.reduce(torch.ones(2), reduce_op="sum"), torch.full((2,), size * 1.0))


def _fit(compression, label: str) -> torch.Tensor:
    """A Trainer's fit of a small model on data that differs per rank, 6 steps; the weights
    after it, flat. ``label`` names the model's layers: a gradient's name is its tensor's in
    the job, so a fit with another compression needs parameters of other names (the same name
    on the wire in float32, then float16, is a MismatchError)."""
    import lightning.pytorch as pl

    from byteps_like.lightning import BytePSStrategy

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.add_module(label, torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                                       torch.nn.Linear(16, 2)))

        def training_step(self, batch, _i):
            x, y = batch
            loss = torch.nn.functional.cross_entropy(getattr(self, label)(x), y)
            self.log("loss", loss, sync_dist=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    torch.manual_seed(1000 + bps.rank())   # every rank starts elsewhere: setup broadcasts
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(96, 8, generator=g), torch.randint(0, 2, (96,), generator=g)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    model = Net()
    trainer = pl.Trainer(strategy=BytePSStrategy(compression=compression), accelerator="cpu",
                         devices=1, max_steps=6, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, data)   # Lightning's DistributedSampler gives each rank its shard
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _same_everywhere(flat: torch.Tensor) -> None:
    every = bps.allgather(flat.reshape(1, -1), name=f"conformance.fit.{flat.numel()}")
    assert all(torch.equal(every[0], row) for row in every), "the ranks' weights differ"


def fit_same_weights(rank, size):
    """A Trainer(strategy=BytePSStrategy()) fit: every rank starts from rank 0's weights and
    ends with the same weights, which differ from where they started."""
    flat = _fit(bps.Compression.none, "plain")
    _same_everywhere(flat)
    assert np.isfinite(flat.numpy()).all()


def fit_compressed(rank, size):
    """The same fit with the gradients compressed to fp16 (BytePSStrategy(compression=...)):
    the ranks still hold the same weights."""
    _same_everywhere(_fit(bps.Compression.fp16, "halved"))
