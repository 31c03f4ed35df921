"""Time push_pull of CUDA tensors, to compare how device memory reaches the servers.

    bpslaunch --local --workers 2 --servers 1 -- python examples/pytorch/cuda_pushpull_bench.py

Run it under different transports to compare (docs/transports.md):

- ZeroMQ (default): each partition is copied to pinned host memory (``copy_d2h``), pushed, and
  its sum copied back;
- ``BYTEPS_TRANSPORT=ucx``: the same staging, over UCX;
- ``BYTEPS_TRANSPORT=ucx BYTEPS_UCX_DEVICE_MEMORY=1 UCX_TLS=tcp,cuda_copy,...``: UCX reads the
  partition from device memory itself (no ``copy_d2h`` stage); the sum comes back to the host.

Every worker uses GPU ``rank % device_count``. Rank 0 prints one line per size with the median
time and the algorithm bandwidth (tensor bytes / time), and checks the sums.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import byteps_like.torch as bps
from byteps_like.worker.runtime import default_runtime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="4,64", help="MiB, comma-separated")
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    bps.init()
    rank, size = bps.rank(), bps.size()
    if not torch.cuda.is_available():
        raise SystemExit("cuda_pushpull_bench: no CUDA device")
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    rt = default_runtime()
    direct = rt.device_push
    transport = rt.cfg.transport.transport
    if rank == 0:
        print(f"transport {transport}, device memory pushed directly: {direct}, "
              f"UCX_TLS={os.environ.get('UCX_TLS', '')!r}", flush=True)
    for mib in [int(s) for s in args.sizes.split(",")]:
        n = (mib << 20) // 4
        x = torch.full((n,), float(rank + 1), device=dev)
        want = float(sum(r + 1 for r in range(size)))
        name = f"bench.{mib}"
        ts = []
        for i in range(args.repeats + 2):
            rt.barrier()
            torch.cuda.synchronize()
            t = time.perf_counter()
            y = bps.push_pull(x, average=False, name=name)
            torch.cuda.synchronize()
            if i >= 2:
                ts.append(time.perf_counter() - t)
        ok = bool(torch.all(y == want).item())
        med = statistics.median(ts)
        if rank == 0:
            print(f"{mib:5d} MiB  median {med * 1e3:8.2f} ms  {(mib << 20) / med / 1e9:6.2f} GB/s"
                  f"  sums {'OK' if ok else 'WRONG'}", flush=True)
        if not ok:
            raise SystemExit(f"rank {rank}: wrong sum for {mib} MiB")
    bps.shutdown()


if __name__ == "__main__":
    main()
