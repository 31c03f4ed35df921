"""Named push_pulls of CUDA tensors through the chunked device path (byteps_like.torch.fusion's
DeviceTensor), checked exactly, on a GPU machine:

    BYTEPS_FORCE_DISTRIBUTED=1 bpslaunch --local --workers 2 --servers 2 -- \\
        python tests/integration/workers/cuda_push_pull_check.py [--bench]

Every rank fills its tensors with values that depend on the rank and the index, so the average
(or sum) of every element is known exactly; sizes from one element to several chunks
(``BYTEPS_FUSION_BYTES``, 32 MiB by default), float32/float16/bfloat16/int32/int64, out of
place, in place, async, and the fp16 cast compressor (cast on the device). Prints ``OK`` and,
with ``--bench``, the median time of a 512 MiB float32 push_pull_inplace against the same
through the pipeline's partition staging (the path with fusion off)."""
from __future__ import annotations

import statistics
import sys
import time

import torch

import byteps_like.torch as bps
from byteps_like.torch import fusion
from byteps_like.worker.runtime import default_runtime

bps.init()
rank, size = bps.rank(), bps.size()
dev = torch.device("cuda", bps.local_rank() % torch.cuda.device_count())
torch.cuda.set_device(dev)
chunk = default_runtime().config.partition.fusion_bytes


def filled(n: int, dtype: torch.dtype, r: int) -> torch.Tensor:
    """Small integers (exact in every dtype here): (index % 7) + r."""
    return (torch.arange(n, device=dev) % 7 + r).to(dtype)


def want(n: int, dtype: torch.dtype, average: bool) -> torch.Tensor:
    total = sum(filled(n, torch.float64, r) for r in range(size))
    if not average:
        return total.to(dtype)
    if dtype in (torch.int32, torch.int64):
        return torch.div(total, size, rounding_mode="floor").to(dtype)
    return (total / size).to(dtype)


def check(got: torch.Tensor, n: int, dtype: torch.dtype, average: bool, what: str) -> None:
    exp = want(n, dtype, average)
    if not torch.equal(got.reshape(-1), exp):
        bad = (got.reshape(-1) != exp).nonzero()[:3].flatten().tolist()
        raise SystemExit(f"rank {rank}: {what}: wrong at {bad}: got "
                         f"{got.reshape(-1)[bad].tolist()}, want {exp[bad].tolist()}")


sizes = [1, 1000, 3_000_001, (2 * chunk) // 4 + 5]  # the last: 3 chunks
for n in sizes:
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64):
        t = filled(n, dtype, rank)
        check(bps.push_pull(t, average=True, name=f"pp.{n}.{dtype}"), n, dtype, True,
              f"push_pull {n} {dtype}")
        if not torch.equal(t, filled(n, dtype, rank)):
            raise SystemExit(f"rank {rank}: push_pull {n} {dtype} changed its input")
        u = filled(n, dtype, rank)
        bps.push_pull_inplace(u, average=False, name=f"ppi.{n}.{dtype}")
        check(u, n, dtype, False, f"push_pull_inplace sum {n} {dtype}")
    # async, several in flight, reusing each name twice (buffers made once)
    for rep in range(2):
        hs = [(bps.push_pull_async(filled(n, torch.float32, rank), name=f"pa.{n}.{i}"), i)
              for i in range(3)]
        for h, i in hs:
            check(bps.synchronize(h), n, torch.float32, True, f"async {n} #{i} rep {rep}")
    # fp16 cast compression: values exact in fp16, so the result is exact too
    v = filled(n, torch.float32, rank)
    got = bps.push_pull(v, name=f"pf.{n}", compression=bps.Compression.fp16)
    if got.dtype != torch.float32:
        raise SystemExit(f"rank {rank}: fp16 compression returned {got.dtype}")
    check(got, n, torch.float32, True, f"fp16 compression {n}")
made = sorted(n for n in fusion._device_tensors)
if not any(k.startswith("pp.") for k in made):
    raise SystemExit(f"rank {rank}: the chunked device path was not taken ({made[:5]})")
big = fusion._device_tensors[f"pp.{sizes[-1]}.torch.float32"]
if len(big.mover.chunks) < 3:
    raise SystemExit(f"rank {rank}: {sizes[-1] * 4} bytes made {len(big.mover.chunks)} chunks")
print(f"rank {rank}: OK ({len(made)} named CUDA tensors through chunks)", flush=True)

if "--bench" in sys.argv:
    n = (512 << 20) // 4
    x = torch.ones(n, device=dev)

    def timed(fn, reps: int = 7) -> float:
        ts = []
        for _ in range(reps):
            bps.barrier()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts[1:])

    chunked = timed(lambda: bps.push_pull_inplace(x, name="bench.chunks"))
    # the pipeline's partition staging: what an unnamed push_pull of a CUDA tensor still takes
    staged = timed(lambda: bps.push_pull_inplace(x))
    if rank == 0:
        print(f"512 MiB float32 push_pull_inplace, {size} workers: chunks {chunked * 1e3:.1f} ms "
              f"({n * 4 / chunked / 1e9:.2f} GB/s), partition staging {staged * 1e3:.1f} ms "
              f"({n * 4 / staged / 1e9:.2f} GB/s)", flush=True)
bps.shutdown()
