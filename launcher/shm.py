"""The shared-memory segments of a job's local reduction, seen from bpslaunch: their names, and
sweeping what a job left behind (standard library only).

The worker runtime names a machine's segments ``bpsl-<job>-<scheduler port>-m<machine>-...``
in BYTEPS_SHM_DIR (byteps_like/shm_names.py names and sweeps them for both) and unlinks them
at exit. A worker killed by a signal cannot, so bpslaunch removes its job's segments when the
job ends, however it ends. When bpslaunch itself is killed
(SIGKILL), its children follow it (procs.py, PR_SET_PDEATHSIG) and the segments stay; a job id
that ``bpslaunch --local`` generates carries the launcher's pid (:func:`local_job_id`), so the
next ``bpslaunch --local`` removes the segments of such jobs whose launcher is gone, and
those of any job (torchrun, SLURM, Ray, ...) whose processes all died
(``shm_names.sweep_orphans``: their lock is free).
"""
from __future__ import annotations

import os
import re
import secrets

from byteps_like.shm_names import matching, segment_prefix, sweep, sweep_orphans, unlink_all

from .procs import pid_alive

__all__ = ["local_job_id", "segment_prefix", "sweep", "sweep_dead_local_jobs", "sweep_orphans"]

LOCAL_JOB_PREFIX = "local-"
_DEAD_LOCAL = re.compile(r"^bpsl-local-(\d+)-(\d+)-[0-9a-f]+-")


def _pid_namespace() -> int:
    """An id of this process's pid namespace: a pid means something only inside it (containers
    that share /dev/shm, ``docker run --ipc=host``, may have pid namespaces of their own)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def local_job_id() -> str:
    """A job id of its own for ``bpslaunch --local``: ``local-<pid namespace>-<pid>-<random>``.
    Two local jobs on one machine never share one (nor their segments, nor a scheduler)."""
    return f"{LOCAL_JOB_PREFIX}{_pid_namespace()}-{os.getpid()}-{secrets.token_hex(4)}"


def sweep_dead_local_jobs(shm_dir: str) -> list[str]:
    """Remove the segments of ``bpslaunch --local`` jobs whose launcher is gone (it was killed
    with SIGKILL, so it could not sweep them itself); only jobs of this pid namespace."""
    namespace, dead, verdict = _pid_namespace(), [], {}
    for path in matching(shm_dir, "bpsl-local-*"):
        m = _DEAD_LOCAL.match(os.path.basename(path))
        if m is None or int(m.group(1)) != namespace:
            continue
        pid = int(m.group(2))
        if pid not in verdict:
            verdict[pid] = pid != os.getpid() and not pid_alive(pid)
        if verdict[pid]:
            dead.append(path)
    return unlink_all(dead)
