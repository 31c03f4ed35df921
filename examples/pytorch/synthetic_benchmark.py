"""Synthetic training throughput of byteps_like.torch, or of PyTorch DDP over gloo, on one model.

In the style of BytePS's ``example/pytorch/benchmark_byteps.py``: random images and labels,
forward + backward + step, timed in iterations of ``--num-batches-per-iter`` batches after
``--num-warmup-batches`` untimed ones.

    # byteps_like (any launch of a byteps_like job; without a launcher: one process)
    bpslaunch --local --workers 2 --servers 1 -- python examples/pytorch/synthetic_benchmark.py

    # the same model with torch.nn.parallel.DistributedDataParallel over gloo; rendezvous from
    # MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE (env://), or --dist-url tcp://HOST:PORT
    MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 WORLD_SIZE=2 RANK=0 \\
        python examples/pytorch/synthetic_benchmark.py --ddp-gloo &   # and RANK=1

    # both, for 1, 2 and 4 workers, in one run, with a table at the end
    python examples/pytorch/synthetic_benchmark.py --compare --workers 1,2,4

Rank 0 prints ``Iter #i: X img/sec per worker`` (its own rate) and at the end, over all workers
(each iteration's rates summed across workers; mean and 1.96 standard deviations over the
iterations):

    Img/sec per worker: MEAN +-CONF
    Total img/sec on N worker(s): MEAN +-CONF
"""
from __future__ import annotations

import argparse
import gc
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # examples/: synthetic_loop
from synthetic_loop import timed_iters  # noqa: E402

# Defaults of a single measurement, and the smaller ones --compare uses unless told otherwise
# (a whole comparison must stay within a few minutes on a 2-core machine).
DEFAULTS = dict(model="mlp", batch_size=32, num_warmup_batches=10, num_batches_per_iter=10,
                num_iters=10, mlp_hidden=2560, mlp_layers=3)
COMPARE_DEFAULTS = dict(model="mlp", batch_size=32, num_warmup_batches=5, num_batches_per_iter=5,
                        num_iters=10, mlp_hidden=1024, mlp_layers=2)
TOTAL_RE = re.compile(r"Total img/sec on (\d+) worker\(s\): ([0-9.]+) \+-([0-9.]+)")


# ---------------------------------------------------------------------------------------------
# Models (defined here: torchvision is not needed)
# ---------------------------------------------------------------------------------------------

def make_model(args):
    import torch
    from torch import nn

    if args.model == "mlp":
        layers: list[nn.Module] = [nn.Flatten()]
        width = 3 * args.image_size * args.image_size
        for _ in range(args.mlp_layers):
            layers += [nn.Linear(width, args.mlp_hidden), nn.ReLU()]
            width = args.mlp_hidden
        layers.append(nn.Linear(width, args.num_classes))
        return nn.Sequential(*layers)

    if args.model == "cnn":   # a small LeNet-like convolutional net
        return nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4),
            nn.Flatten(), nn.Linear(128 * 16, 512), nn.ReLU(), nn.Linear(512, args.num_classes))

    class BasicBlock(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int):
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.shortcut = nn.Sequential()
            if stride != 1 or cin != cout:
                self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                              nn.BatchNorm2d(cout))

        def forward(self, x):
            out = torch.relu(self.bn1(self.conv1(x)))
            return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))

    class ResNet18(nn.Module):
        """ResNet-18's blocks and widths (11.7M parameters with 1000 classes), with the
        CIFAR-style 3x3 stem so that small synthetic images stay cheap on a CPU."""

        def __init__(self, num_classes: int):
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64),
                                      nn.ReLU())
            blocks, cin = [], 64
            for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
                blocks += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
                cin = cout
            self.layers = nn.Sequential(*blocks)
            self.pool = nn.AdaptiveAvgPool2d(1)
            self.fc = nn.Linear(512, num_classes)

        def forward(self, x):
            return self.fc(torch.flatten(self.pool(self.layers(self.stem(x))), 1))

    return ResNet18(args.num_classes)


# ---------------------------------------------------------------------------------------------
# One measurement (a worker of a byteps_like job, or a DDP-gloo process)
# ---------------------------------------------------------------------------------------------

class _Comm:
    """The few collective operations the benchmark itself needs, for either framework."""

    def __init__(self, ddp: bool):
        self.ddp = ddp
        if ddp:
            import torch.distributed as dist
            self.dist = dist
            self.rank, self.size = dist.get_rank(), dist.get_world_size()
        else:
            import byteps_like.torch as bps
            self.bps = bps
            self.rank, self.size = bps.rank(), bps.size()

    def sum(self, values: list[float], name: str) -> list[float]:
        import torch
        t = torch.tensor(values, dtype=torch.float64)
        if self.size == 1:
            return t.tolist()
        if self.ddp:
            self.dist.all_reduce(t)
            return t.tolist()
        return self.bps.push_pull(t, average=False, name=name).tolist()


