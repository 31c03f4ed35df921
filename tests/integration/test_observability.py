"""Observability on real local clusters (docs/observability.md): timeline traces of a known run,
Prometheus metrics scraped over HTTP while traffic flows, and the bpslaunch --status view in a
terminal (tmux) and in plain mode."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

import pytest

from .harness import bpslaunch, worker

pytestmark = pytest.mark.integration

# grad.a: 4000 bytes, one partition; grad.b: 1.2 MB in 256 KiB partitions = 5 partitions
PARTS_PER_STEP = 1 + 5
STAGES = ("push", "pull")


def test_trace_files_of_a_known_run(tmp_path):
    trace_dir = tmp_path / "trace"
    run = bpslaunch(worker("observe.py", 8), workers=2, servers=1,
                    env={"BYTEPS_TRACE_ON": "1", "BYTEPS_TRACE_START_STEP": "2",
                         "BYTEPS_TRACE_END_STEP": "4", "BYTEPS_TRACE_DIR": str(trace_dir),
                         "BYTEPS_PARTITION_BYTES": "256K"})
    assert run.rc == 0, run.log
    for rank in (0, 1):
        doc = json.loads((trace_dir / str(rank) / "comm.json").read_text())
        events = [e for e in doc["traceEvents"] if e["ph"] == "X"]
        meta = [e for e in doc["traceEvents"] if e["ph"] == "M"]
        assert any(e["name"] == "process_name" and e["args"]["name"] == f"worker rank {rank}"
                   for e in meta)
        # steps 2, 3, 4 of the first tensor: every partition of both tensors, push and pull
        assert len(events) == 3 * PARTS_PER_STEP * len(STAGES), run.log
        for e in events:
            assert {"name", "ts", "dur", "pid", "tid", "args"} <= set(e)
            assert e["pid"] == rank and e["dur"] >= 0
            a = e["args"]
            assert a["stage"] in STAGES and 2 <= a["round"] <= 4
            assert {"key", "bytes", "priority", "queue_wait_us"} <= set(a)
        names = {e["name"] for e in events}
        assert names == {"grad.a", "grad.b"}
        assert {e["args"]["priority"] for e in events if e["name"] == "grad.a"} == {1}
        assert sum(e["args"]["bytes"] for e in events
                   if e["name"] == "grad.b" and e["args"]["stage"] == "push") == 3 * 1_200_000
    merged = tmp_path / "merged.json"
    out = subprocess.run([sys.executable, "-m", "byteps_like.trace", "merge", str(trace_dir),
                          "-o", str(merged)], capture_output=True, text=True, check=True)
    assert "merged 2 files" in out.stdout
    doc = json.loads(merged.read_text())
    assert {e["pid"] for e in doc["traceEvents"]} == {0, 1}
    summary = subprocess.run([sys.executable, "-m", "byteps_like.trace", "summary", str(merged)],
                             capture_output=True, text=True, check=True).stdout
    assert "push" in summary and "pull" in summary and "grad.b" in summary


def test_metrics_scraped_over_http_change_with_traffic():
    run = bpslaunch(worker("observe.py", 5), workers=2, servers=1, extra=["--metrics"],
                    env={"OBSERVE_SCRAPE": "1", "BYTEPS_PARTITION_BYTES": "256K"})
    assert run.rc == 0, run.log
    assert len(run.lines("metrics of")) == 0  # launcher lines go to stderr
    assert run.err.count("/metrics") == 4, run.log   # scheduler, server, 2 workers
    metrics = [ln.split("] ", 1)[1].split() for ln in run.lines("METRIC ")]
    assert len(metrics) == 2 * 4, run.log
    for _tag, name, before, after in metrics:
        assert int(after) > int(before), (name, run.log)
        if name == "byteps_rounds_total":
            assert int(after) - int(before) == 2 * 5


def _tmux() -> str:
    path = shutil.which("tmux")
    if path is None:
        pytest.skip("tmux is not installed")
    return path


def test_status_view_renders_in_a_terminal(tmp_path):
    tmux = _tmux()
    session = f"bpsl-status-{time.monotonic_ns()}"
    done = tmp_path / "exit"
    cmd = (f"{sys.executable} -m byteps_like.launcher --local --status --workers 2 --servers 1 "
           f"-- {sys.executable} {worker('observe.py', 40, 0.1)[0]} 40 0.1; "
           f"echo $? > {done}; sleep 60")
    env = {"BYTEPS_PARTITION_BYTES": "256K", "BYTEPS_HEARTBEAT_TIMEOUT_SECONDS": "10"}
    subprocess.run([tmux, "new-session", "-d", "-s", session, "-x", "120", "-y", "32",
                    " ".join(f"{k}={v}" for k, v in env.items()) + " " + cmd], check=True)
    try:
        screens = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not done.exists():
            time.sleep(1.0)
            screens.append(subprocess.run([tmux, "capture-pane", "-p", "-t", session],
                                          capture_output=True, text=True).stdout)
        assert done.exists() and done.read_text().strip() == "0", screens[-1:]
        final = subprocess.run([tmux, "capture-pane", "-p", "-t", session],
                               capture_output=True, text=True).stdout
    finally:
        subprocess.run([tmux, "kill-session", "-t", session], capture_output=True)
    live = [s for s in screens if "worker 1" in s and " up " in s]
    assert live, screens
    screen = live[-1]
    assert "byteps_like local cluster: 2 workers, 1 server" in screen
    for row in ("scheduler", "server 0", "worker 0", "worker 1", "ROUNDS", "MB/s"):
        assert row in screen
    assert "Traceback" not in final and "exited" in final, final


def test_status_plain_mode_without_a_tty():
    run = bpslaunch(worker("observe.py", 40, 0.15), workers=1, servers=1, extra=["--status"],
                    env={"BYTEPS_PARTITION_BYTES": "256K"})
    assert run.rc == 0, run.log
    status = [ln for ln in run.err.splitlines() if ln.startswith("bpslaunch: status ")]
    assert status, run.log
    assert "\x1b[" not in run.err
    assert any("worker 0 up" in ln for ln in status), run.log
