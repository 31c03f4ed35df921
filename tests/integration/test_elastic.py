"""Elastic membership epochs at the protocol level (issue 22), with the numpy API and
``bpslaunch --local --elastic``: a worker SIGKILLed mid-step, a lost worker replaced, a worker
added mid-run, the job falling below --min-workers, a server lost. Every sum a worker prints is
checked against the size of the epoch it was summed in: no sum mixes two epochs.
"""
from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from .harness import bpslaunch, worker

pytestmark = pytest.mark.integration

#: BYTEPS_HEARTBEAT_TIMEOUT_SECONDS's default: a loss found within less proves that the
#: heartbeats did not find it
SLOW_HEARTBEAT_TIMEOUT = 20.0


def records(out: str) -> list[dict]:
    recs = []
    for ln in out.splitlines():
        if ln.startswith("[worker") and "{" in ln:
            rec = json.loads(ln[ln.index("{"):])
            rec["who"] = ln[1:ln.index("]")]   # bpslaunch's name of the process
            recs.append(rec)
    return recs


def check_sums(recs: list[dict], log: str) -> None:
    """Every step's sums are exact for the size of the epoch it ran in, and one epoch has one
    size everywhere."""
    sizes: dict[int, int] = {}
    for r in recs:
        if "fresh" in r:  # a tensor first used in that epoch
            assert r["fresh"] == r["fresh_max"] == r["size"], (r, log)
            assert r["vary"] == r["vary_max"] == r["size"] == r["vary_len"], (r, log)
            assert sizes.setdefault(r["epoch"], r["size"]) == r["size"], (r, log)
        if "step" not in r or "ones" not in r:
            continue
        n = r["size"]
        assert sizes.setdefault(r["epoch"], n) == n, (r, log)
        assert r["ones"] == r["ones_max"] == n, (r, log)
        assert r["ranks"] == r["ranks_max"] == n * (n + 1) / 2, (r, log)


def check_table(recs: list[dict], log: str) -> None:
    """table=1: every worker reads the same row at the same (epoch, step), and within an epoch
    each round takes it down by the epoch's size (every worker of the epoch pushed 1s, none
    of another epoch)."""
    seen: dict[tuple, float] = {}
    for r in recs:
        if "table" in r:
            assert seen.setdefault((r["epoch"], r["step"]), r["table"]) == r["table"], (r, log)
    for (e, s), v in seen.items():
        if (e, s + 1) in seen:
            n = next(r["size"] for r in recs if r.get("epoch") == e and "table" in r)
            assert seen[(e, s + 1)] == v - n, (e, s, seen, log)


def job_env(**extra: str) -> dict:
    return {"BYTEPS_JOB_ID": f"elastic-test-{uuid.uuid4().hex[:12]}", **extra}


def leftovers(job_id: str) -> list[str]:
    """Processes of this job still alive, and shared-memory files naming it."""
    left = []
    for env_file in Path("/proc").glob("[0-9]*/environ"):
        try:
            if f"BYTEPS_JOB_ID={job_id}".encode() in env_file.read_bytes():
                left.append(f"pid {env_file.parent.name}")
        except OSError:
            continue
    left += [str(p) for p in Path("/dev/shm").glob(f"*{job_id}*")]
    return left


def launch(args: list, workers: int, *, extra: list[str], timeout: float = 90, **env: str):
    e = job_env(**env)
    run = bpslaunch(worker("elastic_numpy.py", *args), workers=workers, servers=1, env=e,
                    timeout=timeout, extra=["--elastic", *extra])
    return run, e["BYTEPS_JOB_ID"]


