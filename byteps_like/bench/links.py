"""Uneven clusters for the benchmarks: a straggler and a link whose rate changes mid-run.

``--straggler RANK:FACTOR`` (``bench train``, ``bench cluster``, ``bench sparse``): worker RANK
is FACTOR times slower. Without ``--rate`` its compute is: before each backward pass it sleeps
FACTOR - 1 times its last step's compute (:class:`SlowCompute`). With ``--rate`` its link is:
its host's NIC alone is capped at RATE / FACTOR, the others at RATE (``bench cluster`` always
has a rate, so there the straggler is always its link).

``--rate`` takes a fixed rate (``1gbit``) or a schedule (``25gbit:20s,1gbit:20s,25gbit:20s``):
the cluster is built at the first rate, and :class:`RateSwitcher` changes every NIC's ``tc``
cap (``tc qdisc change``) at the given times from the start of each run, printing a
``RATE SWITCH`` line and keeping the switch times, so that a report can place each round (and
each decision of ``Compression.auto``) relative to the switches (:func:`after_switches`).
"""
from __future__ import annotations

import argparse
import re
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

_UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0}


def parse_duration(text: str) -> float:
    """'20s', '500ms', '2m' -> seconds (> 0)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m|min)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"bad duration {text!r}: use e.g. 20s, 500ms, 2m")
    v = float(m.group(1)) * _UNITS[m.group(2)]
    if v <= 0:
        raise argparse.ArgumentTypeError(f"duration {text!r} must be > 0")
    return v


@dataclass(frozen=True)
class RateSchedule:
    """NIC caps over time: ``segments`` of (bits/s, seconds), in order."""
    segments: tuple[tuple[float, float], ...]
    text: str = ""

    @property
    def first(self) -> float:
        return self.segments[0][0]

    @property
    def duration(self) -> float:
        return sum(s for _r, s in self.segments)

    def switches(self) -> list[tuple[float, float]]:
        """(seconds from the start, new rate) of every change after the first segment."""
        out, t = [], 0.0
        for (_r, secs), (nxt, _s) in zip(self.segments, self.segments[1:]):
            t += secs
            out.append((t, nxt))
        return out

    def rate_at(self, t: float) -> float:
        """The cap ``t`` seconds from the start (the last segment's after the end)."""
        for rate, secs in self.segments:
            if t < secs:
                return rate
            t -= secs
        return self.segments[-1][0]


def parse_rate_schedule(text: str, parse_rate: Callable[[str], float]) -> RateSchedule:
    """``RATE:DURATION[,RATE:DURATION...]`` (at least two segments; each rate as
    ``parse_rate`` reads it)."""
    parts = [t.strip() for t in text.split(",")]
    segs = []
    for p in parts:
        if p.count(":") != 1:
            raise argparse.ArgumentTypeError(
                f"--rate {text!r}: a schedule is RATE:DURATION items, e.g. "
                f"25gbit:20s,1gbit:20s,25gbit:20s; {p!r} is not one")
        r, d = p.split(":")
        segs.append((parse_rate(r), parse_duration(d)))
    if len(segs) < 2:
        raise argparse.ArgumentTypeError(f"--rate {text!r}: a schedule needs at least two "
                                         "segments (one rate: give it without a duration)")
    return RateSchedule(tuple(segs), text.strip())


def rate_or_schedule(parse_rate: Callable[[str], float]) -> Callable[[str], Any]:
    """An argparse type: one rate (``parse_rate``'s value) or, with ':', a RateSchedule."""
    def parse(text: str) -> Any:
        if ":" in text:
            return parse_rate_schedule(text, parse_rate)
        return parse_rate(text)
    return parse


@dataclass(frozen=True)
class Straggler:
    rank: int
    factor: float

    def arg(self) -> str:
        return f"{self.rank}:{self.factor:g}"


def add_link_options(p: argparse.ArgumentParser, parse_rate: Callable[[str], float],
                     hosts: str) -> None:
    """``--rate`` (a cap or a schedule), ``--straggler`` and ``--queue-ms``, as ``bench train``
    and ``bench sparse`` take them; ``hosts``: what gets a namespace of its own."""
    p.add_argument("--rate", type=rate_or_schedule(parse_rate), default=None,
                   help=f"NIC cap of every host (e.g. 25gbit; root): {hosts} in its own "
                        "network namespace; default: loopback. A schedule "
                        "(25gbit:20s,1gbit:20s) changes the caps during each run")
    p.add_argument("--straggler", type=parse_straggler, default=None,
                   metavar="RANK:FACTOR", help="worker RANK is FACTOR times slower: its "
                   "compute, or with --rate its NIC alone (capped at rate / FACTOR)")
    p.add_argument("--queue-ms", type=float, default=20.0,
                   help="with --rate: queue of each NIC's token bucket, milliseconds")


def parse_straggler(text: str) -> Straggler:
    """``RANK:FACTOR``: a worker rank >= 0 and a factor >= 1."""
    m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+(?:\.\d+)?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"--straggler {text!r}: use RANK:FACTOR, e.g. 1:3 "
                                         "(worker 1 three times slower)")
    factor = float(m.group(2))
    if factor < 1:
        raise argparse.ArgumentTypeError(f"--straggler {text!r}: the factor must be >= 1")
    return Straggler(int(m.group(1)), factor)


def check_straggler(st: Straggler | None, workers: int) -> str | None:
    """Why ``st`` does not fit a job of ``workers`` workers (None: it does)."""
    if st is not None and st.rank >= workers:
        return f"--straggler {st.arg()}: there are only {workers} workers (ranks 0..{workers - 1})"
    return None


