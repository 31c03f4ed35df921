"""``bpslaunch --local --status``: a live one-screen status of the local cluster.

Every process of the job serves Prometheus metrics on a free port that bpslaunch assigns
(``BYTEPS_METRICS_PORT``, :func:`assign_metrics_ports`); the view scrapes them over HTTP
(standard library only) and draws roles, ranks, state, steps, rounds and throughput. On a
terminal it redraws one screen in place, with the latest output lines of the processes beneath;
when stdout is not a terminal it prints a plain ``bpslaunch: status ...`` line every few seconds
and leaves the processes' output alone.
"""
from __future__ import annotations

import dataclasses
import io
import re
import shutil
import sys
import threading
import time
import urllib.request
from collections import deque
from collections.abc import Sequence
from typing import TextIO, cast

from .procs import free_port

_LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{([^}]*)\})?\s+(\S+)')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def assign_metrics_ports(specs: Sequence, host: str) -> tuple[list, dict]:
    """Specs with ``BYTEPS_METRICS_PORT`` set to a free port each; and {spec name: port}."""
    out, ports = [], {}
    for spec in specs:
        port = free_port(host)
        ports[spec.name] = port
        # a worker serves BYTEPS_METRICS_PORT + its local rank (byteps_like/telemetry.py)
        setting = port - int(spec.env.get("BYTEPS_LOCAL_RANK") or 0) if spec.role == "worker" \
            else port
        out.append(dataclasses.replace(spec, env={**spec.env, "BYTEPS_METRICS_PORT": str(setting),
                                                  "BYTEPS_METRICS_HOST": host}))
    return out, ports


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text format -> {"name" or "name{label=value}": value}, summing over the
    role/rank labels (one process per endpoint)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            continue
        name, labels, value = m.groups()
        extra = [f"{k}={v}" for k, v in _LABEL.findall(labels or "") if k not in ("role", "rank")]
        key = name + ("{" + ",".join(extra) + "}" if extra else "")
        try:
            out[key] = out.get(key, 0.0) + float(value)
        except ValueError:
            continue
    return out


def scrape(host: str, port: int, timeout: float = 1.0) -> dict[str, float] | None:
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout) as r:
            return parse_metrics(r.read().decode("utf-8", "replace"))
    except (OSError, ValueError):
        return None


@dataclasses.dataclass
class Row:
    name: str
    role: str
    rank: str
    port: int
    state: str = "starting"
    seen: bool = False
    metrics: dict = dataclasses.field(default_factory=dict)
    last: tuple[float, float] | None = None   # (time, bytes) of the previous scrape
    mbps: float = 0.0