@pytest.mark.parametrize("sig", ["KILL", "TERM"])
def test_worker_lost_mid_step(sig):
    """SIGKILL: bpslaunch, the worker's parent, tells the scheduler at once (issue 30: before,
    the survivors waited out the heartbeat timeout); SIGTERM (a preempted machine): the worker
    tells the scheduler as it goes. Either way the others resume within 2 s, with the heartbeat
    timeout at its default of 20 s, so only the new paths can make it."""
    steps = 8
    run, job = launch([steps, f"kill=2@1:{sig}", "slow=0.05"], 3,
                      extra=["--min-workers", "2", "--max-restarts", "0"],
                      BYTEPS_HEARTBEAT_TIMEOUT_SECONDS=str(SLOW_HEARTBEAT_TIMEOUT))
    log = run.log
    assert run.rc == 0, log
    recs = records(run.out)
    check_sums(recs, log)
    assert {r["epoch"] for r in recs if "fresh" in r} == {1, 2}, log
    killed = next(r for r in recs if "killing" in r)
    assert "lost" in run.err and killed["who"] in run.err, log   # bpslaunch names it
    survivors = {r["who"] for r in recs if r.get("done")}
    assert len(survivors) == 2 and killed["who"] not in survivors, log
    for who in survivors:
        mine = [r for r in recs if r["who"] == who]
        changed = [r for r in mine if "changed" in r]
        assert len(changed) == 1 and changed[0]["changed"] == 2, log
        assert len(changed[0]["lost"]) == 1 and "rank 1" in changed[0]["lost"][0], log
        after = [r for r in mine if "step" in r and "ones" in r and r["epoch"] == 2]
        assert after and all(r["size"] == 2 for r in after), log
        # resumed: the first step of the new epoch within 2 s of the kill (was: the heartbeat
        # timeout, 20 s by default)
        assert after[0]["t"] - killed["t"] <= 2.0, (after[0], killed, log)
        # the plan: the step that was cut short runs again, then the rest, each once
        assert [r["step"] for r in after] == list(range(killed["killing"], steps)), log
        done = next(r for r in mine if r.get("done"))
        assert done["size"] == 2 and done["step"] == steps, log
    # dense ranks in the new epoch, survivors in their old order
    ranks = sorted(r["rank"] for r in recs if r.get("done"))
    assert ranks == [0, 1], log
    assert not leftovers(job), leftovers(job)


@pytest.mark.slow
def test_lost_worker_is_replaced():
    """--max-restarts 1: the lost worker's replacement registers and is admitted at the next
    epoch (the one the loss begins, when it registered before the loss was detected, else the
    next commit); the job ends with 3 workers again, every sum exact for its epoch."""
    steps = 30
    run, _ = launch([steps, "kill=2@2", "slow=0.15"], 3,
                    extra=["--min-workers", "2", "--max-restarts", "1"], timeout=120)
    log = run.log
    assert run.rc == 0, log
    recs = records(run.out)
    check_sums(recs, log)
    assert "restart 1 of 1" in run.err, log
    sizes = [r["size"] for r in recs if "ones" in r and r["who"] == "worker 0"]
    assert sizes[0] == 3 and sizes[-1] == 3, (sizes, log)
    changed = [r for r in recs if "changed" in r and r["who"] == "worker 0"]
    assert any(r["lost"] and "rank 2" in r["lost"][0] for r in changed), log
    joiner = [r for r in recs if r["who"] == "worker 3"]
    first = next(r for r in joiner if "ones" in r)
    assert first["size"] == 3 and first["epoch"] >= 2, log
    # from its first step on it sums with the others: same step in the same epoch
    peers = {(r["epoch"], r["step"]) for r in recs if "ones" in r and r["who"] == "worker 0"}
    assert (first["epoch"], first["step"]) in peers, log
    assert len([r for r in recs if r.get("done")]) == 3, log


def launch_adding_one(args: list) -> tuple[list, str]:
    """A job of 2 workers that adds a third after step 1: its records and log, the run passed
    and its sums checked."""
    run, _ = launch(args, 2,
                    extra=["--max-workers", "3", "--add-workers", "1", "--add-after", "1"],
                    timeout=120)
    assert run.rc == 0, run.log
    recs = records(run.out)
    check_sums(recs, run.log)
    return recs, run.log


def test_worker_added_mid_run():
    recs, log = launch_adding_one([24, "slow=0.15"])
    joiner = [r for r in recs if r["who"] == "worker 2"]
    init = next(r for r in joiner if "init" in r)
    assert init["size"] == 3 and init["epoch"] == 2 and init["rank"] == 2, log
    olds = [r for r in recs if r["who"] in ("worker 0", "worker 1")]
    assert all(r["added"] == 1 for r in olds if "changed" in r), log
    assert {r["size"] for r in olds if "ones" in r} == {2, 3}, log
    done = [r for r in recs if r.get("done")]
    assert len(done) == 3 and {r["size"] for r in done} == {3}, log


