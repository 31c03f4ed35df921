"""The names of a job's shared-memory segments and their removal, written once for the worker
runtime (byteps_like/local.py) and bpslaunch (launcher/shm.py). Standard library only: the
launcher imports it.

Segments are named ``bpsl-<job>-<scheduler port>-m<machine>-t<tensor>`` in BYTEPS_SHM_DIR.

Orphans (issue 41): every process that makes or uses a machine's files of a job holds a shared
``flock`` on its lock file, ``<prefix>lock`` (:func:`hold`), which the kernel drops when the
process ends, however it ends (SIGKILL included). A job's files whose lock nobody holds are
an orphan's, whatever launched the job: :func:`sweep_orphans` takes the lock exclusively
(never waiting) and removes them, and never touches the files of a job with a live process.
"""
from __future__ import annotations

import fcntl
import glob
import os
import re
from collections.abc import Iterable

LOCK = "lock"
#: what follows a job machine's prefix in the names of its files (t<tensor>, peers, lock, ...):
#: no dash, so a job whose id extends another's is never taken for it
_TAIL = re.compile(r"^[A-Za-z0-9_.]+$")


def segment_prefix(job_id: str, port: int) -> str:
    """What every segment name of a job starts with."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", job_id)
    return f"bpsl-{safe}-{port}-"


def matching(shm_dir: str, pattern: str) -> list[str]:
    """The paths in ``shm_dir`` whose names match the glob ``pattern``."""
    return glob.glob(os.path.join(glob.escape(shm_dir), pattern))


def unlink_all(paths: Iterable[str]) -> list[str]:
    """Unlink each path; the names removed. One that is gone or refused (a file of another user
    in a sticky /dev/shm: rightly so) is left out."""
    removed = []
    for path in paths:
        try:
            os.unlink(path)
            removed.append(os.path.basename(path))
        except OSError:
            pass
    return removed


def sweep(shm_dir: str, prefix: str) -> list[str]:
    """Remove every segment in ``shm_dir`` whose name starts with ``prefix``; the names removed."""
    return unlink_all(matching(shm_dir, glob.escape(prefix) + "*"))


def hold(shm_dir: str, prefix: str) -> int:
    """Take a shared lock on the lock file of ``prefix`` (a job on one machine) for as long as
    the returned descriptor is open; the kernel drops it when the process ends. A sweeper
    that removed the file between our open and our lock is noticed (another inode) and the
    lock taken again on a fresh file."""
    path = os.path.join(shm_dir, prefix + LOCK)
    for _ in range(100):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)   # waits only while a sweeper holds it
            if os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    raise OSError(f"cannot hold {path}: it is removed as fast as it is made")


def _remove_if_free(fd: int, shm_dir: str, prefix: str) -> list[str]:
    """With ``fd`` open on the lock file of ``prefix``: when no process holds it any more
    (an exclusive lock, not waited for), remove the prefix's files, the lock file last."""
    path = os.path.join(shm_dir, prefix + LOCK)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return []   # a live process holds it
    try:
        if os.stat(path, follow_symlinks=False).st_ino != os.fstat(fd).st_ino:
            return []
    except FileNotFoundError:
        return []
    files = [p for p in matching(shm_dir, glob.escape(prefix) + "*")
             if p != path and _TAIL.match(os.path.basename(p)[len(prefix):])]
    return unlink_all(files) + unlink_all([path])


def release(fd: int, shm_dir: str, prefix: str) -> list[str]:
    """Give up this process's hold; when it was the last, the prefix's files go (the names
    removed). Closes ``fd``."""
    try:
        return _remove_if_free(fd, shm_dir, prefix)
    finally:
        os.close(fd)


def sweep_orphans(shm_dir: str) -> list[str]:
    """Remove the files of every job (of any launcher) whose lock no live process holds: its
    processes all ended without removing them (killed, or failed before their exit
    handlers). The names removed; files of other users are left alone."""
    removed: list[str] = []
    for lock in matching(shm_dir, "bpsl-*-" + LOCK):
        prefix = os.path.basename(lock)[:-len(LOCK)]
        try:
            fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            removed += _remove_if_free(fd, shm_dir, prefix)
        finally:
            os.close(fd)
    return removed
