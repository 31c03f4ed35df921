"""CPU lists: the syntax of Linux's ``cpulist`` files and of ``taskset -c`` (``"0-3,8,10-11"``).

Read by :mod:`byteps_like.config` (BYTEPS_VISIBLE_CPU_CORES, BYTEPS_CPU_BLACKLIST) and
:mod:`byteps_like.topology` (sysfs, placements), which both import it: standard library only, so
the launcher, which imports both, stays free of numpy and frameworks.
"""
from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = ["MAX_CPU", "CpuListError", "parse_cpu_list", "format_cpu_list"]

#: Largest CPU number a CPU list may name (Linux's NR_CPUS is at most 8192 today).
MAX_CPU = 65535
_CPU_RANGE_RE = re.compile(r"(\d+)(?:-(\d+))?")


class CpuListError(ValueError):
    """Text that is not a CPU list; ``reason`` says why without repeating the text."""

    def __init__(self, text: str, reason: str):
        super().__init__(f"{text!r} is not a CPU list: {reason} (expected e.g. 0-3,8,10-11)")
        self.text = text
        self.reason = reason


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """``"0-3,8,10-11"`` -> ``(0, 1, 2, 3, 8, 10, 11)``: sorted, without duplicates.

    The syntax of Linux's ``cpulist`` files and of ``taskset -c``; spaces around items are
    allowed and an empty string is the empty list. Raises :class:`CpuListError`.
    """
    cpus: set[int] = set()
    if not text.strip():
        return ()
    for item in text.split(","):
        m = _CPU_RANGE_RE.fullmatch(item.strip())
        if m is None:
            reason = "empty item" if not item.strip() else f"{item.strip()!r} is not N or N-M"
            raise CpuListError(text, reason)
        lo = int(m[1])
        hi = lo if m[2] is None else int(m[2])
        if hi < lo:
            raise CpuListError(text, f"range {item.strip()} runs backwards")
        if hi > MAX_CPU:
            raise CpuListError(text, f"CPU {hi} is beyond {MAX_CPU}")
        cpus.update(range(lo, hi + 1))
    return tuple(sorted(cpus))


def format_cpu_list(cpus: Iterable[int]) -> str:
    """``(0, 1, 2, 3, 8)`` -> ``"0-3,8"``; the inverse of :func:`parse_cpu_list`."""
    items: list[str] = []
    run: list[int] = []
    for cpu in sorted(set(cpus)):
        if run and cpu == run[-1] + 1:
            run.append(cpu)
            continue
        if run:
            items.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
        run = [cpu]
    if run:
        items.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ",".join(items)
