"""The former process helpers of the benchmarks, now :mod:`byteps_like.bench.harness` (built on
bpslaunch's supervisor). Only the names tests/frameworks/test_torch_examples.py imports are
kept here; new code imports :mod:`.harness`."""
from __future__ import annotations

from .harness import ChildFailed, free_port
from .harness import Job as ProcGroup

__all__ = ["ChildFailed", "ProcGroup", "free_port"]
