"""Tracer, trace merge/summary, metrics endpoint and status view, without a cluster."""
from __future__ import annotations

import json
import sys
import urllib.request
from types import SimpleNamespace

import pytest

from byteps_like import trace
from byteps_like.config import IGNORED_NAMES, load
from byteps_like.launcher.status import StatusView, parse_metrics
from byteps_like.worker.telemetry import StageStats


def _task(key=1, part=0, nbytes=100, priority=0, rnd=0, name="t", enqueued_at=0.0):
    return SimpleNamespace(handle=SimpleNamespace(name=name), key=key, part=part, nbytes=nbytes,
                           priority=priority, round=rnd, enqueued_at=enqueued_at)


def test_trace_settings_are_real_settings():
    for name in ("BYTEPS_TRACE_ON", "BYTEPS_TRACE_START_STEP", "BYTEPS_TRACE_END_STEP",
                 "BYTEPS_TRACE_DIR"):
        assert name not in IGNORED_NAMES
    cfg = load(env={"BYTEPS_TRACE_ON": "1", "BYTEPS_TRACE_START_STEP": "3",
                    "BYTEPS_TRACE_DIR": "/x", "BYTEPS_METRICS_PORT": "9100"})
    assert (cfg.trace.on, cfg.trace.start_step, cfg.trace.end_step, cfg.trace.dir) == \
        (True, 3, 20, "/x")
    assert cfg.metrics.port == 9100


def test_tracer_records_only_the_traced_steps_and_writes_once(tmp_path):
    step = [0]
    tr = trace.Tracer(3, str(tmp_path), 1, 2, lambda: step[0])
    for s in range(5):
        step[0] = s
        t = _task(rnd=s, enqueued_at=10.0 + s)
        tr(t, "push", "start", 10.5 + s)
        tr(t, "push", "end", 10.75 + s)
    assert (tmp_path / "3" / "comm.json").exists()  # written once step 3 began
    assert tr.flush() is None
    doc = json.loads((tmp_path / "3" / "comm.json").read_text())
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert [e["args"]["round"] for e in xs] == [1, 2]
    e = xs[0]
    assert e["name"] == "t" and e["pid"] == 3 and e["dur"] == pytest.approx(250000, rel=1e-6)
    assert e["args"]["queue_wait_us"] == pytest.approx(500000, rel=1e-6)
    assert e["args"]["bytes"] == 100


def test_merge_and_summary(tmp_path, capsys):
    for rank in (0, 1):
        tr = trace.Tracer(rank, str(tmp_path), 0, 10, lambda: 0)
        for part, name in enumerate(("small", "big")):
            t = _task(key=part, part=0, nbytes=10 ** (part + 2), name=name)
            tr(t, "push", "start", 1.0)
            tr(t, "push", "end", 1.0 + 0.001 * (part + 1))
            tr(t, "pull", "start", 2.0)
            tr(t, "pull", "end", 2.0 + 0.01 * (part + 1))
        tr.flush()
    out = tmp_path / "m.json"
    assert trace.main(["merge", str(tmp_path), "-o", str(out)]) == 0
    doc = trace.load(str(out))
    assert {e["pid"] for e in doc["traceEvents"]} == {0, 1}
    s = trace.summarize(doc)
    assert s["stages"]["push"]["count"] == 4 and s["stages"]["pull"]["count"] == 4
    assert s["tensors"][0]["name"] == "big"
    capsys.readouterr()
    assert trace.main(["summary", str(out)]) == 0
    text = capsys.readouterr().out
    assert "pull" in text and "big" in text
    assert trace.main(["summary", str(tmp_path / "missing.json")]) == 1


def test_an_empty_trace_says_why_and_fails(tmp_path, capsys):
    """A job that ended before the traced window: summary and plot exit 1 naming the window
    and the steps seen, for one rank's file and for a merged trace."""
    for rank in (0, 1):
        tr = trace.Tracer(rank, str(tmp_path), 10, 20, lambda: 3)
        t = _task(rnd=3)
        tr(t, "push", "start", 1.0)     # step 3 < 10: not traced
        tr(t, "push", "end", 1.5)
        tr.flush()
    one = tmp_path / "0" / "comm.json"
    capsys.readouterr()
    assert trace.main(["summary", str(one)]) == 1
    err = capsys.readouterr().err
    assert "no stage events" in err and "steps 10..20 traced, last step seen 3" in err, err
    assert "BYTEPS_TRACE_START_STEP" in err
    assert trace.main(["plot", str(one), "-o", str(tmp_path / "p.png")]) == 1
    assert "nothing to draw" in capsys.readouterr().err
    assert not (tmp_path / "p.png").exists()
    merged = tmp_path / "m.json"
    assert trace.main(["merge", str(tmp_path), "-o", str(merged)]) == 0
    capsys.readouterr()
    assert trace.main(["summary", str(merged)]) == 1
    err = capsys.readouterr().err
    assert "rank 0: steps 10..20" in err and "rank 1: steps 10..20" in err, err


