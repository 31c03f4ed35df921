"""Worker: push_pull tensors of every dtype and size, check the sums against the exact expectation.

Every worker generates its data from (rank, tensor name), so each can compute the sum over all
workers locally. Integers must match exactly; floats within the dtype's rounding.
Usage: pushpull_check.py SIZES... (element counts); env ROUNDS (default 2).
"""
import os
import sys
import zlib

import numpy as np

import byteps_like as bps

DTYPES = ["float32", "float64", "float16", "bfloat16", "int32", "int64"]


def to_bf16(x32):
    b = x32.astype(np.float32).view(np.uint32)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def from_bf16(u16):
    return (u16.astype(np.uint32) << 16).view(np.float32)


def data(rank, name, n, dtype, rnd):
    rng = np.random.default_rng([rank, zlib.crc32(name.encode()), rnd])
    if dtype.startswith("int"):
        big = 2**62 if dtype == "int64" else 2**30
        return rng.integers(-big, big, n, dtype=np.dtype(dtype))
    vals = rng.integers(-64, 64, n).astype(np.float32) / 4  # exactly representable everywhere
    if dtype == "bfloat16":
        return to_bf16(vals)
    return vals.astype(dtype)


def main():
    sizes = [int(s) for s in sys.argv[1:]]
    rounds = int(os.environ.get("ROUNDS", "2"))
    bps.init()
    rank, size = bps.rank(), bps.size()
    checked = 0
    for rnd in range(rounds):
        handles = []
        for n in sizes:
            for dt in DTYPES:
                name = f"{dt}.{n}"
                x = data(rank, name, n, dt, rnd)
                kw = {"dtype": "bfloat16"} if dt == "bfloat16" else {}
                h = bps.push_pull_async(x, name=name, average=False, priority=-len(handles),
                                        **kw)
                handles.append((name, n, dt, h))
        for name, n, dt, h in handles:
            got = h.wait()
            parts = [data(r, name, n, dt, rnd) for r in range(size)]
            if dt.startswith("int"):
                want = np.sum(np.stack(parts), axis=0, dtype=np.dtype(dt))  # wraps like C
                assert np.array_equal(got, want), f"{name}: integer sum differs"
            elif dt == "bfloat16":
                want = np.sum([from_bf16(p) for p in parts], axis=0)
                assert np.allclose(from_bf16(got), want, rtol=1e-2, atol=1e-2), f"{name}"
            else:
                want = np.sum([p.astype(np.float64) for p in parts], axis=0)
                # inputs are multiples of 1/4 below 16: sums are exact in fp32/fp64/fp16
                assert np.array_equal(got.astype(np.float64), want), f"{name}: float sum differs"
            checked += 1
    # averaging: floats divide by the number of workers
    avg = bps.push_pull(np.full(10, rank + 1, np.float32), name="avg", average=True)
    assert np.allclose(avg, (size + 1) / 2), avg
    if os.environ.get("REPORT_PLANE"):  # where push_pull went (the one-machine tests)
        from byteps_like.worker.runtime import default_runtime
        rt = default_runtime()
        nserv = sum(p.role == "server" for p in rt.control.peers)
        streams = rt.native.stats()["streams"] if rt.native is not None else 0
        print(f"PLANE rank {rank} single_machine={rt.single_machine} servers={nserv} "
              f"pushed={rt.bytes_pushed} native_streams={streams}", flush=True)
    print(f"OK rank {rank} of {size}: {checked} tensors checked", flush=True)
    bps.shutdown()


if __name__ == "__main__":
    main()
