"""The timing loop the synthetic benchmarks share (examples/pytorch/synthetic_benchmark.py,
examples/tensorflow/synthetic_benchmark_tf2.py), Horovod's: ``--num-warmup-batches`` untimed
steps, then ``--num-iters`` timings of ``--num-batches-per-iter`` steps each.

A script in a subfolder puts this folder on ``sys.path`` and imports it."""
from __future__ import annotations

import timeit
from collections.abc import Callable


def timed_iters(step: Callable[[], object], args, log: Callable[[str], None], *,
                announce: bool = False) -> list[float]:
    """Images per second of each timed iteration on this worker (``args.batch_size`` images a
    step), each logged as ``Iter #i: X img/sec per worker``; ``announce`` also logs the
    ``Running warmup...`` and ``Running benchmark...`` phases."""
    if announce:
        log("Running warmup...")
    timeit.timeit(step, number=args.num_warmup_batches)
    if announce:
        log("Running benchmark...")
    img_secs = []
    for i in range(args.num_iters):
        t = timeit.timeit(step, number=args.num_batches_per_iter)
        img_sec = args.batch_size * args.num_batches_per_iter / t
        log(f"Iter #{i}: {img_sec:.1f} img/sec per worker")
        img_secs.append(img_sec)
    return img_secs
