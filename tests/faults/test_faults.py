"""The fault-injection suite: SIGKILL, SIGSTOP (a hung process) and an unhandled in-process
exception, for each role (scheduler, a server, a worker, a local rank), at rendezvous, mid-push,
mid-pull and during shutdown (a representative matrix, see docs/reliability.md for what is
left out). For each: every survivor raises the right typed error naming the lost node within
its timeout, bpslaunch exits non-zero naming the first failure, and no process or shared
memory segment is left behind. In asynchronous mode the loss of a worker does not stop the
others."""
from __future__ import annotations

import glob
import json
import re
import sys
from pathlib import Path

import pytest

from tests.integration.harness import bpslaunch, pids_in, wait_gone

pytestmark = pytest.mark.integration
HERE = Path(__file__).parent / "workers"
INJECT = str(HERE / "inject.py")


def _role_cmd(role: str, point: str) -> list[str]:
    return ["--_role-cmd", f"{role}=" + json.dumps([sys.executable, str(HERE / "role_fault.py"),
                                                     role, point])]


# the victim and the scheduler (which fails the job on the victim's abort notice) exit at once:
# either is named first, the scheduler's line quoting the victim's exception
EXC_FIRST = (r"worker 1 \(pid \d+\) failed first: exit status 1|failed first: exit status 1; "
             r"last stderr: .*worker rank 1 .*unhandled RuntimeError: injected fault")
# a rendezvous that cannot complete: bpslaunch tells the scheduler the victim exited, which
# fails the registered survivors at once naming it; a survivor that registers later meets its
# own registration timeout (or the scheduler's, when the victim hung)
REG_TYPE = "PeerLostError|ConfigError|CommTimeoutError"
REG_TEXT = "exited before it registered|registration timed out|no node table from the scheduler"
# target, action, point, survivor error type, text naming the lost node, who bpslaunch names
# as the first failure (None: a hung process never exits, so the first to exit is a survivor)
CASES = [
    ("worker", "kill", "push", "PeerLostError", "worker rank 1", r"worker 1 \(pid \d+\) failed "
     r"first: killed by SIGKILL"),
    ("worker", "kill", "rendezvous", REG_TYPE, REG_TEXT,
     r"worker 1 \(pid \d+\) failed first: killed by SIGKILL"),
    ("worker", "stop", "pull", "PeerLostError", "worker rank 1", None),
    ("worker", "exception", "push", "PeerLostError", "worker rank 1", EXC_FIRST),
    ("worker", "exception", "rendezvous", REG_TYPE, REG_TEXT,
     r"worker 1 \(pid \d+\) failed first: exit status 1"),
    ("worker", "kill", "shutdown", None, None, r"worker 1 \(pid \d+\) failed first"),
    ("server", "kill", "pull", "PeerLostError", "server rank 0",
     r"server 0 \(pid \d+\) failed first: killed by SIGKILL"),
    ("server", "stop", "push", "PeerLostError", "server rank 0", None),
    ("server", "exception", "push", "PeerLostError", "server rank 0",
     r"server 0 \(pid \d+\) failed first: exit status 1"),
    ("server", "kill", "shutdown", None, None, r"failed first"),
    ("server", "exception", "rendezvous", REG_TYPE, REG_TEXT,
     r"server 0 \(pid \d+\) failed first: exit status 1; last stderr: .*injected fault"),
    ("scheduler", "kill", "push", "PeerLostError", "lost the scheduler",
     r"scheduler \(pid \d+\) failed first: killed by SIGKILL"),
    ("scheduler", "stop", "pull", "PeerLostError", "lost the scheduler", None),
    # a scheduler that failed on its own: bpslaunch stops the others 2 s later (issue 40),
    # not after their registration timeout
    ("scheduler", "exception", "rendezvous", None, None,
     r"scheduler \(pid \d+\) failed first: exit status 1; last stderr: .*injected fault"),
    ("scheduler", "exception", "push", "PeerLostError", "lost the scheduler",
     r"scheduler \(pid \d+\) failed first: exit status 1"),
    ("local", "kill", "pull", "PeerLostError", "worker rank 1",
     r"worker 1 \(pid \d+\) failed first: killed by SIGKILL"),
    ("local", "stop", "push", "PeerLostError", "worker rank 1", None),
    ("local", "exception", "push", "PeerLostError", "worker rank 1", EXC_FIRST),
]