def test_the_step_without_a_plugin_is_the_round_of_the_tensor_push_pulled_most():
    """BytePS counts steps per tensor: a tensor push_pulled once (a broadcast, the model check,
    declared first in every plugin script) must not hold the step at 0 (issue 18)."""
    from byteps_like.worker.runtime import Runtime, TensorState
    from byteps_like.worker.telemetry import Telemetry
    rt = Runtime()
    tel = Telemetry(rt)
    assert tel.step() == -1                     # nothing declared
    rounds = {"Signature.model.2": 1, "Parameter.w": 1, "Gradient.w": 0, "Gradient.b": 0}
    for i, (name, rnd) in enumerate(rounds.items()):
        rt._tensors[name] = TensorState(i, name, round=rnd)
    assert tel.step() == 0                      # the one-shot push_pulls ran: step 0
    rt._tensors["Gradient.b"].round = 6         # step 5 of the gradients done,
    rt._tensors["Gradient.w"].round = 7         # step 6 started (its first gradient)
    assert tel.step() == 6                      # not 0: the first-declared tensor is done


def test_plugin_noted_steps_are_the_step():
    """A plugin counts the optimizer's steps (Runtime.note_step, one per gradient averaging);
    several gradient groups (a GAN's two optimizers) step together: the most of any group."""
    from byteps_like.worker.runtime import Runtime, TensorState
    from byteps_like.worker.telemetry import Telemetry
    rt = Runtime()
    tel = Telemetry(rt)
    rt._tensors["Gradient.w"] = TensorState(0, "Gradient.w", round=40)
    for _ in range(3):
        rt.note_step("Gradient.w")
    assert tel.step() == 3                      # the noted steps win over the per-tensor count
    for _ in range(5):
        rt.note_step("Gradient.d")
    assert tel.step() == 5 and rt.steps == {"Gradient.w": 3, "Gradient.d": 5}


def test_stage_stats():
    st = StageStats()
    t = _task()
    st(t, "push", "start", 1.0)
    st(t, "push", "end", 1.5)
    assert st.take() == {"push": (1, 0.5)}
    assert st.take() == {}


def test_metrics_endpoint_changes_as_counters_move():
    pytest.importorskip("prometheus_client")
    from byteps_like.metrics import RoleMetrics
    state = {"byteps_server_bytes_summed": 0, "byteps_server_rounds": 0}
    m = RoleMetrics("server", 0, "127.0.0.1", 0, lambda: dict(state))
    try:
        def get():
            url = f"http://127.0.0.1:{m.port}/metrics"
            return parse_metrics(urllib.request.urlopen(url, timeout=5).read().decode())
        first = get()
        state["byteps_server_bytes_summed"] = 4096
        state["byteps_server_rounds"] = 3
        second = get()
    finally:
        m.close()
    assert first["byteps_server_bytes_summed_total"] == 0
    assert second["byteps_server_bytes_summed_total"] == 4096
    assert second["byteps_server_rounds_total"] == 3 and second["byteps_up"] == 1


def test_metrics_and_the_status_view_show_the_noted_step():
    """The byteps_step gauge (and so the --status STEP column, which reads it) is the trace's
    step: the optimizer steps a plugin noted, not the first tensor's rounds."""
    pytest.importorskip("prometheus_client")
    from byteps_like.metrics import WorkerMetrics
    from byteps_like.worker.runtime import Runtime, TensorState
    from byteps_like.worker.telemetry import Telemetry
    rt = Runtime()
    rt.pipeline = SimpleNamespace(queues={})
    rt._tensors["Signature.model.2"] = TensorState(0, "Signature.model.2", round=1)
    rt._tensors["Gradient.w"] = TensorState(1, "Gradient.w", round=12)
    for _ in range(12):
        rt.note_step("Gradient.w")
    tel = Telemetry(rt)
    m = WorkerMetrics(rt, tel, "127.0.0.1", 0)
    try:
        url = f"http://127.0.0.1:{m.port}/metrics"
        scraped = parse_metrics(urllib.request.urlopen(url, timeout=5).read().decode())
    finally:
        m.close()
    assert scraped["byteps_step"] == tel.step() == 12
    view = StatusView([SimpleNamespace(name="worker 0", role="worker", rank=0)], {},
                      "127.0.0.1", tty=True)
    view.rows[0].state = "up"
    view.rows[0].metrics = scraped
    lines = view.render(100, 20)
    assert "| step 12 |" in lines[0], lines
    row = next(ln for ln in lines if ln.startswith("worker 0"))
    assert row.split()[5] == "12", row       # worker 0, ROLE, RANK, STATE, STEP
    assert "step 12 " in tel.summary_line(1.0, 0)


