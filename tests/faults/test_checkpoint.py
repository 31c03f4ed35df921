"""Checkpoint and resume: a job that fails part-way (a worker SIGKILLed) is restarted with a
different number of workers from rank 0's checkpoint (model, optimizer state, step), and ends
with the same parameters as an uninterrupted run."""
from __future__ import annotations

import pytest

from tests.integration.harness import bpslaunch

from .test_faults import HERE

pytestmark = pytest.mark.integration
TRAIN = str(HERE / "ckpt_train.py")
END = 10


def train(*args):
    return [TRAIN, *map(str, args)]


def test_resume_after_failure_with_a_different_worker_count_matches_an_uninterrupted_run(
        tmp_path):
    torch = pytest.importorskip("torch")
    ref = bpslaunch(train(tmp_path / "ref.ckpt", tmp_path / "ref.pt", END), workers=2,
                    servers=1, timeout=120)
    assert ref.rc == 0, ref.log
    # a 2-worker job that dies before step 6 (checkpoint written after step 5)
    ckpt = tmp_path / "job.ckpt"
    crashed = bpslaunch(train(ckpt, tmp_path / "never.pt", END, 6), workers=2, servers=1,
                        timeout=120)
    assert crashed.rc != 0, crashed.log
    assert not (tmp_path / "never.pt").exists()
    at6 = torch.load(ckpt, weights_only=True)
    assert at6["step"] == 6
    # restart with 3 workers and 2 servers
    resumed = bpslaunch(train(ckpt, tmp_path / "resumed.pt", END), workers=3, servers=2,
                        timeout=120)
    assert resumed.rc == 0, resumed.log
    assert "RESUMED from step 6 with 3 workers" in resumed.out, resumed.log
    a = torch.load(tmp_path / "ref.pt", weights_only=True)
    b = torch.load(tmp_path / "resumed.pt", weights_only=True)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-10, atol=1e-12)
    # training really continued after the resume
    assert not torch.equal(b["0.weight"], at6["model"]["0.weight"])
