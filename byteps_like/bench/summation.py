"""Benchmark of the native summation kernel ``_core.add_into`` against numpy.

Run ``python -m byteps_like.bench.summation [--sizes 4MiB,64MiB] [--repeats 7]``. For each
size and dtype it prints the median throughput of ``add_into`` (one thread and
``--nthreads``), of numpy's ``np.add(a, b, out=a)`` on the same data, and the ratio
core/numpy. Throughput counts the bytes of one array (dst) per second.

bfloat16 has no numpy dtype; its numpy column times a reference written with numpy
(uint16 -> float32 by shifting, add, round to nearest even back to uint16).
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np

from byteps_like import _core

from .report import fmt_size, size_list

DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64")


def _arrays(dtype: str, nbytes: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """dst and src holding nbytes each; values small so repeated adds stay finite."""
    n = nbytes // _core.itemsize(dtype)
    if dtype in ("int32", "int64"):
        return (rng.integers(-1000, 1000, n).astype(dtype),
                rng.integers(-1000, 1000, n).astype(dtype))
    a = rng.standard_normal(n, dtype=np.float32)
    b = rng.standard_normal(n, dtype=np.float32)
    if dtype == "bfloat16":
        return ((a.view(np.uint32) >> 16).astype(np.uint16),
                (b.view(np.uint32) >> 16).astype(np.uint16))
    return a.astype(dtype), b.astype(dtype)


def _bf16_numpy_add(a: np.ndarray, b: np.ndarray) -> None:
    """a += b for bfloat16 held as uint16, in numpy (float32 add, round to nearest even)."""
    s = (a.astype(np.uint32) << 16).view(np.float32) + (b.astype(np.uint32) << 16).view(np.float32)
    x = s.view(np.uint32)
    rounded = (x + 0x7FFF + ((x >> 16) & 1)) >> 16
    a[...] = np.where(np.isnan(s), (x >> 16) | 0x40, rounded).astype(np.uint16)


def median_seconds(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median wall time of each fn; runs are interleaved so drifting machine load hits all."""
    for fn in fns.values():
        fn()  # warm-up: page faults, pool threads, caches
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def measure(dtype: str, nbytes: int, repeats: int, nthreads: int,
            rng: np.random.Generator) -> dict[str, float]:
    """GB/s of add_into (1 and nthreads threads) and of numpy on one dtype and size."""
    a, b = _arrays(dtype, nbytes, rng)
    if dtype == "bfloat16":
        def ref() -> None:
            _bf16_numpy_add(a, b)
    else:
        def ref() -> None:
            np.add(a, b, out=a)
    dst, src = a.data, b.data   # the arrays' buffers, for _core
    with np.errstate(all="ignore"):
        secs = median_seconds({
            "core_1t": lambda: _core.add_into(dst, src, dtype),
            "core_nt": lambda: _core.add_into(dst, src, dtype, nthreads),
            "numpy": ref,
        }, repeats)
    return {name: a.nbytes / 1e9 / t for name, t in secs.items()}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m byteps_like.bench.summation",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="4MiB,64MiB",
                        help="comma-separated bytes per array (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per case (default: 7)")
    parser.add_argument("--nthreads", type=int, default=2,
                        help="threads of the multi-threaded column (default: 2)")
    parser.add_argument("--dtypes", default=",".join(DTYPES),
                        help="comma-separated dtypes (default: all)")
    args = parser.parse_args(argv)
    try:
        sizes = size_list(args.sizes)
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown:
        parser.error(f"unknown dtype(s) {', '.join(unknown)}; choose from {', '.join(DTYPES)}")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")

    feats = _core.cpu_features()
    print(f"kernels: isa={feats['isa']} fp16={feats['kernel_fp16']}; "
          f"repeats={args.repeats}, median GB/s of dst bytes")
    nt = args.nthreads
    header = (f"{'size':>8} {'dtype':>9} {'core 1t':>9} {f'core {nt}t':>9} {'numpy':>9} "
              f"{'1t/numpy':>9} {f'{nt}t/numpy':>9}")
    print(header)
    print("-" * len(header))
    rng = np.random.default_rng(0)
    for nbytes in sizes:
        for dtype in dtypes:
            r = measure(dtype, nbytes, args.repeats, nt, rng)
            print(f"{fmt_size(nbytes):>8} {dtype:>9} {r['core_1t']:9.2f} {r['core_nt']:9.2f} "
                  f"{r['numpy']:9.2f} {r['core_1t'] / r['numpy']:8.2f}x "
                  f"{r['core_nt'] / r['numpy']:8.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
