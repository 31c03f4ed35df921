"""Bounded staleness in asynchronous mode (BYTEPS_ASYNC_STALENESS, issue 38 item 3): real jobs
under bpslaunch --local (tests/integration/workers/stale.py). A fast worker is never more than
S rounds ahead of the slowest, meets the bound exactly when the slow one holds back, and is not
held by a worker that has finished; with no bound it runs any number of rounds ahead, as
before."""
from __future__ import annotations

import re

import pytest

from .harness import bpslaunch, worker

pytestmark = pytest.mark.integration


def run(tmp_path, s: int, steps0: int, steps1: int):
    env = {"BYTEPS_ENABLE_ASYNC": "1", "BYTEPS_ASYNC_STALENESS": str(s)}
    return bpslaunch(worker("stale.py", s, steps0, steps1, tmp_path), workers=2, servers=2,
                     env=env, timeout=120)


def ahead(text: str) -> int:
    return int(re.search(r"AHEAD (\d+)", text).group(1))


def test_a_fast_worker_stays_within_the_bound_and_a_finished_one_holds_nobody(tmp_path):
    r = run(tmp_path, 3, 16, 6)   # rank 1 stops after 6 steps; rank 0 goes on to 16
    text = r.out + r.err
    assert r.rc == 0, text
    assert ahead(text) == 3, text   # at the bound when rank 1 held back, never past it
    # rank 0's steps 9 to 15 needed rank 1's rounds 6 to 12, which never came: the servers were
    # told rank 1 finished (else rank 0 would fail on its 60 s timeout)
    assert text.count("DONE") == 2, text


def test_without_a_bound_nothing_waits_as_before(tmp_path):
    r = run(tmp_path, 0, 12, 3)    # rank 1 waits after its first step until rank 0 is done
    text = r.out + r.err
    assert r.rc == 0, text
    assert ahead(text) == 11, text  # 12 rounds against rank 1's 1
    assert "staleness bound" not in text