def run_benchmark(args) -> int:
    import torch
    import torch.nn.functional as F

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.ddp_gloo:
        import torch.distributed as dist
        init = args.dist_url or "env://"
        kw = {}
        if init != "env://":  # tcp:// or file:// rendezvous: rank and size from the environment
            kw = dict(rank=int(os.environ.get("RANK", "0")),
                      world_size=int(os.environ.get("WORLD_SIZE", "1")))
        dist.init_process_group("gloo", init_method=init, **kw)
    else:
        import byteps_like.torch as bps
        bps.init()
    comm = _Comm(args.ddp_gloo)
    rank, size = comm.rank, comm.size

    def log(msg: str) -> None:
        if rank == 0:
            print(msg, flush=True)

    torch.manual_seed(0)
    model = make_model(args)
    nparams = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    if args.ddp_gloo:
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(model)   # broadcasts rank 0's parameters
        if args.fp16_pushpull:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        framework = "torch DistributedDataParallel (gloo)"
    else:
        compression = bps.Compression.fp16 if args.fp16_pushpull else bps.Compression.none
        optimizer = bps.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                             compression=compression)
        bps.broadcast_parameters(model.state_dict(), root_rank=0)
        bps.broadcast_optimizer_state(optimizer, root_rank=0)
        framework = "byteps_like.torch"

    data = torch.rand(args.batch_size, 3, args.image_size, args.image_size)
    target = torch.randint(0, args.num_classes, (args.batch_size,))

    def benchmark_step() -> None:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        loss.backward()
        optimizer.step()

    log(f"Framework: {framework}")
    log(f"Model: {args.model} ({nparams / 1e6:.2f}M parameters, "
        f"{nparams * 4 / 2**20:.1f} MiB of float32 gradients)")
    log(f"Batch size: {args.batch_size} per worker, images 3x{args.image_size}x{args.image_size}")
    log(f"Gradient compression: {'fp16' if args.fp16_pushpull else 'none'}")
    log(f"Torch threads per worker: {torch.get_num_threads()}")
    log(f"Number of workers: {size}")
    img_secs = timed_iters(benchmark_step, args, log, announce=True)

    # each iteration's rate summed over the workers (BytePS multiplies rank 0's by size())
    totals = np.array(comm.sum(img_secs, name="benchmark.img_secs"))
    total_mean, total_conf = totals.mean(), 1.96 * totals.std()
    log(f"Img/sec per worker: {total_mean / size:.1f} +-{total_conf / size:.1f}")
    log(f"Total img/sec on {size} worker(s): {total_mean:.1f} +-{total_conf:.1f}")
    if args.ddp_gloo:
        # every rank done with the group, and DDP's reducer (which holds it) gone, before the
        # group is destroyed: otherwise gloo's threads can outlive it and abort the process
        dist.barrier()
        del model, optimizer
        gc.collect()
        dist.destroy_process_group()
    else:
        bps.shutdown()
    return 0


# ---------------------------------------------------------------------------------------------
# --compare: byteps_like through bpslaunch against DDP-gloo, for several worker counts
# ---------------------------------------------------------------------------------------------

def _child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DMLC_", "BYTEPS_", "MASTER_", "RANK", "WORLD_SIZE",
                                "LOCAL_RANK"))}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _bench_argv(args, threads: int) -> list[str]:
    argv = [sys.executable, os.path.abspath(__file__), "--model", args.model,
            "--batch-size", str(args.batch_size),
            "--num-warmup-batches", str(args.num_warmup_batches),
            "--num-batches-per-iter", str(args.num_batches_per_iter),
            "--num-iters", str(args.num_iters), "--image-size", str(args.image_size),
            "--num-classes", str(args.num_classes), "--mlp-hidden", str(args.mlp_hidden),
            "--mlp-layers", str(args.mlp_layers), "--threads", str(threads)]
    if args.fp16_pushpull:
        argv.append("--fp16-pushpull")
    return argv


def _parse_total(text: str, what: str) -> tuple[float, float]:
    m = TOTAL_RE.search(text)
    if not m:
        raise RuntimeError(f"{what}: no 'Total img/sec' line in its output:\n{text[-3000:]}")
    return float(m.group(2)), float(m.group(3))


