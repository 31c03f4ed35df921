"""The live job page's server (scheduler/dashboard.py) and bpslaunch's readers of it
(launcher/status.py: ``bpslaunch status``, ``--dashboard``, the --status view's straggler line),
over real HTTP on loopback with a known state."""
from __future__ import annotations

import io
import json
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest

from byteps_like.errors import ConfigError
from byteps_like.launcher import cli
from byteps_like.launcher import status as st
from byteps_like.launcher.plan import ChildSpec
from byteps_like.scheduler.dashboard import CSP, Dashboard, is_loopback

STATE = {
    "job": {"phase": "running", "uptime_s": 12.0, "workers": 2, "servers": 1,
            "expected_workers": 2, "expected_servers": 1, "steps_per_s": 4.5, "step": 40,
            "samples_per_s": 288.0, "total_steps": 100, "progress_step": 41, "eta_s": 13.1},
    "workers": [
        {"rank": 0, "host": "alpha", "pid": 1, "state": "up", "step": 41, "steps_per_s": 4.5,
         "bytes_per_s": 1e6, "held_fraction": 0.0, "waited_fraction": 0.8, "held_s": 0.0,
         "report_age_s": 0.1, "straggler": False, "step_time_s": 0.222, "compute_s": 0.02,
         "wait_s": 0.19, "exchange_s": 0.012},
        {"rank": 1, "host": "beta", "pid": 2, "state": "up", "step": 40, "steps_per_s": 4.5,
         "bytes_per_s": 1e6, "held_fraction": 0.85, "waited_fraction": 0.0, "held_s": 9.0,
         "report_age_s": 0.1, "straggler": True, "step_time_s": 0.222, "compute_s": 0.21,
         "wait_s": 0.0, "exchange_s": 0.012}],
    "servers": [{"rank": 0, "host": "gamma", "pid": 3, "state": "up", "bytes_per_s": 2e7,
                 "cpu_cores": 0.25, "rounds_per_s": 9.0, "keys": 7, "store_bytes": 1000,
                 "report_age_s": 0.5}],
    "straggler": {"machine": 1, "ranks": [1], "rank": 1, "host": "beta", "fraction": 0.85},
    "events": [{"seq": 1, "time": 1.7e9, "kind": "formed", "text": "the job formed"}],
    "timeline": [], "settings": {"straggler_fraction": 0.1, "window_s": 5.0,
                                 "report_interval_s": 1.0}}


@pytest.fixture
def page():
    d = Dashboard(lambda: STATE, "127.0.0.1", 0)
    yield d
    d.close()


def get(url: str, headers: dict | None = None) -> tuple[int, dict, bytes]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def test_serves_the_page_its_assets_and_the_json_with_a_strict_policy(page):
    base = f"http://127.0.0.1:{page.port}"
    code, headers, body = get(base + "/")
    assert code == 200 and headers["Content-Type"].startswith("text/html")
    assert headers["Content-Security-Policy"] == CSP and "default-src 'none'" in CSP
    assert b'src="page.js"' in body and b"http" not in body.replace(b"http-equiv", b"")\
        .split(b"<footer")[0]  # nothing loaded from elsewhere
    for asset, kind in (("/page.js", "text/javascript"), ("/page.css", "text/css")):
        code, headers, body = get(base + asset)
        assert code == 200 and headers["Content-Type"].startswith(kind) and body
        assert b"//cdn" not in body and b"https://" not in body
    code, headers, body = get(base + "/api/state")
    assert code == 200 and headers["Cache-Control"] == "no-store"
    assert json.loads(body) == STATE
    code, _, body = get(base + "/nope")
    assert code == 404 and b"/api/state" in body


def test_a_foreign_host_header_is_refused_on_loopback(page):
    code, _, body = get(f"http://127.0.0.1:{page.port}/api/state",
                        {"Host": f"evil.example:{page.port}"})
    assert code == 403 and b"evil.example" in body
    code, _, _ = get(f"http://127.0.0.1:{page.port}/api/state",
                     {"Host": f"localhost:{page.port}"})
    assert code == 200


def test_exposed_it_needs_the_secret_and_takes_it_as_token():
    with pytest.raises(ConfigError, match="BYTEPS_AUTH_SECRET"):
        Dashboard(lambda: STATE, "0.0.0.0", 0)
    d = Dashboard(lambda: STATE, "0.0.0.0", 0, token="s3cret")
    try:
        base = f"http://127.0.0.1:{d.port}"
        assert get(base + "/api/state")[0] == 401
        assert get(base + "/")[0] == 401
        assert get(base + "/api/state?token=wrong")[0] == 401
        assert get(base + "/api/state?token=s3cret")[0] == 200
        assert get(base + "/", {"Authorization": "Bearer s3cret"})[0] == 200
        assert get(base + "/page.js")[0] == 200   # no data in it
    finally:
        d.close()


