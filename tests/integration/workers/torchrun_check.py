"""Worker started by torchrun (tests/integration/test_torchrun.py): one byteps_like job of
WORLD_SIZE processes, checked with exact sums.

Checks that byteps_like's rank, size, local rank and local size are torchrun's RANK, WORLD_SIZE,
LOCAL_RANK and LOCAL_WORLD_SIZE, push_pulls known values (int64 and float32 sums, a float32
average) and compares them with the exact result, then prints ``RESULT rank R size N local L/S``
and ``PIDS <its pid> <its children>`` (local rank 0's children are the scheduler and servers it
started), ``CHILDREN <count>``. With ``TORCHRUN_CHECK_DIE=1``, local rank 0 of node 0 then kills
itself with SIGKILL (no exit handler runs) and the others wait in a barrier, so that the test can
check that nothing it started outlives it.
"""
import glob
import os
import signal

import numpy as np

import byteps_like as bps


def children() -> list[str]:
    kids: list[str] = []
    for path in glob.glob(f"/proc/{os.getpid()}/task/*/children"):
        with open(path) as f:
            kids += f.read().split()
    return kids


def main() -> None:
    want_rank, want_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    want_local = (int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"]))
    bps.init()
    rank, size = bps.rank(), bps.size()
    assert (rank, size) == (want_rank, want_size), (rank, size, want_rank, want_size)
    assert (bps.local_rank(), bps.local_size()) == want_local, want_local
    total = size * (size + 1) // 2  # the sum of rank + 1 over all ranks
    ints = np.arange(1000, dtype=np.int64) * (rank + 1) + (1 << 40)
    got = bps.push_pull(ints, name="ints", average=False)
    assert np.array_equal(got, np.arange(1000, dtype=np.int64) * total + size * (1 << 40)), got
    floats = np.full(1_200_000, 0.25 * (rank + 1), dtype=np.float32)  # several partitions
    got = bps.push_pull(floats, name="floats", average=False)
    assert np.array_equal(got, np.full_like(floats, 0.25 * total)), got[:4]
    got = bps.push_pull(floats, name="floats.avg", average=True)
    assert np.array_equal(got, np.full_like(floats, 0.25 * total / size)), got[:4]
    kids = children()
    # one write of less than PIPE_BUF: the local ranks share torchrun's stdout
    os.write(1, (f"RESULT rank {rank} size {size} local {bps.local_rank()}/{bps.local_size()}\n"
                 f"PIDS {os.getpid()} {' '.join(kids)}\nCHILDREN rank {rank} {len(kids)}\n"
                 ).encode())
    if os.environ.get("TORCHRUN_CHECK_DIE") == "1":
        # every rank has written its lines before rank 0 dies: torchrun stops the others at
        # once, and a rank still on its way to its write would never report its pid
        bps.barrier()
        if rank == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        bps.barrier()  # fails (or is stopped by torchrun) once rank 0 is gone
    bps.shutdown()


if __name__ == "__main__":
    main()