def _stop_launcher(child) -> None:
    """bpslaunch forwards SIGTERM to each of its children's process groups and SIGKILLs them
    5 s later; give it that time before the Job kills bpslaunch's own group."""
    if child.proc.poll() is None:
        try:
            child.proc.send_signal(signal.SIGTERM)
            child.proc.wait(10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass


def run_byteps(args, n: int, threads: int) -> tuple[float, float]:
    from byteps_like.bench.harness import Job
    cmd = [sys.executable, "-m", "byteps_like.launcher", "--local", "--workers", str(n),
           "--servers", str(args.servers), "--timeout", str(int(args.timeout)), "--",
           *_bench_argv(args, threads)]
    with Job("byteps_like") as g:
        child = g.spawn(f"bpslaunch-{n}", cmd, _child_env())
        try:
            g.wait(args.timeout + 15)
        except BaseException:
            _stop_launcher(child)
            raise
        return _parse_total(child.stdout(), f"byteps_like with {n} worker(s)")


def run_ddp(args, n: int, threads: int) -> tuple[float, float]:
    from byteps_like.bench.harness import Job, free_port
    env = _child_env()
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(n))
    with Job("ddp-gloo") as g:
        children = [g.spawn(f"ddp-{r}", [*_bench_argv(args, threads), "--ddp-gloo"],
                            {**env, "RANK": str(r)}) for r in range(n)]
        g.wait(args.timeout)
        return _parse_total(children[0].stdout(), f"ddp-gloo with {n} process(es)")


def measured(fn, *a):
    """(fn's result, share of the machine that other processes took while it ran, or None)."""
    from byteps_like.bench.report import OthersMeter
    with OthersMeter() as m:
        result = fn(*a)
    return result, m.others


