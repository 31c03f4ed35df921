"""A job for strangers to attack (tests/faults/test_open_doors.py, issue 41). Usage: target.py
INFO_FILE STOP_FILE

Rank 0 writes INFO_FILE (JSON: every server's host, data port and ZeroMQ port, the
scheduler's address, whether the job has a secret, the job's tag, every pid of the job) once
the job is up.
Every worker then runs rounds of an int64 push_pull whose exact sum it checks, until STOP_FILE
exists on any worker (a one-element push_pull carries the decision, so every worker stops
after the same round), and prints ``EXACT <rounds>`` — or ``WRONG round <r> ...`` and exits
1 at the first wrong sum. Works under bpslaunch and torchrun alike.
"""
import itertools
import json
import os
import sys

import numpy as np

import byteps_like as bps
from byteps_like.wire import job_hash
from byteps_like.worker.runtime import default_runtime

N = 5000


def say(line: str) -> None:
    """One line in one write: torchrun's workers share its stdout, and print() writes the
    text and the newline apart when unbuffered (PYTHONUNBUFFERED), so two ranks' lines could
    run together ("EXACT 129EXACT 129")."""
    os.write(1, (line + "\n").encode())


def main() -> int:
    info_file, stop_file = sys.argv[1:3]
    bps.init()
    rank, size = bps.rank(), bps.size()
    rt = default_runtime()
    if rank == 0:
        peers = rt.control.peers
        info = {"servers": [{"host": p.host, "data_port": p.data_port, "port": p.port}
                            for p in peers if p.role == "server"],
                "scheduler": f"{rt.cfg.cluster.root_uri}:{rt.cfg.cluster.root_port}",
                "auth": bool(rt.cfg.auth.secret or rt.cfg.auth.secret_file),
                "job": job_hash(rt.cfg.cluster.job_id),
                "pids": sorted({p.pid for p in peers} | {os.getpid()}),
                "workers": {str(p.rank): p.pid for p in peers if p.role == "worker"}}
        tmp = info_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump(info, f)
        os.replace(tmp, info_file)
    for r in itertools.count():   # until STOP_FILE (the attacker's watchdog bounds it)
        x = np.full(N, 10 ** 12 + 1000 * r + rank, np.int64)
        out = bps.push_pull(x, name="target.i", average=False)
        want = size * (10 ** 12 + 1000 * r) + size * (size - 1) // 2
        if not np.array_equal(np.asarray(out), np.full(N, want, np.int64)):
            say(f"WRONG round {r} rank {rank}: {np.asarray(out)[:3]} want {want}")
            return 1
        stop = bps.push_pull(np.array([float(os.path.exists(stop_file))], np.float32),
                             name="target.stop", average=False)
        if float(np.asarray(stop)[0]) > 0:
            say(f"EXACT {r + 1}")
            break
    bps.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
