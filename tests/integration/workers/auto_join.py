"""Worker: Compression.auto with uneven steps: rank 0 runs STEPS - 3 push_pulls, the others
STEPS, then join(). The ranks still pushing go on after rank 0 joined (its tables stop coming:
the broadcast sums to zeros and the last table stays), and each round's result is the sum over
the ranks still in."""
import numpy as np

import byteps_like as bps
from byteps_like.compression import Compression

STEPS = 8


def main() -> None:
    bps.init()
    rank, size = bps.rank(), bps.size()
    auto = Compression.auto(allow=("fp16",))
    x = np.full(1 << 17, rank + 1, np.float32)   # 512 KiB: exact in fp16 too
    steps = STEPS - 3 if rank == 0 else STEPS     # rank 0 stops first
    for step in range(steps):
        got = bps.push_pull(x, name="g", average=False, compression=auto)
        ranks_in = size if step < STEPS - 3 else size - 1
        want = sum(r + 1 for r in range(size)) - (1 if ranks_in < size else 0)
        assert np.all(got == want), (rank, step, got[:3], want)
    last = bps.join()
    print(f"OK auto join rank {rank}: {steps} steps, join() -> {last}", flush=True)
    bps.shutdown()


if __name__ == "__main__":
    main()
