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
    def straggler(self) -> str | None:
        """The scheduler's straggler report (scheduler/reports.py), as a line: the worker the
        others wait for more than BYTEPS_STRAGGLER_FRACTION of the time; None when none."""
        sched = next((r for r in self.rows if r.role == "scheduler" and r.metrics), None)
        if sched is None:
            return None
        rank = int(sched.metrics.get("byteps_scheduler_straggler_rank", -1))
        if rank < 0:
            return None
        frac = sched.metrics.get(f"byteps_scheduler_worker_held_fraction{{worker={rank}}}", 0.0)
        return (f"straggler: worker rank {rank} on {self.host} (the others wait for it "
                f"{frac:.0%} of the time)")

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
        slow = self.straggler()
        lines = [head.replace(" 1 servers", " 1 server")[:width],
                 (slow.upper()[:1] + slow[1:])[:width] if slow else "",
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
        slow = self.straggler()
        return "bpslaunch: status " + " | ".join(parts + ([slow] if slow else []))

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


# -- the live job page (scheduler/dashboard.py) -------------------------------------------------
def with_dashboard(launch, port: int, host: str):
    """``launch`` with its scheduler serving the live page on ``port`` (0: a free one) of
    ``host``; and the page's address. ValueError when this launch starts no scheduler."""
    if not any(s.role == "scheduler" for s in launch.specs):
        raise ValueError("--dashboard: this bpslaunch starts no scheduler (DMLC_ROLE); give it "
                         "to the bpslaunch that runs the scheduler, or read a running job's "
                         "page with `bpslaunch status HOST:PORT`")
    port = port or free_port(host)
    specs = tuple(dataclasses.replace(s, env={**s.env, "BYTEPS_DASHBOARD_PORT": str(port),
                                              "BYTEPS_DASHBOARD_HOST": host})
                  if s.role == "scheduler" else s for s in launch.specs)
    return dataclasses.replace(launch, specs=specs), f"http://{host}:{port}/"


def fetch_state(address: str, token: str = "", timeout: float = 5.0) -> dict:
    """The live page's JSON (``/api/state``) of the scheduler whose page is at ``address``
    (``HOST:PORT`` or ``http://HOST:PORT/``). OSError/ValueError when it cannot be read."""
    import json
    base = address if "://" in address else f"http://{address}"
    url = base.rstrip("/") + "/api/state"
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token
                                 else {})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        doc = json.loads(r.read().decode("utf-8"))
    if not isinstance(doc, dict) or "workers" not in doc:
        raise ValueError(f"{url} is not a byteps_like job page")
    return doc


def _ms(v) -> str:
    return "-" if v is None else f"{v * 1e3:.0f}"


