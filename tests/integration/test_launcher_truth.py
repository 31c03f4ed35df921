"""What bpslaunch and the roles tell the user when something goes wrong (issue 18):

* blame: the process whose failure ended the job is named, not the scheduler, servers or
  workers that only exited because of it (exit status ``EXIT_PEER_FAILED``), whatever order
  they exit in;
* waits: a node that cannot reach the scheduler, and a scheduler still missing nodes, say
  what they wait for while they wait, not only at the timeout.

Every run has its own process group, free loopback ports and a watchdog that kills the group
and puts the captured output in the failure message.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from byteps_like.errors import EXIT_PEER_FAILED
from tests.support import free_port, watch

from .harness import bpslaunch

pytestmark = pytest.mark.integration

WATCHDOG_S = 90


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "BYTEPS_"))}
    env.pop("PYTHONWARNINGS", None)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def communicate(proc: subprocess.Popen, what: str, timeout: float = WATCHDOG_S
                ) -> tuple[int, str, str]:
    """Wait for ``proc`` (started with start_new_session); on a hang kill its process group and
    fail with everything it printed (tests/support.py's watchdog)."""
    return watch(proc, timeout, what)


def last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else ""


# -- blame: a real job --------------------------------------------------------------------------

# Worker 1 raises. Before it exits it waits (atexit) until every other process of the job has
# exited because of its abort, so the scheduler, the server and worker 0 always exit first:
# the order in which the first non-zero exit used to be blamed on them.
RAISING_WORKER = textwrap.dedent("""\
    import atexit, os, sys, time
    import numpy as np
    import byteps_like as bps
    from byteps_like.worker.runtime import default_runtime

    def gone(pid):
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            return True
        return stat[stat.rfind(b")") + 2:][:1] in (b"Z", b"X")

    def exit_last():
        deadline = time.monotonic() + 60
        while not all(gone(p) for p in others) and time.monotonic() < deadline:
            time.sleep(0.02)
        print("OTHERS", "GONE" if all(gone(p) for p in others) else "STILL RUNNING",
              flush=True)

    bps.init()
    others = {p.pid for p in default_runtime().control.peers} - {os.getpid()}
    bps.push_pull(np.ones(4, np.float32), name="x")
    if bps.rank() == 1:
        atexit.register(exit_last)
        raise ValueError("boom from worker 1")
    bps.push_pull(np.ones(4, np.float32), name="y", timeout=60)
    bps.shutdown()
    """)


def test_a_raising_worker_is_blamed_even_when_the_others_exit_first(tmp_path):
    script = tmp_path / "raise_on_rank1.py"
    script.write_text(RAISING_WORKER)
    run = bpslaunch([str(script)], workers=2, servers=1, timeout=WATCHDOG_S)
    assert "OTHERS GONE" in run.out, run.log  # the order this test is about did happen
    assert run.rc == 1, run.log
    last = last_line(run.err)
    assert re.match(r"bpslaunch: error: worker 1 \(pid \d+\) failed first: exit status 1; "
                    r"last stderr: .*ValueError: boom from worker 1$", last), run.log
    # the others are reported as what they are: they exited because worker 1 failed
    for name in ("scheduler", "server 0", "worker 0"):
        assert re.search(rf"bpslaunch: {name} \(pid \d+\) exited because another process of "
                         rf"the job failed: exit status {EXIT_PEER_FAILED}\n", run.err), run.log
    # its traceback: in the report (held back while the job ran), not printed as it came
    assert "bpslaunch: | ValueError: boom from worker 1" in run.err, run.log
    assert "[worker 1] ValueError: boom from worker 1" not in run.err, run.log


# -- blame: the launcher's policy, with stand-ins for the roles ---------------------------------

# argv: PIDDIR PLAN_JSON. PLAN maps a name ("scheduler", "server", "worker-<rank>") to actions,
# run in order: "stderr:TEXT", "exit:N", "sleep", "awaitgone:NAME" (until NAME's pid file exists
# and that process has exited).
STANDIN = textwrap.dedent("""\
    import json, os, sys, time
    piddir, plan = sys.argv[1], json.loads(sys.argv[2])
    role = os.environ["DMLC_ROLE"]
    name = f"worker-{os.environ['DMLC_WORKER_ID']}" if role == "worker" else role
    with open(os.path.join(piddir, f".{name}"), "w") as f:
        f.write(str(os.getpid()))
    os.rename(os.path.join(piddir, f".{name}"), os.path.join(piddir, name))

    def gone(other):
        try:
            pid = int(open(os.path.join(piddir, other)).read())
            stat = open(f"/proc/{pid}/stat", "rb").read()
        except FileNotFoundError:
            return os.path.exists(os.path.join(piddir, other))  # no pid file yet: not gone
        except OSError:
            return True
        return stat[stat.rfind(b")") + 2:][:1] in (b"Z", b"X")

    def reaped(other):
        try:
            pid = int(open(os.path.join(piddir, other)).read())
        except FileNotFoundError:
            return False
        return not os.path.exists(f"/proc/{pid}")

    for action in plan[name]:
        verb, _, arg = action.partition(":")
        if verb == "stderr":
            print(arg, file=sys.stderr, flush=True)
        elif verb == "exit":
            sys.exit(int(arg))
        elif verb == "sleep":
            time.sleep(300)
        elif verb in ("awaitgone", "awaitreaped"):   # reaped: bpslaunch has seen the exit
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not (
                    gone(arg) if verb == "awaitgone" else reaped(arg)):
                time.sleep(0.02)
    """)


def run_standins(tmp_path: Path, plan: dict, *options: str) -> tuple[int, str, str, dict]:
    piddir = tmp_path / "pids"
    piddir.mkdir()
    script = tmp_path / "standin.py"
    script.write_text(STANDIN)
    cmd = [sys.executable, str(script), str(piddir), json.dumps(plan)]
    argv = [sys.executable, "-m", "byteps_like.launcher", "--local", "--no-bind", *options,
            "--_role-cmd", f"scheduler={json.dumps(cmd)}",
            "--_role-cmd", f"server={json.dumps(cmd)}", "--", *cmd]
    proc = subprocess.Popen(argv, env=clean_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        rc, out, err = communicate(proc, "bpslaunch with stand-ins", timeout=60)
    finally:
        for f in piddir.iterdir():  # never leave a stand-in behind
            try:
                os.kill(int(f.read_text()), signal.SIGKILL)
            except (OSError, ValueError):
                pass
    pids = {f.name: int(f.read_text()) for f in piddir.iterdir() if not f.name.startswith(".")}
    return rc, out, err, pids


def test_only_reactions_seen_is_said_so_and_the_scheduler_report_is_shown(tmp_path):
    # worker 1 hangs (the scheduler lost it by heartbeat); everyone else exits because of it,
    # the scheduler last. No process failed on its own: bpslaunch must not call one the cause.
    lost = "scheduler: lost worker rank 1 on 127.0.0.1 (pid 99): no heartbeat for 3.1 s"
    peer_failed = f"exit:{EXIT_PEER_FAILED}"
    plan = {"server": [peer_failed], "worker-0": ["awaitgone:server", peer_failed],
            "worker-1": ["sleep"],
            "scheduler": ["awaitgone:server", "awaitgone:worker-0", f"stderr:{lost}",
                          peer_failed]}
    rc, out, err, pids = run_standins(tmp_path, plan, "--grace", "2")
    log = f"exit {rc}\n--- stdout\n{out}\n--- stderr\n{err}"
    assert rc == EXIT_PEER_FAILED, log
    assert f"stopping worker 1 (pid {pids['worker-1']}) (grace period over)" in err, log
    assert last_line(err) == (
        f"bpslaunch: error: no process failed on its own; scheduler (pid {pids['scheduler']}) "
        f"exited because another process of the job failed: exit status {EXIT_PEER_FAILED}; "
        f"last stderr: {lost}"), log


def test_a_failure_of_its_own_wins_over_reactions_seen_before_it(tmp_path):
    # each waits until bpslaunch has reaped the one before (not only seen it exit): on a loaded
    # machine bpslaunch could otherwise find all four gone at once, with no one left to give
    # the grace to
    plan = {"scheduler": [f"exit:{EXIT_PEER_FAILED}"],
            "server": ["awaitreaped:scheduler", f"exit:{EXIT_PEER_FAILED}"],
            "worker-0": ["awaitreaped:server", "stderr:RuntimeError: out of memory", "exit:3"],
            "worker-1": ["awaitreaped:worker-0", "exit:1"]}
    rc, out, err, pids = run_standins(tmp_path, plan, "--grace", "20")
    log = f"exit {rc}\n--- stdout\n{out}\n--- stderr\n{err}"
    assert rc == 3, log
    assert last_line(err) == (
        f"bpslaunch: error: worker 0 (pid {pids['worker-0']}) failed first: exit status 3; "
        f"last stderr: RuntimeError: out of memory"), log
    assert (f"bpslaunch: scheduler (pid {pids['scheduler']}) exited because another process "
            f"of the job failed: exit status {EXIT_PEER_FAILED}\n") in err, log
    assert re.search(r"bpslaunch: scheduler exited because another process of the job failed; "
                     r"giving the other \d process\(es\) 20 s to exit", err), log


# -- the exit status of a worker script that dies of a lost peer --------------------------------

HOOKED = textwrap.dedent("""\
    import atexit, sys
    from byteps_like.errors import PeerLostError
    from byteps_like.roles import exit_if_peer_failed
    prev = sys.excepthook
    def hook(tp, val, tb):
        prev(tp, val, tb)
        exit_if_peer_failed(val)
    sys.excepthook = hook
    atexit.register(lambda: print("ATEXIT RAN", flush=True))
    print("buffered output survives", end="")
    mode = sys.argv[1]
    if mode == "repl":  # a REPL that shows a traceback through the hook goes on
        import code
        code.InteractiveInterpreter().runsource("raise PeerLostError('in the repl')")
        print(" REPL SURVIVED")
        sys.exit(0)
    if mode == "lost":
        raise PeerLostError("worker 0: worker rank 1 failed")
    if mode == "wrapped":
        try:
            raise PeerLostError("worker 0: worker rank 1 failed")
        except PeerLostError as exc:
            raise RuntimeError("training failed") from exc
    raise ValueError("a bug of this script")
    """)


@pytest.mark.parametrize("mode,status", [("lost", EXIT_PEER_FAILED),
                                         ("wrapped", EXIT_PEER_FAILED), ("own", 1),
                                         ("repl", 0)])
def test_a_script_dying_of_a_lost_peer_exits_with_exit_peer_failed(tmp_path, mode, status):
    proc = subprocess.Popen([sys.executable, "-c", HOOKED, mode], env=clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    rc, out, err = communicate(proc, "the hooked script", timeout=60)
    assert rc == status, f"{out}\n{err}"
    assert "buffered output survives" in out and "ATEXIT RAN" in out, f"{out}\n{err}"
    assert "Traceback (most recent call last):" in err, err


# -- waits that say what they wait for ----------------------------------------------------------

# the first report comes after 5 s, at WARNING from BYTEPS_STARTUP_WARN_SECONDS (30 s by
# default, so that a job whose processes are merely importing is quiet)
WAIT_ENV = {"DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_NUM_WORKER": "2", "DMLC_NUM_SERVER": "1",
            "BYTEPS_REGISTER_TIMEOUT_SECONDS": "8", "BYTEPS_STARTUP_WARN_SECONDS": "5"}


def start_role(argv: list[str], **env: str) -> subprocess.Popen:
    # the default log level (WARNING): no BYTEPS_LOG_LEVEL
    return subprocess.Popen(argv, env=clean_env(**WAIT_ENV, **env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def test_waiting_nodes_and_scheduler_say_what_they_wait_for():
    closed = free_port()   # nothing listens here
    lonely_server = start_role([sys.executable, "-m", "byteps_like.server"],
                               DMLC_PS_ROOT_PORT=str(closed), DMLC_ROLE="server")
    port = free_port()
    scheduler = start_role([sys.executable, "-m", "byteps_like.scheduler"],
                           DMLC_PS_ROOT_PORT=str(port), DMLC_ROLE="scheduler",
                           BYTEPS_PARTITON_BYTES="4M")   # misspelt: said once, in a log line
    worker = start_role([sys.executable, "-c", "import byteps_like as bps; bps.init()"],
                        DMLC_PS_ROOT_PORT=str(port), DMLC_ROLE="worker", DMLC_WORKER_ID="0")
    try:
        runs = {name: communicate(p, name, timeout=60) for name, p in
                (("server", lonely_server), ("scheduler", scheduler), ("worker", worker))}
    finally:
        for p in (lonely_server, scheduler, worker):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    logs = "\n".join(f"--- {name}: exit {rc}\n{err}" for name, (rc, _out, err) in runs.items())

    def said_while_waiting(role: str, waiting: str, gave_up: str) -> str:
        """``role`` exited 1 having said ``waiting`` before it said ``gave_up``: its stderr."""
        rc, _out, err = runs[role]
        assert rc == 1, logs
        assert waiting in err, logs
        assert err.index(waiting) < err.index(gave_up), logs
        return err

    # a server with no scheduler at its address: the address, how long so far, the limit
    said_while_waiting("server", f"server on 127.0.0.1: no node table yet from the scheduler "
                       f"at tcp://127.0.0.1:{closed} after 5 s (gives up after 8 s, "
                       f"BYTEPS_REGISTER_TIMEOUT_SECONDS)",
                       "within 8 s (BYTEPS_REGISTER_TIMEOUT_SECONDS)")
    # the scheduler with 1 of 2 workers and no server: who has joined and who has not
    err = said_while_waiting(
        "scheduler", f"scheduler: waiting for nodes to register at tcp://127.0.0.1:{port} for "
        f"5 s (gives up after 8 s, BYTEPS_REGISTER_TIMEOUT_SECONDS): 1 of 2 workers and 0 of 1 "
        f"servers joined; not seen yet: worker ids [1] (DMLC_WORKER_ID), 1 server",
        "registration timed out after 8 s")
    said = [ln for ln in err.splitlines() if "BYTEPS_PARTITON_BYTES" in ln]
    assert len(said) == 1 and said[0].endswith(
        "WARNING scheduler] unknown environment variable(s) ignored: BYTEPS_PARTITON_BYTES "
        "(did you mean BYTEPS_PARTITION_BYTES?); `python -m byteps_like.config --describe` "
        "lists the settings"), logs
    assert "Warning" not in err, logs   # no warnings.warn line, no source line

    # the worker that did join waits for the same table, and says so too
    rc, _out, err = runs["worker"]
    assert rc == 1, logs
    assert (f"worker on 127.0.0.1: no node table yet from the scheduler at "
            f"tcp://127.0.0.1:{port} after 5 s") in err, logs


def test_a_slow_healthy_start_is_quiet_and_a_misspelt_setting_is_said_once():
    """Issue 30, item 7: workers that take 5.5 s to start (a framework import): the scheduler
    and the server wait past their first report (5 s) without a WARNING (before: "the
    scheduler is not running or not reachable"); a misspelt setting is said once, by bpslaunch,
    in one line (before: by every process, with warnings.warn's source line)."""
    code = ("import time; time.sleep(5.5)\nimport numpy as np, byteps_like as bps\n"
            "bps.init(); bps.push_pull(np.ones(4, np.float32), name='x'); bps.shutdown()\n")
    run = bpslaunch(["-c", code], workers=2, servers=1, timeout=WATCHDOG_S,
                    env={"BYTEPS_PARTITON_BYTES": "4M"})
    assert run.rc == 0, run.log
    text = run.out + run.err
    assert "WARNING" not in text and "Warning" not in text, run.log
    said = [ln for ln in text.splitlines() if "BYTEPS_PARTITON_BYTES" in ln]
    assert said == ["bpslaunch: warning: unknown environment variable(s) ignored: "
                    "BYTEPS_PARTITON_BYTES (did you mean BYTEPS_PARTITION_BYTES?); `python -m "
                    "byteps_like.config --describe` lists the settings"], run.log
