"""Multi-GPU benchmark of one machine: NCCL local reduction and training throughput, against
torch.distributed NCCL measured in the same processes and the same run.

    bpslaunch --local --workers 1 --local-size 2 --servers 1 -- \\
        python examples/pytorch/gpu_benchmark.py --nccl-port 29533

Every local rank drives GPU <local rank>. Rank 0 prints two tables:
1. per size: torch.distributed NCCL all_reduce; byteps_like's local path alone (NCCL
   reduce-scatter, each rank's slice to host shared memory and back, NCCL all-gather); and the
   whole push_pull through the server on this host;
2. synthetic training (an MLP): byteps_like.torch DistributedOptimizer against
   torch.nn.parallel.DistributedDataParallel with NCCL, images per second.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import byteps_like.torch as bps
from byteps_like.torch import nccl
from byteps_like.worker.runtime import default_runtime


def timed(fn, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(repeats):
        default_runtime().barrier()
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def staging(mib: int, part: int, repeats: int) -> tuple[float, float]:
    """Seconds for D2H + H2D of ``mib`` MiB: plain pinned copies of the whole tensor, and
    byteps_like's CudaCopier partition by partition (as the pipeline drives it)."""
    from byteps_like.torch._tensor import CudaCopier, pinned_buffer
    x = torch.ones((mib << 20) // 4, device="cuda")
    out = torch.empty_like(x)
    host = pinned_buffer(f"staging.{mib}", x)

    def plain():
        host.copy_(x, non_blocking=True)
        out.copy_(host, non_blocking=True)

    def copier():
        c = CudaCopier(x, out, host)
        for off in range(0, x.nbytes, part):
            n = min(part, x.nbytes - off)
            c.d2h(off, n)
            c.h2d(off, n)
        c.finish()
    t_plain = timed(plain, repeats)
    t_copier = timed(copier, repeats)
    assert torch.equal(out, x)
    return t_plain, t_copier


def make_model(hidden: int, layers: int) -> torch.nn.Module:
    mods = [torch.nn.Linear(1024, hidden), torch.nn.ReLU()]
    for _ in range(layers - 1):
        mods += [torch.nn.Linear(hidden, hidden), torch.nn.ReLU()]
    return torch.nn.Sequential(*mods, torch.nn.Linear(hidden, 10))


def train(model, opt, batch: int, iters: int) -> float:
    x = torch.randn(batch, 1024, device="cuda")
    y = torch.randint(0, 10, (batch,), device="cuda")

    def step():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return batch / timed(step, iters, warmup=3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="4,64,256", help="MiB, comma-separated")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--nccl-port", type=int, required=True, help="for torch.distributed")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--iters", type=int, default=10)
    a = ap.parse_args()

    bps.init()
    r, L = bps.local_rank(), bps.local_size()
    torch.cuda.set_device(r)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{a.nccl_port}", rank=r,
                            world_size=L)
    rt = default_runtime()
    stage_rows = [(mib, *staging(mib, 4096000, a.repeats)) for mib in (64, 256)]
    rows = []
    for mib in (int(s) for s in a.sizes.split(",")):
        n = (mib << 20) // 4
        x = torch.ones(n, device="cuda")
        t_ar = timed(lambda: dist.all_reduce(x), a.repeats)
        out = torch.empty_like(x)

        def local_only():
            op = nccl.NcclPushPull(rt, x, out, f"local.{mib}", False, 0)
            op.finish()  # no network: reduce-scatter, slice to shm and back, all-gather
        t_local = float("nan")
        if L > 1:  # the NCCL local path needs several local ranks
            t_local = timed(local_only, a.repeats)
            assert torch.equal(out, x * L), "local reduction result"
        y = torch.ones(n, device="cuda")
        t_pp = timed(lambda: bps.push_pull_inplace(y, average=False, name=f"pp.{mib}"),
                     a.repeats, warmup=1)
        rows.append((mib, t_ar, t_local, t_pp))

    model = make_model(a.hidden, a.layers).cuda()
    params = sum(p.numel() for p in model.parameters())
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   model.named_parameters())
    bps_ips = train(model, opt, a.batch_size, a.iters) * L
    ddp_model = torch.nn.parallel.DistributedDataParallel(
        make_model(a.hidden, a.layers).cuda(), device_ids=[r])
    ddp_ips = train(ddp_model, torch.optim.SGD(ddp_model.parameters(), lr=0.01),
                    a.batch_size, a.iters) * L

    if r == 0:
        gpus = ", ".join(torch.cuda.get_device_name(i) for i in range(L))
        print(f"{L} local ranks on {gpus}; torch {torch.__version__}; medians of {a.repeats}")
        print("| size | NCCL all_reduce ms (GB/s) | byteps_like local RS+staging+AG ms (GB/s) "
              "| local / all_reduce | push_pull via server ms (GB/s) |")
        print("|---:|---:|---:|---:|---:|")
        for mib, t_ar, t_local, t_pp in rows:
            nb = mib << 20
            print(f"| {mib} MiB | {t_ar * 1e3:.2f} ({nb / t_ar / 1e9:.1f}) | "
                  f"{t_local * 1e3:.2f} ({nb / t_local / 1e9:.1f}) | {t_ar / t_local:.2f} | "
                  f"{t_pp * 1e3:.1f} ({nb / t_pp / 1e9:.2f}) |")
        print("| staging size | pinned D2H+H2D ms (GB/s) | CudaCopier, 4096000-byte partitions "
              "ms (GB/s) | ratio |")
        print("|---:|---:|---:|---:|")
        for mib, tp, tc in stage_rows:
            nb = 2 * (mib << 20)  # bytes moved: both directions
            print(f"| {mib} MiB | {tp * 1e3:.2f} ({nb / tp / 1e9:.1f}) | {tc * 1e3:.2f} "
                  f"({nb / tc / 1e9:.1f}) | {tp / tc:.2f} |")
        print(f"synthetic MLP ({params / 1e6:.1f}M parameters, batch {a.batch_size} per GPU): "
              f"byteps_like {bps_ips:.0f} img/s total, DDP NCCL {ddp_ips:.0f} img/s total, "
              f"ratio {bps_ips / ddp_ips:.2f}")
    dist.barrier()
    dist.destroy_process_group()
    bps.shutdown()


if __name__ == "__main__":
    main()
