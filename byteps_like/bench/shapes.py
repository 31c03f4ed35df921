"""Many tensors against one flat tensor of the same bytes: ``bench pushpull --shapes resnet50``.

A model's gradients are many tensors of many sizes, not one flat array. Each worker of the job
push_pulls, per repetition, the model's gradient shapes (every one submitted with
``push_pull_async``, then every handle waited for) and one flat tensor of the same total bytes,
alternately, as CPU torch tensors (numpy arrays where torch is missing); the report is the time
of each and ``flat / shapes`` (1.0: the shapes cost nothing more than their bytes). Issue 38
measured, on the 16-core device with 2 workers + 2 servers and bpslaunch's defaults, 186.7 ms for
ResNet-50's 161 shapes against 70.4 ms flat (0.38): each worker's 8 torch threads came on top of
the data plane's I/O threads; with the launcher's thread shares counting the plane's threads
(launcher/shares.py) the defaults give each worker 4.

The shapes are written here (no torchvision needed): ResNet-50's as torchvision builds it,
161 parameters, 25,557,032 float32 values.
"""
from __future__ import annotations

import importlib.util
import math
import statistics
import time
from collections.abc import Callable
from typing import Any


def resnet50_shapes() -> list[tuple[str, tuple[int, ...]]]:
    """torchvision's ResNet-50 parameters in ``named_parameters()`` order: (name, shape)."""
    out: list[tuple[str, tuple[int, ...]]] = [("conv1.weight", (64, 3, 7, 7)),
                                               ("bn1.weight", (64,)), ("bn1.bias", (64,))]
    inplanes = 64
    for layer, (planes, blocks) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3)), start=1):
        for b in range(blocks):
            pre = f"layer{layer}.{b}."
            for i, shape in enumerate(((planes, inplanes, 1, 1), (planes, planes, 3, 3),
                                       (planes * 4, planes, 1, 1)), start=1):
                out += [(f"{pre}conv{i}.weight", shape), (f"{pre}bn{i}.weight", (shape[0],)),
                        (f"{pre}bn{i}.bias", (shape[0],))]
            if b == 0:
                out += [(f"{pre}downsample.0.weight", (planes * 4, inplanes, 1, 1)),
                        (f"{pre}downsample.1.weight", (planes * 4,)),
                        (f"{pre}downsample.1.bias", (planes * 4,))]
            inplanes = planes * 4
    out += [("fc.weight", (1000, 2048)), ("fc.bias", (1000,))]
    return out


MODELS = {"resnet50": resnet50_shapes}


Side = tuple[Any, list[Any], Any, Callable[[list[Any], str], None]]


def _torch_side(shapes: list[tuple[int, ...]]) -> Side:
    """byteps_like.torch, started; the gradients and the flat tensor as CPU torch tensors; a
    round (every tensor push_pulled asynchronously, then every sum checked)."""
    import torch

    import byteps_like.torch as bps
    bps.init()
    rank, n = bps.rank(), bps.size()
    grads = [torch.full(s, float(rank + 1)) for s in shapes]
    flat = torch.full((sum(math.prod(s) for s in shapes),), float(rank + 1))

    def run(tensors: list[Any], prefix: str) -> None:
        hs = [bps.push_pull_async(t, average=False, name=f"{prefix}.{i}")
              for i, t in enumerate(tensors)]
        outs = [bps.synchronize(h) for h in hs]
        if not all(bool((o == n * (n + 1) / 2).all()) for o in outs):
            raise AssertionError(f"worker {rank}: wrong push_pull result ({prefix})")
    return bps, grads, flat, run


def _numpy_side(shapes: list[tuple[int, ...]]) -> Side:
    """The same with numpy arrays (no torch here)."""
    import numpy as np

    import byteps_like as bps
    bps.init()
    rank, n = bps.rank(), bps.size()
    grads = [np.full(s, rank + 1, np.float32) for s in shapes]
    flat = np.full(sum(math.prod(s) for s in shapes), rank + 1, np.float32)

    def run(tensors: list[Any], prefix: str) -> None:
        outs = [np.empty_like(t) for t in tensors]
        hs = [bps.push_pull_async(t, average=False, name=f"{prefix}.{i}", out=o)
              for i, (t, o) in enumerate(zip(tensors, outs))]
        for h in hs:
            h.wait()
        if not all((o == n * (n + 1) / 2).all() for o in outs):
            raise AssertionError(f"worker {rank}: wrong push_pull result ({prefix})")
    return bps, grads, flat, run


def shapes_worker(model: str, repeats: int, warmup: int) -> dict:
    """In a worker of a running job: the model's shapes and one flat tensor of the same bytes,
    push_pulled alternately (sums checked); returns ``{"shapes": [s...], "flat": [s...]}``,
    this worker's time of each timed repetition."""
    shapes = [s for _n, s in MODELS[model]()]
    side = _torch_side if importlib.util.find_spec("torch") is not None else _numpy_side
    bps, grads, flat, run = side(shapes)
    rank = bps.rank()
    times: dict[str, list[float]] = {"shapes": [], "flat": []}
    for rep in range(warmup + repeats):
        for what, tensors in (("flat", [flat]), ("shapes", grads)):
            bps.barrier()
            t0 = time.perf_counter()
            run(tensors, f"bench.{model}.{what}")
            if rep >= warmup:
                times[what].append(time.perf_counter() - t0)
    bps.shutdown()
    return {"rank": rank, "shapes": times["shapes"], "flat": times["flat"],
            "tensors": len(shapes), "nbytes": 4 * sum(math.prod(s) for s in shapes)}


def summarize_shapes(per_worker: list[dict]) -> dict:
    """Slowest worker per repetition, median over repetitions, and flat / shapes."""
    out = {}
    for what in ("shapes", "flat"):
        out[what] = statistics.median(max(rep) for rep in zip(*(w[what] for w in per_worker)))
    out["ratio"] = out["flat"] / out["shapes"]
    out["tensors"], out["nbytes"] = per_worker[0]["tensors"], per_worker[0]["nbytes"]
    return out
