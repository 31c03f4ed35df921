"""Timeline traces: Chrome trace-event JSON of every pipeline stage of every partition.

A :class:`Tracer` is a pipeline observer (docs/architecture.md: observers subscribe to stage start
and end; they do not live in the router). It keeps its events in memory and writes them once, when
the traced steps are over or at shutdown, so tracing costs the hot path a dict lookup and a list
append per stage.

A *step* is a training step (:meth:`byteps_like.worker.telemetry.Telemetry.step`): where a framework
plugin averages the gradients (torch ``DistributedOptimizer``, TensorFlow's
``DistributedGradientTape``, a Keras ``DistributedOptimizer``, MXNet's ``DistributedTrainer``) it
counts each averaging; in a script that calls ``push_pull`` itself, the round of the tensor
push_pulled most often (BytePS counts steps per tensor). Steps ``BYTEPS_TRACE_START_STEP`` ..
``BYTEPS_TRACE_END_STEP``, inclusive, counting from 0, are traced. Each worker writes
``BYTEPS_TRACE_DIR/<rank>/comm.json``.

Command line::

    python -m byteps_like.trace merge DIR -o merged.json   # one process per rank
    python -m byteps_like.trace summary FILE [--top N]     # per-stage time, slowest tensors
    python -m byteps_like.trace plot FILE -o trace.png     # a PNG timeline (matplotlib)
"""
from __future__ import annotations

import argparse
import glob
import json
import logging
import os
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

from .worker.pipeline import Spans

log = logging.getLogger("byteps_like.trace")

#: Stable thread ids for the stages, in pipeline order.
STAGE_TIDS = {s: i for i, s in enumerate(
    ("reduce", "copy_d2h", "compress", "push", "pull", "decompress", "copy_h2d", "broadcast"))}


class Tracer:
    """Collects one complete ("X") trace event per stage per partition for the traced steps."""

    def __init__(self, rank: int, out_dir: str, start_step: int, end_step: int,
                 step_fn: Callable[[], int], *, role: str = "worker"):
        self.rank = rank
        self.role = role
        self.path = os.path.join(out_dir, str(rank), "comm.json")
        self.start_step = start_step
        self.end_step = end_step
        self.step_fn = step_fn
        self._spans = Spans()
        self._events: list[dict] = []
        self._lock = threading.Lock()
        self._written = False
        # monotonic -> wall-clock microseconds, so the ranks' files line up when merged
        self._offset = time.time() - time.monotonic()

    @property
    def events(self) -> list[dict]:
        return list(self._events)

    def __call__(self, task: Any, stage: str, event: str, t: float) -> None:
        if self._written:
            return
        step = self.step_fn()
        if step < self.start_step:
            return
        if step > self.end_step:
            self.flush()  # once: the traced steps are over
            return
        t0 = self._spans.end(task, stage, event, t)
        if t0 is None:
            return
        wait = max(0.0, t0 - task.enqueued_at)
        ev = {"name": getattr(task.handle, "name", "?"), "cat": stage, "ph": "X",
              "ts": round((t0 + self._offset) * 1e6, 3), "dur": round((t - t0) * 1e6, 3),
              "pid": self.rank, "tid": STAGE_TIDS.get(stage, 99),
              "args": {"stage": stage, "key": task.key, "part": task.part,
                       "bytes": task.nbytes, "priority": task.priority, "round": task.round,
                       "step": step, "queue_wait_us": round(wait * 1e6, 3)}}
        with self._lock:
            self._events.append(ev)

    def document(self) -> dict:
        meta = [{"name": "process_name", "ph": "M", "pid": self.rank, "tid": 0,
                 "args": {"name": f"{self.role} rank {self.rank}"}},
                {"name": "process_sort_index", "ph": "M", "pid": self.rank, "tid": 0,
                 "args": {"sort_index": self.rank}}]
        meta += [{"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid,
                  "args": {"name": stage}} for stage, tid in STAGE_TIDS.items()]
        with self._lock:
            events = list(self._events)
        try:
            last = int(self.step_fn())
        except Exception:  # noqa: BLE001 - the window is what matters; the step is a hint
            last = None
        return {"traceEvents": meta + events, "displayTimeUnit": "ms",
                "otherData": {"rank": self.rank, "role": self.role,
                              "start_step": self.start_step, "end_step": self.end_step,
                              "last_step": last}}

    def flush(self) -> str | None:
        """Write the trace file (once); returns its path."""
        with self._lock:
            if self._written:
                return None
            self._written = True
        doc = self.document()
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, self.path)
        log.info("rank %d: wrote %d trace events to %s", self.rank,
                 len(doc["traceEvents"]), self.path)
        return self.path


