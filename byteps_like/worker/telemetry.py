"""Telemetry of a worker: push_pull speed, per-stage time, the periodic summary line.

:func:`attach` subscribes the observability pieces to a runtime's pipeline (its observers), as
the configuration asks: the always-on :class:`StageStats` (a few additions per stage), the
timeline :class:`~byteps_like.trace.Tracer` (``BYTEPS_TRACE_ON``) and the Prometheus metrics
(``BYTEPS_METRICS_PORT``). A daemon thread samples the byte counters for
:func:`get_pushpull_speed` and logs a summary line at INFO level every
``BYTEPS_TELEMETRY_INTERVAL_SECONDS``.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from .. import _core
from .pipeline import Spans

if TYPE_CHECKING:
    from ..metrics import WorkerMetrics
    from ..trace import Tracer

log = logging.getLogger("byteps_like.worker.telemetry")

_SAMPLE_S = 0.5
_SPEED_WINDOW_S = 5.0


class StageStats:
    """Pipeline observer: time spent per stage since the last :meth:`take`."""

    def __init__(self) -> None:
        self._spans = Spans()
        self._lock = threading.Lock()
        self._busy: dict[str, float] = {}
        self._count: dict[str, int] = {}

    def __call__(self, task: Any, stage: str, event: str, t: float) -> None:
        t0 = self._spans.end(task, stage, event, t)
        if t0 is None:
            return
        with self._lock:
            self._busy[stage] = self._busy.get(stage, 0.0) + (t - t0)
            self._count[stage] = self._count.get(stage, 0) + 1

    def take(self) -> dict[str, tuple[int, float]]:
        """{stage: (events, seconds)} since the previous call."""
        with self._lock:
            out = {s: (self._count[s], self._busy[s]) for s in self._busy}
            self._busy, self._count = {}, {}
        return out


class ExchangeClock:
    """Pipeline observer: wall-clock seconds during which some partition of this worker was in
    a PUSH or PULL stage (the exchange with the servers, the wait for the other workers'
    pushes included), overlapping spans counted once. The native plane reports an operation's
    spans when it completes, after the fact: each span is merged into the time covered so far
    (spans arrive roughly in the order they end)."""

    _STAGES = frozenset(("push", "pull"))

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans = Spans()
        self._until = 0.0
        self._busy = 0.0

    def __call__(self, task: Any, stage: str, event: str, t: float) -> None:
        if stage not in self._STAGES:
            return
        with self._lock:
            t0 = self._spans.end(task, str(stage), event, t)
            if t0 is None or t <= self._until or t <= t0:
                return
            self._busy += t - max(t0, self._until)
            self._until = t

    def busy(self) -> float:
        """Seconds so far."""
        with self._lock:
            return self._busy


class Telemetry:
    """The observability of one worker runtime; :meth:`close` at shutdown."""

    def __init__(self, runtime: Any, *, interval: float = 10.0):
        self.runtime = runtime
        self.interval = interval
        self.stats = StageStats()
        self.exchange = ExchangeClock()
        # bps.set_progress(): (step, total steps, samples per step) as the script declares them
        self.progress: tuple[int, int, int] | None = None
        self.report_interval = 0.0   # BYTEPS_REPORT_INTERVAL_SECONDS (attach)
        self.tracer: Tracer | None = None
        self.metrics: WorkerMetrics | None = None
        self._samples: deque = deque(maxlen=int(_SPEED_WINDOW_S / _SAMPLE_S) + 2)
        self._samples.append((time.monotonic(), self._total()))
        self._moved: dict[int, list[int]] = {}   # failover -> the keys it moved (keys_moved)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bpsl-telemetry", daemon=True)

    def _total(self) -> int:
        return self.runtime.bytes_pushed + self.runtime.bytes_pulled

    def rounds(self) -> int:
        """Rounds started, summed over the declared tensors."""
        return sum(st.round for st in self.runtime.tensors().values())

    def step(self) -> int:
        """The training step in progress, counting from 0 (-1 before the first push_pull).

        Where a framework plugin averages the gradients (DistributedOptimizer,
        DistributedGradientTape, DistributedTrainer, ...) it counts the steps itself
        (``Runtime.note_step``: one per averaging of a gradient group); the step is then the
        most steps of any group. Otherwise (push_pull in a script of its own) it is counted per
        tensor, as BytePS does: the round in progress of the tensor push_pulled most often, so
        a tensor push_pulled once (a broadcast, a model check) does not hold it at 0."""
        noted = list(self.runtime.steps.values())
        if noted:
            return max(noted)
        return max((st.round for st in self.runtime.tensors().values()), default=0) - 1

    def speed(self) -> tuple[int, float]:
        """(timestamp in ms, MB/s pushed plus pulled over the last few seconds)."""
        now = time.monotonic()
        total = self._total()
        t0, b0 = self._samples[0]
        dt = now - t0
        mbps = (total - b0) / dt / 1e6 if dt > 0 else 0.0
        return int(time.time() * 1000), mbps

    def set_progress(self, step: int, total_steps: int = 0, samples_per_step: int = 0) -> None:
        """The script's own progress (``bps.set_progress``): the live page's samples/s and
        ETA."""
        for name, v in (("step", step), ("total_steps", total_steps),
                        ("samples_per_step", samples_per_step)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"set_progress: {name}={v!r} must be an int >= 0")
        self.progress = (step, total_steps, samples_per_step)

    def report(self) -> dict:
        """This worker's REPORT to the scheduler (byteps_like/report.py)."""
        out: dict[str, Any] = {"step": self.step(), "bytes": self._total(),
                               "exchange": round(self.exchange.busy(), 4),
                               "rounds": self.rounds()}
        if self.progress is not None:
            step, total, sps = self.progress
            out["progress"] = {"step": step, "total_steps": total, "samples_per_step": sps}
        if self.runtime.members.rank == 0:  # one worker says where the keys live
            owners = key_owners(self.runtime)
            if owners:
                out["owners"] = owners
            moved = keys_moved(self.runtime, self._moved)
            if moved:
                out["moved"] = moved
        return out

    def _send_report(self) -> None:
        from ..report import send_report
        try:
            send_report(self.runtime.control, self.report())
        except Exception as exc:  # noqa: BLE001 - telemetry never breaks training
            log.debug("rank %s: report not sent: %r", self.runtime.rank_, exc)

    def start(self) -> None:
        self._thread.start()

    def _loop(self) -> None:
        last_summary = time.monotonic()
        last_bytes = self._total()
        last_report = 0.0
        while not self._stop.wait(min(_SAMPLE_S, self.report_interval or _SAMPLE_S)):
            now = time.monotonic()
            if self.report_interval > 0 and now - last_report >= self.report_interval - 1e-3:
                last_report = now
                self._send_report()
            self._samples.append((now, self._total()))
            if self.interval > 0 and now - last_summary >= self.interval:
                total = self._total()
                log.info(self.summary_line(now - last_summary, total - last_bytes))
                last_summary, last_bytes = now, total

    def summary_line(self, window: float, nbytes: int) -> str:
        stages = self.stats.take()
        slow = max(stages.items(), key=lambda kv: kv[1][1], default=None)
        slowest = (f"slowest stage {slow[0]} {slow[1][1] * 1e3 / max(1, slow[1][0]):.2f} ms/part "
                   f"({slow[1][0]} parts)") if slow else "no stage ran"
        return (f"rank {self.runtime.rank_}: step {self.step()} | {nbytes / window / 1e6:.2f} MB/s "
                f"pushed+pulled over {window:.1f} s | {self.rounds()} rounds | {slowest}")

    def close(self) -> None:
        self._stop.set()
        if self.tracer is not None:
            try:
                self.tracer.flush()
            except OSError as exc:
                log.warning("cannot write the trace: %s", exc)
        if self.metrics is not None:
            self.metrics.close()