def render_state(doc: dict) -> list[str]:
    """``bpslaunch status``'s text of a job page's JSON."""
    j = doc.get("job", {})
    head = (f"job: {j.get('phase')} | {j.get('workers')} of {j.get('expected_workers')} "
            f"workers, {j.get('servers')} of {j.get('expected_servers')} servers | up "
            f"{j.get('uptime_s', 0):.0f} s")
    if j.get("steps_per_s") is not None:
        head += f" | {j['steps_per_s']:.2f} steps/s"
    if j.get("samples_per_s") is not None:
        head += f" | {j['samples_per_s']:.1f} samples/s"
    if j.get("eta_s") is not None:
        head += (f" | step {j.get('progress_step')} of {j.get('total_steps')}, "
                 f"ETA {j['eta_s']:.0f} s")
    lines = [head]
    st = doc.get("straggler")
    if st:
        lines.append(f"STRAGGLER: worker rank {', '.join(map(str, st['ranks']))} on {st['host']}:"
                     f" the others wait for it {st['fraction']:.0%} of the job's time")
    lines += ["", f"{'WORKER':>6}  {'HOST':<16}{'STATE':<9}{'STEP':>7}{'STEPS/S':>9}"
                  f"{'COMPUTE ms':>11}{'WAIT ms':>9}{'EXCH ms':>9}{'HELD':>7}"]
    for w in doc.get("workers", []):
        step = "-" if w.get("step") is None else str(w["step"])
        sps = "-" if w.get("steps_per_s") is None else f"{w['steps_per_s']:.2f}"
        mark = "  <- straggler" if w.get("straggler") else ""
        lines.append(f"{w['rank']:>6}  {str(w['host'])[:15]:<16}{w['state']:<9}{step:>7}"
                     f"{sps:>9}{_ms(w.get('compute_s')):>11}{_ms(w.get('wait_s')):>9}"
                     f"{_ms(w.get('exchange_s')):>9}{w.get('held_fraction', 0):>7.0%}{mark}")
    lines += ["", f"{'SERVER':>6}  {'HOST':<16}{'STATE':<9}{'MB/s':>9}{'KEYS':>7}{'CPU':>7}"
                  f"{'OWNS KEYS':>11}{'OWNS MB':>9}"]
    for s in doc.get("servers", []):
        mbps = "-" if s.get("bytes_per_s") is None else f"{s['bytes_per_s'] / 1e6:.1f}"
        cpu = "-" if s.get("cpu_cores") is None else f"{s['cpu_cores']:.2f}"
        owned = "-" if s.get("keys_owned") is None else str(s["keys_owned"])
        mb = "-" if s.get("bytes_owned") is None else f"{s['bytes_owned'] / 1e6:.1f}"
        lines.append(f"{s['rank']:>6}  {str(s['host'])[:15]:<16}{s['state']:<9}{mbps:>9}"
                     f"{'-' if s.get('keys') is None else s['keys']:>7}{cpu:>7}{owned:>11}{mb:>9}")
    lines += _failover_lines(doc.get("failovers") or [])
    events = doc.get("events", [])[-5:]
    if events:
        lines += ["", "recent events:"]
        lines += [f"  {time.strftime('%H:%M:%S', time.localtime(e['time']))} {e['kind']}: "
                  f"{e['text']}" for e in events]
    return lines


def _failover_lines(failovers: list) -> list[str]:
    """Every server lost or replaced (scheduler/reports.py, ``failovers``), oldest first."""
    if not failovers:
        return []
    out = ["", f"servers lost and replaced ({len(failovers)}):"]
    for f in failovers:
        at = time.strftime("%H:%M:%S", time.localtime(f.get("at") or 0))
        what = ("replaced: its keys moved back" if f.get("cause") == "replacement"
                else f"lost ({f.get('cause')}): its keys moved to the others")
        stall = "stall -" if f.get("stall") is None else f"stall {f['stall']:.2f} s"
        moved = ("keys moved: ?" if f.get("keys_moved") is None else
                 f"{f['keys_moved']} keys ({(f.get('bytes_moved') or 0) / 1e6:.1f} MB) moved")
        out.append(f"  #{f.get('failover')} {at} server {f.get('server')} on {f.get('host') or '?'}"
                   f" (pid {f.get('pid')}) {what}; {stall}; {moved}")
        out.append(f"      {str(f.get('why'))[:300]}")
    return out


def main(argv: Sequence[str], env) -> int:
    """``bpslaunch status ADDRESS``: a running job's status, read from its scheduler's live page
    (BYTEPS_DASHBOARD_PORT), from any machine that reaches it."""
    import argparse
    import json
    p = argparse.ArgumentParser(prog="bpslaunch status", description=main.__doc__)
    p.add_argument("address", help="the live page's HOST:PORT (or http://HOST:PORT/)")
    p.add_argument("--json", action="store_true", help="print the page's JSON")
    p.add_argument("--watch", type=float, metavar="SECONDS", default=0.0,
                   help="print it again every SECONDS until interrupted")
    p.add_argument("--token", default=None, help="the job's secret, for a page exposed "
                   "beyond loopback (default: BYTEPS_AUTH_SECRET)")
    args = p.parse_args(list(argv))
    token = args.token if args.token is not None else env.get("BYTEPS_AUTH_SECRET", "")
    while True:
        try:
            doc = fetch_state(args.address, token)
        except (OSError, ValueError) as exc:
            print(f"bpslaunch status: cannot read the job page at {args.address}: {exc} (is "
                  "the scheduler running with BYTEPS_DASHBOARD_PORT / bpslaunch --dashboard, "
                  "and is the token right?)", file=sys.stderr)
            return 1
        print(json.dumps(doc, indent=1) if args.json else "\n".join(render_state(doc)),
              flush=True)
        if args.watch <= 0:
            return 0
        try:
            time.sleep(args.watch)
        except KeyboardInterrupt:
            return 0
        print()
