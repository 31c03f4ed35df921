"""Worker: Compression.auto switches every rank at the same round, and back.

Rank 0 stops the controller's measuring and decides with bandwidths it sets: from step SLOW on
(decided before that step's push_pulls) a link of 1 Mbit/s (onebit wins), from step FAST on one of
1 Pbit/s (none wins). Each step push_pulls "big" (1 MiB, float32 values that float16 cannot hold
exactly) and "small" (below BYTEPS_MIN_COMPRESS_BYTES: always none); each rank prints one line
per step: the step, whether big's sum was exact, and a CRC of both results, so that the test
compares the ranks' lines.
"""
import os
import zlib

import numpy as np

import byteps_like as bps
from byteps_like.compression import Compression
from byteps_like.worker.autocompress import controller, decisions
from byteps_like.worker.runtime import default_runtime

STEPS, SLOW, FAST = 8, 2, 5


def main() -> None:
    bps.init()
    rank, size = bps.rank(), bps.size()
    auto = Compression.auto(allow=("fp16", "onebit"))
    ctl = controller(default_runtime(), auto)
    ctl.measuring = False
    n = 1 << 18
    for step in range(STEPS):
        if rank == 0 and step == SLOW:
            ctl.decide(1e6 / 8)
        if rank == 0 and step == FAST:
            ctl.decide(1e15 / 8)
        x = (1 + (np.arange(n, dtype=np.float32) % 7) / 4096 + rank).astype(np.float32)
        small = np.full(1000, rank + step, np.float32)
        hb = bps.push_pull_async(x, name="big", average=False, compression=auto)
        hs = bps.push_pull_async(small, name="small", average=False, compression=auto)
        big, sm = hb.wait(), hs.wait()
        want = sum((1 + (np.arange(n, dtype=np.float32) % 7) / 4096 + r).astype(np.float32)
                   for r in range(size))
        assert np.array_equal(sm, np.full(1000, sum(r + step for r in range(size)),
                                          np.float32)), sm[:3]
        crc = zlib.crc32(big.tobytes() + sm.tobytes())
        print(f"STEP {step} rank {rank} exact={np.array_equal(big, want)} crc={crc:08x}",
              flush=True)
    if rank == 0:
        for d in decisions(default_runtime()):
            print(f"DECISION changed={d['changed']} epoch={d['applies_from_epoch']} "
                  f"table={d['table']}", flush=True)
    print(f"OK auto rank {rank} of {size} ({os.environ.get('DMLC_NUM_SERVER')} servers)",
          flush=True)
    bps.shutdown()


if __name__ == "__main__":
    main()
