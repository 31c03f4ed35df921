"""Worker: push_pull with a cast compressor (fp16, bf16) checked bit for bit against a replay of
the job: every worker narrows its whole tensor with the compression library, the servers (and
with several local ranks, each machine first) sum the narrowed tensors with the summation
kernel, divide in the narrow dtype when averaging, and the caller's dtype comes back widened.
With two summands per sum the order of arrival does not matter, so the replay is exact.

Each case pushes several partitions (BYTEPS_PARTITION_BYTES splits the tensor), a float32 one
converted partition by partition with one local rank, the others whole, for two steps (the wire buffer of a name is
reused), through the numpy API (``out=None``, ``out=``, in place), for float32, float64 and
bfloat16 inputs; a one-partition tensor is converted whole; an int32 tensor must stay exact.

Usage: cast_check.py ELEMENTS
"""
import sys
import zlib

import numpy as np

import byteps_like as bps
from byteps_like import _core
from byteps_like.compression import Compression
from byteps_like.worker.runtime import default_runtime

CASES = [  # (compressor, caller dtype name, numpy dtype, average, out mode)
    ("fp16", "float32", np.float32, True, "new"),
    ("fp16", "float32", np.float32, False, "out"),
    ("fp16", "float64", np.float64, True, "inplace"),
    ("fp16", "bfloat16", np.uint16, True, "out"),
    ("bf16", "float32", np.float32, True, "inplace"),
    ("bf16", "float64", np.float64, False, "new"),
]


def data(rank: int, name: str, step: int, n: int, dtype: str, npdt) -> np.ndarray:
    rng = np.random.default_rng([rank, zlib.crc32(name.encode()), step])
    x = rng.standard_normal(n) * 3.0
    x[::997] *= 30000.0          # some beyond float16's range: inf on the wire
    if dtype == "bfloat16":
        b = x.astype(np.float32).view(np.uint32)
        return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)
    return x.astype(npdt)


def replay(comp, dtype: str, npdt, name: str, step: int, n: int, size: int, local: int,
           average: bool) -> np.ndarray:
    wdt = comp.wire_dtype(dtype)
    wires = [comp.compress(data(r, name, step, n, dtype, npdt), dtype)[0] for r in range(size)]
    machines = []
    for m in range(size // local):   # each machine's local ranks first (rank // local_size)
        acc = wires[m * local].copy()
        for r in range(m * local + 1, (m + 1) * local):
            _core.add_into(acc, wires[r], wdt)
        machines.append(acc)
    total = machines[0]
    for acc in machines[1:]:
        _core.add_into(total, acc, wdt)
    if average and size > 1:
        _core.scale_into(total, wdt, size)
    out = np.empty(n, npdt)
    comp.decompress(total, dtype, out, dtype)
    return out


def main() -> None:
    n = int(sys.argv[1])
    bps.init()
    rank, size, local = bps.rank(), bps.size(), bps.local_size()
    rt = default_runtime()
    for step in range(2):
        for i, (cname, dtype, npdt, average, mode) in enumerate(CASES):
            comp = getattr(Compression, cname)
            name = f"cast.{i}"
            x = data(rank, name, step, n, dtype, npdt)
            keep = x.copy()
            out = x if mode == "inplace" else (np.empty_like(x) if mode == "out" else None)
            h = bps.push_pull_async(x, name=name, average=average, out=out,
                                    dtype="bfloat16" if dtype == "bfloat16" else None,
                                    compression=comp)
            # float32 with one local rank: converted partition by partition on the native
            # client's codec threads; otherwise whole (worker/route.py's plan)
            assert (h.convert is not None) == (local > 1 or dtype != "float32"), (name, h)
            got = h.wait()
            if mode != "new":
                assert got is out, f"{name}: the result is not the out array"
            if mode != "inplace":
                assert np.array_equal(x.view(np.uint8), keep.view(np.uint8)), f"{name}: input"
            want = replay(comp, dtype, npdt, name, step, n, size, local, average)
            assert got.dtype == npdt, (name, got.dtype)
            assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), (
                f"{name} ({cname}, {dtype}, step {step}): "
                f"{int(np.sum(got.view(np.uint8) != want.view(np.uint8)))} bytes differ")
            st = rt.tensors()[name]
            assert st.dtype == comp.wire_dtype(dtype), (name, st.dtype)   # bound as it travels
        # one partition: converted whole (nothing to overlap), the same bits
        x = data(rank, "cast.one", step, 1000, "float32", np.float32)
        h = bps.push_pull_async(x, name="cast.one", compression=Compression.fp16)
        assert h.convert is not None, "a one-partition tensor went through the stages"
        want = replay(Compression.fp16, "float32", np.float32, "cast.one", step, 1000, size,
                      local, True)
        assert np.array_equal(h.wait().view(np.uint8), want.view(np.uint8)), "cast.one"
        ints = np.arange(n, dtype=np.int32) * (rank + 1)
        got = bps.push_pull(ints, name="cast.ints", average=False, compression=Compression.fp16)
        assert got.dtype == np.int32 and np.array_equal(
            got, np.arange(n, dtype=np.int32) * sum(r + 1 for r in range(size))), "ints"
    parts = len(rt.tensors()["cast.0"].parts)
    print(f"OK cast rank {rank} of {size}: {len(CASES)} cases x 2 steps exact, {parts} "
          f"partitions, {coded_operations(rt)} coded", flush=True)
    bps.shutdown()


def coded_operations(rt) -> int:
    """float32 casts on the native plane with one local rank are one native operation each,
    the native client narrowing and widening (coded operations): how many this rank ran."""
    client = rt.native
    return 0 if client is None else client.stats()["coded_ops"]


if __name__ == "__main__":
    main()