def attach(runtime: Any) -> Telemetry:
    """Subscribe telemetry, tracing and metrics (as configured) to ``runtime.pipeline``."""
    cfg = runtime.cfg
    tel = Telemetry(runtime, interval=cfg.metrics.summary_interval)
    observers = runtime.pipeline.observers
    observers.append(tel.stats)
    observers.append(tel.exchange)
    tel.report_interval = cfg.metrics.report_interval
    if cfg.trace.on:
        from ..trace import Tracer
        tel.tracer = Tracer(runtime.rank_, cfg.trace.dir, cfg.trace.start_step,
                            cfg.trace.end_step, tel.step)
        observers.append(tel.tracer)
    if cfg.metrics.port:
        from ..metrics import WorkerMetrics
        # the local ranks of a machine share the setting: each serves port + local rank
        tel.metrics = WorkerMetrics(runtime, tel, cfg.metrics.host,
                                    cfg.metrics.port + cfg.cluster.local_rank)
        observers.append(tel.metrics.observe)
    tel.start()
    return tel


def _parts(runtime: Any) -> tuple[list[int], list[tuple[int, int, int]]]:
    """The server ranks by index, and every declared partition's (key, first server, bytes)."""
    ranks = list(runtime.members.server_ranks)
    if runtime.plane.client is None or not ranks:
        return [], []
    return ranks, [(key, server, n) for st in runtime.tensors().values()
                   for _off, n, key, server in list(st.parts) if 0 <= server < len(ranks)]


def _owner(key: int, server: int, nservers: int, gone: set[int]) -> int:
    """The server index that owns ``key`` (first assigned to ``server``) with ``gone`` lost:
    its first server until that one is lost, then the survivor the native client moves it to
    (rendezvous hashing over the servers alive, ``_core.failover_owner``)."""
    if server not in gone:
        return server
    return _core.failover_owner(key, [i for i in range(nservers) if i not in gone])


def key_owners(runtime: Any) -> list[list[int]]:
    """Per server (by index): [its rank, the keys it owns now and their bytes, the keys first
    assigned to it and their bytes], for ``bpslaunch status`` and the live page; a replacement
    takes its first keys back. Empty when this worker talks to no server."""
    ranks, parts = _parts(runtime)
    gone = set(runtime.plane.gone)
    rows = [[r, 0, 0, 0, 0] for r in ranks]
    for key, server, n in parts:
        owner = _owner(key, server, len(ranks), gone)
        rows[server][3] += 1
        rows[server][4] += n
        if 0 <= owner < len(rows):
            rows[owner][1] += 1
            rows[owner][2] += n
    return rows


def keys_moved(runtime: Any, cache: dict | None = None) -> list[list[int]]:
    """[failover number, keys it moved, their bytes] for each failover this worker took part
    in (worker/failover.py, ``history``): the keys whose owner the servers it lost, or got
    back, changed. ``cache``: failover number -> its row, each counted once (with the keys
    declared when it was first counted)."""
    fo = runtime.failover
    if fo is None or not fo.history:
        return []
    cache = {} if cache is None else cache
    ranks: list[int] = []
    parts: list[tuple[int, int, int]] = []
    for number, before, after in list(fo.history):
        if number in cache:
            continue
        if not parts:
            ranks, parts = _parts(runtime)
            if not parts:
                return []
        old, new = set(before), set(after)
        moved = [n for key, server, n in parts
                 if _owner(key, server, len(ranks), old) != _owner(key, server, len(ranks), new)]
        cache[number] = [number, len(moved), sum(moved)]
    return [cache[number] for number, _b, _a in list(fo.history) if number in cache]