def test_metrics_without_prometheus_client_is_a_clear_error(monkeypatch):
    import builtins

    from byteps_like import metrics
    from byteps_like.errors import ConfigError
    real = builtins.__import__

    def fake(name, *a, **k):
        if name.startswith("prometheus_client"):
            raise ImportError(name)
        return real(name, *a, **k)
    monkeypatch.setattr(builtins, "__import__", fake)
    with pytest.raises(ConfigError, match=r"byteps_like\[metrics\]"):
        metrics.RoleMetrics("worker", 0, "127.0.0.1", 0, dict)


def test_status_view_renders_rows():
    specs = [SimpleNamespace(name="scheduler", role="scheduler", rank=None),
             SimpleNamespace(name="server 0", role="server", rank=0),
             SimpleNamespace(name="worker 0", role="worker", rank=0)]
    view = StatusView(specs, {}, "127.0.0.1", tty=True)
    view.rows[2].state = "up"
    view.rows[2].metrics = {"byteps_step": 7, "byteps_rounds_total": 14,
                            "byteps_bytes_pushed_total": 2e6, "byteps_bytes_pulled_total": 2e6,
                            "byteps_queue_depth{stage=push}": 2}
    view.lines.append("[worker 0] hello")
    lines = view.render(100, 20)
    text = "\n".join(lines)
    assert "1 workers, 1 server" in text and "step 7" in text
    assert any(ln.startswith("worker 0") and " 14 " in ln for ln in lines)
    assert "[worker 0] hello" in text and len(lines) <= 20
    assert view.plain_line().startswith("bpslaunch: status scheduler starting")


def test_parse_metrics():
    text = ('# HELP x y\nbyteps_queue_depth{rank="0",role="worker",stage="push"} 3.0\n'
            'byteps_up{rank="0",role="worker"} 1.0\n')
    assert parse_metrics(text) == {"byteps_queue_depth{stage=push}": 3.0, "byteps_up": 1.0}


def test_plot_draws_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    tr = trace.Tracer(0, str(tmp_path), 0, 10, lambda: 0)
    t = _task()
    tr(t, "push", "start", 1.0)
    tr(t, "push", "end", 1.001)
    tr.flush()
    out = tmp_path / "t.png"
    assert trace.main(["plot", str(tmp_path / "0" / "comm.json"), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_names_the_extra_and_exits_2(tmp_path, monkeypatch, capsys):
    tr = trace.Tracer(0, str(tmp_path), 0, 10, lambda: 0)
    t = _task()
    tr(t, "push", "start", 1.0)
    tr(t, "push", "end", 1.001)
    tr.flush()
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    capsys.readouterr()
    assert trace.main(["plot", str(tmp_path / "0" / "comm.json"), "-o",
                       str(tmp_path / "t.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "byteps_like[bench]" in err and "matplotlib" in err, err
    assert not (tmp_path / "t.png").exists()


def test_summary_shows_whole_tensor_names(tmp_path, capsys):
    """Keras layer names run past 40 characters; the table shows them whole."""
    long = "DistributedOptimizer/sequential/transformer_block_11/multi_head_attention/kernel:0"
    tr = trace.Tracer(0, str(tmp_path), 0, 10, lambda: 0)
    for key, name in enumerate((long, "short")):
        t = _task(key=key, name=name)
        tr(t, "push", "start", 1.0)
        tr(t, "push", "end", 1.002 - 0.001 * key)
    tr.flush()
    capsys.readouterr()
    assert trace.main(["summary", str(tmp_path / "0" / "comm.json")]) == 0
    rows = capsys.readouterr().out.splitlines()
    row = next(r for r in rows if r.startswith(long))
    assert row.split()[:2] == [long, "1"], row
    header = next(r for r in rows if r.startswith("tensor"))
    assert header.index("rounds") + len("rounds") == row.index(" 1 ") + 2  # columns line up
