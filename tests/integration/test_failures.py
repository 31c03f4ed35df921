"""Failures on real clusters: lost servers and workers, tensor mismatches, asynchronous mode."""
from __future__ import annotations

import re
import signal
import time

import pytest

from .harness import bpslaunch, pids_in, wait_gone, worker

pytestmark = pytest.mark.integration


def test_async_mode_applies_deltas_at_once():
    # on the native data plane (issue 29)
    run = bpslaunch(worker("faults.py", "async"), workers=2, servers=2,
                    env={"BYTEPS_ENABLE_ASYNC": "1"})
    assert run.rc == 0, run.log
    assert len(run.lines("ASYNC OK")) == 2, run.log
    assert all("total 10" in ln and "plane native" in ln for ln in run.lines("ASYNC OK")), \
        run.log


def test_mismatch_raises_on_every_worker_naming_both_sides():
    run = bpslaunch(worker("faults.py", "mismatch"), workers=2, servers=1)
    assert run.rc == 0, run.log
    lines = run.lines("MISMATCH")
    assert len(lines) == 2, run.log
    for ln in lines:
        assert "'w'" in ln and "(3, 7)" in ln and "(7, 3)" in ln, ln
        assert "worker rank 0" in ln and "worker rank 1" in ln, ln


@pytest.mark.parametrize("victim", [0, 1])
def test_server_killed_mid_run(victim):
    """With failover off (the fail-fast behaviour; a job that loses a server and goes on is
    tests/faults/test_lose_server.py's). Either server: bpslaunch's "server N" for the killed
    process is the rank N the job knows it by (issue 41: bpslaunch said "server 0" for the
    process the scheduler and the workers called "server rank 1")."""
    run = bpslaunch(worker("faults.py", "kill-server", victim), workers=2, servers=2,
                    timeout=90, env={"BYTEPS_SERVER_FAILOVER": "0"})
    assert run.rc != 0, run.log
    lost = run.lines("PEER_LOST")
    assert len(lost) == 2, run.log
    assert all(f"server rank {victim}" in ln for ln in lost), run.log
    # bpslaunch's "server N" is the job's server rank N (BYTEPS_SERVER_ID, issue 41)
    pid = run.lines(f"KILLING server rank {victim} pid")[0].split()[-1]
    assert re.search(rf"server {victim} \(pid {pid}\) failed first: killed by SIGKILL",
                     run.err), run.log
    pids = pids_in(run.out)
    assert len(pids) == 5, run.log  # scheduler, 2 servers, 2 workers
    assert not wait_gone(pids), f"processes left behind\n{run.log}"


def test_worker_killed_mid_run():
    """bpslaunch, the killed worker's parent, tells the scheduler at once: the job ends within
    seconds of the kill. The heartbeat timeout is its default, 20 s (issue 30: the job used to
    end 21 s after the kill), so only that notice can make it."""
    run = bpslaunch(worker("faults.py", "kill-worker"), workers=2, servers=1, timeout=90,
                    env={"BYTEPS_HEARTBEAT_TIMEOUT_SECONDS": "20"})
    ended = time.time()
    assert run.rc == 128 + signal.SIGKILL, run.log   # the killed worker is blamed
    lost = run.lines("PEER_LOST")
    assert len(lost) == 1 and "worker rank 1" in lost[0], run.log
    assert "exited (killed by SIGKILL; reported by its launcher" in lost[0], run.log
    assert "SIGKILL" in run.err and "worker 1" in run.err, run.log
    killed = float(run.lines("KILLING MYSELF at")[0].split()[-1])
    assert ended - killed < 5, f"the job ended {ended - killed:.1f} s after the kill\n{run.log}"
    pids = pids_in(run.out)
    assert len(pids) == 4, run.log
    assert not wait_gone(pids), f"processes left behind\n{run.log}"


def test_scheduler_killed_mid_run_ends_the_job_within_seconds():
    """Issue 40: every node sees the scheduler's connection close and fails within
    BYTEPS_SCHEDULER_LOST_GRACE_SECONDS (0.5 s) naming it; bpslaunch stops whatever is left
    soon after. The heartbeat timeout is its default, 20 s (the job used to end 21.1 s after the
    kill, the workers training on meanwhile). With restarts off: a restarted scheduler is
    tests/faults/test_lose_server.py's."""
    run = bpslaunch(worker("faults.py", "kill-scheduler"), workers=2, servers=1, timeout=90,
                    env={"BYTEPS_HEARTBEAT_TIMEOUT_SECONDS": "20"},
                    extra=["--scheduler-restarts", "0"])
    ended = time.time()
    assert run.rc == 128 + signal.SIGKILL, run.log   # the scheduler is blamed
    assert re.search(r"scheduler \(pid \d+\) failed first: killed by SIGKILL", run.err), run.log
    killed = float(run.lines("KILLING scheduler at")[0].split()[-1])
    lost = run.lines("PEER_LOST")
    assert len(lost) == 2, run.log
    for ln in lost:
        assert "lost the scheduler" in ln and "connection closed" in ln, ln
        raised = float(re.search(r" at ([\d.]+) step", ln).group(1))
        assert raised - killed < 5, ln   # the 0.5 s grace, on loaded machines
    # 2 s is the target (issue 40, measured in docs/reliability.md); the margin is for CI's 2
    # loaded cores: the heartbeat timeout (20 s) is what it tells apart
    assert ended - killed < 8, f"the job ended {ended - killed:.1f} s after the kill\n{run.log}"
    assert not wait_gone(pids_in(run.out)), f"processes left behind\n{run.log}"