# ------------------------------------------------------------------------------ merge, summary
def _trace_files(directory: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(directory, "*", "comm.json")))
    files += sorted(f for f in glob.glob(os.path.join(directory, "*.json")))
    return files


def load(path: str) -> dict:
    with open(path) as f:
        doc = json.load(f)
    if isinstance(doc, list):  # the JSON-array form of the format
        doc = {"traceEvents": doc}
    if not isinstance(doc.get("traceEvents"), list):
        raise ValueError(f"{path}: not a trace-event JSON file (no traceEvents list)")
    return doc


def merge(paths: Iterable[str]) -> dict:
    """One trace with a process per rank (pid = the rank of each file)."""
    out: list[dict] = []
    ranks = []
    windows = []
    for i, path in enumerate(paths):
        doc = load(path)
        other = doc.get("otherData", {})
        rank = other.get("rank", i)
        ranks.append(rank)
        windows.append({k: other.get(k) for k in ("rank", "start_step", "end_step", "last_step")})
        for ev in doc["traceEvents"]:
            ev = dict(ev)
            ev["pid"] = rank
            out.append(ev)
    return {"traceEvents": out, "displayTimeUnit": "ms",
            "otherData": {"ranks": ranks, "windows": windows}}


def empty_reason(doc: dict, path: str) -> str | None:
    """Why a trace holds no stage events (None when it holds some): the traced step window and
    the steps each rank reached, with what to change."""
    if any(e.get("ph") == "X" for e in doc["traceEvents"]):
        return None
    other = doc.get("otherData", {})
    windows = other.get("windows") or ([other] if "start_step" in other else [])
    if not windows:
        return f"{path} holds no stage events (and no record of the traced step window)"
    seen = "; ".join(f"rank {w.get('rank')}: steps {w.get('start_step')}..{w.get('end_step')} "
                     f"traced, last step seen {w.get('last_step')}" for w in windows)
    return (f"{path} holds no stage events: {seen}. A step is an optimizer step of a framework "
            "plugin (without one, a round of the tensor push_pulled most often); if the job "
            "ended before the window, run more steps or lower BYTEPS_TRACE_START_STEP / "
            "BYTEPS_TRACE_END_STEP")


def summarize(doc: dict, top: int = 10) -> dict:
    """Per-stage totals and the slowest tensors (mean time from first stage start to last stage
    end of a round, over rounds and ranks)."""
    stages: dict[str, dict] = defaultdict(lambda: {"count": 0, "total_us": 0.0, "max_us": 0.0,
                                                   "wait_us": 0.0, "bytes": 0})
    spans: dict[tuple, list] = {}
    for ev in doc["traceEvents"]:
        if ev.get("ph") != "X":
            continue
        a = ev.get("args", {})
        st = stages[a.get("stage", ev.get("cat", "?"))]
        st["count"] += 1
        st["total_us"] += ev["dur"]
        st["max_us"] = max(st["max_us"], ev["dur"])
        st["wait_us"] += a.get("queue_wait_us", 0.0)
        st["bytes"] += a.get("bytes", 0)
        k = (ev["name"], ev.get("pid"), a.get("round"))
        s = spans.setdefault(k, [ev["ts"], ev["ts"] + ev["dur"], 0])
        s[0] = min(s[0], ev["ts"])
        s[1] = max(s[1], ev["ts"] + ev["dur"])
        s[2] += a.get("bytes", 0) if a.get("stage") == "push" else 0
    per_tensor: dict[str, list] = defaultdict(list)
    for (name, _pid, _rnd), (t0, t1, _b) in spans.items():
        per_tensor[name].append(t1 - t0)
    tensors = sorted(({"name": n, "rounds": len(v), "mean_us": sum(v) / len(v), "max_us": max(v)}
                      for n, v in per_tensor.items()), key=lambda r: -r["mean_us"])
    return {"stages": dict(stages), "tensors": tensors[:top]}


