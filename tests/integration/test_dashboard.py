"""The straggler report and the live job page on real local clusters (issues 38 and 40,
docs/observability.md), the page driven in a real headless browser (Debian's chromium, which
scripts/setup.sh installs): a worker sleeping 0.2 s a step is named by rank and host in the
scheduler's log, in ``bpslaunch status`` and on the page within 10 s of the job forming; the
page's numbers move as the job runs; the page holds when a worker is lost (an elastic job
going on without it, then with its replacement); and the page asks for nothing but its own
origin (the browser's net log says so)."""
from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.support import FAST_ENV, clean_env, free_port, kill_group

from .harness import WORKERS_DIR

pytestmark = pytest.mark.integration

#: a browser that sends nothing anywhere but the page's own origin: no background services,
#: no name resolves, and a proxy that answers nobody for anything not on loopback
CHROME_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--no-default-browser-check",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-default-apps", "--disable-extensions", "--disable-domain-reliability",
    "--disable-client-side-phishing-detection", "--metrics-recording-only",
    "--disable-features=Translate,OptimizationHints,MediaRouter,AutofillServerCommunication,"
    "SpellCheck,CertificateTransparencyComponentUpdater,NetworkTimeServiceQuerying",
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
    "--proxy-server=http://127.0.0.1:9", "--hide-scrollbars", "--window-size=1280,1100"]


def chromium() -> str:
    path = shutil.which("chromium")
    assert path, ("Debian's chromium is not installed: bash scripts/setup.sh installs it (as "
                  "root: apt-get install -y chromium)")
    return path


class Browser:
    """One headless chromium run per look at the page: its DOM after the page's script ran
    for a few (virtual) seconds, every URL it asked for kept in ``urls``."""

    def __init__(self, tmp: Path):
        self.tmp, self.n, self.urls = tmp, 0, []

    def look(self, url: str, screenshot: Path | None = None) -> str:
        self.n += 1
        netlog = self.tmp / f"net{self.n}.json"
        what = [f"--screenshot={screenshot}"] if screenshot else ["--dump-dom"]
        p = subprocess.run([chromium(), *CHROME_FLAGS, f"--user-data-dir={self.tmp / 'prof'}",
                            f"--log-net-log={netlog}", "--virtual-time-budget=4000", *what,
                            url], capture_output=True, text=True, timeout=90)
        assert p.returncode == 0, p.stderr[-3000:]
        self.urls += page_requests(netlog)
        return p.stdout


def page_requests(netlog: Path) -> list[str]:
    """The URLs the page asked for, from the browser's net log: its main frame and every
    request it initiated (the browser's own background requests, which the flags above send
    to a dead proxy, are not the page's)."""
    doc = json.loads(netlog.read_text(errors="replace"))
    start = doc["constants"]["logEventTypes"]["URL_REQUEST_START_JOB"]
    urls = []
    for e in doc["events"]:
        p = e.get("params") or {}
        if e["type"] == start and "url" in p and (
                p.get("request_type") == "main frame"
                or str(p.get("initiator", "")).startswith(("http://", "https://"))):
            urls.append(p["url"])
    return urls


def workers_of(dom: str) -> dict[int, dict]:
    """The workers table of a page's DOM: rank -> {state, classes, step}."""
    table = dom.split('<table id="workers">', 1)[1].split("</table>", 1)[0]
    rows = {}
    for rank, state, cls, body in re.findall(
            r'<tr data-rank="(\d+)" data-state="(\w+)" class="([^"]*)">(.*?)</tr>', table, re.S):
        step = re.search(r'<td class="step">([^<]*)</td>', body)
        rows[int(rank)] = {"state": state, "classes": cls.split(),
                           "step": int(step.group(1)) if step and step.group(1) != "-" else -1}
    return rows


