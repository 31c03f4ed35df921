"""Worker: the ranks push two tensors in opposite orders within each step (declared up front in
one order, as the synchronizer declares its buckets); after rank 0 switches them to onebit,
their onebit names must get the same keys on every rank (declared in the order of the names'
own declarations, not in this step's push order), or the servers would see a mismatch."""
import numpy as np

import byteps_like as bps
from byteps_like.compression import Compression
from byteps_like.worker.autocompress import controller
from byteps_like.worker.runtime import default_runtime

STEPS, SLOW = 5, 1


def main() -> None:
    bps.init()
    rank, size = bps.rank(), bps.size()
    auto = Compression.auto(allow=("onebit",), error_feedback=False)
    ctl = controller(default_runtime(), auto)
    ctl.measuring = False
    for name in ("a", "b"):
        bps.declare(name)
    xs = {"a": np.linspace(-1, 1, 1 << 18, dtype=np.float32),
          "b": np.linspace(1, -1, 1 << 17, dtype=np.float32)}
    order = ["a", "b"] if rank == 0 else ["b", "a"]
    for step in range(STEPS):
        if rank == 0 and step == SLOW:
            ctl.decide(1e6 / 8)
        hs = {n: bps.push_pull_async(xs[n], name=n, average=False, compression=auto)
              for n in order}
        for n in order:
            got = hs[n].wait()
            if step <= SLOW:
                assert np.array_equal(got, xs[n] * size), (rank, step, n)
            else:   # onebit with scaling: +-scale, the signs of the sum
                assert np.array_equal(np.sign(got), np.sign(xs[n])), (rank, step, n)
    keys = sorted(n for n in default_runtime().tensors() if "#auto." in n)
    print(f"OK auto order rank {rank}: {' '.join(keys)}", flush=True)
    bps.shutdown()


if __name__ == "__main__":
    main()
