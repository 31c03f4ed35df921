"""Many small gradients against one flat tensor of the same bytes, through DistributedOptimizer.

    bpslaunch --local --workers 1 --servers 1 -- python examples/pytorch/many_tensors_bench.py --device cuda

The model is ResNet-50's 161 parameter shapes (25.6 M float32, 102 MB) as plain parameters whose
backward is an elementwise product, so a step is almost all exchange; the flat model is one
parameter of the same 102 MB. The loss is one product of the concatenated parameters with a
constant (its backward: one kernel, then a gradient per parameter); ``--per-tensor`` writes it
as a product and a sum per parameter, as this script first did, which costs 10-14 ms a step of
autograd and kernel launches on an H200 with no communication at all. Each step: zero_grad, backward, ``step()`` (which waits for the
averaged gradients). Rank 0 prints the median step of each, their ratio (flat / many: 1.0 means
the many small gradients cost nothing extra), and checks every gradient equals the average over
the workers. Run it with ``BYTEPS_FUSION_BYTES=0`` to see the job without tensor fusion.
``--check`` also compares, on the device, the fused and unfused averages bit for bit.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import byteps_like.torch as bps


def resnet50_shapes() -> list[tuple[str, tuple[int, ...]]]:
    """The 161 parameter shapes of torchvision's ResNet-50, in its named_parameters order."""
    out: list[tuple[str, tuple[int, ...]]] = [("conv1.weight", (64, 3, 7, 7)),
                                              ("bn1.weight", (64,)), ("bn1.bias", (64,))]
    inplanes = 64
    for stage, (planes, blocks) in enumerate([(64, 3), (128, 4), (256, 6), (512, 3)], 1):
        for b in range(blocks):
            p = f"layer{stage}.{b}."
            out += [(p + "conv1.weight", (planes, inplanes if b == 0 else planes * 4, 1, 1)),
                    (p + "bn1.weight", (planes,)), (p + "bn1.bias", (planes,)),
                    (p + "conv2.weight", (planes, planes, 3, 3)),
                    (p + "bn2.weight", (planes,)), (p + "bn2.bias", (planes,)),
                    (p + "conv3.weight", (planes * 4, planes, 1, 1)),
                    (p + "bn3.weight", (planes * 4,)), (p + "bn3.bias", (planes * 4,))]
            if b == 0:
                out += [(p + "downsample.0.weight", (planes * 4, inplanes, 1, 1)),
                        (p + "downsample.1.weight", (planes * 4,)),
                        (p + "downsample.1.bias", (planes * 4,))]
        inplanes = planes * 4
    out += [("fc.weight", (1000, 2048)), ("fc.bias", (1000,))]
    return out


def run(shapes, dev, steps: int, warmup: int, tag: str, rank: int, size: int,
        distributed: bool = True, per_tensor: bool = False) -> tuple[float, float]:
    """(median step, median time of the step() call alone) of one model."""
    params = [torch.nn.Parameter(torch.zeros(s, device=dev)) for _, s in shapes]
    named = [(f"{tag}.{n}", p) for (n, _), p in zip(shapes, params)]
    opt = torch.optim.SGD(params, lr=0.0)
    if distributed:
        opt = bps.DistributedOptimizer(opt, named_parameters=named)
    coef = [torch.full(s, float(rank + 1), device=dev) for _, s in shapes]
    flat_coef = torch.cat([c.view(-1) for c in coef])
    want = sum(r + 1 for r in range(size)) / size if distributed else rank + 1
    times, waits = [], []
    for i in range(warmup + steps):
        opt.zero_grad()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t = time.perf_counter()
        if per_tensor:  # a multiply and a sum per tensor: autograd and kernels per tensor
            loss = sum((p * c).sum() for p, c in zip(params, coef))
        else:  # one flat product: the same gradients, backward costs next to nothing
            loss = (torch.cat([p.view(-1) for p in params]) * flat_coef).sum()
        loss.backward()
        t1 = time.perf_counter()
        opt.step()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if i >= warmup:
            times.append(time.perf_counter() - t)
            waits.append(time.perf_counter() - t1)
    bad = [n for n, p in named if not bool(torch.all(p.grad == want))]
    if bad:
        raise SystemExit(f"rank {rank}: wrong averages in {bad[:3]}")
    return statistics.median(times), statistics.median(waits)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--json", default="", help="append one JSON record to this file")
    ap.add_argument("--per-tensor", action="store_true",
                    help="the loss as a product and a sum per parameter (161 of each, and their "
                         "backward: 10-14 ms a step on an H200 with no communication) instead "
                         "of one product of the concatenated parameters")
    args = ap.parse_args()
    bps.init()
    rank, size = bps.rank(), bps.size()
    dev = torch.device("cpu")
    if args.device == "cuda":
        dev = torch.device("cuda", bps.local_rank() % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    shapes = resnet50_shapes()
    total = sum(torch.Size(s).numel() for _, s in shapes)
    pt = args.per_tensor
    many, many_w = run(shapes, dev, args.steps, args.warmup, "many", rank, size, True, pt)
    flat, flat_w = run([("flat", (total,))], dev, args.steps, args.warmup, "flat", rank, size,
                       True, pt)
    local_many = run(shapes, dev, args.steps, args.warmup, "lm", rank, size, False, pt)[0]
    local_flat = run([("flat", (total,))], dev, args.steps, args.warmup, "lf", rank, size,
                     False, pt)[0]
    from byteps_like.worker.runtime import default_runtime
    fusion = default_runtime().config.partition.fusion_bytes
    if rank == 0:
        rec = {"device": args.device, "workers": size, "tensors": len(shapes),
               "bytes": total * 4, "fusion_bytes": fusion, "per_tensor_loss": pt, "many_s": many, "flat_s": flat,
               "ratio": flat / many, "many_step_call_s": many_w, "flat_step_call_s": flat_w,
               "local_many_s": local_many, "local_flat_s": local_flat}
        print(f"{len(shapes)} tensors, {total * 4 / 1e6:.1f} MB, {args.device}, {size} "
              f"worker(s), fusion {fusion} B: many {many * 1e3:.1f} ms (step() "
              f"{many_w * 1e3:.1f}), flat {flat * 1e3:.1f} ms (step() {flat_w * 1e3:.1f}), "
              f"flat/many {flat / many:.2f}; no communication: many "
              f"{local_many * 1e3:.1f} ms, flat {local_flat * 1e3:.1f} ms", flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(rec) + "\n")
    bps.shutdown()


if __name__ == "__main__":
    main()
