"""Training-step benchmark of priority scheduling (part of ``python -m byteps_like.bench cluster``).

Each worker runs a VGG-16-shaped training loop with synthetic compute: the forward pass of layer
``i`` sleeps ``fwd[i]`` and the backward pass ``bwd[i]`` (sleeping stands for GPU compute, which
leaves the CPU to communication, as on a real GPU cluster). After the backward pass of a layer its
gradient is handed to ``push_pull_async``; the forward pass of layer ``i`` in the next iteration
first waits for layer ``i``'s gradient (the per-layer overlap of BytePS/ByteScheduler).

VGG's largest tensors (fc6, fc7) are the last layers of the forward pass: their gradients are the
first ready in backward and the last needed in the next forward. With FIFO (every priority 0,
unlimited credit) they are on the wire when the small first-layer gradients arrive, so the next
forward waits for everything. With priorities (layer ``i`` gets priority ``-i``) and byte credits
the first layers overtake the bulk and the next forward overlaps the rest of the communication.

Compute is calibrated to the communication time: total compute (forward + backward, 1:2) is
``compute_ratio`` times the theoretical push_pull time of the whole model at the measured link
rate, spread over layers in proportion to VGG-16's per-layer FLOPs.
"""
from __future__ import annotations

import statistics
import sys
import time

from .report import emit
from .vgg16 import VGG16_LAYERS, model_tensors


def compute_delays(total_compute_s: float) -> tuple[list[float], list[float]]:
    """Per-layer (forward, backward) sleep times: forward 1/3 and backward 2/3 of the total,
    in proportion to each layer's forward FLOPs."""
    flops = [f for _n, _w, _b, f in VGG16_LAYERS]
    tot = sum(flops)
    fwd = [total_compute_s / 3 * f / tot for f in flops]
    bwd = [2 * x for x in fwd]
    return fwd, bwd


def step_worker(params: dict) -> int:
    import numpy as np

    import byteps_like as bps
    bps.init()
    rank = bps.rank()
    specs = model_tensors(int(params["bytes"]))
    nlayers = len(VGG16_LAYERS)
    fwd, bwd = compute_delays(float(params["compute_s"]))
    prio = bool(params["priority"])
    iters, warmup = int(params["iters"]), int(params["warmup"])
    by_layer: list[list[int]] = [[] for _ in range(nlayers)]
    for j, (_nm, _cnt, layer) in enumerate(specs):
        by_layer[layer].append(j)
    grads = [np.full(cnt, 1.0, dtype=np.float32) for _nm, cnt, _l in specs]
    outs = [np.empty_like(g) for g in grads]
    handles: list = [None] * len(specs)
    starts = []
    waited = []
    bps.barrier()
    for _it in range(warmup + iters + 1):
        starts.append(time.perf_counter())
        w = 0.0
        for i in range(nlayers):
            for j in by_layer[i]:
                if handles[j] is not None:
                    t = time.perf_counter()
                    handles[j].wait()
                    w += time.perf_counter() - t
            time.sleep(fwd[i])
        waited.append(w)
        for i in reversed(range(nlayers)):
            time.sleep(bwd[i])
            for j in by_layer[i]:
                handles[j] = bps.push_pull_async(grads[j], name=specs[j][0], average=True,
                                                 priority=-i if prio else 0, out=outs[j])
    for h in handles:
        h.wait()
    if not all((o == 1.0).all() for o in outs):
        raise AssertionError(f"worker {rank}: wrong averaged gradient")
    iter_times = [b - a for a, b in zip(starts, starts[1:])][warmup:]
    if rank == 0:
        print(f"progress: {'priority' if prio else 'FIFO'}: median iteration "
              f"{statistics.median(iter_times) * 1e3:.0f} ms", file=sys.stderr, flush=True)
    bps.shutdown()
    emit({"rank": rank, "iter_times": iter_times, "forward_wait_s": waited[warmup + 1:]})
    return 0
