"""BYTEPS_TRANSPORT=ucx jobs end to end since the ucxx endpoint's retirement (issue 39): dense
data on the native plane's UCX streams, control and the server-held tables on each node's
ZeroMQ endpoint, with the job's secret (bpslaunch --local's default) and without one. Exact
sums of every dtype, and tables that match the one-process model."""
from __future__ import annotations

import pytest

from ..native_stream import require_ucx
from .harness import bpslaunch, worker
from .test_pushpull import SMALL, transport_env

pytestmark = pytest.mark.integration

#: (worker script and arguments, what each worker prints when its results are exact)
JOBS = {"sums": (worker("pushpull_check.py", *SMALL), f"of 2: {2 * 6 * len(SMALL)} tensors"),
        "tables": (worker("sparse_torch.py"), "tables and head match")}


@pytest.fixture(autouse=True)
def ucx(monkeypatch):
    require_ucx(monkeypatch)   # skips only without the `ucx` extra; where it is, UCX must work


def test_tables_run_over_ucx():
    """Server-held tables (SGD and Adagrad) with a dense head, 2 workers x 2 servers over UCX,
    with the job's secret: the tables' requests ride the ZeroMQ endpoint (CURVE)."""
    pytest.importorskip("torch")
    script, done = JOBS["tables"]
    run = bpslaunch(script, workers=2, servers=2, env=transport_env("ucx"), timeout=180)
    assert run.rc == 0, run.log
    assert len(run.lines(done)) == 2, run.log


@pytest.mark.parametrize("job", sorted(JOBS))
def test_a_ucx_job_without_a_secret(job):
    """bpslaunch --local --no-auth over UCX: no secret, so no CURVE on the ZeroMQ endpoints
    and no hello on the UCX streams; dense sums and tables exact all the same."""
    if job == "tables":
        pytest.importorskip("torch")
    script, done = JOBS[job]
    run = bpslaunch(script, workers=2, servers=2, env=transport_env("ucx"), extra=["--no-auth"],
                    timeout=180)
    assert run.rc == 0, run.log
    assert len(run.lines(done)) == 2, run.log