class Job:
    """``bpslaunch --local --dashboard=PORT`` in the background, its output collected; killed
    (its process group) if the test leaves it running."""

    def __init__(self, args: list[str], tmp: Path, env: dict | None = None):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.out = tmp / "job.log"
        full = clean_env(**FAST_ENV)
        full.update(env or {})
        cmd = [sys.executable, "-m", "byteps_like.launcher", "--local",
               f"--dashboard={self.port}", *args]
        with self.out.open("w") as f:  # its own session: the group is killed whole on a hang
            self.proc = subprocess.Popen(cmd, env=full, stdin=subprocess.DEVNULL, stdout=f,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def log(self) -> str:
        return self.out.read_text(errors="replace")

    def state(self) -> dict | None:
        try:
            with urllib.request.urlopen(self.base + "/api/state", timeout=3) as r:
                return json.loads(r.read())
        except OSError:
            return None

    def wait_for(self, cond, what: str, timeout: float = 60.0) -> dict:
        """Poll the page's JSON until ``cond(state)``; fail naming ``what`` with the log."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = self.state()
            if s is not None and cond(s):
                return s
            assert self.proc.poll() is None or s is not None, \
                f"the job ended before {what}:\n{self.log()[-6000:]}"
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {what}:\n{self.log()[-6000:]}")

    def finish(self, timeout: float = 90.0) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            kill_group(self.proc, signal.SIGKILL)
            raise AssertionError(f"the job hung:\n{self.log()[-6000:]}") from None

    def close(self) -> None:
        if self.proc.poll() is None:
            kill_group(self.proc, signal.SIGKILL)
            self.proc.wait()


def event(state: dict, kind: str) -> dict | None:
    return next((e for e in state["events"] if e["kind"] == kind), None)


@pytest.mark.timeout(240)
def test_a_slow_worker_is_named_within_10_s_and_highlighted_on_the_live_page(tmp_path):
    """3 workers and 2 servers; worker rank 1 sleeps 0.2 s a step, the others 0.02 s."""
    job = Job(["--workers", "3", "--servers", "2", "--", sys.executable,
               str(WORKERS_DIR / "straggler.py"), "170", "1", "0.2"], tmp_path)
    browser = Browser(tmp_path)
    try:
        # the report, within 10 s of the job forming, with the right rank and host
        s = job.wait_for(lambda s: event(s, "straggler") is not None, "the straggler report")
        formed, named = event(s, "formed"), event(s, "straggler")
        assert formed is not None
        assert named["time"] - formed["time"] <= 10.0, s["events"]
        assert named["text"].startswith("worker rank 1 on 127.0.0.1:"), named
        assert s["straggler"]["rank"] == 1 and s["straggler"]["host"] == "127.0.0.1"
        # bpslaunch status, pointed at the page's address
        out = subprocess.run([sys.executable, "-m", "byteps_like.launcher", "status",
                              f"127.0.0.1:{job.port}"], capture_output=True, text=True,
                             timeout=30)
        assert out.returncode == 0, out.stderr
        assert "STRAGGLER: worker rank 1 on 127.0.0.1" in out.stdout, out.stdout
        # the page: the straggler's row highlighted, nobody else's
        dom = browser.look(job.base + "/")
        rows = workers_of(dom)
        assert sorted(rows) == [0, 1, 2], dom[-3000:]
        assert "straggler" in rows[1]["classes"], rows
        assert not any("straggler" in rows[r]["classes"] for r in (0, 2)), rows
        assert 'id="straggler" class="banner" data-rank="1"' in dom
        assert 'class="conn ok"' in dom
        # the numbers move: a later look shows later steps
        first = {r: v["step"] for r, v in rows.items()}
        job.wait_for(lambda s: min(w["step"] or 0 for w in s["workers"])
                     >= max(first.values()) + 5, "five more steps")
        rows2 = workers_of(browser.look(job.base + "/"))
        assert all(rows2[r]["step"] > first[r] for r in rows2), (first, rows2)
        assert job.finish() == 0, job.log()[-6000:]
    finally:
        job.close()
    log = job.log()
    lines = [ln for ln in log.splitlines() if "scheduler: straggler:" in ln]
    assert len(lines) == 1 and "worker rank 1 on 127.0.0.1" in lines[0], log[-6000:]
    # nothing but the page's own origin was asked for
    assert browser.urls and all(u.startswith(job.base + "/") for u in browser.urls), \
        sorted(set(browser.urls))


@pytest.mark.timeout(240)
def test_the_page_holds_when_a_worker_is_lost_and_shows_its_replacement(tmp_path):
    """An elastic job of 3 workers whose rank 2 kills itself at step 20: the page shows the
    loss (an event, the lost worker's row struck through), goes on updating with the two
    survivors, and shows the replacement bpslaunch starts joining."""
    job = Job(["--workers", "3", "--servers", "1", "--elastic", "--max-restarts", "1", "--",
               sys.executable, str(WORKERS_DIR / "elastic_numpy.py"), "200", "kill=20@2",
               "slow=0.05"], tmp_path)
    browser = Browser(tmp_path)
    try:
        s = job.wait_for(lambda s: event(s, "lost") is not None, "the loss", timeout=90)
        lost = event(s, "lost")
        assert "worker" in lost["text"], lost
        s = job.wait_for(lambda s: event(s, "replacement") is not None, "the replacement",
                         timeout=90)
        assert event(s, "replacement")["text"].startswith("worker registered from 127.0.0.1")
        # the survivors and the replacement step on; the lost one stays listed, as lost
        s = job.wait_for(lambda s: sum(1 for w in s["workers"] if w["state"] == "up"
                                       and (w["steps_per_s"] or 0) > 0) == 3,
                         "three workers stepping again", timeout=90)
        dom = browser.look(job.base + "/")
        rows_dom = re.findall(r'<tr data-rank="(\d+)" data-state="(\w+)"', dom)
        states = [st for _r, st in rows_dom]
        assert states.count("lost") == 1 and states.count("up") >= 3, rows_dom
        assert 'data-kind="lost"' in dom and 'data-kind="replacement"' in dom
        assert 'class="conn ok"' in dom
        steps = {w["rank"]: w["step"] for w in s["workers"] if w["state"] == "up"}
        job.wait_for(lambda s: all((w["step"] or 0) > steps.get(w["rank"], 0)
                                   for w in s["workers"] if w["state"] == "up"),
                     "steps after the replacement")
        assert job.finish() == 0, job.log()[-6000:]
    finally:
        job.close()
    assert browser.urls and all(u.startswith(job.base + "/") for u in browser.urls), \
        sorted(set(browser.urls))
