"""Backup workers and the data (docs/reliability.md, "Backup workers"): with BYTEPS_BACKUP_WORKERS=1
on 3 workers, rank 2's pushes are dropped in every round (it starts only once the others have
finished). Measured through the real servers, from the averages every rank gets back:

* with ``bps.DistributedSampler`` every sample of the dataset reaches the model, each epoch's
  rounds sum at least the dataset's size, and each average divides by the pushes summed;
* with a fixed shard per rank (the digits example before) the slow rank's shard never does:
  the cause of the accuracy the digits example lost with a backup worker.
"""
from __future__ import annotations

import json
import re

import pytest

from .harness import bpslaunch, worker

pytestmark = pytest.mark.integration
pytest.importorskip("torch")

N, EPOCHS, SLOW = 240, 4, 2


def run_job(tmp_path, mode: str):
    env = {"BYTEPS_BACKUP_WORKERS": "1", "BYTEPS_SERVER_FAILOVER": "0",
           "BYTEPS_BACKUP_MAX_LAG": "100", "BYTEPS_LOG_LEVEL": "INFO"}
    run = bpslaunch(worker("backup_sampling.py", mode, EPOCHS, SLOW, tmp_path), workers=3,
                    servers=1, env=env, timeout=180)
    assert run.rc == 0, run.log
    reports = {}
    for line in run.lines("REPORT rank"):
        m = re.search(r"REPORT rank (\d+): (\{.*\})", line)
        assert m, line
        reports[int(m.group(1))] = json.loads(m.group(2))
    assert sorted(reports) == [0, 1, 2], run.log
    # the slow rank was left out of every round, and it caught up with the same sums
    assert all(r == reports[0] for r in reports.values()), reports
    rep = reports[0]
    assert rep["ranks"] == [0, 1] and rep["exact"], rep
    m = re.search(r"(\d+) rounds completed without every worker's push, (\d+) late", run.err)
    assert m and int(m.group(1)) == int(m.group(2)) == rep["steps"], run.log
    return rep


def test_the_sampler_puts_every_sample_into_the_model(tmp_path):
    rep = run_job(tmp_path, "sampler")
    assert rep["never"] == 0, rep
    # each rank's part is ceil(240 / 2) = 120 samples, 15 batches: the two ranks the rounds
    # average sum 240 samples an epoch, as three healthy ranks would
    assert rep["steps"] == EPOCHS * 15 and rep["per_epoch"] == [N] * EPOCHS, rep


def test_fixed_shards_lose_the_slow_ranks_shard(tmp_path):
    rep = run_job(tmp_path, "shards")
    assert rep["never_ids"] == list(range(SLOW, N, 3)), rep
    assert rep["per_epoch"] == [2 * 10 * 8] * EPOCHS, rep  # 160 of 240 samples an epoch
