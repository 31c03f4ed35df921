"""Issue 19, exhausted resources and a launcher that goes away, with real processes on loopback:

* shared memory: segments are reserved when created, so a small tmpfs (mounted here, 32 MiB,
  as Docker's 64 MiB default would be) gives a clear BytePSError naming it, never a SIGBUS;
  shutdown() does not wait on the push_pull that failed; nothing is left in the tmpfs, whether
  the script catches the error, dies of it, or its workers are killed; segments of a bpslaunch
  killed with SIGKILL are swept by the next one;
* a SIGKILLed bpslaunch takes its job with it (PR_SET_PDEATHSIG);
* two ``bpslaunch --local --port P`` started together never make one job: one runs exactly,
  the other stops with a message naming the port and DMLC_PS_ROOT_PORT and no traceback.

Every run has a watchdog: on a hang the processes are killed and the output is in the failure.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.integration.harness import FAST_ENV, Run, alive, bpslaunch, pids_in, wait_gone
from tests.support import free_port

pytestmark = pytest.mark.integration
HEARTBEAT_TIMEOUT_S = float(FAST_ENV["BYTEPS_HEARTBEAT_TIMEOUT_SECONDS"])

#: Local ranks push 8 MiB tensors: a segment of 3 x 8 MiB (2 slots + the output) = 24 MiB, so
#: a second tensor does not fit in 32 MiB.
PUSH_PULL = """
import os, signal, sys, time
import numpy as np
import byteps_like as bps
from byteps_like.errors import BytePSError
mode = sys.argv[1]
bps.init()
a = np.ones(2 << 20, np.float32)
assert bps.push_pull(a, name="fits", average=False)[0] == bps.size()
print("PIDS", os.getpid(), flush=True)
if mode == "die":
    os.kill(os.getpid(), signal.SIGKILL)
if mode == "wait":
    print("READY", flush=True)
    time.sleep(120)
try:
    bps.push_pull(a, name="too_much", average=False)
    print("NO ERROR", flush=True)
except BytePSError as exc:
    print("ERROR", exc, flush=True)
    if mode == "raise":
        raise
t0 = time.monotonic()
bps.shutdown()
print(f"SHUTDOWN {time.monotonic() - t0:.2f}", flush=True)
"""


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 32 MiB tmpfs of our own, to run out of (root only)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    where = tmp_path / "shm"
    where.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(where)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {r.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "push_pull.py"
    path.write_text(PUSH_PULL)
    return str(path)


# ---- item 5: /dev/shm exhaustion ---------------------------------------------------------------
SEGMENTS = """
import os, sys
import numpy as np
from byteps_like import local
from byteps_like.errors import BytePSError
where = sys.argv[1]
segs = []
try:  # 12 MiB each: every one fits in 32 MiB, three do not
    for i in range(3):
        segs.append(local.Segment(f"bpsl-t-1-m0-t{i}", 6 << 20, 1, what=f"t{i}",
                                  shm_dir=where))
except BytePSError as exc:
    print("ERROR", exc, flush=True)
print("FILES", sorted(os.listdir(where)), flush=True)
for s in segs:  # every byte of what was made can be written
    s.slot(0)[:] = 1
    s.out[:] = 2
print("WRITTEN", len(segs), flush=True)
for s in segs:
    s.close(unlink=True)
try:  # larger than the whole tmpfs
    local.Segment("bpsl-t-1-m0-big", 20 << 20, 1, what="big", shm_dir=where)
except BytePSError as exc:
    print("ERROR", exc, flush=True)
