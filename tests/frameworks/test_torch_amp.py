"""The AMP and torch.compile recipes of docs/frameworks/pytorch.md, on 2 CPU workers of a local
cluster (bpslaunch, loopback, under the harness's watchdog).

- ``amp``: ``torch.autocast("cpu", torch.bfloat16)`` and ``torch.amp.GradScaler("cpu")`` with
  ``DistributedOptimizer``: ``synchronize()``, ``scaler.unscale_(opt)``, clip, then
  ``scaler.step(opt)`` under ``skip_synchronize()``. At one step rank 1's loss is made infinite:
  the averaged gradient is then not finite on every worker, so every worker (and the reference)
  skips that update and halves its scale.
- ``compile``: the model is ``torch.compile``'d; the DistributedOptimizer's gradient hooks still
  fire per parameter during backward (every push_pull has started when backward returns). The
  test skips, saying why, where torch.compile cannot run (no C++ compiler).

Each worker also runs the single-process reference (the shards' gradients accumulated in one
process and averaged, then the same update), and checks after every step that its parameters
equal every other worker's exactly and the reference's, and at the end that it counted one
training step per iteration (``Runtime.steps``). The file is its own worker script: bpslaunch
runs ``python test_torch_amp.py MODE STEPS``.
"""
from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytestmark = pytest.mark.integration

PER_WORKER = 4
INF_STEP = 2          # amp: rank 1's loss is infinite at this step
INIT_SCALE = 2.0 ** 12


# ------------------------------------------------------------------------------------ the tests
def _run(mode: str, steps: int, timeout: float):
    from tests.integration.harness import bpslaunch
    return bpslaunch([str(Path(__file__).resolve()), mode, str(steps)], workers=2, servers=1,
                     timeout=timeout)


@functools.lru_cache(maxsize=1)
def _compile_unavailable() -> str | None:
    """Why torch.compile cannot run here (it needs a working C++ compiler for CPU code), or
    None. Probed in a child process, so a broken toolchain cannot take pytest down."""
    probe = ("import torch\n"
             "m = torch.compile(torch.nn.Linear(2, 2))\n"
             "m(torch.ones(1, 2, requires_grad=True)).sum().backward()\n")
    from tests.support import WatchdogError, run
    try:
        r = run([sys.executable, "-c", probe], 240)
    except WatchdogError:
        return "torch.compile of a Linear layer did not finish in 240 s"
    if r.rc != 0:   # the exception's own line, e.g. "...InvalidCxxCompiler: No working C++
        lines = (r.err + r.out).strip().splitlines()   # compiler found ..."
        errors = [ln for ln in lines if "Error" in ln and not ln.startswith(" ")]
        return ("torch.compile does not work on this machine: "
                + (errors or lines or ["(no output)"])[-1])
    return None


@pytest.mark.timeout(150)
def test_amp_autocast_bf16_gradscaler_recipe():
    r = _run("amp", 6, timeout=120)
    assert r.rc == 0, r.log
    assert len(r.lines("AMP-RECIPE OK amp")) == 2, r.log


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_torch_compile_model_with_distributed_optimizer():
    why = _compile_unavailable()
    if why:
        pytest.skip(why)
    r = _run("compile", 4, timeout=300)
    assert r.rc == 0, r.log
    assert len(r.lines("AMP-RECIPE OK compile")) == 2, r.log


# ------------------------------------------------------------------------------- the worker
def _worker(mode: str, steps: int) -> None:
    import torch
    import torch.nn.functional as F

    import byteps_like.torch as bps
    from byteps_like.worker.runtime import default_runtime

    bps.init()
    torch.set_num_threads(1)
    rank, size = bps.rank(), bps.size()

    def make_model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.Tanh(),
                                   torch.nn.Linear(16, 16), torch.nn.Tanh(),
                                   torch.nn.Linear(16, 3))

    def flat(m):
        return torch.cat([p.detach().reshape(-1) for p in m.parameters()])

    g = torch.Generator().manual_seed(42)
    X = torch.randn(steps, size * PER_WORKER, 10, generator=g)
    Y = torch.randint(0, 3, (steps, size * PER_WORKER), generator=g)
    amp = mode == "amp"

    def loss_of(m, step, shard):
        x, y = X[step, shard * PER_WORKER:(shard + 1) * PER_WORKER], \
            Y[step, shard * PER_WORKER:(shard + 1) * PER_WORKER]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            loss = F.cross_entropy(m(x), y)
        if amp and step == INF_STEP and shard == 1:
            loss = loss * float("inf")       # an overflow on one worker only
        return loss

    # the reference: every shard's gradient in this process, averaged, the same update
    ref = make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=2,
                                      enabled=amp)

    model = make_model()
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters())
    bps.broadcast_parameters(model.state_dict(), root_rank=0)
    net = torch.compile(model) if mode == "compile" else model
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=2, enabled=amp)
    # compiled kernels round differently from eager ones; with AMP the sums of 2 workers and
    # the scaling by powers of 2 are exact: the reference matches to the bit
    tol = 1e-5 if mode == "compile" else 0.0

    skipped = 0
    for step in range(steps):
        ref_opt.zero_grad()
        for shard in range(size):
            ref_scaler.scale(loss_of(ref, step, shard)).backward()
        for p in ref.parameters():
            p.grad /= size
        ref_scaler.unscale_(ref_opt)
        if amp:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_scaler.step(ref_opt)
        ref_scaler.update()

        before, scale = flat(model), scaler.get_scale()
        opt.zero_grad()
        nbuckets = len(opt._sync.buckets)   # the gradients, fused into buckets
        if amp:   # the recipe of docs/frameworks/pytorch.md
            scaler.scale(loss_of(net, step, rank)).backward()
            # every bucket's push_pull started during backward (the hooks fired)
            assert opt._sync.in_flight == nbuckets, opt._sync.in_flight
            opt.synchronize()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            with opt.skip_synchronize():
                scaler.step(opt)
            scaler.update()
        else:     # compile: the plain loop on the compiled model
            loss_of(net, step, rank).backward()
            assert opt._sync.in_flight == nbuckets, opt._sync.in_flight
            opt.step()

        mine = flat(model)
        if amp and step == INF_STEP:
            assert torch.equal(mine, before), f"rank {rank}: the overflowed step was applied"
            assert scaler.get_scale() == ref_scaler.get_scale() == scale / 2
            skipped += 1
        else:
            assert not torch.equal(mine, before), f"rank {rank}: step {step} changed nothing"
        assert torch.isfinite(mine).all()
        diff = (mine - flat(ref)).abs().max().item()
        assert diff <= tol, f"step {step}: rank {rank} differs from the reference by {diff}"
        avg = bps.push_pull(mine.clone(), average=True, name="check.parameters")
        assert torch.equal(avg, mine), f"step {step}: the workers' parameters differ"
    assert scaler.get_scale() == ref_scaler.get_scale()
    noted = list(default_runtime().steps.values())
    assert noted == [steps], f"training steps counted: {noted}, expected [{steps}]"
    print(f"AMP-RECIPE OK {mode} rank {rank} of {size}: {steps} steps ({skipped} skipped), "
          f"max diff from the reference {diff:.2e}, scale {scaler.get_scale()}", flush=True)
    bps.shutdown()


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]))
