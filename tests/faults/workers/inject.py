"""Worker for the fault-injection suite. Usage: inject.py TARGET ACTION POINT

TARGET  worker (the last worker rank) | local (the last local rank: run with local_size 2) |
        server (server 0) | scheduler | none
ACTION  kill (SIGKILL) | stop (SIGSTOP: a hung process) | exception (an unhandled exception;
        for the server and scheduler the role wrapper role_fault.py raises it in-process)
POINT   rendezvous (before init) | push (before pushing round K) | pull (after round K's push,
        while its pull is outstanding) | shutdown (just before shutdown)

Rank 0 prints ``PIDS ...`` (every process of the job). A survivor that sees a byteps_like error
prints ``SURVIVOR rank R TYPE: message`` and exits 1; ``ASYNC SURVIVED rank R`` in async mode.
"""
import os
import signal
import sys
import time

import numpy as np

import byteps_like as bps
from byteps_like.errors import EXIT_PEER_FAILED
from byteps_like.roles import caused_by_peer
from byteps_like.worker.runtime import default_runtime

K = 5
SIG = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}


def act_on_self(action):
    if action == "exception":
        raise RuntimeError("injected fault: unhandled exception in a worker")
    os.kill(os.getpid(), SIG[action])
    time.sleep(60)  # SIGSTOP: never reached until continued


def main():
    target, action, point = sys.argv[1:4]
    n_machines = int(os.environ["DMLC_NUM_WORKER"])
    local_size = int(os.environ.get("BYTEPS_LOCAL_SIZE", "1"))
    me_victim = (target in ("worker", "local")
                 and int(os.environ.get("DMLC_WORKER_ID", "0")) == n_machines - 1
                 and int(os.environ.get("BYTEPS_LOCAL_RANK", "0")) == local_size - 1)
    if point == "rendezvous" and me_victim:
        act_on_self(action)
    try:
        run(target, action, point, me_victim)
    except bps.BytePSError as exc:
        print(f"SURVIVOR rank {os.environ.get('DMLC_WORKER_ID')}/{os.environ.get('BYTEPS_LOCAL_RANK', '0')} "
              f"{type(exc).__name__}: {exc}", flush=True)
        sys.exit(1)


def run(target, action, point, me_victim):
    if target == "none":
        print("AUTH", "on" if os.environ.get("BYTEPS_AUTH_SECRET") else "off", flush=True)
    bps.init()
    rank, size = bps.rank(), bps.size()
    peers = default_runtime().control.peers
    if rank == 0:
        print("PIDS", *sorted({p.pid for p in peers} | {os.getpid()}), flush=True)
    victim_pid = None
    if target in ("server", "scheduler"):
        victim_pid = next(p.pid for p in peers if p.role == target and p.rank == 0)
    async_mode = os.environ.get("BYTEPS_ENABLE_ASYNC") == "1"
    x = np.ones(20000, np.float32)

    def inject():
        if me_victim:
            act_on_self(action)
        elif victim_pid is not None and rank == 0 and action in SIG:
            os.kill(victim_pid, SIG[action])

    try:
        lost_at = None
        step = 0
        while True:
            if async_mode:
                # keep training well past the loss being detected (heartbeat timeout + 2 s)
                if lost_at is not None and time.monotonic() - lost_at > 5.0:
                    break
            elif step >= 40:
                break
            if step == K and point == "push":
                if async_mode and not me_victim:
                    lost_at = time.monotonic()
                inject()
                if target == "scheduler" and action == "exception":
                    bps.barrier()  # role_fault.py makes the scheduler crash on a barrier
            h = bps.push_pull_async(x, name="x", average=False)
            if step == K and point == "pull":
                time.sleep(0.2)  # the push has reached the server; the pull is outstanding
                inject()
            out = h.wait(30)
            if not async_mode:
                assert np.array_equal(out, x * size), out[:4]
            step += 1
            time.sleep(0.01)
        if point == "shutdown":
            inject()
        if async_mode:
            print(f"ASYNC SURVIVED rank {rank} after {step} steps", flush=True)
        bps.shutdown()
    except bps.BytePSError as exc:
        print(f"SURVIVOR rank {rank} {type(exc).__name__}: {exc}", flush=True)
        # as a script dying of it would (the runtime's excepthook): a survivor of a lost peer
        # exits with EXIT_PEER_FAILED, so bpslaunch blames the peer however fast this was; a
        # stopped peer never exits, so there a survivor's exit is the failure to report
        sys.exit(EXIT_PEER_FAILED if caused_by_peer(exc) and action != "stop" else 1)
    print(f"FINISHED rank {rank}", flush=True)


if __name__ == "__main__":
    main()
