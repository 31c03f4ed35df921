"""CrossBarrier in a one-process job: step() leaves the parameters as they are, the next
forward pass (or state_dict(), or flush()) applies the update, and the updates are those of
the plain optimizer; a forward that bypasses the model is refused by name, not mixed."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


@pytest.fixture
def bt():
    import byteps_like.torch as bt
    from byteps_like.worker.runtime import default_runtime, reset_default_runtime
    reset_default_runtime()
    bt.init()
    yield bt
    default_runtime().shutdown()
    reset_default_runtime()


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _data(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(5, 4, generator=g), torch.randn(5, 2, generator=g)


def test_cross_barrier_defers_each_update_to_the_next_forward(bt):
    from byteps_like.torch.cross_barrier import CrossBarrier
    ref, model = _model(), _model()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    opt = CrossBarrier(model, bt.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=0.01),
        named_parameters=model.named_parameters()))
    for step in range(4):
        x, y = _data(step)
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        before = [p.detach().clone() for p in model.parameters()]
        opt.step()
        assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    sd = model.state_dict()   # applies the last step's update
    for name, p in ref.state_dict().items():
        assert torch.equal(sd[name], p), name
    assert all(p.grad is None for p in model.parameters())  # used up as each bucket applied


def test_a_forward_that_bypasses_the_model_is_refused(bt):
    from byteps_like.errors import BytePSError
    from byteps_like.torch.cross_barrier import CrossBarrier
    model = _model()
    opt = CrossBarrier(model, bt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()))
    x, y = _data(0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    out = model[2](model[1](model[0](x)))  # submodules run their own hooks: applied
    torch.nn.functional.mse_loss(out, y).backward()
    opt.step()
    opt.zero_grad()
    # the parameters used directly, no module runs: their update is still waiting
    w, b = model[0].weight, model[0].bias
    out = torch.nn.functional.linear(x, w, b).sum()
    with pytest.raises(BytePSError, match=r"CrossBarrier: parameter '0\.(weight|bias)'"):
        out.backward()


def test_cross_barrier_wants_a_distributed_optimizer(bt):
    from byteps_like.torch.cross_barrier import CrossBarrier
    model = _model()
    with pytest.raises(TypeError, match="DistributedOptimizer"):
        CrossBarrier(model, torch.optim.SGD(model.parameters(), lr=0.1))