@pytest.mark.parametrize("then", ["kill-worker", "kill-scheduler"])
def test_after_a_scheduler_restart_a_failure_still_ends_the_job_at_once(then):
    """Issue 40, with --scheduler-restarts 1: the scheduler SIGKILLed, bpslaunch starts it
    again and every node registers again; then a second failure. A worker SIGKILLed is still
    told to the (new) scheduler at once: bpslaunch skipped the notice while any scheduler it had
    started was gone, the first one included, and the job waited out the heartbeat timeout
    (20.4 s). The scheduler SIGKILLed again, its restarts used up: bpslaunch stops the others
    at once, since they wait up to 15 s for a restart (it gave them 2 s: 2.1 s)."""
    run = bpslaunch(worker("faults.py", f"restart-then-{then}"), workers=2, servers=1,
                    timeout=90, env={"BYTEPS_HEARTBEAT_TIMEOUT_SECONDS": "20"},
                    extra=["--scheduler-restarts", "1"])
    ended = time.time()
    assert "restarting it (restart 1 of 1)" in run.err, run.log
    assert run.rc == 128 + signal.SIGKILL, run.log
    if then == "kill-worker":
        killed = float(run.lines("KILLING MYSELF at")[0].split()[-1])
        lost = run.lines("PEER_LOST")
        assert len(lost) == 1 and "worker rank 1" in lost[0], run.log
        assert "reported by its launcher at once" in lost[0], run.log
        assert re.search(r"worker 1 \(pid \d+\) failed first: killed by SIGKILL", run.err)
    else:
        killed = float(run.lines("KILLING scheduler again at")[0].split()[-1])
        assert "--scheduler-restarts 1 used up" in run.err, run.log
        assert "stopping the other 3 process(es) now" in run.err, run.log
        assert re.search(r"scheduler \(pid \d+\) failed first: killed by SIGKILL", run.err)
    # the heartbeat timeout (20 s) and the nodes' wait for a restart (15 s) are what this
    # tells apart; the margin is for CI's 2 loaded cores
    assert ended - killed < 8, f"the job ended {ended - killed:.1f} s after the kill\n{run.log}"
    assert not wait_gone(pids_in(run.out)), f"processes left behind\n{run.log}"


def test_a_node_refused_at_registration_ends_the_job_naming_it():
    """Issue 40: worker 1 was told DMLC_NUM_WORKER=3 in a job of 2. The scheduler refuses it
    and tells every other node at once (PeerLostError naming it and why, exit 75): the job
    ends in seconds, bpslaunch blaming the refused worker, with the default registration
    timeout (120 s: the others used to wait all of it, then blame 'worker ids not seen')."""
    run = bpslaunch(worker("wrong_size.py"), workers=2, servers=1, timeout=90,
                    env={"BYTEPS_REGISTER_TIMEOUT_SECONDS": "120"})
    ended = time.time()
    assert run.rc == 1, run.log
    why = ("worker on 127.0.0.1 (pid {pid}, DMLC_WORKER_ID=1) has DMLC_NUM_WORKER=3 but the "
           "scheduler has DMLC_NUM_WORKER=2")
    m = re.search(r"worker 1 \(pid (\d+)\) failed first: exit status 1", run.err)
    assert m, run.log
    assert "ConfigError: the scheduler refused this worker: " + why.format(pid=m.group(1)) \
        in run.err, run.log
    assert re.search(r"\[worker 0\] \[.*ERROR.*\] worker on 127\.0\.0\.1: the job cannot form: "
                     r"the scheduler refused " + re.escape(why.format(pid=m.group(1))),
                     run.err), run.log
    assert re.search(r"worker 0 \(pid \d+\) exited because another process", run.err), run.log
    started = min(float(ln.split()[-1]) for ln in run.lines("STARTED"))
    assert ended - started < 10, f"{ended - started:.1f} s\n{run.log}"   # 3 s is the target
    assert "INIT OK" not in run.out, run.log


def test_local_rank_killed_mid_run_leaves_no_shared_memory():
    import glob
    before = set(glob.glob("/dev/shm/bpsl-*"))
    run = bpslaunch(worker("faults.py", "kill-worker"), workers=1, servers=1, local_size=2,
                    timeout=90)
    assert run.rc != 0, run.log
    lost = run.lines("PEER_LOST")
    assert len(lost) == 1 and "worker rank 1" in lost[0], run.log
    assert "SIGKILL" in run.err and "worker 1" in run.err, run.log
    assert not wait_gone(pids_in(run.out)), f"processes left behind\n{run.log}"
    assert set(glob.glob("/dev/shm/bpsl-*")) <= before, "shared memory left behind"
