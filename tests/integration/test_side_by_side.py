"""Several jobs on the same machine at once (issue 12, "jobs side by side").

Two ``bpslaunch --local`` clusters run concurrently, with different BYTEPS_JOB_IDs and with the
same default one (their ports differ, so their shared-memory segment names differ too). Both
must be exact and leave nothing under /dev/shm. A worker of one job pointed at the scheduler of
another is refused with an error that names both jobs.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from .harness import FAST_ENV, Run, bpslaunch, free_port, worker

pytestmark = pytest.mark.integration

SHM = Path("/dev/shm")
SIZES = [1, 1000, 70001]
# 2 machines x 2 local ranks: the local ranks share data through /dev/shm segments.
WORKERS, LOCAL_SIZE = 2, 2


def _segments() -> set[str]:
    return {p.name for p in SHM.glob("bpsl-*")} if SHM.is_dir() else set()


def _run_pair(envs: list[dict]) -> list[Run]:
    def one(env: dict) -> Run:
        return bpslaunch(worker("pushpull_check.py", *SIZES), workers=WORKERS, servers=2,
                         local_size=LOCAL_SIZE, timeout=180,
                         env={"BYTEPS_PARTITION_BYTES": "64K", **env})
    with ThreadPoolExecutor(len(envs)) as pool:
        return list(pool.map(one, envs))


def _check_exact(run: Run) -> None:
    total = WORKERS * LOCAL_SIZE
    assert run.rc == 0, run.log
    ok = run.lines("OK rank")
    assert len(ok) == total, run.log
    assert all(f"of {total}: {2 * 6 * len(SIZES)} tensors checked" in ln for ln in ok), run.log


@pytest.mark.parametrize("job_ids", [("job-a", "job-b"), (None, None)],
                         ids=["different-job-ids", "same-default-job-id"])
def test_two_local_clusters_at_once(job_ids):
    before = _segments()
    envs = [{} if j is None else {"BYTEPS_JOB_ID": j} for j in job_ids]
    t0 = time.monotonic()
    runs = _run_pair(envs)
    elapsed = time.monotonic() - t0
    for run in runs:
        _check_exact(run)
    # They did overlap: together they took less than one after the other would have.
    assert elapsed < sum(r.elapsed for r in runs), (elapsed, [r.elapsed for r in runs])
    left = _segments() - before
    assert not left, f"shared-memory segments left behind: {sorted(left)}"


def test_worker_of_another_job_is_refused():
    port = free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "BYTEPS_"))}
    common = {**base, **FAST_ENV, "PYTHONUNBUFFERED": "1", "DMLC_NUM_WORKER": "1",
              "DMLC_NUM_SERVER": "1", "DMLC_PS_ROOT_URI": "127.0.0.1",
              "DMLC_PS_ROOT_PORT": str(port), "DMLC_NODE_HOST": "127.0.0.1"}
    sched = subprocess.Popen([sys.executable, "-m", "byteps_like.scheduler"],
                             env={**common, "DMLC_ROLE": "scheduler", "BYTEPS_JOB_ID": "job-b"},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
    try:
        code = "import byteps_like as bps; bps.init(); print('JOINED', flush=True)"
        wrk = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=60, env={**common, "DMLC_ROLE": "worker",
                                              "DMLC_WORKER_ID": "0", "BYTEPS_JOB_ID": "job-a"})
    finally:
        os.killpg(sched.pid, signal.SIGTERM)
        try:
            sched.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(sched.pid, signal.SIGKILL)
            sched.communicate()
    log = f"exit {wrk.returncode}\n--- stdout ---\n{wrk.stdout}\n--- stderr ---\n{wrk.stderr}"
    assert wrk.returncode != 0, log
    assert "JOINED" not in wrk.stdout, log
    assert "ConfigError" in wrk.stderr, log
    assert "the scheduler refused this worker" in wrk.stderr, log
    assert "job-b" not in wrk.stderr, log  # the scheduler names no job id to outsiders
    assert "another job" in wrk.stderr and "BYTEPS_JOB_ID" in wrk.stderr, log
