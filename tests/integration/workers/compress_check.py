"""Worker: push_pull with every compressor and check the result bit for bit against a
simulation of the whole job built from the compression library itself.

Every worker can generate every worker's gradients (seeded by rank, tensor name and step), so it
replays what each worker's codec encodes, what the server decodes, sums and re-encodes, and what
this worker decodes: the result of the real job must equal that replay exactly (with two
workers the server's float32 sum does not depend on the order the pushes arrive). This checks
that worker and server codecs share seeds, keys and steps, that error feedback and momentum keep
their state across steps, and that every partition lands in its place.

Usage: compress_check.py ELEMENTS   (env STEPS, default 3; BYTEPS_PARTITION_BYTES splits it)
"""
import os
import sys
import threading
import zlib

import numpy as np

import byteps_like as bps
from byteps_like.compression import Compression, from_spec
from byteps_like.worker.runtime import default_runtime

COMPRESSORS = {
    "onebit": lambda: Compression.onebit(scaling=True),
    "onebit_ef": lambda: Compression.onebit(scaling=True, error_feedback=True),
    "topk": lambda: Compression.topk(0.05, error_feedback=True),
    "topk_count": lambda: Compression.topk(7),
    "randomk": lambda: Compression.randomk(0.1, seed=42, error_feedback=True),
    "dithering": lambda: Compression.dithering(levels=8, partition="natural", normalize="l2",
                                               seed=7),
    "dithering_max": lambda: Compression.dithering(levels=4, seed=3, momentum=0.9),
    # registered by workers/registered/sitecustomize.py in every process (PYTHONPATH)
    "registered": lambda: from_spec({"name": "test-large"}),
    "registered_ef": lambda: from_spec({"name": "ef", "inner": {"name": "test-large"}}),
}


def grad(rank: int, name: str, step: int, n: int) -> np.ndarray:
    rng = np.random.default_rng([rank, zlib.crc32(name.encode()), step])
    return rng.standard_normal(n).astype(np.float32)


def main() -> None:
    n = int(sys.argv[1])
    steps = int(os.environ.get("STEPS", "3"))
    only = os.environ.get("COMPRESSORS")
    bps.init()
    rank, size = bps.rank(), bps.size()
    local = bps.local_size()      # the local ranks of a machine reduce first, then it pushes
    machines = size // local
    rt = default_runtime()
    names = [c for c in COMPRESSORS if c in only.split(",")] if only else [
        c for c in COMPRESSORS if not c.startswith("registered")]
    sims = {}
    for step in range(steps):
        handles = {}
        for cname in names:
            x = grad(rank, cname, step, n)
            handles[cname] = bps.push_pull_async(x, name=cname, average=True,
                                                 compression=COMPRESSORS[cname]())
        for cname, h in handles.items():
            got = h.wait()
            st = rt.tensors()[cname]
            if cname not in sims:   # one codec per (simulated worker, partition) and server
                comp = COMPRESSORS[cname]()
                sims[cname] = [(off // 4, nb // 4,
                                [comp.make_codec(nb // 4, role="worker", key=key)
                                 for _ in range(machines)],
                                comp.make_codec(nb // 4, role="server", key=key))
                               for off, nb, key, _srv in st.parts]
            want = np.empty(n, np.float32)
            xs = [grad(r, cname, step, n) for r in range(size)]
            # what each machine pushes: its local ranks' sum (two addends: order-free)
            ms = [sum(xs[m * local + 1:(m + 1) * local], xs[m * local].copy())
                  for m in range(machines)]
            for lo, cnt, workers, server in sims[cname]:
                acc = np.empty(cnt, np.float32)
                for m in range(machines):
                    p = workers[m].encode(ms[m][lo:lo + cnt], step)
                    (server.decode if m == 0 else server.decode_add)(bytes(p), acc)
                pulled = bytes(server.encode(acc, step))
                out = np.empty(cnt, np.float32)
                assert workers[rank // local].decode(pulled, out) == step
                want[lo:lo + cnt] = out / np.float32(size)
            if not np.array_equal(got, want):
                bad = np.flatnonzero(got != want)
                raise SystemExit(f"rank {rank} {cname} step {step}: {bad.size} of {n} elements "
                                 f"differ, first at {bad[0]}: {got[bad[0]]} != {want[bad[0]]}")
            if not np.isfinite(got).all() or not np.any(got):
                raise SystemExit(f"rank {rank} {cname} step {step}: degenerate result")
    plane = "native" if rt.native is not None else "zmq"   # the local root's data plane
    coders = sum(t.name == "bpsl-compress" for t in threading.enumerate())
    if rt.native is not None:  # every partition of every step went through the native plane
        parts = sum(len(rt.tensors()[c].parts) for c in names) * steps
        print(f"NATIVE rank {rank}: {rt.native.stats()['msgs_out']} pushes of {parts}",
              flush=True)
    # push_pulls the native client encoded and decoded itself (coded operations)
    coded = rt.native.stats()["coded_ops"] if rt.native is not None else 0
    print(f"OK rank {rank} of {size}: {len(names)} compressors x {steps} steps exact "
          f"(plane {plane}, {coders} compress threads, {coded} coded)", flush=True)
    bps.shutdown()


if __name__ == "__main__":
    main()