def format_summary(s: dict) -> str:
    lines = [f"{'stage':<12}{'events':>8}{'total ms':>12}{'mean ms':>10}{'max ms':>10}"
             f"{'wait ms':>10}{'MB':>10}"]
    for name, st in sorted(s["stages"].items(), key=lambda kv: -kv[1]["total_us"]):
        n = max(1, st["count"])
        lines.append(f"{name:<12}{st['count']:>8}{st['total_us'] / 1e3:>12.3f}"
                     f"{st['total_us'] / n / 1e3:>10.3f}{st['max_us'] / 1e3:>10.3f}"
                     f"{st['wait_us'] / n / 1e3:>10.3f}{st['bytes'] / 1e6:>10.3f}")
    lines.append("")
    lines.append("slowest tensors (first stage start to last stage end, per round):")
    # whole names (Keras layer paths run long): the column is as wide as the longest
    w = max([40] + [len(t["name"]) + 1 for t in s["tensors"]])
    lines.append(f"{'tensor':<{w}}{'rounds':>8}{'mean ms':>10}{'max ms':>10}")
    for t in s["tensors"]:
        lines.append(f"{t['name']:<{w}}{t['rounds']:>8}{t['mean_us'] / 1e3:>10.3f}"
                     f"{t['max_us'] / 1e3:>10.3f}")
    return "\n".join(lines)


def plot(doc: dict, output: str, title: str = "byteps_like timeline") -> None:
    """Draw the trace as a PNG timeline (rows: rank x stage), with matplotlib."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    xs = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
    if not xs:
        raise ValueError("no events to plot")
    t0 = min(e["ts"] for e in xs)
    rows = sorted({(e["pid"], e["tid"], e.get("args", {}).get("stage", e.get("cat", "?")))
                   for e in xs})
    index = {(p, t): i for i, (p, t, _s) in enumerate(rows)}
    names = sorted({e["name"] for e in xs})
    colors = {n: plt.cm.tab10(i % 10) for i, n in enumerate(names)}
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(rows) + 1.5))
    for e in xs:
        y = index[(e["pid"], e["tid"])]
        ax.barh(y, max(e["dur"], 1.0) / 1e3, left=(e["ts"] - t0) / 1e3, height=0.7,
                color=colors[e["name"]], edgecolor="black", linewidth=0.3)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"rank {p} {s}" for p, _t, s in rows])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_title(title)
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=colors[n]) for n in names],
              labels=names, loc="upper right", fontsize="small")
    fig.tight_layout()
    fig.savefig(output, dpi=100)
    plt.close(fig)


def _load_events(path: str, tool: str, empty_note: str = "") -> dict | None:
    """The trace at ``path`` if it holds stage events; else None, after ``tool`` said why on
    stderr (unreadable, or empty with its step window)."""
    try:
        doc = load(path)
    except (OSError, ValueError) as exc:
        print(f"{tool}: {exc}", file=sys.stderr)
        return None
    why = empty_reason(doc, path)
    if why is not None:
        print(f"{tool}: {empty_note}{why}", file=sys.stderr)
        return None
    return doc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m byteps_like.trace",
                                description="Merge and summarise byteps_like timeline traces.")
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("merge", help="merge the ranks' trace files into one trace")
    m.add_argument("dir", help="BYTEPS_TRACE_DIR of the job (or trace files)", nargs="+")
    m.add_argument("-o", "--output", default="merged.json")
    s = sub.add_parser("summary", help="per-stage time and the slowest tensors")
    s.add_argument("file")
    s.add_argument("--top", type=int, default=10)
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")
    g = sub.add_parser("plot", help="draw the trace as a PNG timeline (needs matplotlib)")
    g.add_argument("file")
    g.add_argument("-o", "--output", default="trace.png")
    args = p.parse_args(argv)
    if args.cmd == "plot":
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("trace plot: needs matplotlib, which is not installed: "
                  "pip install 'byteps_like[bench]' (or pip install matplotlib)", file=sys.stderr)
            return 2
        doc = _load_events(args.file, "trace plot", "nothing to draw: ")
        if doc is None:
            return 1
        plot(doc, args.output)
        print(f"wrote {args.output}")
        return 0
    if args.cmd == "merge":
        files: list[str] = []
        for d in args.dir:
            files += _trace_files(d) if os.path.isdir(d) else [d]
        if not files:
            print(f"trace merge: no trace files under {' '.join(args.dir)}", file=sys.stderr)
            return 1
        doc = merge(files)
        with open(args.output, "w") as f:
            json.dump(doc, f)
        print(f"merged {len(files)} files ({len(doc['traceEvents'])} events) into {args.output}")
        return 0
    doc = _load_events(args.file, "trace summary")
    if doc is None:
        return 1
    summary = summarize(doc, args.top)
    print(json.dumps(summary, indent=1) if args.json else format_summary(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