@pytest.mark.parametrize("target,action,point,etype,etext,first", CASES,
                         ids=[f"{t}-{a}-{p}" for t, a, p, *_ in CASES])
def test_fault(target, action, point, etype, etext, first):
    shm_before = set(glob.glob("/dev/shm/bpsl-*"))
    local = target == "local"
    workers, local_size = (1, 2) if local else (2, 1)
    extra = _role_cmd(target, point) if action == "exception" and target in ("server",
                                                                          "scheduler") else []
    env = {"BYTEPS_REGISTER_TIMEOUT_SECONDS": "4"} if point == "rendezvous" else {}
    if action == "stop":  # the hung process never exits: SIGTERM/SIGKILL it soon after
        extra = [*extra, "--grace", "2"]
    if target == "scheduler":  # fail-fast here; a restarted scheduler: test_lose_server.py
        extra = [*extra, "--scheduler-restarts", "0"]
    run = bpslaunch([INJECT, target, action, point], workers=workers, servers=1,
                    local_size=local_size, env=env, extra=extra, timeout=90)
    assert run.rc != 0, run.log
    survivors = run.lines("SURVIVOR")
    if etype is not None:
        # every worker but the victim raises the typed error naming the lost node
        n_survivors = 2 if target in ("server", "scheduler") else 1
        assert len(survivors) == n_survivors, run.log
        for ln in survivors:
            assert re.search(f" ({etype}): ", ln) and re.search(etext, ln), ln
    assert "NO FAILURE" not in run.out
    assert "failed first" in run.err, run.log
    if first is not None:
        assert re.search(first, run.err), run.log
    assert run.elapsed < 60, run.log
    pids = pids_in(run.out)
    if point != "rendezvous":
        assert len(pids) == (2 + workers * local_size), run.log
    assert not wait_gone(pids), f"processes left behind\n{run.log}"
    assert set(glob.glob("/dev/shm/bpsl-*")) <= shm_before, "shared memory left behind"


@pytest.mark.parametrize("staleness", ["0", "2"])
def test_async_mode_survives_the_loss_of_a_worker(staleness):
    """With a staleness bound (BYTEPS_ASYNC_STALENESS=2) too: the survivors, held back 2 rounds
    ahead of the lost worker, go on once the scheduler takes it out of the bound."""
    run = bpslaunch([INJECT, "worker", "kill", "push"], workers=3, servers=1,
                    env={"BYTEPS_ENABLE_ASYNC": "1", "BYTEPS_ASYNC_STALENESS": staleness},
                    extra=["--grace", "30"], timeout=90)
    survived = run.lines("ASYNC SURVIVED")
    assert len(survived) == 2, run.log
    assert len(run.lines("FINISHED")) == 2, run.log
    assert not run.lines("SURVIVOR"), run.log
    # the loss is still loud: bpslaunch names it and exits non-zero
    assert run.rc != 0, run.log
    assert re.search(r"worker 2 \(pid \d+\) failed first: killed by SIGKILL", run.err), run.log
    assert "asynchronous mode: the other workers continue" in run.err, run.log
    assert not wait_gone(pids_in(run.out)), f"processes left behind\n{run.log}"


@pytest.mark.parametrize("local_size,plane", [(1, "auto"), (2, "auto"), (1, "native"),
                                              (2, "native")])
def test_an_authenticated_job_runs_with_a_one_time_secret(local_size, plane):
    # auto and native: authenticated native streams (the control plane on CURVE)
    run = bpslaunch([INJECT, "none", "kill", "push"], workers=2, servers=1, extra=["--auth"],
                    local_size=local_size, env={"BYTEPS_DATA_PLANE": plane,
                                                "BYTEPS_LOG_LEVEL": "INFO"})
    assert run.rc == 0, run.log
    assert "authenticated streams" in run.err, run.log
    assert len(run.lines("FINISHED")) == 2 * local_size, run.log
    assert len(run.lines("AUTH on")) == 2 * local_size, run.log