def compare(args) -> int:
    import platform

    import torch

    from byteps_like.bench.harness import ChildFailed
    counts = [int(x) for x in args.workers.split(",") if x.strip()]
    if not counts or min(counts) < 1:
        raise SystemExit(f"--workers {args.workers!r}: give worker counts such as 1,2,4")
    cores = os.cpu_count() or 1
    args.threads = args.threads or 0
    nparams = sum(p.numel() for p in make_model(args).parameters())
    cmd = " ".join(["python", os.path.relpath(__file__), *sys.argv[1:]])
    print(f"command: {cmd}")
    print(f"machine: nproc={cores}, {platform.machine()}, Linux {platform.release()}, "
          f"Python {platform.python_version()}, torch {torch.__version__}")
    print(f"model {args.model} ({nparams / 1e6:.2f}M parameters), batch {args.batch_size} per "
          f"worker, images 3x{args.image_size}x{args.image_size}, {args.num_warmup_batches} "
          f"warm-up batches + {args.num_iters} x {args.num_batches_per_iter} timed, gradient "
          f"compression {'fp16' if args.fp16_pushpull else 'none'}")
    print("note: --compare defaults are deliberately small (a ~5M-parameter MLP, batch 32, few "
          "iterations) so the whole run stays within minutes on a 2-core machine; pass "
          "--model/--batch-size/--num-iters to measure something bigger")
    print(f"byteps_like: bpslaunch --local --workers N --servers {args.servers} (scheduler and "
          f"servers share the machine); ddp-gloo: N processes, env:// rendezvous; torch threads "
          f"per worker: {'as given' if args.threads else f'max(1, {cores} // N)'}", flush=True)
    rows, others = [], []
    t0 = time.monotonic()

    def stamp() -> str:
        return f"[{time.monotonic() - t0:5.0f} s]"

    def share(x: float | None) -> str:
        return "n/a" if x is None else f"{100 * x:.0f}%"
    _, idle_other = measured(time.sleep, 1.0)
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; other processes "
          f"kept {share(idle_other)} of the machine busy in the second before the start",
          flush=True)
    for n in counts:
        threads = args.threads or max(1, cores // n)
        try:
            print(f"{stamp()} byteps_like, {n} worker(s)...", flush=True)
            bps_total, bps_other = measured(run_byteps, args, n, threads)
            print(f"{stamp()}   {bps_total[0]:.1f} +-{bps_total[1]:.1f} img/s total "
                  f"(other processes took {share(bps_other)} of the machine)", flush=True)
            print(f"{stamp()} ddp-gloo, {n} process(es)...", flush=True)
            ddp_total, ddp_other = measured(run_ddp, args, n, threads)
            print(f"{stamp()}   {ddp_total[0]:.1f} +-{ddp_total[1]:.1f} img/s total "
                  f"(other processes took {share(ddp_other)} of the machine)", flush=True)
        except (ChildFailed, RuntimeError) as exc:
            print(f"compare: failed with {n} worker(s):\n{exc}", file=sys.stderr, flush=True)
            return 1
        rows.append((n, bps_total, ddp_total))
        others.append(f"{n}: {share(bps_other)} / {share(ddp_other)}")
    print(f"\ntotal wall time {time.monotonic() - t0:.0f} s\n")
    print(format_table(rows))
    print("\nshare of the machine other processes took during the byteps_like / ddp-gloo runs, "
          "by workers: " + ", ".join(others) + " (high values mean a noisy measurement)")
    return 0


def format_table(rows) -> str:
    head = ("workers", "byteps_like img/s total", "ddp-gloo img/s total", "ratio")
    body = [(str(n), f"{b[0]:.1f} +-{b[1]:.1f}", f"{d[0]:.1f} +-{d[1]:.1f}",
             f"{b[0] / d[0]:.2f}" if d[0] else "-") for n, b, d in rows]
    widths = [max(len(h), *(len(r[i]) for r in body)) for i, h in enumerate(head)]
    def line(cells) -> str:
        return "| " + " | ".join(c.rjust(w) for c, w in zip(cells, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"
    return "\n".join([line(head), sep, *(line(r) for r in body)])


# ---------------------------------------------------------------------------------------------

def parse_args(argv: Sequence[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("mlp", "cnn", "resnet18"),
                   help=f"mlp: Linear layers (default {DEFAULTS['mlp_layers']} x "
                        f"{DEFAULTS['mlp_hidden']}, ~24M parameters); cnn: a small conv net "
                        "(~1.7M); resnet18: ResNet-18 blocks with a 3x3 stem (~11.7M) "
                        f"(default {DEFAULTS['model']})")
    p.add_argument("--batch-size", type=int, help=f"per worker (default {DEFAULTS['batch_size']})")
    p.add_argument("--num-warmup-batches", type=int,
                   help=f"untimed batches first (default {DEFAULTS['num_warmup_batches']})")
    p.add_argument("--num-batches-per-iter", type=int,
                   help=f"batches per timed iteration (default {DEFAULTS['num_batches_per_iter']})")
    p.add_argument("--num-iters", type=int,
                   help=f"timed iterations (default {DEFAULTS['num_iters']})")
    p.add_argument("--image-size", type=int, default=32, help="synthetic images are 3xSxS")
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--mlp-hidden", type=int, help="width of the mlp's hidden layers (default "
                        f"{DEFAULTS['mlp_hidden']}; --compare {COMPARE_DEFAULTS['mlp_hidden']})")
    p.add_argument("--mlp-layers", type=int, help="hidden layers of the mlp (default "
                        f"{DEFAULTS['mlp_layers']}; --compare {COMPARE_DEFAULTS['mlp_layers']})")
    p.add_argument("--fp16-pushpull", action="store_true",
                   help="gradients travel as float16 (Compression.fp16; with --ddp-gloo DDP's "
                        "fp16_compress_hook)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads per worker (0: torch's default; --compare: cores // N)")
    p.add_argument("--ddp-gloo", action="store_true",
                   help="measure torch.nn.parallel.DistributedDataParallel over gloo instead")
    p.add_argument("--dist-url", default=None,
                   help="--ddp-gloo rendezvous (default env://: MASTER_ADDR, MASTER_PORT, RANK, "
                        "WORLD_SIZE); tcp://HOST:PORT takes RANK and WORLD_SIZE from the env")
    p.add_argument("--compare", action="store_true",
                   help="driver: run byteps_like and ddp-gloo for each of --workers and print a "
                        "table")
    p.add_argument("--workers", default="1,2,4", help="--compare: worker counts (default 1,2,4)")
    p.add_argument("--servers", type=int, default=1, help="--compare: byteps_like servers")
    p.add_argument("--timeout", type=float, default=300,
                   help="--compare: watchdog per measurement, seconds (default 300)")
    args = p.parse_args(argv)
    base = COMPARE_DEFAULTS if args.compare else DEFAULTS
    for k, v in base.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.compare and args.ddp_gloo:
        p.error("--compare runs both frameworks itself; drop --ddp-gloo")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.compare:
        # SIGTERM/SIGHUP end the driver through SystemExit, so every Job's cleanup runs
        # (the children live in their own sessions and would otherwise outlive it)
        def stop(signum, _frame):
            raise SystemExit(128 + signum)
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, stop)
        return compare(args)
    return run_benchmark(args)


if __name__ == "__main__":
    sys.exit(main())