print("LEFT", sorted(os.listdir(where)), flush=True)
"""


def test_segments_are_reserved_so_a_full_tmpfs_is_an_error_not_a_sigbus(small_tmpfs, tmp_path):
    path = tmp_path / "segments.py"
    path.write_text(SEGMENTS)
    r = subprocess.run([sys.executable, str(path), str(small_tmpfs)], capture_output=True,
                       text=True, timeout=60)
    log = f"exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    assert r.returncode == 0, log  # before: -7 (SIGBUS) on a write to the third segment
    errors = [ln for ln in r.stdout.splitlines() if ln.startswith("ERROR")]
    assert len(errors) == 2, log
    for line in errors:
        assert f"in {small_tmpfs} (size 32.0 MiB" in line, line
        assert "BYTEPS_SHM_DIR" in line and "--shm-size" in line, line
    assert "FILES ['bpsl-t-1-m0-t0', 'bpsl-t-1-m0-t1']" in r.stdout, log  # no empty third
    assert "WRITTEN 2" in r.stdout and "LEFT []" in r.stdout, log


@pytest.mark.parametrize("mode", ["catch", "raise"])
def test_a_local_job_on_a_full_tmpfs_fails_clearly_and_leaves_nothing(small_tmpfs, script,
                                                                      mode):
    run = bpslaunch([script, mode], workers=1, servers=None, local_size=2, timeout=90,
                    env={"BYTEPS_SHM_DIR": str(small_tmpfs)})
    assert "NO ERROR" not in run.out, run.log
    errors = run.lines("ERROR")
    tmpfs = [ln for ln in errors if f"in {small_tmpfs}" in ln]
    if mode == "catch":  # each local rank meets the full tmpfs itself
        assert len(errors) == 2 and tmpfs == errors, run.log
    else:
        # the first rank to fail raises, bpslaunch reports its exit to the scheduler at once,
        # and the other rank may learn of that (a lost peer) before its own segment fails:
        # either way one error per rank, and the tmpfs is named
        assert 1 <= len(tmpfs) and len(errors) <= 2, run.log
    assert "SIGBUS" not in run.err and run.rc != 135, run.log
    if mode == "catch":  # shutdown() does not wait on the push_pull that failed
        assert run.rc == 0, run.log
        times = [float(ln.split()[-1]) for ln in run.lines("SHUTDOWN")]
        assert len(times) == 2 and max(times) < 10, run.log
    else:  # uncaught: the job fails at once, not after BYTEPS_TIMEOUT_SECONDS
        assert run.rc == 1 and "BytePSError" in run.err, run.log
    assert run.elapsed < 45, run.log
    assert os.listdir(small_tmpfs) == [], run.log


def test_bpslaunch_sweeps_its_jobs_segments_when_the_workers_die(small_tmpfs, script):
    run = bpslaunch([script, "die"], workers=1, servers=None, local_size=2, timeout=90,
                    env={"BYTEPS_SHM_DIR": str(small_tmpfs)})
    assert run.rc == 128 + signal.SIGKILL, run.log
    assert not wait_gone(pids_in(run.out)), run.log
    assert os.listdir(small_tmpfs) == [], run.log


# ---- a SIGKILLed bpslaunch ---------------------------------------------------------------------
def _children(ppid: int) -> set[int]:
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_bytes()
            except OSError:
                continue
            if int(stat[stat.rfind(b")") + 2:].split()[1]) == ppid:
                found.add(int(entry))
    return found


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "BYTEPS_"))}
    return {**env, **FAST_ENV, "PYTHONUNBUFFERED": "1", **extra}


def test_a_killed_bpslaunch_takes_its_job_with_it(small_tmpfs, script):
    # one worker machine of two local ranks (a segment), pushing through a server
    cmd = [sys.executable, "-m", "byteps_like.launcher", "--local", "--workers", "1",
           "--local-size", "2", "--", sys.executable, script, "wait"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=_env(BYTEPS_SHM_DIR=str(small_tmpfs), BYTEPS_FORCE_DISTRIBUTED="1"),
                         start_new_session=True)
    out: list[str] = []
    ready = threading.Event()

    def read(stream) -> None:
        for line in stream:
            out.append(line)
            if sum("READY" in ln for ln in out) == 2:
                ready.set()
    readers = [threading.Thread(target=read, args=(stream,), daemon=True)
               for stream in (p.stdout, p.stderr)]
    for t in readers:
        t.start()
    children: set[int] = set()
    try:
        assert ready.wait(60), "watchdog: the job did not start\n" + "".join(out)
        children = _children(p.pid)
        assert len(children) == 4, children  # scheduler, server, 2 workers
        assert os.listdir(small_tmpfs), "the workers have segments"
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)
        t0 = time.monotonic()
        left = wait_gone(children, HEARTBEAT_TIMEOUT_S + 5)
        assert not left, f"still running {time.monotonic() - t0:.1f} s after bpslaunch died: " \
                         f"{sorted(left)}\n" + "".join(out)
    finally:
        for pid in children:  # before the fix they outlive it: do not leave them to others
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        if p.poll() is None:
            p.kill()
        p.wait(10)
        for t in readers:  # EOF once every holder of the pipes is gone
            t.join(10)
        p.stdout.close()
        p.stderr.close()
    # the workers died by signal and left their segments; the next local job removes them
    # (its launcher's pid is in their name and gone), and its own at exit
    assert os.listdir(small_tmpfs)
    run = bpslaunch(["-c", "import byteps_like as b; b.init(); b.shutdown()"], workers=1,
                    servers=None, local_size=2, timeout=60,
                    env={"BYTEPS_SHM_DIR": str(small_tmpfs)})
    assert run.rc == 0, run.log
    assert re.search(r"removed \d+ shared-memory segment\(s\) of dead jobs", run.err), run.log
    assert os.listdir(small_tmpfs) == [], run.log


# ---- item 7: two jobs on one --port --------------------------------------------------------------
EXACT = """
import time
import numpy as np
import byteps_like as bps
bps.init()
time.sleep(4)  # the two jobs overlap, however the two launchers are scheduled
for _ in range(30):
    r = bps.push_pull(np.full(4, bps.rank() + 1.0), name="g", average=False)
    if not (r == 3.0).all():
        print("MIXED", r, flush=True)
        raise SystemExit(3)
