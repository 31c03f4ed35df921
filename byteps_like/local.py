"""Local reduction across the worker processes of one machine (CPU path).

The local ranks of a machine share one shared-memory segment per tensor, laid out as
``local_size`` input slots followed by one output region, each ``nbytes`` long. For every
partition:

1. each rank copies its input into its slot and tells the local root (``LOCAL_READY``);
2. once all have, the root tells every rank (``LOCAL_REDUCE``) to sum its own slice of the
   partition across all slots into the output region: a reduce-scatter in shared memory, every
   rank summing 1/local_size of the bytes with the ``_core`` kernels;
3. when every rank has reported (``LOCAL_REDUCED``), the root pushes the reduced partition from
   the output region and pulls the servers' sum back into it;
4. the root announces the result (``LOCAL_DONE``) and every rank copies it out: an all-gather.

Only the root talks to the servers; ``size()`` still counts every process. Segments are named
``bpsl-<job>-<scheduler port>-m<machine>-t<tensor>`` in BYTEPS_SHM_DIR (``/dev/shm``); each is
reserved in full when created (``posix_fallocate``), so a full tmpfs is a BytePSError naming it
and never a SIGBUS on a later write. Every rank unlinks them at exit, a local root sweeps
leftovers of a crashed run of the same job at start, and bpslaunch sweeps its job's at exit
(launcher/shm.py; both name them through shm_names.py).
"""
from __future__ import annotations

import atexit
import logging
import mmap
import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from . import shm_names
from .errors import BytePSError
from .shm_names import segment_prefix as segment_prefix  # the runtime names segments by it

SHM_DIR = "/dev/shm"
log = logging.getLogger("byteps_like.worker")


_holds: dict[tuple[str, str], int] = {}
_holds_lock = threading.Lock()


def hold(prefix: str, shm_dir: str = SHM_DIR) -> None:
    """This process uses the files of ``prefix`` (a job on this machine) until it ends or
    :func:`release` (shm_names.hold: what makes them an orphan's once every user is gone).
    The first hold of a process first removes the orphans of dead jobs in ``shm_dir``, of any
    launcher (issue 41)."""
    with _holds_lock:
        if (shm_dir, prefix) in _holds:
            return
        if not any(d == shm_dir for d, _ in _holds):
            removed = shm_names.sweep_orphans(shm_dir)
            if removed:
                log.info("removed %d shared-memory file(s) of dead jobs from %s: %s",
                         len(removed), shm_dir, ", ".join(removed[:8]))
        _holds[(shm_dir, prefix)] = shm_names.hold(shm_dir, prefix)
        if len(_holds) == 1:
            atexit.register(release_all)


def release(prefix: str, shm_dir: str = SHM_DIR) -> None:
    """Give up the hold on ``prefix``; the last process to do so removes its files."""
    with _holds_lock:
        fd = _holds.pop((shm_dir, prefix), None)
    if fd is not None:
        shm_names.release(fd, shm_dir, prefix)


def release_all() -> None:
    """At exit: every hold given up (a process killed by a signal gives them up too, to the
    kernel, and the next job's first hold sweeps what it left)."""
    for shm_dir, prefix in list(_holds):
        release(prefix, shm_dir)


def sweep(prefix: str, shm_dir: str = SHM_DIR) -> list[str]:
    """Remove every segment whose name starts with ``prefix``; returns the names removed."""
    return shm_names.sweep(shm_dir, prefix)