def test_below_min_workers_fails_typed_and_leaves_nothing():
    run, job = launch([20, "kill=1@1", "slow=0.1"], 2,
                      extra=["--min-workers", "2", "--max-restarts", "0",
                             "--elastic-timeout", "2"])
    log = run.log
    assert run.rc != 0, log
    assert "TooFewWorkersError" in run.err.splitlines()[-1], log   # the cause, named last
    too_few = [r for r in records(run.out) if "too_few" in r]
    assert len(too_few) == 1 and too_few[0]["min_workers"] == 2, log
    assert too_few[0]["lost"] and "rank 1" in too_few[0]["lost"][0], log
    assert not leftovers(job), leftovers(job)


def test_server_lost_is_still_a_typed_error():
    run, job = launch([20, "killserver=2", "slow=0.05"], 2, extra=[])
    log = run.log
    assert run.rc != 0, log
    assert "PeerLostError" in run.out + run.err and "server" in run.err, log
    assert not leftovers(job), leftovers(job)


def test_a_script_that_fails_on_every_worker_fails_the_job():
    """Losing workers is elasticity; every worker failing is an error. Before: both workers
    exited 1, the scheduler saw them leave, and bpslaunch called the job completed, exit 0."""
    e = job_env()
    code = ("import numpy as np, byteps_like as bps\nbps.init()\n"
            "bps.push_pull(np.ones(4, np.float32), name='x')\n"
            "raise SystemExit('boom: a bug in the training script')\n")
    run = bpslaunch(["-c", code], workers=2, servers=1, env=e, timeout=60,
                    extra=["--elastic", "--min-workers", "1", "--elastic-timeout", "3"])
    log = run.log
    assert run.rc != 0, log
    assert "no worker finished: all 2 were lost" in run.err, log
    last = run.err.splitlines()[-1]
    assert last.startswith("bpslaunch: error: worker") and "boom" in last, log
    assert not leftovers(e["BYTEPS_JOB_ID"]), leftovers(e["BYTEPS_JOB_ID"])


def test_tables_follow_the_epochs():
    """Server-held tables in an elastic job (docs/sparse.md, "Membership"), the dense tensors on
    the native data plane: a worker SIGKILLed after the others pushed a table's round (it pulled,
    never pushed) does not hang them; the epoch change drops that round (the row is what it
    was before it) and the new epoch's rounds complete with the 2 workers left."""
    steps = 6
    run, job = launch([steps, "kill=2@1", "slow=0.05", "table=1"], 3,
                      extra=["--min-workers", "2", "--max-restarts", "0"])
    log = run.log
    assert run.rc == 0, log
    recs = records(run.out)
    check_sums(recs, log)
    check_table(recs, log)
    first = {(r["epoch"], r["step"]): r["table"] for r in recs if "table" in r}
    assert first[(1, 0)] == 0.0 and first[(1, 1)] == -3.0, log   # rounds of 3 workers
    # step 2 of epoch 1 never ended: round 1 applied (-6), round 2 dropped, not applied
    assert first[(2, 2)] == -6.0, log
    assert first[(2, steps - 1)] == -6.0 - 2 * (steps - 3), log
    assert len([r for r in recs if r.get("done")]) == 2, log
    assert not leftovers(job), leftovers(job)


def test_a_worker_added_mid_run_reads_and_pushes_the_tables():
    """A joiner creates the job's table (the servers hold it already) at the epoch's first
    round and reads the rows the others read; from then on every round needs 3 pushes."""
    recs, log = launch_adding_one([16, "slow=0.15", "table=1"])
    check_table(recs, log)
    joiner = [r for r in recs if r["who"] == "worker 2" and "table" in r]
    assert joiner and joiner[0]["epoch"] == 2 and joiner[0]["size"] == 3, log
    assert len([r for r in recs if r.get("done")]) == 3, log
