"""join(): ranks with fewer steps join, the others finish their steps with averages over the
ranks still in; a rank that ends without join() is a PeerLeftError on the others, naming it."""
from __future__ import annotations

import json
import time

import pytest

from byteps_like.errors import EXIT_PEER_FAILED

from .harness import bpslaunch, worker

pytestmark = pytest.mark.integration


def records(out: str) -> list[dict]:
    """The JSON lines the workers printed (bpslaunch prefixes each with "[worker N] ")."""
    return [json.loads(ln[ln.index("{"):]) for ln in out.splitlines()
            if ln.startswith("[worker") and "{" in ln]


def test_uneven_steps_with_join():
    steps = [5, 3, 4]
    run = bpslaunch(worker("join_check.py", ",".join(map(str, steps)), "join"), workers=3,
                    servers=2, timeout=120)
    assert run.rc == 0, run.log
    recs = records(run.out)
    for rec in recs:
        if "step" not in rec:
            continue
        s = rec["step"]
        still_in = [q for q in range(3) if steps[q] > s]
        assert rec["rank"] in still_in, run.log
        want_avg = sum(q + 1 for q in still_in) / len(still_in)
        assert rec["avg"] == pytest.approx(want_avg, rel=1e-6), (rec, run.log)
        assert rec["avg_uniform"], rec
        assert rec["sum"] == pytest.approx(sum(10 * (q + 1) for q in still_in)), (rec, run.log)
    assert sorted(r["rank"] for r in recs if "step" in r) == sorted(
        q for q in range(3) for _ in range(steps[q])), run.log
    joins = [r for r in recs if "joined" in r]
    assert len(joins) == 3 and len({r["joined"] for r in joins}) == 1, run.log
    assert joins[0]["joined"] == 0, run.log  # rank 0 has the most steps: it joins last
    after = [r["after"] for r in recs if "after" in r]
    assert after == [60.0] * 3, run.log  # everyone back in after the join


def test_integer_average_with_join():
    run = bpslaunch(worker("join_check.py", "3,1", "join", "int64"), workers=2, servers=1,
                    timeout=120)
    assert run.rc == 0, run.log
    avgs = {(r["rank"], r["step"]): r["avg"] for r in records(run.out) if "step" in r}
    assert avgs == {(0, 0): 1.0, (1, 0): 1.0, (0, 1): 1.0, (0, 2): 1.0}, run.log  # 3 // 2, 1 // 1


def test_rank_that_ends_without_join_is_named():
    run = bpslaunch(worker("join_check.py", "6,2", "nojoin"), workers=2, servers=1,
                    timeout=90)
    assert run.rc != 0, run.log
    left = [r for r in records(run.out) if "peer_left" in r]
    assert len(left) == 1 and left[0]["rank"] == 0, run.log
    assert left[0]["peer_left"] == 1 and left[0]["last_round"] == 1, run.log
    assert "worker rank 1" in left[0]["message"] and "join()" in left[0]["message"], run.log
    assert "round 2 of key" in left[0]["message"], run.log
    # well within the heartbeat timeout: no waiting out BYTEPS_TIMEOUT_SECONDS (60 s here)
    assert run.elapsed < 30, run.log


def test_rank_that_ends_without_join_leaves_at_once():
    """Rank 1 ends after 2 steps without join(); rank 0 dies of the PeerLeftError naming it.
    Rank 1's shutdown() returns at once (issue 30: it waited out the heartbeat timeout, 20 s
    by default, the scheduler being gone) and the job ends within seconds, blaming no process
    for a failure of its own (rank 0 exited because rank 1 left) and quoting the error."""
    run = bpslaunch(worker("join_check.py", "6,2", "nojoin-uncaught"), workers=2, servers=1,
                    env={"BYTEPS_HEARTBEAT_TIMEOUT_SECONDS": "20"}, timeout=90)
    ended = time.time()
    assert run.rc == EXIT_PEER_FAILED, run.log
    left = [r for r in records(run.out) if "shutdown" in r]
    assert [r["rank"] for r in left] == [1], run.log
    assert left[0]["shutdown"] < 2, run.log
    assert ended - left[0]["t"] < 5, run.log
    last = run.err.strip().splitlines()[-1]
    assert "no process failed on its own" in last and "PeerLeftError" in last, run.log
    assert "worker rank 1" in last and "join()" in last, run.log
