"""A byteps_like script under torchrun (issue 30): one job of WORLD_SIZE workers, whose
scheduler and servers local rank 0 of each node starts, and nothing left running afterwards
(launcher/torchrun.py, docs/launcher.md "torchrun")."""
from __future__ import annotations

import importlib.util
import re
import signal
import sys
from pathlib import Path

import pytest

from tests.integration.harness import FAST_ENV, pids_in, wait_gone, worker
from tests.support import Run, clean_env, free_port, kill_group, run, spawn, watch

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                 reason="torchrun comes with torch")]

TORCHRUN = Path(sys.executable).with_name("torchrun")
MODULE = [sys.executable, "-m", "torch.distributed.run"]
CHECK = worker("torchrun_check.py")
JOINED = "byteps_like: joined the torchrun job as one byteps_like job of {} workers"


def torchrun_cmd() -> list[str]:
    return [str(TORCHRUN)] if TORCHRUN.exists() else MODULE


def env(**extra: str) -> dict[str, str]:
    """No torchrun variables of the test's own and no byteps_like job: only what torchrun
    gives its workers."""
    return clean_env("MASTER_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_",
                     "ROLE_", "TORCHELASTIC_", **FAST_ENV, **extra)


def results(out: str) -> list[str]:
    return sorted(re.findall(r"^(?:\[.*?\]:)?(RESULT .*)$", out, re.M))


def children(out: str) -> dict[int, int]:
    return {int(r): int(n) for r, n in re.findall(r"CHILDREN rank (\d+) (\d+)", out)}


def test_torchrun_standalone_forms_one_job_and_leaves_nothing_running():
    r = run([*torchrun_cmd(), "--standalone", "--nproc_per_node", "2", *CHECK], 90, env(),
            what="torchrun --standalone")
    assert r.rc == 0, r.log
    assert results(r.out) == ["RESULT rank 0 size 2 local 0/2",
                              "RESULT rank 1 size 2 local 1/2"], r.log
    assert r.err.count(JOINED.format(2)) == 1, r.log  # said once, by rank 0
    assert "Not applied: torchrun's elasticity (--nnodes MIN:MAX, --max-restarts)" in r.err
    assert children(r.out) == {0: 1, 1: 0}, r.log  # the scheduler; one node: no server
    pids = pids_in(r.out)
    assert len(pids) == 3, r.log
    assert not wait_gone(pids), r.log


def test_torchrun_two_nodes_with_a_rendezvous_endpoint():
    """Two torchrun agents (torchrun and python -m torch.distributed.run) of 2 processes each,
    meeting at a c10d rendezvous endpoint: one job of 4, a server on each node."""
    rdzv = ["--nnodes", "2", "--nproc_per_node", "2", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "bpsl-test"]
    secret = {"BYTEPS_AUTH_SECRET": "two-nodes-test-secret"}  # several nodes: no secret made
    procs = [spawn([*torchrun_cmd(), *rdzv, *CHECK], env(**secret)),
             spawn([*MODULE, *rdzv, *CHECK], env(**secret))]
    runs = []
    try:
        for p in procs:
            rc, out, err = watch(p, 120, "torchrun node")
            runs.append(Run(rc, out, err, 0.0))
    finally:
        for p in procs:
            kill_group(p)
    log = "\n".join(r.log for r in runs)
    assert [r.rc for r in runs] == [0, 0], log
    out = "".join(r.out for r in runs)
    assert results(out) == [f"RESULT rank {r} size 4 local {r % 2}/2" for r in range(4)], log
    assert "".join(r.err for r in runs).count(JOINED.format(4)) == 1, log
    assert "1 server(s) per node" in log, log
    # local rank 0 of node 0: the scheduler and a server; of node 1: a server
    assert children(out) == {0: 2, 1: 0, 2: 1, 3: 0}, log
    pids = pids_in(out)
    assert len(pids) == 7, log
    assert not wait_gone(pids), log


def test_local_rank_0_killed_takes_its_scheduler_with_it():
    r = run([*torchrun_cmd(), "--standalone", "--nproc_per_node", "2", *CHECK], 90,
            env(TORCHRUN_CHECK_DIE="1"), what="torchrun --standalone")
    assert r.rc != 0, r.log
    assert f"exitcode  : -{int(signal.SIGKILL)}" in r.err or "SIGKILL" in r.err, r.log
    pids = pids_in(r.out)
    assert len(pids) == 3, r.log  # both workers and the scheduler
    assert not wait_gone(pids), r.log


def test_torchruns_root_cause_is_the_rank_that_failed_first():
    """Issue 40: rank 1 raises; rank 0 fails because of it (PeerLostError, exit 75) but waits
    for rank 1's process to be gone before exiting, so torchrun sees rank 1's failure first and
    its summary's "Root Cause" names rank 1 (it named rank 0, exit 75, before)."""
    r = run([*torchrun_cmd(), "--standalone", "--nproc_per_node", "2",
             *worker("torchrun_raise.py")], 90, env(), what="torchrun --standalone")
    assert r.rc != 0, r.log
    root = r.err[r.err.index("Root Cause (first observed failure):"):]
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)\s*\n\s*exitcode\s*: 1 ", root), r.log
    assert "RuntimeError: rank 1 fails on purpose" in r.err, r.log