class StatusView:
    """Scrapes every process and renders the cluster status."""

    def __init__(self, specs: Sequence, ports: dict[str, int], host: str, *,
                 out: TextIO | None = None, tty: bool | None = None, interval: float = 1.0,
                 plain_interval: float = 5.0):
        self.rows = [Row(s.name, s.role, "-" if s.rank is None else str(s.rank),
                         ports.get(s.name, 0)) for s in specs]
        self.host = host
        self.out = out or sys.stdout
        self.tty = self.out.isatty() if tty is None else tty
        self.plain_out = out or sys.stderr  # plain lines beside the launcher's own messages
        self.interval = interval
        self.draw_every = interval if self.tty else plain_interval
        self.started = time.monotonic()
        self.lines: deque[str] = deque(maxlen=200)     # children's output (TTY mode)
        self.messages: list[str] = []                  # the launcher's own lines (TTY mode)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bpslaunch-status", daemon=True)

    # -- capture of the children's output in TTY mode -----------------------------------------
    def capture(self, which: str) -> TextIO:
        view = self

        class _Capture(io.TextIOBase):
            def write(self, text: str) -> int:
                for line in text.splitlines():
                    if which == "stderr" and line.startswith("bpslaunch:"):
                        view.messages.append(line)
                    view.lines.append(line)
                return len(text)

            def isatty(self) -> bool:
                return False
        return cast(TextIO, _Capture())

    # -- scraping ----------------------------------------------------------------------------
    def poll(self) -> None:
        now = time.monotonic()
        for row in self.rows:
            m = scrape(self.host, row.port) if row.port else None
            if m is None:
                row.state = row.state if row.state == "exited" else (
                    "down" if row.seen else "starting")
                continue
            row.seen, row.state, row.metrics = True, "up", m
            moved = (m.get("byteps_bytes_pushed_total", 0) + m.get("byteps_bytes_pulled_total", 0)
                     + m.get("byteps_server_bytes_summed_total", 0))
            if row.last is not None and now > row.last[0]:
                row.mbps = (moved - row.last[1]) / (now - row.last[0]) / 1e6
            row.last = (now, moved)

    # -- rendering -----------------------------------------------------------------------------
    def render(self, width: int = 100, height: int = 30) -> list[str]:
        workers = [r for r in self.rows if r.role == "worker"]
        servers = [r for r in self.rows if r.role == "server"]
        up = time.monotonic() - self.started
        total = sum(r.mbps for r in workers)
        steps = [r.metrics["byteps_step"] for r in workers
                 if r.state == "up" and r.metrics.get("byteps_step") is not None]
        head = (f"byteps_like local cluster: {len(workers)} workers, {len(servers)} servers | "
                f"up {up:.0f} s | step {int(min(steps)) if steps else '-'} | "
                f"{total:.1f} MB/s (workers, pushed+pulled)")
        lines = [head.replace(" 1 servers", " 1 server")[:width], "",
                 f"{'PROCESS':<12}{'ROLE':<10}{'RANK':>5}  {'STATE':<9}{'STEP':>6}{'ROUNDS':>8}"
                 f"{'PUSHED MB':>11}{'PULLED MB':>11}{'MB/s':>9}{'QUEUED':>8}"]
        for r in self.rows:
            m = r.metrics
            if r.role == "worker":
                step = int(m.get("byteps_step", -1)) if m else -1
                rounds = int(m.get("byteps_rounds_total", 0))
                pushed = m.get("byteps_bytes_pushed_total", 0) / 1e6
                pulled = m.get("byteps_bytes_pulled_total", 0) / 1e6
                queued = int(sum(v for k, v in m.items() if k.startswith("byteps_queue_depth")))
                cells = (f"{step if step >= 0 else '-':>6}{rounds:>8}{pushed:>11.1f}"
                         f"{pulled:>11.1f}{r.mbps:>9.1f}{queued:>8}")
            elif r.role == "server":
                rounds = int(m.get("byteps_server_rounds_total", 0))
                summed = m.get("byteps_server_bytes_summed_total", 0) / 1e6
                cells = f"{'-':>6}{rounds:>8}{summed:>11.1f}{'':>11}{r.mbps:>9.1f}{'':>8}"
            else:
                nodes = int(sum(v for k, v in m.items()
                                if k.startswith("byteps_scheduler_nodes")))
                missed = int(m.get("byteps_scheduler_heartbeats_missed_total", 0))
                cells = f"  nodes {nodes}, heartbeats missed {missed}" if m else ""
            lines.append((f"{r.name:<12}{r.role:<10}{r.rank:>5}  {r.state:<9}" + cells)[:width])
        if self.tty:
            lines += ["", "-- latest output " + "-" * max(0, width - 18)]
            room = max(0, height - len(lines) - 1)
            tail = list(self.lines)[-room:] if room else []
            lines += [ln[:width] for ln in tail]
        return lines

    def plain_line(self) -> str:
        parts = []
        for r in self.rows:
            m = r.metrics
            if r.role == "worker":
                parts.append(f"{r.name} {r.state} step {int(m.get('byteps_step', -1))} "
                             f"rounds {int(m.get('byteps_rounds_total', 0))} "
                             f"{r.mbps:.1f} MB/s")
            else:
                parts.append(f"{r.name} {r.state}")
        return "bpslaunch: status " + " | ".join(parts)

    def draw(self) -> None:
        if self.tty:
            size = shutil.get_terminal_size((100, 30))
            lines = self.render(size.columns, size.lines)
            self.out.write("\x1b[H\x1b[2J" + "\n".join(lines) + "\n")
            self.out.flush()
        else:
            self.plain_out.write(self.plain_line() + "\n")
            self.plain_out.flush()

    def _loop(self) -> None:
        last_draw = None
        while True:
            try:
                self.poll()
                now = time.monotonic()
                if last_draw is None or now - last_draw >= self.draw_every - 1e-3:
                    self.draw()
                    last_draw = now
            except (OSError, ValueError):
                pass
            if self._stop.wait(self.interval):
                return

    def start(self) -> None:
        self._thread.start()

    def stop(self, final_stream: TextIO | None = None) -> None:
        self._stop.set()
        self._thread.join(5.0)
        for row in self.rows:
            row.state = "exited" if row.seen else row.state
        if self.tty:  # leave the last screen, then the launcher's own messages
            self.poll()
            self.draw()
            err = final_stream or sys.stderr
            for line in self.messages:
                err.write(line + "\n")
            err.flush()


def run_with_status(launch, run_job, host: str, *, metrics_only: bool = False) -> int:
    """Run ``launch`` (cli.Launch) with metrics ports assigned and, unless ``metrics_only``, the
    status view; returns the exit status."""
    specs, ports = assign_metrics_ports(launch.specs, host)
    for spec in specs:
        print(f"bpslaunch: metrics of {spec.name}: http://{host}:{ports[spec.name]}/metrics",
              file=sys.stderr, flush=True)
    if metrics_only:
        return run_job(specs, launch.base_env, launch.settings)
    view = StatusView(specs, ports, host)
    view.start()
    try:
        if view.tty:
            return run_job(specs, launch.base_env, launch.settings,
                           stdout=view.capture("stdout"), stderr=view.capture("stderr"))
        return run_job(specs, launch.base_env, launch.settings)
    finally:
        view.stop()
