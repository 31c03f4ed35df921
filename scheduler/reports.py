"""What the scheduler knows of a running job beyond its membership: the nodes' periodic
REPORTs (byteps_like/report.py), the straggler report built from them, and the job's event
log. The live page (dashboard.py), the Prometheus metrics and the straggler log line read it.

* A worker reports its step, bytes moved, exchange seconds and, if its script declares it
  (``bps.set_progress``), its total steps and samples per step.
* A server reports its traffic, keys, CPU seconds and, per worker machine, the seconds the
  others waited for that machine's pushes ("held") and the seconds it waited for the last
  pusher ("waited"), merged over its keys (csrc/dataplane_straggle.h).

A machine's cost to the job over the last BYTEPS_STRAGGLER_WINDOW_SECONDS is the largest
"held" rate any server saw for it (the servers' keys run in parallel: their waits overlap, so
they are not added). Past BYTEPS_STRAGGLER_FRACTION over a whole window the scheduler logs one
line naming the worker by rank and host, and one when it recovers.
"""
from __future__ import annotations

import bisect
import logging
import math
import threading
import time
from collections import deque
from typing import Any

from ..wire import Role
from .nodes import Host, NodeInfo

log = logging.getLogger("byteps_like.scheduler")

#: samples kept per node (one a report): enough for the window and the timeline's rates
SAMPLES = 120
#: points of the page's timeline (one a report interval)
TIMELINE = 300


class EventLog:
    """The job's membership events as the page shows them: ``add(kind, text)`` from anywhere
    in the scheduler (registrations, losses, replacements, stragglers, the end). Bounded;
    thread-safe."""

    def __init__(self, maxlen: int = 500):
        self._lock = threading.Lock()
        self._items: deque[dict] = deque(maxlen=maxlen)
        self._seq = 0

    def add(self, kind: str, text: str) -> None:
        with self._lock:
            self._seq += 1
            self._items.append({"seq": self._seq, "time": round(time.time(), 3),
                                "kind": str(kind)[:40], "text": str(text)[:2000]})

    def recent(self, n: int = 100) -> list[dict]:
        with self._lock:
            return list(self._items)[-n:]


