"""Benchmark of the gradient compressors (byteps_like.compression codecs) against memcpy.

Run ``python -m byteps_like.bench compress [--sizes 4MiB,64MiB] [--repeats 5]``. For each
size (bytes of float32 input) and compressor it prints the median throughput of ``encode`` and
of ``decode`` (GB/s of float32 input bytes), their ratio to a memcpy (``_core.copy_into``,
one thread) of the same bytes measured in the same run, and the compression ratio (payload
bytes / input bytes).
"""
from __future__ import annotations

import argparse
from collections.abc import Sequence

import numpy as np

from byteps_like import _core
from byteps_like.compression import Compression, Compressor

from .report import fmt_size, size_list
from .summation import median_seconds


def compressors() -> dict[str, Compressor]:
    """The benchmarked compressors, by the label of their row."""
    return {
        "onebit": Compression.onebit(),
        "onebit+ef": Compression.onebit(error_feedback=True),
        "topk 1%": Compression.topk(0.01),
        "randomk 1%": Compression.randomk(0.01),
        "dither lin16": Compression.dithering(16),
        "dither nat8 l2": Compression.dithering(8, "natural", "l2"),
        "nesterov+onebit": Compression.onebit(momentum=0.9),
    }


def measure(nbytes: int, repeats: int, rng: np.random.Generator,
            names: Sequence[str] | None = None) -> list[dict]:
    """One row per compressor: encode/decode GB/s, memcpy GB/s and the payload ratio."""
    n = nbytes // 4
    x = rng.standard_normal(n, dtype=np.float32)
    out = np.empty_like(x)
    copy_dst = np.empty_like(x)
    rows = []
    for label, comp in compressors().items():
        if names is not None and label not in names:
            continue
        codec = comp.make_codec(n, role="worker", key=1)
        payload = bytes(codec.encode(x, 0))
        step = [0]

        def enc() -> None:
            step[0] += 1
            codec.encode(x, step[0])

        dst_buf, x_buf = copy_dst.data, x.data
        secs = median_seconds({"memcpy": lambda: _core.copy_into(dst_buf, x_buf),
                                "encode": enc,
                                "decode": lambda: codec.decode(payload, out)}, repeats)
        gbs = {k: x.nbytes / 1e9 / t for k, t in secs.items()}
        rows.append({"size": nbytes, "compressor": label, "encode": gbs["encode"],
                     "decode": gbs["decode"], "memcpy": gbs["memcpy"],
                     "ratio": len(payload) / x.nbytes})
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m byteps_like.bench compress",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="4MiB,64MiB",
                        help="comma-separated float32 input bytes (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per case (default: 5)")
    parser.add_argument("--compressors", default="",
                        help="comma-separated rows (default: all of "
                             + ", ".join(compressors()).replace("%", "%%") + ")")
    args = parser.parse_args(argv)
    try:
        sizes = size_list(args.sizes)
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    names = [c.strip() for c in args.compressors.split(",") if c.strip()] or None
    if names and set(names) - set(compressors()):
        parser.error(f"unknown compressor(s) {sorted(set(names) - set(compressors()))}")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    feats = _core.cpu_features()
    print(f"kernels: isa={feats['isa']}; repeats={args.repeats}, median GB/s of float32 input "
          "bytes; x memcpy = ratio to a one-thread memcpy of the same bytes")
    header = (f"{'size':>8} {'compressor':>16} {'encode':>8} {'decode':>8} {'memcpy':>8} "
              f"{'enc/cpy':>8} {'dec/cpy':>8} {'bytes':>8}")
    print(header)
    print("-" * len(header))
    rng = np.random.default_rng(0)
    for nbytes in sizes:
        for r in measure(nbytes, args.repeats, rng, names):
            print(f"{fmt_size(nbytes):>8} {r['compressor']:>16} {r['encode']:8.2f} "
                  f"{r['decode']:8.2f} {r['memcpy']:8.2f} {r['encode'] / r['memcpy']:7.3f}x "
                  f"{r['decode'] / r['memcpy']:7.3f}x {r['ratio']:8.4f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
