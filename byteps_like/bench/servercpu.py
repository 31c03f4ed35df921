"""The servers' CPU per byte received: the "server core-s/GB" column of ``bench pushpull`` and
``bench cluster`` (docs/performance.md, "Server CPU").

A :class:`CpuSampler` reads the server processes' CPU time (user + system, every thread, from
``/proc/<pid>/stat``) every few milliseconds on a thread of the driver; the workers report the
monotonic-clock window of each timed repetition (``time.monotonic``, the same clock in every
process of one machine); the servers' CPU over the repetitions' windows (interpolated between
samples), divided by the bytes the servers received in them (every worker's push of the
tensor: ``workers x tensor bytes`` a repetition, whatever the number of servers), is the cost.
Linux only: elsewhere, or when a server's /proc entry cannot be read, the column says n/a.
"""
from __future__ import annotations

import bisect
import os
import threading
import time
from collections.abc import Iterable, Sequence

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def proc_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of every thread of ``pid`` (None: not readable)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            text = f.read()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: fields after its last ')'
    fields = text[text.rfind(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / _TICK   # utime, stime (fields 14, 15)


class CpuSampler:
    """CPU seconds of ``pids`` together, sampled every ``interval`` s while running
    (``with CpuSampler(pids) as s: ...``). A pid whose entry goes away keeps its last value."""

    def __init__(self, pids: Iterable[int], interval: float = 0.005):
        self.pids = list(pids)
        self.interval = interval
        self.times: list[float] = []
        self.cpu: list[float] = []
        self.readable = bool(self.pids)
        self._last = dict.fromkeys(self.pids, 0.0)
        self._stop = threading.Event()
        self._th = threading.Thread(target=self._run, name="server-cpu-sampler", daemon=True)

    def __enter__(self) -> CpuSampler:
        self.sample()
        self._th.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._th.join()
        self.sample()

    def sample(self) -> None:
        total = 0.0
        for pid in self.pids:
            v = proc_cpu_seconds(pid)
            if v is None:
                if not self.times:
                    self.readable = False
                v = self._last[pid]
            self._last[pid] = v
            total += v
        self.times.append(time.monotonic())
        self.cpu.append(total)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def at(self, t: float) -> float:
        """The CPU seconds at time ``t``, linear between the samples around it."""
        i = bisect.bisect_left(self.times, t)
        if i <= 0:
            return self.cpu[0]
        if i >= len(self.times):
            return self.cpu[-1]
        t0, t1 = self.times[i - 1], self.times[i]
        c0, c1 = self.cpu[i - 1], self.cpu[i]
        return c0 if t1 <= t0 else c0 + (c1 - c0) * (t - t0) / (t1 - t0)

    def between(self, windows: Sequence[tuple[float, float]]) -> float:
        return sum(self.at(b) - self.at(a) for a, b in windows)


def repetition_windows(per_worker: Sequence[dict], key: str | int) -> list[tuple[float, float]]:
    """Each timed repetition's window across the workers: first start to last end (workers'
    ``windows`` entries, ``[[start, end], ...]`` per size)."""
    series = [w.get("windows", {}).get(str(key), []) for w in per_worker]
    if not series or any(not s for s in series):
        return []
    return [(min(r[0] for r in rep), max(r[1] for r in rep)) for rep in zip(*series)]


def core_seconds_per_gb(sampler: CpuSampler | None, per_worker: Sequence[dict], key: str | int,
                        received_per_repetition: int) -> float | None:
    """The servers' core-seconds per GB (1e9 B) received over the timed repetitions of ``key``
    (None when it cannot be measured)."""
    if sampler is None or not sampler.readable or received_per_repetition <= 0:
        return None
    windows = repetition_windows(per_worker, key)
    if not windows:
        return None
    return sampler.between(windows) / (received_per_repetition * len(windows) / 1e9)


def server_pids(procs: Iterable) -> list[int]:
    """The pids of a :class:`.harness.Job`'s servers (its children named ``server ...``)."""
    out = []
    for p in procs:
        if p.name.startswith("server") and p.child is not None:
            out.append(p.pid)
    return out