print("EXACT", bps.rank(), flush=True)
bps.shutdown()
"""


@pytest.mark.parametrize("auth", ["auth", "no-auth"])
def test_two_jobs_on_one_port_never_mix(tmp_path, auth):
    path = tmp_path / "exact.py"
    path.write_text(EXACT)
    port = free_port()
    cmd = [sys.executable, "-m", "byteps_like.launcher", "--local", "--workers", "2",
           "--port", str(port), *(["--no-auth"] if auth == "no-auth" else []),
           "--", sys.executable, str(path)]
    t0 = time.monotonic()
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=_env(), start_new_session=True) for _ in range(2)]
    runs = []
    for p in procs:
        try:
            o, e = p.communicate(timeout=max(1.0, 90 - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            for q in procs:
                if q.poll() is None:
                    os.killpg(q.pid, signal.SIGINT)
            o, e = p.communicate(timeout=20)
            raise AssertionError(f"watchdog: bpslaunch hung\n{o}\n{e}") from None
        runs.append(Run(p.returncode, o, e, time.monotonic() - t0))
    log = "\n=====\n".join(r.log for r in runs)
    assert "MIXED" not in log, log
    # the losing scheduler says why in one line (its job's workers, refused by the winner's
    # scheduler as another job's when there is no secret, may raise in the script)
    assert "[scheduler] Traceback" not in log and "ZMQError" not in log, log
    won = [r for r in runs if r.rc == 0]
    lost = [r for r in runs if r.rc != 0]
    assert len(won) == 1 and len(lost) == 1, log
    assert len(won[0].lines("EXACT")) == 2, log
    assert lost[0].rc == 2, log
    assert str(port) in lost[0].err and "DMLC_PS_ROOT_PORT" in lost[0].err, log
    assert max(r.elapsed for r in runs) < 60, log


def test_a_scheduler_on_a_taken_port_says_so_without_a_traceback():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "byteps_like.scheduler"], capture_output=True,
                           text=True, timeout=30,
                           env=_env(DMLC_PS_ROOT_URI="127.0.0.1", DMLC_PS_ROOT_PORT=str(port),
                                    DMLC_NUM_WORKER="1", DMLC_NUM_SERVER="1"))
    assert r.returncode == 2, r.stderr
    assert f"127.0.0.1:{port}" in r.stderr and "DMLC_PS_ROOT_PORT" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
