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