def test_a_failing_state_is_a_500_and_the_server_goes_on():
    calls = []

    def state():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return STATE
    d = Dashboard(state, "127.0.0.1", 0)
    try:
        code, _, body = get(f"http://127.0.0.1:{d.port}/api/state")
        assert code == 500 and b"boom" in body
        assert get(f"http://127.0.0.1:{d.port}/api/state")[0] == 200
    finally:
        d.close()


def test_a_taken_port_is_a_config_error_naming_the_setting(page):
    with pytest.raises(ConfigError, match="BYTEPS_DASHBOARD_PORT"):
        Dashboard(lambda: STATE, "127.0.0.1", page.port)


def test_loopback_addresses():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("") and not is_loopback("10.0.0.1")
    assert not is_loopback("example.com")


# ---- bpslaunch ------------------------------------------------------------------------------
def test_bpslaunch_status_prints_the_straggler_by_rank_and_host(page, capsys):
    assert cli.main(["status", f"127.0.0.1:{page.port}"], environ={}) == 0
    out = capsys.readouterr().out
    assert "STRAGGLER: worker rank 1 on beta: the others wait for it 85%" in out
    assert "4.50 steps/s" in out and "288.0 samples/s" in out and "ETA 13 s" in out
    row = next(line for line in out.splitlines() if line.strip().startswith("1 "))
    assert "beta" in row and "<- straggler" in row and "210" in row   # compute ms
    assert "formed: the job formed" in out
    assert cli.main(["status", f"http://127.0.0.1:{page.port}/", "--json"], environ={}) == 0
    assert json.loads(capsys.readouterr().out) == STATE


def test_bpslaunch_status_of_nothing_says_what_to_check(capsys):
    from tests.support import free_port
    port = free_port()
    assert cli.main(["status", f"127.0.0.1:{port}"], environ={}) == 1
    err = capsys.readouterr().err
    assert f"127.0.0.1:{port}" in err and "BYTEPS_DASHBOARD_PORT" in err


def test_bpslaunch_status_sends_the_jobs_secret_as_token(capsys):
    d = Dashboard(lambda: STATE, "0.0.0.0", 0, token="tok")
    try:
        assert cli.main(["status", f"127.0.0.1:{d.port}"], environ={}) == 1
        capsys.readouterr()
        assert cli.main(["status", f"127.0.0.1:{d.port}"],
                        environ={"BYTEPS_AUTH_SECRET": "tok"}) == 0
        assert "STRAGGLER" in capsys.readouterr().out
    finally:
        d.close()


def test_dashboard_option_gives_the_scheduler_its_port():
    launch = SimpleNamespace(specs=(ChildSpec("scheduler", None, ("x",), {"A": "1"}),
                                    ChildSpec("worker", 0, ("y",), {})))
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class L:
        specs: tuple
    new, url = st.with_dashboard(L(launch.specs), 8123, "127.0.0.1")
    sched, worker = new.specs
    assert sched.env == {"A": "1", "BYTEPS_DASHBOARD_PORT": "8123",
                         "BYTEPS_DASHBOARD_HOST": "127.0.0.1"}
    assert "BYTEPS_DASHBOARD_PORT" not in worker.env and url == "http://127.0.0.1:8123/"
    new, url = st.with_dashboard(L(launch.specs), 0, "127.0.0.1")
    assert int(new.specs[0].env["BYTEPS_DASHBOARD_PORT"]) > 0
    with pytest.raises(ValueError, match="starts no scheduler"):
        st.with_dashboard(L(launch.specs[1:]), 0, "127.0.0.1")
    args, _ = cli.parse_args(["--local", "--dashboard=8124", "python", "x.py"])
    assert args.dashboard == 8124
    args, command = cli.parse_args(["--local", "--dashboard", "python", "x.py"])
    assert args.dashboard == 0 and command == ["python", "x.py"]


def test_status_view_names_the_straggler_from_the_schedulers_metrics():
    specs = [ChildSpec("scheduler", None, ("s",)), ChildSpec("worker", 0, ("w",)),
             ChildSpec("worker", 1, ("w",))]
    view = st.StatusView(specs, {}, "127.0.0.1", out=io.StringIO(), tty=False)
    assert view.straggler() is None
    sched = view.rows[0]
    sched.metrics = {"byteps_scheduler_straggler_rank": -1.0}
    assert view.straggler() is None
    sched.metrics = {"byteps_scheduler_straggler_rank": 1.0,
                     "byteps_scheduler_worker_held_fraction{worker=1}": 0.42}
    assert view.straggler() == ("straggler: worker rank 1 on 127.0.0.1 (the others wait for it "
                                "42% of the time)")
    assert view.plain_line().endswith("| straggler: worker rank 1 on 127.0.0.1 (the others "
                                      "wait for it 42% of the time)")
    assert view.render(120, 20)[1].startswith("Straggler: worker rank 1")
