"""Worker: small tensors stay exact under compression; a compressor mismatch between workers
fails on every worker with a MismatchError that names the tensor.

Usage: compress_small.py            tensors below and above BYTEPS_MIN_COMPRESS_BYTES
       compress_small.py mismatch   rank 0 uses top-k, rank 1 onebit for the same tensor
"""
import sys

import numpy as np

import byteps_like as bps
from byteps_like.compression import Compression
from byteps_like.errors import MismatchError, RemoteError


def main() -> None:
    bps.init()
    rank, size = bps.rank(), bps.size()
    if sys.argv[1:] == ["async"]:  # the servers run BYTEPS_ENABLE_ASYNC=1
        try:
            bps.push_pull(np.ones(1 << 16, np.float32), name="grad.a", timeout=30,
                          compression=Compression.onebit())
        except RemoteError as exc:
            print(f"rank {rank}: RemoteError: {exc}", flush=True)
            raise SystemExit(3) from exc
        raise SystemExit(f"rank {rank}: a compressed push in async mode was accepted")
    if sys.argv[1:] == ["mismatch"]:
        comp = Compression.topk(0.5) if rank == 0 else Compression.onebit()
        x = np.full(1 << 16, rank + 1, np.float32)
        try:
            bps.push_pull(x, name="grad.w", compression=comp, timeout=30)
        except MismatchError as exc:
            print(f"rank {rank}: MismatchError: {exc}", flush=True)
            raise SystemExit(3) from exc
        raise SystemExit(f"rank {rank}: a compressor mismatch went unnoticed")
    small = np.arange(1000, dtype=np.float32) * (rank + 1)         # 4 KB: not compressed
    got = bps.push_pull(small, name="small", compression=Compression.onebit())
    want = np.arange(1000, dtype=np.float32) * sum(r + 1 for r in range(size)) / size
    assert np.array_equal(got, want), (got[:4], want[:4])
    # a cast compressor through the numpy API: float16 on the wire, float32 back (exact here)
    few = np.arange(100, dtype=np.float32) * (rank + 1)    # sums < 512: exact in float16
    h = bps.push_pull_async(few, name="small.fp16", compression=Compression.fp16)
    got = h.wait()
    want = np.arange(100, dtype=np.float32) * sum(r + 1 for r in range(size)) / size
    assert got.dtype == np.float32 and np.array_equal(got, want), (got[:4], want[:4])
    assert h.wait() is got and h.done()   # converted once
    ints = np.arange(40000, dtype=np.int32)                         # ints: never compressed
    got = bps.push_pull(ints, name="ints", average=False, compression=Compression.topk(0.01))
    assert np.array_equal(got, ints * size)
    big = np.linspace(-1, 1, 40000, dtype=np.float32)              # 160 KB: compressed
    got = bps.push_pull(big, name="big", compression=Compression.onebit(scaling=True))
    assert len(np.unique(np.abs(got))) == 1, "onebit: every element is +-scale"
    for dt in (np.float64, np.float16):   # converted to float32 for the codec and back
        x = np.linspace(-1, 1, 40000).astype(dt)
        got = bps.push_pull(x, name=f"big.{np.dtype(dt).name}",
                            compression=Compression.onebit(scaling=True))
        assert got.dtype == dt and np.array_equal(np.sign(got), np.sign(x)), dt
        assert len(np.unique(np.abs(got))) == 1, dt
    print(f"OK small rank {rank}", flush=True)
    bps.shutdown()


if __name__ == "__main__":
    main()
