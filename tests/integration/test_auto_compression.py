"""Compression.auto on a real local cluster: rank 0 decides, every rank switches at the same
round, and back (tests/integration/workers/auto_check.py)."""
from __future__ import annotations

import re

import pytest

from .harness import bpslaunch, worker

pytestmark = pytest.mark.integration


def test_auto_switches_every_rank_at_the_same_round_and_back():
    run = bpslaunch(worker("auto_check.py"), workers=2, servers=2,
                    env={"BYTEPS_PARTITION_BYTES": "256K", "BYTEPS_LOG_LEVEL": "INFO"})
    assert run.rc == 0, run.log
    steps: dict[int, dict[int, tuple[bool, str]]] = {}
    for ln in run.lines("STEP "):
        m = re.search(r"STEP (\d+) rank (\d+) exact=(True|False) crc=(\w+)", ln)
        assert m, ln
        steps.setdefault(int(m[1]), {})[int(m[2])] = (m[3] == "True", m[4])
    assert sorted(steps) == list(range(8)), run.log
    for step, ranks in steps.items():
        assert len(ranks) == 2 and ranks[0] == ranks[1], (step, ranks, run.log)
    # decided before step 2 (slow link): onebit from step 3 (the next epoch's broadcast);
    # decided before step 5 (fast link): none again from step 6
    exact = [steps[s][0][0] for s in range(8)]
    assert exact == [True, True, True, False, False, False, True, True], run.log
    dec = run.lines("DECISION")
    assert len(dec) == 2 and "epoch=3" in dec[0] and "'onebit'" in dec[0], run.log
    assert "epoch=6" in dec[1] and "'none'" in dec[1], run.log
    assert "auto compression: bandwidth" in run.err and "-> onebit [onebit" in run.err, run.log


def test_auto_under_torchs_distributed_optimizer_keeps_every_rank_identical():
    # the synchronizer's fused host bucket goes through auto: none, then onebit from the step
    # after rank 0 decided; every rank's parameters stay bit-identical
    run = bpslaunch(worker("auto_torch.py"), workers=2, servers=1, timeout=180)
    assert run.rc == 0, run.log
    crcs: dict[int, dict[int, str]] = {}
    for ln in run.lines("STEP "):
        m = re.search(r"STEP (\d+) rank (\d+) crc=(\w+)", ln)
        assert m, ln
        crcs.setdefault(int(m[1]), {})[int(m[2])] = m[3]
    assert sorted(crcs) == list(range(6)), run.log
    assert all(len(c) == 2 and c[0] == c[1] for c in crcs.values()), (crcs, run.log)
    names = run.lines("AUTO NAMES")
    assert len(names) == 2 and all("#auto.onebit" in ln for ln in names), run.log


def test_auto_goes_on_after_rank_0_joined():
    # rank 0 (the one that decides) stops 3 steps early and joins; the other ranks' auto
    # broadcasts then sum to zeros: the last table stays, no "out of step" error
    run = bpslaunch(worker("auto_join.py"), workers=2, servers=1)
    assert run.rc == 0, run.log
    assert len(run.lines("OK auto join")) == 2, run.log


def test_switched_names_get_the_same_keys_whatever_the_push_order():
    # the ranks push two tensors in opposite orders each step; the names they switch to are
    # declared in the order of the tensors' own declarations (without that, rank 1 declared
    # 'b#auto.onebit' under the key rank 0 gave 'a#auto.onebit': a MismatchError)
    run = bpslaunch(worker("auto_order.py"), workers=2, servers=1)
    assert run.rc == 0, run.log
    ok = run.lines("OK auto order")
    assert len(ok) == 2 and all(ln.endswith("a#auto.onebit b#auto.onebit") for ln in ok), run.log


def test_shutdown_stops_the_measuring_thread_first():
    # rank 0 shuts down while its thread is held inside the codec-speed measurement; shutdown
    # returns with the thread ended (stopped at its next timed call), and the process exits 0
    run = bpslaunch(worker("auto_shutdown.py"), workers=2, servers=1)
    assert run.rc == 0, run.log
    lines = run.lines("AUTO SHUTDOWN")
    assert len(lines) == 2 and all("thread_alive=False" in ln for ln in lines), run.log
    assert "AUTO SHUTDOWN rank 0 thread_alive=False speeds=None" in run.out, run.log
    assert "terminate called" not in run.err, run.log