class Segment:
    """One tensor's shared memory: ``slots`` input slots and one output region."""

    def __init__(self, name: str, nbytes: int, slots: int, *, what: str,
                 shm_dir: str = SHM_DIR):
        self.name, self.nbytes, self.slots = name, nbytes, slots
        self.path = os.path.join(shm_dir, name)
        size = max(1, nbytes * (slots + 1))
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            # no free-space check first: the other local ranks reserve the same pages at the
            # same time, which a count of free bytes would mistake for a shortage
            if os.fstat(fd).st_size < size:
                _reserve(fd, size, what, shm_dir)
            self._mm = mmap.mmap(fd, size)
        except BaseException:
            # nothing of a segment that could not be made stays behind (the other local
            # ranks fail alike: none of them can use it)
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            raise
        finally:
            os.close(fd)
        self._buf: np.ndarray | None = np.frombuffer(self._mm, np.uint8)

    def _view(self) -> np.ndarray:
        if self._buf is None:
            raise BytePSError(f"shared-memory segment {self.name} is closed")
        return self._buf

    def slot(self, i: int) -> np.ndarray:
        return self._view()[i * self.nbytes:(i + 1) * self.nbytes]

    @property
    def out(self) -> np.ndarray:
        return self._view()[self.slots * self.nbytes:(self.slots + 1) * self.nbytes]

    def close(self, unlink: bool) -> None:
        self._buf = None
        try:
            self._mm.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes with the process
        if unlink:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def _reserve(fd: int, size: int, what: str, shm_dir: str) -> None:
    """Allocate every page of the segment now: an mmap of a sparse file on a tmpfs that later
    runs full kills the process with SIGBUS on the write that finds no page; several segments
    (tensors, local ranks) could each pass a free-space check before any of them is written."""
    import errno
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
            raise _no_space(what, size, _fs_bytes(shm_dir, "f_bavail"), shm_dir) from None
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise BytePSError(f"local reduction of {what}: cannot reserve {_mib(size)} of "
                              f"shared memory in {shm_dir}: {exc.strerror}") from None
        os.ftruncate(fd, size)  # a file system without fallocate: sized, not reserved


def _no_space(what: str, size: int, free: int | None, shm_dir: str) -> BytePSError:
    total = _fs_bytes(shm_dir, "f_blocks")
    return BytePSError(
        f"local reduction of {what} needs {_mib(size)} of shared memory in {shm_dir} "
        f"(size {_mib(total) if total is not None else 'unknown'}, "
        f"{_mib(free) if free is not None else 'unknown'} free): make it larger (`mount -o "
        f"remount,size=8G {shm_dir}`, `docker run --shm-size=8g`, a Kubernetes emptyDir "
        "with medium Memory), point BYTEPS_SHM_DIR at a larger tmpfs, or use fewer local ranks")


def _fs_bytes(path: str, blocks: str) -> int | None:
    """``blocks`` (a ``statvfs`` field: f_blocks, the size; f_bavail, free to us) of the file
    system holding ``path``, in bytes; None where it cannot be read."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return getattr(st, blocks) * st.f_frsize


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


class Gate:
    """Meets a pipeline task with the event it waits for, whichever comes first.

    ``park(token, task)`` returns True when the event already happened (go on now), otherwise
    keeps the task; ``signal(token)`` records the event or resumes the parked task."""

    def __init__(self, resume: Callable[[Any], None]):
        self._resume = resume
        self._lock = threading.Lock()
        self._parked: dict = {}
        self._fired: set = set()

    def park(self, token, task) -> bool:
        with self._lock:
            if token in self._fired:
                self._fired.discard(token)
                return True
            self._parked[token] = task
            return False

    def signal(self, token) -> None:
        with self._lock:
            task = self._parked.pop(token, None)
            if task is None:
                self._fired.add(token)
                return
        self._resume(task)


class Counter:
    """Counts arrivals per token; ``arrive`` returns True for the arrival that completes it."""

    def __init__(self, need: int):
        self.need = need
        self._lock = threading.Lock()
        self._counts: dict = {}

    def arrive(self, token) -> bool:
        with self._lock:
            n = self._counts.get(token, 0) + 1
            if n >= self.need:
                self._counts.pop(token, None)
                return True
            self._counts[token] = n
            return False


def slice_of(offset: int, nbytes: int, itemsize: int, part: int, parts: int) -> tuple[int, int]:
    """Byte range (start, end) of the ``part``-th of ``parts`` element-aligned slices of
    [offset, offset + nbytes)."""
    count = nbytes // itemsize
    lo = count * part // parts
    hi = count * (part + 1) // parts
    return offset + lo * itemsize, offset + hi * itemsize
