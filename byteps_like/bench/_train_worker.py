"""One process of ``python -m byteps_like.bench train`` (started by :mod:`.train`):

``python -m byteps_like.bench._train_worker MODE --model NAME [options]`` with MODE one of

- ``local``: the model alone, no communication (the bound of the others);
- ``byteps_like``: a worker of a byteps_like job (``bps.init()``, ``DistributedOptimizer``,
  ``broadcast_parameters``); after the timed steps it measures the exchange of one step's
  gradients alone and a single-tensor push_pull of the same bytes (see :func:`run_bps`);
- ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` (``--backend nccl|gloo``, rendezvous
  through MASTER_ADDR/MASTER_PORT, which the driver sets);
- ``horovod``: ``horovod.torch.DistributedOptimizer`` (run with an interpreter that has it).

Every mode runs ``--warmup`` untimed and ``--steps`` timed training steps (zero_grad, forward
under bf16 autocast on CUDA unless ``--no-amp``, backward, step; on CUDA the device is synchronised
before and after each step, so a step's time is its whole work) on one synthetic batch
(:mod:`.models`), and prints one ``BENCH_RESULT {json}`` line (:func:`.report.emit`) with the
per-step times; progress goes to stderr. A worker of rank r uses ``cuda:(r % GPUs)``.
Nothing runs on import.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from . import models
from .links import SlowCompute, straggler_arg
from .report import emit, end_torch_distributed, progress

PROGRESS_EVERY_S = 10.0


class Trainer:
    """The model of one worker on its device, and the timed training loop."""

    def __init__(self, a: argparse.Namespace, rank: int):
        import torch
        self.torch = torch
        self.rank = rank
        self.slow = SlowCompute(a.straggler, rank)
        if a.threads:
            torch.set_num_threads(a.threads)
        if a.device == "cuda":
            n = torch.cuda.device_count()
            if n == 0:
                raise RuntimeError("--device cuda: this worker sees no CUDA device")
            self.dev = torch.device("cuda", rank % n)
            torch.cuda.set_device(self.dev)
            torch.backends.cudnn.benchmark = True
        else:
            self.dev = torch.device("cpu")
        self.amp = a.device == "cuda" and not a.no_amp
        self.work = models.build(a.model, self.dev, a.batch or None, seed=1000 + rank)
        self.grads, self.grad_bytes = models.gradient_info(self.work.model)
        self.last_loss = math.nan

    def optimizer(self, params: Any) -> Any:
        return self.torch.optim.SGD(params, lr=self.work.lr, momentum=0.9)

    def autocast(self) -> Any:
        if self.amp:
            return self.torch.autocast("cuda", dtype=self.torch.bfloat16)
        return contextlib.nullcontext()

    def sync(self) -> None:
        if self.dev.type == "cuda":
            self.torch.cuda.synchronize(self.dev)

    def loss(self, model: Any) -> Any:
        with self.autocast():
            return self.work.loss(model, self.work.batch)

    def steps(self, model: Any, opt: Any, steps: int, warmup: int) -> list[float]:
        """``warmup`` untimed, then ``steps`` timed training steps; the timed steps' seconds."""
        times: list[float] = []
        t_start = last = time.perf_counter()
        loss = None
        for i in range(warmup + steps):
            self.sync()
            t0 = time.perf_counter()
            self.slow.start()
            opt.zero_grad(set_to_none=True)
            loss = self.loss(model)
            self.slow.delay()    # --straggler: this rank's gradients come FACTOR times later
            loss.backward()
            if self.slow.factor > 1:   # its compute: forward and backward (synchronised)
                self.sync()
                self.slow.stop()
            opt.step()
            self.sync()
            t1 = time.perf_counter()
            if i >= warmup:
                times.append(t1 - t0)
            if self.rank == 0:
                if i + 1 == warmup:
                    progress(f"{warmup} warm-up steps done in {t1 - t_start:.1f} s")
                elif t1 - last > PROGRESS_EVERY_S and i >= warmup:
                    progress(f"step {i + 1 - warmup}/{steps}: median so far "
                             f"{statistics.median(times) * 1e3:.1f} ms")
                    last = t1
        if loss is not None:
            self.last_loss = float(loss.detach().float().item())
        if self.rank == 0 and times:
            progress(f"{steps} timed steps: median {statistics.median(times) * 1e3:.1f} ms")
        return times

    def result(self, mode: str, times: list[float], **extra: Any) -> dict:
        out = {"mode": mode, "rank": self.rank, "device": str(self.dev), "amp": self.amp,
               "batch": self.work.batch_size, "gradients": self.grads,
               "gradient_bytes": self.grad_bytes, "step_times_s": times,
               "loss": self.last_loss if math.isfinite(self.last_loss) else None}
        if self.dev.type == "cuda":
            out["gpu"] = self.torch.cuda.get_device_name(self.dev)
            out["max_memory_bytes"] = self.torch.cuda.max_memory_allocated(self.dev)
        out.update(extra)
        return out


# ------------------------------------------------------------------------------------- modes
def run_local(a: argparse.Namespace) -> int:
    tr = Trainer(a, 0)
    opt = tr.optimizer(tr.work.model.parameters())
    emit(tr.result("local", tr.steps(tr.work.model, opt, a.steps, a.warmup)))
    return 0


def _timed(tr: Trainer, barrier: Callable[[], None], fn: Callable[[], Any],
           repeats: int) -> list[float]:
    """One untimed call of ``fn``, then ``repeats`` timed ones, each after a barrier of every
    worker (so no worker's time includes waiting for another's late start)."""
    times = []
    for i in range(1 + repeats):
        barrier()
        tr.sync()
        t0 = time.perf_counter()
        fn()
        tr.sync()
        if i:
            times.append(time.perf_counter() - t0)
    return times


