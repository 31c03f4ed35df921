"""The names of a job's shared-memory segments and their removal, written once for the worker
runtime (byteps_like/local.py) and bpslaunch (launcher/shm.py). Standard library only: the
launcher imports it.

Segments are named ``bpsl-<job>-<scheduler port>-m<machine>-t<tensor>`` in BYTEPS_SHM_DIR.
"""
from __future__ import annotations

import glob
import os
import re
from collections.abc import Iterable


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
