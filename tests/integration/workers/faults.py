"""Worker for failure tests. Usage: faults.py MODE [SERVER]

kill-server  rank 0 SIGKILLs server rank SERVER (default 0) after a few rounds; everyone keeps
             pushing
kill-worker  the last rank SIGKILLs itself after a few rounds (printing ``KILLING MYSELF at T``)
kill-scheduler  rank 0 SIGKILLs the scheduler after a few rounds (``KILLING scheduler at T``)
restart-then-kill-worker  as kill-scheduler (bpslaunch restarts it); once a barrier shows the
             restarted scheduler has every node back, the last rank SIGKILLs itself
restart-then-kill-scheduler  as restart-then-kill-worker, but rank 0 SIGKILLs the restarted
             scheduler (``KILLING scheduler again at T``)
mismatch     the last rank declares tensor 'w' with another shape
async        asynchronous mode: pushes are deltas, a pull returns the current value
Prints ``PIDS ...`` (every process of the job, from rank 0), then ``PEER_LOST <message>`` or
``MISMATCH <message>`` when that error is raised.
"""
import os
import signal
import sys
import time

import numpy as np

import byteps_like as bps
from byteps_like.worker.runtime import default_runtime


def running_scheduler() -> int:
    """The scheduler bpslaunch (this worker's parent) runs now: a restarted one is a new
    process, which the node table does not name."""
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{d}/stat") as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
            if int(ppid) != os.getppid() or state == "Z":
                continue
            with open(f"/proc/{d}/environ", "rb") as f:
                if b"\0DMLC_ROLE=scheduler\0" in b"\0" + f.read():
                    return int(d)
        except OSError:
            continue
    raise RuntimeError("bpslaunch runs no scheduler")


def main():
    mode = sys.argv[1]
    bps.init()
    rank, size = bps.rank(), bps.size()
    peers = default_runtime().control.peers
    if rank == 0:
        print("PIDS", *sorted({p.pid for p in peers} | {os.getpid()}), flush=True)
    x = np.ones(50000, np.float32)
    if mode == "mismatch":
        shape = (7, 3) if rank == size - 1 else (3, 7)
        try:
            bps.push_pull(np.zeros(shape, np.float32), name="w", timeout=30)
        except bps.MismatchError as exc:
            print(f"MISMATCH rank {rank}: {exc}", flush=True)
        bps.shutdown()
        return
    if mode == "async":
        for _ in range(5):
            bps.push_pull(np.ones(1000, np.int64), name="v", average=False)
        bps.barrier()
        total = bps.push_pull(np.zeros(1000, np.int64), name="v", average=False)
        assert np.array_equal(total, np.full(1000, 5 * size)), total[:4]
        native = default_runtime().native
        plane = "native" if native is not None and native.stats()["msgs_out"] else "zmq"
        print(f"ASYNC OK rank {rank} total {int(total[0])} plane {plane}", flush=True)
        bps.shutdown()
        return
    victim = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    server = next(p for p in peers if p.role == "server" and p.rank == victim)
    try:
        for step in range(10_000):
            if step == 5 and mode == "kill-server" and rank == 0:
                print(f"KILLING server rank {victim} pid {server.pid}", flush=True)
                os.kill(server.pid, signal.SIGKILL)
            if step == 5 and mode.startswith(("kill-scheduler", "restart-then")) and rank == 0:
                scheduler = next(p for p in peers if p.role == "scheduler")
                print(f"KILLING scheduler at {time.time():.3f}", flush=True)
                os.kill(scheduler.pid, signal.SIGKILL)
            if step == 10 and mode.startswith("restart-then"):
                bps.barrier()   # completes once the restarted scheduler has every node back
                if rank == 0 and mode == "restart-then-kill-scheduler":
                    pid = running_scheduler()
                    print(f"KILLING scheduler again at {time.time():.3f}", flush=True)
                    os.kill(pid, signal.SIGKILL)
            if (step == 5 and mode == "kill-worker" or step == 12
                    and mode == "restart-then-kill-worker") and rank == size - 1:
                print(f"KILLING MYSELF at {time.time():.3f}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            bps.push_pull(x, name="x", timeout=60)
            time.sleep(0.01)
    except bps.PeerLostError as exc:
        print(f"PEER_LOST rank {rank} at {time.time():.3f} step {step}: {exc}", flush=True)
        sys.exit(1)
    print("NO FAILURE SEEN", flush=True)


if __name__ == "__main__":
    main()