def _num(meta: dict, name: str, kind: type = float, default: Any = 0) -> Any:
    """A finite, non-negative number of a report (a bad one reads as ``default``)."""
    v = meta.get(name, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return default
    if kind is int:
        return int(v) if isinstance(v, int) and 0 <= v < 1 << 62 else default
    v = float(v)
    return v if math.isfinite(v) and v >= 0 else default


def _rate(samples: deque, now: float, window: float, read) -> tuple[float, float] | None:
    """(rate, span) of ``read(sample)`` over the samples of the last ``window`` seconds."""
    if len(samples) < 2:
        return None
    newest = samples[-1]
    oldest = next((s for s in samples if s[0] >= now - window), samples[-2])
    if oldest is newest:
        oldest = samples[-2]
    span = newest[0] - oldest[0]
    if span <= 0:
        return None
    a, b = read(oldest[1]), read(newest[1])
    if a is None or b is None:
        return None
    return max(0.0, (b - a) / span), span


class Reports:
    """The reports of one scheduler's nodes (``worker``/``server``, from its I/O thread) and
    what is made of them (``state``, ``straggler``, ``metrics``, from any thread)."""

    def __init__(self, host: Host, events: EventLog | None = None, loss: Any = None):
        self.host = host
        self.loss = loss                      # the ServerLoss (failover.py): its events
        m = host.cfg.metrics
        self.window = m.straggler_window
        self.threshold = m.straggler_fraction
        self.interval = m.report_interval
        self.events = events if events is not None else EventLog()
        self._lock = threading.Lock()
        # (time, sample) of each node's reports, by its connection (Route.ident)
        self.workers: dict[bytes | None, deque] = {}
        self.servers: dict[bytes | None, deque] = {}
        self.timeline: deque[dict] = deque(maxlen=TIMELINE)
        self.flagged: int | None = None      # the machine the straggler line named
        self._next_point = 0.0
        self.started = time.monotonic()
        self._moved: dict[int, tuple[int, int]] = {}  # failover -> (keys, bytes) it moved

    # -- input (the scheduler's I/O thread) ------------------------------------------------------
    def report(self, node: NodeInfo, meta: dict, now: float | None = None) -> None:
        """A node's REPORT (``now``: when it came, monotonic seconds; default: now)."""
        now = time.monotonic() if now is None else now
        if node.role is Role.WORKER:
            sample = self._worker_sample(meta)
            table = self.workers
        else:
            sample = self._server_sample(meta)
            table = self.servers
        with self._lock:  # by connection: an elastic job renumbers its workers
            table.setdefault(node.route.ident, deque(maxlen=SAMPLES)).append((now, sample))
        if node.role is Role.SERVER:
            self.check_straggler(now)
        if now >= self._next_point:
            self._next_point = now + max(0.2, self.interval)
            self._add_point(now)

    def registered(self, node: NodeInfo | None, phase: str) -> None:
        """A registration was taken: ``node`` is new (None: not a new node); ``phase``, the
        scheduler's before it."""
        if node is not None:
            text = f"{node.role.label} registered from {node.host} (pid {node.pid})"
            lost = [n for n in list(self.host.nodes.values())
                    if n.role is node.role and n.lost]
            # a replacement server took a lost one's place (ServerLoss.replace removed it)
            newest = list(getattr(self.loss, "events", []))[-1:]
            if newest and newest[0].get("cause") == "replacement" \
                    and newest[0].get("pid") == node.pid:
                lost = lost or [node]
            if phase == "running" and lost:  # an elastic worker's (or a server's) successor
                self.events.add("replacement", f"{text} during the job, after the loss of "
                                f"{len(lost)} {node.role.label}(s)")
            else:
                self.events.add("join", text + (" during the job" if phase == "running"
                                                else ""))
        if phase == "register" and self.host.phase == "running":
            self.events.add("formed", f"the job formed: {self.host.counts()}")

    def _worker_sample(self, meta: dict) -> dict:
        out = {"step": _num(meta, "step", int, 0), "bytes": _num(meta, "bytes", int, 0),
               "exchange": _num(meta, "exchange"), "rounds": _num(meta, "rounds", int, 0)}
        for name, width in (("owners", 5), ("moved", 3)):  # worker rank 0: where the keys
            rows = meta.get(name)                          # live, what each failover moved
            if isinstance(rows, list):
                out[name] = [[_num({"v": v}, "v", int, 0) for v in row]
                             for row in rows[:4096] if isinstance(row, list) and len(row) == width]
        prog = meta.get("progress")
        if isinstance(prog, dict):
            out["progress"] = (_num(prog, "step", int, 0), _num(prog, "total_steps", int, 0),
                               _num(prog, "samples_per_step", int, 0))
        return out

    def _server_sample(self, meta: dict) -> dict:
        rows = meta.get("straggle")
        straggle: list[tuple[float, float]] = []
        if isinstance(rows, list):
            for row in rows[:self.capacity()]:
                ok = isinstance(row, list) and len(row) == 3
                straggle.append((_num({"v": row[0]}, "v"), _num({"v": row[2]}, "v"))
                                if ok else (0.0, 0.0))
        return {"bytes": _num(meta, "bytes", int, 0), "keys": _num(meta, "keys", int, 0),
                "cpu": _num(meta, "cpu"), "rounds": _num(meta, "rounds", int, 0),
                "store_bytes": _num(meta, "store_bytes", int, 0), "straggle": straggle}

    def capacity(self) -> int:
        """Worker machines a server may report on (elastic jobs: up to the most workers)."""
        c = self.host.cfg
        n = c.cluster.num_worker
        return c.elastic.capacity(n) if self.host.elastic else n

    # -- the straggler ---------------------------------------------------------------------------
    def costs(self, now: float | None = None) -> dict[int, dict]:
        """Per worker machine: the fraction of the last window the others waited for it
        ("held") and it waited for others ("waited"), the largest any server saw, with the
        span measured, and the seconds held since the start. O(servers x machines)."""
        now = time.monotonic() if now is None else now
        out: dict[int, dict] = {}
        with self._lock:
            servers = [list(s) for s in self.servers.values()]
        for samples in servers:
            if len(samples) < 2:
                continue
            t_new, new = samples[-1]
            # the oldest sample within the window (else the one before the newest)
            k = bisect.bisect_left([t for t, _ in samples], now - self.window)
            t_old, old = samples[min(k, len(samples) - 2)]
            span = t_new - t_old
            for m, (held_total, waited_total) in enumerate(new["straggle"]):
                row = out.setdefault(m, {"held": 0.0, "waited": 0.0, "span": 0.0,
                                         "held_total": 0.0})
                row["held_total"] = max(row["held_total"], held_total)
                if span <= 0 or m >= len(old["straggle"]):
                    continue
                held0, waited0 = old["straggle"][m]
                row["held"] = max(row["held"], min(1.0, max(0.0, held_total - held0) / span))
                row["waited"] = max(row["waited"],
                                    min(1.0, max(0.0, waited_total - waited0) / span))
                row["span"] = max(row["span"], span)
        return out

    def straggler(self, now: float | None = None) -> dict | None:
        """The machine the others wait for most, if over the threshold for a whole window."""
        costs = self.costs(now)
        if not costs:
            return None
        m, row = max(costs.items(), key=lambda kv: kv[1]["held"])
        if row["held"] <= 0 or row["span"] < 0.8 * self.window:
            return None
        if self.threshold > 0 and row["held"] < self.threshold:
            return None
        return {"machine": m, **self.name(m), "fraction": round(row["held"], 4)}

    def name(self, machine: int) -> dict:
        """Worker ranks and host of a worker machine (its local ranks)."""
        ls = self.host.cfg.cluster.local_size
        nodes = [n for n in list(self.host.nodes.values())
                 if n.role is Role.WORKER and n.rank >= 0 and n.rank // ls == machine]
        ranks = sorted(n.rank for n in nodes) or list(range(machine * ls, (machine + 1) * ls))
        hosts = sorted({n.host for n in nodes}) or ["?"]
        return {"ranks": ranks, "rank": ranks[0], "host": ", ".join(hosts)}

    def check_straggler(self, now: float) -> None:
        """Log one line when a worker starts to cost the job more than the threshold over a
        whole window, and one when it is back under half of it."""
        if self.threshold <= 0 or self.host.phase != "running":
            return
        costs = self.costs(now)
        if self.flagged is not None:
            row = costs.get(self.flagged)
            if row is not None and row["held"] < self.threshold / 2:
                who = self._who(self.flagged)
                text = (f"{who} is no longer a straggler: the others waited for it "
                        f"{row['held']:.0%} of the last {self.window:g} s")
                log.info("scheduler: %s", text)
                self.events.add("straggler", text)
                self.flagged = None
        st = self.straggler(now)
        if st is not None and st["machine"] != self.flagged:
            self.flagged = st["machine"]
            text = (f"{self._who(st['machine'])}: the other workers waited for it "
                    f"{st['fraction']:.0%} of the job's time over the last {self.window:g} s "
                    f"(BYTEPS_STRAGGLER_FRACTION={self.threshold:g})")
            log.warning("scheduler: straggler: %s", text)
            self.events.add("straggler", text)

    def _who(self, machine: int) -> str:
        n = self.name(machine)
        ranks = n["ranks"]
        which = f"worker rank {ranks[0]}" if len(ranks) == 1 else f"worker ranks {ranks}"
        return f"{which} on {n['host']}"

    # -- output (any thread) ---------------------------------------------------------------------
    def _nodes(self, role: Role) -> list[tuple[Any, deque, dict, bool]]:
        """The ranked nodes of ``role`` in rank order, each with a copy of its reports (taken
        under the lock), its last report and whether it is live."""
        nodes = sorted((n for n in list(self.host.nodes.values())
                        if n.role is role and n.rank >= 0),
                       key=lambda n: (n.rank, n.lost))
        table = self.workers if role is Role.WORKER else self.servers
        with self._lock:
            samples = {i: deque(s) for i, s in table.items()}
        out = []
        for node in nodes:
            dq = samples.get(node.route.ident, deque())
            out.append((node, dq, dq[-1][1] if dq else {}, not (node.lost or node.finished)))
        return out

    def _worker_rows(self, now: float, costs: dict[int, dict], flagged: int | None) -> list:
        ls = self.host.cfg.cluster.local_size
        rows = []
        for node, dq, last, live in self._nodes(Role.WORKER):
            steps = _rate(dq, now, self.window, lambda s: s["step"]) if live else None
            busy = _rate(dq, now, self.window, lambda s: s["exchange"])
            moved = _rate(dq, now, self.window, lambda s: s["bytes"]) if live else None
            cost = costs.get(node.rank // ls, {}) if live else {}
            row: dict[str, Any] = {
                "rank": node.rank, "host": node.host, "pid": node.pid, "state": _state(node),
                "step": last.get("step"), "steps_per_s": round(steps[0], 3) if steps else None,
                "bytes_per_s": round(moved[0]) if moved else None,
                "held_fraction": round(cost.get("held", 0.0), 4),
                "waited_fraction": round(cost.get("waited", 0.0), 4),
                "held_s": round(cost.get("held_total", 0.0), 3),
                "report_age_s": round(now - dq[-1][0], 2) if dq else None,
                "straggler": live and flagged is not None and node.rank // ls == flagged}
            if steps and steps[0] > 0:
                step_time = 1.0 / steps[0]
                exch = min(1.0, busy[0]) if busy else 0.0
                wait = min(exch, cost.get("waited", 0.0))
                row.update(step_time_s=round(step_time, 4),
                           compute_s=round((1.0 - exch) * step_time, 4),
                           wait_s=round(wait * step_time, 4),
                           exchange_s=round((exch - wait) * step_time, 4))
            if "progress" in last:
                row["progress"] = dict(zip(("step", "total_steps", "samples_per_step"),
                                           last["progress"]))
            rows.append(row)
        return rows

    # -- where the keys live, and the servers lost and replaced (issue 37) -----------------------
    def _newest(self, name: str) -> list:
        """The newest worker report's ``name`` rows (worker rank 0 sends them)."""
        best: tuple[float, list] | None = None
        with self._lock:
            for dq in self.workers.values():
                for t, sample in reversed(dq):
                    if name in sample:
                        if best is None or t > best[0]:
                            best = (t, sample[name])
                        break
        return best[1] if best else []

    def owners(self) -> dict[int, list[int]]:
        """Server rank -> [rank, keys owned now, their bytes, keys first assigned, their
        bytes] (byteps_like/worker/telemetry.py, key_owners)."""
        return {row[0]: row for row in self._newest("owners")}

    def failovers(self) -> list[dict]:
        """Every server lost or replaced: which, when, why (``cause``: exit, stream lost,
        heartbeat, announced leave, failed, replacement), the stall, and the keys (and bytes)
        that moved, as the workers moved them (telemetry.py, keys_moved; None until a worker
        has said)."""
        for number, keys, nbytes in self._newest("moved"):
            self._moved[number] = (keys, nbytes)
        out = []
        for e in list(getattr(self.loss, "events", []))[-200:]:
            moved = self._moved.get(e["failover"])
            out.append(dict(e) | {
                "keys_moved": moved[0] if moved else None,
                "bytes_moved": moved[1] if moved else None})
        return out

    def _server_rows(self, now: float) -> list:
        rows = []
        owners = self.owners()
        for node, dq, last, live in self._nodes(Role.SERVER):
            own = owners.get(node.rank) if live else None
            moved = _rate(dq, now, self.window, lambda s: s["bytes"]) if live else None
            cpu = _rate(dq, now, self.window, lambda s: s["cpu"]) if live else None
            rounds = _rate(dq, now, self.window, lambda s: s["rounds"]) if live else None
            rows.append({"rank": node.rank, "host": node.host, "pid": node.pid,
                         "state": _state(node),
                         "bytes_per_s": round(moved[0]) if moved else None,
                         "cpu_cores": round(cpu[0], 3) if cpu else None,
                         "rounds_per_s": round(rounds[0], 2) if rounds else None,
                         "keys": last.get("keys"), "store_bytes": last.get("store_bytes"),
                         "keys_owned": own[1] if own else (0 if owners else None),
                         "bytes_owned": own[2] if own else (0 if owners else None),
                         "report_age_s": round(now - dq[-1][0], 2) if dq else None})
        return rows

    def state(self, now: float | None = None) -> dict:
        """The live page's data (and /api/state's)."""
        now = time.monotonic() if now is None else now
        costs = self.costs(now)
        st = self.straggler(now)
        flagged = st["machine"] if st is not None else None
        workers = self._worker_rows(now, costs, flagged)
        servers = self._server_rows(now)
        h = self.host
        job: dict[str, Any] = {
            "phase": h.phase, "uptime_s": round(now - self.started, 1),
            "workers": sum(1 for w in workers if w["state"] == "up"),
            "servers": sum(1 for s in servers if s["state"] == "up"),
            "expected_workers": h.expected[Role.WORKER],
            "expected_servers": h.expected[Role.SERVER]}
        job.update(_progress(workers))
        return {"job": job, "workers": workers, "servers": servers, "straggler": st,
                "events": self.events.recent(100), "timeline": self.points(),
                "failovers": self.failovers(),
                "settings": {"straggler_fraction": self.threshold, "window_s": self.window,
                             "report_interval_s": self.interval}}

    def _add_point(self, now: float) -> None:
        """One point of the timeline: steps/s per worker, samples/s, server bytes/s."""
        try:
            s = self.state(now)
        except (RuntimeError, KeyError, ValueError):  # a table changing under a reader
            return
        point = {"time": round(time.time(), 3),
                 "steps_per_s": {str(w["rank"]): w["steps_per_s"] for w in s["workers"]
                                 if w["state"] == "up"},
                 "samples_per_s": s["job"].get("samples_per_s"),
                 "server_bytes_per_s": sum(x["bytes_per_s"] or 0 for x in s["servers"]),
                 "straggler": s["straggler"]["rank"] if s["straggler"] else None}
        with self._lock:
            self.timeline.append(point)

    def points(self, n: int = TIMELINE) -> list[dict]:
        with self._lock:
            return list(self.timeline)[-n:]

    def metrics(self, now: float | None = None) -> dict[str, Any]:
        """The scheduler's Prometheus samples of the straggler report (byteps_like/metrics.py)."""
        costs = self.costs(now)
        ls = self.host.cfg.cluster.local_size
        held, frac = {}, {}
        for m, row in costs.items():
            for r in range(m * ls, (m + 1) * ls):
                held[str(r)] = row["held_total"]
                frac[str(r)] = row["held"]
        st = self.straggler(now)
        return {"byteps_scheduler_worker_held_seconds": held,
                "byteps_scheduler_worker_held_fraction": frac,
                "byteps_scheduler_straggler_rank": st["rank"] if st else -1}


def _state(node: NodeInfo | None) -> str:
    if node is None:
        return "gone"
    if node.lost:
        return "lost"
    if node.finished:
        return "finished"
    return "up"


def _progress(workers: list[dict]) -> dict:
    """The job's steps/s, samples/s and ETA from the workers' rows (samples/s and ETA only when
    their scripts declare them: bps.set_progress)."""
    live = [w for w in workers if w["state"] == "up" and w["steps_per_s"] is not None]
    out: dict[str, Any] = {}
    if not live:
        return out
    out["steps_per_s"] = round(min(w["steps_per_s"] for w in live), 3)
    out["step"] = min(w["step"] for w in live if w["step"] is not None) if any(
        w["step"] is not None for w in live) else None
    declared = [w for w in live if "progress" in w]
    if declared and all(w["progress"]["samples_per_step"] > 0 for w in declared):
        out["samples_per_s"] = round(sum(w["steps_per_s"] * w["progress"]["samples_per_step"]
                                         for w in declared), 1)
    totals = [w["progress"]["total_steps"] for w in declared if w["progress"]["total_steps"]]
    if totals:
        total = max(totals)
        done = min(w["progress"]["step"] for w in declared)
        rate = min(w["steps_per_s"] for w in declared)
        out.update(total_steps=total, progress_step=done,
                   eta_s=round((total - done) / rate, 1) if rate > 0 else None)
    return out