def run_bps(a: argparse.Namespace) -> int:
    """The training steps through byteps_like, then two measurements of the exchange alone:

    - ``exchange``: one backward (gradients computed with ``torch.autograd.grad`` and put into
      ``.grad``, so no push_pull starts during it), then ``optimizer.synchronize()`` timed alone:
      every gradient's push_pull is started and waited for, with whatever fusion, partitioning
      and scheduling the library does; ``--exchange-repeats`` times (it averages the gradients
      in place, which changes nothing measurable);
    - ``single``: ``bps.push_pull_inplace`` of one flat float32 tensor of the gradients' total
      bytes, on the model's device, with the same compression: what the engine does with the
      same bytes in one piece.
    """
    import byteps_like.torch as bps
    bps.init()
    rank = bps.rank()
    tr = Trainer(a, rank)
    model = tr.work.model
    torch = tr.torch
    comp = bps.Compression.fp16 if a.compression == "fp16" else bps.Compression.none
    opt = bps.DistributedOptimizer(tr.optimizer(model.parameters()),
                                   named_parameters=model.named_parameters(), compression=comp)
    if a.cross_barrier:
        from byteps_like.torch.cross_barrier import CrossBarrier
        opt = CrossBarrier(model, opt)
    bps.broadcast_parameters(model.state_dict(), root_rank=0)
    times = tr.steps(model, opt, a.steps, a.warmup)
    opt.flush()  # CrossBarrier: the last step's updates (nothing otherwise)

    params = [p for p in model.parameters() if p.requires_grad]
    opt.zero_grad(set_to_none=True)
    grads = torch.autograd.grad(tr.loss(model), params, allow_unused=True)
    if getattr(getattr(opt, "_sync", None), "in_flight", 0):
        raise RuntimeError("a push_pull started during torch.autograd.grad: the exchange "
                           "measurement would include the backward pass")
    with torch.no_grad():
        for p, g in zip(params, grads):
            p.grad = torch.zeros_like(p) if g is None else g.contiguous()
    exchange = _timed(tr, bps.barrier, opt.synchronize, a.exchange_repeats)
    if rank == 0:
        progress(f"exchange alone (optimizer.synchronize): median "
                 f"{statistics.median(exchange) * 1e3:.1f} ms")
    for p in params:
        p.grad = None
    nelem = tr.grad_bytes // 4
    flat = torch.ones(nelem, dtype=torch.float32, device=tr.dev)
    single = _timed(tr, bps.barrier, lambda: bps.push_pull_inplace(
        flat, average=True, name="bench.train.single", compression=comp), a.exchange_repeats)
    if rank == 0:
        progress(f"single-tensor push_pull of {tr.grad_bytes / (1 << 20):.1f} MiB: median "
                 f"{statistics.median(single) * 1e3:.1f} ms")
    size = bps.size()
    bps.shutdown()
    emit(tr.result("byteps_like", times, exchange_s=exchange, single_tensor_s=single,
                   world=size, compression=a.compression))
    return 0


def run_ddp(a: argparse.Namespace) -> int:
    """DistributedDataParallel with its defaults (25 MiB buckets); the rendezvous address is
    MASTER_ADDR/MASTER_PORT of the environment the driver gave (``env://``)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    tr = Trainer(a, a.rank)   # sets the CUDA device first: NCCL binds to it
    dist.init_process_group(a.backend, rank=a.rank, world_size=a.world)
    try:
        cuda = tr.dev.type == "cuda"
        ddp = DDP(tr.work.model, device_ids=[tr.dev.index] if cuda else None)
        opt = tr.optimizer(ddp.parameters())
        times = tr.steps(ddp, opt, a.steps, a.warmup)
    except BaseException:
        dist.destroy_process_group()
        raise
    end_torch_distributed(dist, tr.result("ddp", times, backend=a.backend, world=a.world))


def run_horovod(a: argparse.Namespace) -> int:
    import horovod.torch as hvd
    hvd.init()
    tr = Trainer(a, hvd.rank())
    model = tr.work.model
    comp = hvd.Compression.fp16 if a.compression == "fp16" else hvd.Compression.none
    opt = hvd.DistributedOptimizer(tr.optimizer(model.parameters()),
                                   named_parameters=model.named_parameters(), compression=comp)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    times = tr.steps(model, opt, a.steps, a.warmup)
    size = hvd.size()
    hvd.shutdown()
    emit(tr.result("horovod", times, world=size, compression=a.compression))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m byteps_like.bench._train_worker")
    p.add_argument("mode", choices=("local", "byteps_like", "ddp", "horovod"))
    p.add_argument("--model", required=True, choices=tuple(models.MODELS))
    p.add_argument("--batch", type=int, default=0, help="per worker; 0 = the model's default")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--no-amp", action="store_true")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads; 0 = torch's own")
    p.add_argument("--compression", choices=("none", "fp16"), default="none")
    p.add_argument("--exchange-repeats", type=int, default=5)
    p.add_argument("--straggler", type=straggler_arg, default=None, metavar="RANK:FACTOR",
                   help="worker RANK's compute FACTOR times as long (bench/links.py)")
    p.add_argument("--cross-barrier", action="store_true", help="byteps_like: CrossBarrier")
    p.add_argument("--backend", choices=("nccl", "gloo"), default="gloo", help="ddp")
    p.add_argument("--rank", type=int, default=0, help="ddp")
    p.add_argument("--world", type=int, default=1, help="ddp")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    run = {"local": run_local, "byteps_like": run_bps, "ddp": run_ddp,
           "horovod": run_horovod}[a.mode]
    return run(a)


if __name__ == "__main__":
    raise SystemExit(main())