def host_rates(st: Straggler | None, rate: float, host: str) -> dict[str, float]:
    """Per-host caps where they differ from ``rate``: the straggler's host at rate / factor."""
    return {} if st is None or st.factor == 1 else {host: rate / st.factor}


def emulated_cluster(workers: int, servers: int, rate: float, st: Straggler | None,
                     queue_ms: float) -> Any:
    """The benches' emulated cluster (a :class:`~.netns.NetnsCluster`, to enter): hosts w0..
    and s0.., every NIC capped at ``rate``, the straggler's (``st``, worker rank) at rate /
    factor."""
    from .netns import NetnsCluster
    hosts = [f"w{i}" for i in range(workers)] + [f"s{j}" for j in range(servers)]
    return NetnsCluster(hosts, rate, latency_ms=queue_ms, log=sys.stderr,
                        host_rates=host_rates(st, rate, f"w{st.rank}" if st else ""))


class SlowCompute:
    """In a worker: make this rank's compute ``factor`` times as long (``factor`` 1: nothing).
    Time the compute with :meth:`start`/:meth:`stop`; :meth:`delay` sleeps factor - 1 times the
    last measured compute (call it where the gradients would come, before backward)."""

    def __init__(self, straggler: Straggler | None, rank: int):
        self.factor = straggler.factor if straggler and straggler.rank == rank else 1.0
        self.last = 0.0
        self._t0 = 0.0
        self._slept_now = 0.0
        self.slept = 0.0

    def start(self) -> None:
        self._t0 = time.perf_counter()
        self._slept_now = 0.0

    def stop(self) -> None:
        """The compute since :meth:`start`, the sleep of :meth:`delay` left out."""
        self.last = max(0.0, time.perf_counter() - self._t0 - self._slept_now)

    def delay(self) -> None:
        if self.factor > 1 and self.last > 0:
            d = (self.factor - 1) * self.last
            time.sleep(d)
            self._slept_now += d
            self.slept += d


def straggler_arg(text: str) -> Straggler | None:
    """Worker-side ``--straggler`` (empty: none)."""
    return parse_straggler(text) if text else None


@dataclass
class RateSwitcher:
    """Change the caps of ``cluster`` (a :class:`~.netns.NetnsCluster`) on ``schedule`` from
    :meth:`start`; ``scale`` divides a host's cap (the straggler's). A daemon thread; :meth:`stop`
    ends it (the caps stay where they are)."""
    cluster: Any
    schedule: RateSchedule
    scale: dict[str, float] = field(default_factory=dict)
    log: TextIO = field(default_factory=lambda: sys.stderr)
    t0: float = 0.0
    done: list[tuple[float, float]] = field(default_factory=list)  # (time.time(), rate)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    error: BaseException | None = None

    def start(self) -> RateSwitcher:
        self.apply(self.schedule.first)    # every run starts at the first rate
        self.t0 = time.time()
        self._thread = threading.Thread(target=self._run, name="rate-switcher", daemon=True)
        self._thread.start()
        return self

    def apply(self, rate: float) -> None:
        for h in self.cluster.hosts:
            self.cluster.set_rate(h, rate / self.scale.get(h, 1.0))

    def _run(self) -> None:
        try:
            for at, rate in self.schedule.switches():
                if self._stop.wait(max(0.0, self.t0 + at - time.time())):
                    return
                self.apply(rate)
                now = time.time()
                self.done.append((now, rate))
                slow = "".join(f", {h} at {rate / f / 1e9:g}" for h, f in self.scale.items()
                               if f != 1)
                print(f"RATE SWITCH at {now - self.t0:.2f} s: every NIC -> {rate / 1e9:g} "
                      f"Gbit/s{slow}", file=self.log, flush=True)
        except BaseException as exc:  # noqa: BLE001 - reported by stop()
            self.error = exc

    def stop(self) -> list[tuple[float, float]]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self.error is not None:
            raise RuntimeError(f"changing the NIC caps failed: {self.error}") from self.error
        return list(self.done)


def start_schedule(cluster: Any, schedule: RateSchedule | None,
                   straggler: Straggler | None) -> RateSwitcher | None:
    """The switcher of one run, started (None without a schedule); the straggler's host (w
    RANK) keeps its cap divided by its factor."""
    if schedule is None or cluster is None:
        return None
    scale = {f"w{straggler.rank}": straggler.factor} if straggler else {}
    return RateSwitcher(cluster, schedule, scale).start()


def after_switches(switches: Sequence[tuple[float, float]], decisions: Sequence[dict]
                   ) -> list[tuple[float | None, dict | None]]:
    """For each switch (time.time(), rate): seconds until ``Compression.auto`` first decided
    after it (rank 0 decides when the bandwidth it measures moved), and that decision; (None,
    None) when it did not before the next switch."""
    out: list[tuple[float | None, dict | None]] = []
    for i, (t, _rate) in enumerate(switches):
        end = switches[i + 1][0] if i + 1 < len(switches) else float("inf")
        first = next((d for d in decisions if t <= d["time"] < end), None)
        out.append((None, None) if first is None else (first["time"] - t, first))
    return out


def segment_medians(schedule: RateSchedule, t0: float,
                    rounds: Sequence[tuple[float, float]]) -> list[float | None]:
    """Median round seconds of the rounds (start time.time(), seconds) that began in each
    segment of ``schedule`` started at ``t0`` (None: no round there)."""
    import statistics
    out: list[float | None] = []
    start = t0
    for _rate, secs in schedule.segments:
        mine = [dt for ts, dt in rounds if start <= ts < start + secs]
        out.append(statistics.median(mine) if mine else None)
        start += secs
    return out
