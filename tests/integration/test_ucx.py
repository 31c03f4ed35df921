"""BYTEPS_TRANSPORT=ucx jobs end to end since the ucxx endpoint's retirement (issue 39): dense
data and the server-held tables on the native plane's UCX streams (the tables' since they moved
there), control on each node's ZeroMQ endpoint, with the job's secret (bpslaunch --local's default) and without one, on
loopback and across emulated machines (network namespaces behind one bridge, each process on
its machine's own address: the case without a secret that had the ucxx endpoint). Exact sums
of every dtype, and tables that match the one-process model."""
from __future__ import annotations

import sys

import pytest

from byteps_like.bench import netns
from byteps_like.bench.harness import Job, local_job, on_hosts
from tests.support import FAST_ENV, clean_env, free_port

from ..native_stream import require_ucx
from .harness import bpslaunch, worker
from .test_pushpull import SMALL, transport_env

_WHY = netns.why_unavailable() if sys.platform == "linux" else "needs Linux"
needs_netns = pytest.mark.skipif(_WHY is not None, reason=str(_WHY))

pytestmark = pytest.mark.integration

#: (worker script and arguments, what each worker prints when its results are exact)
JOBS = {"sums": (worker("pushpull_check.py", *SMALL), f"of 2: {2 * 6 * len(SMALL)} tensors"),
        "tables": (worker("sparse_torch.py"), "tables and head match")}


@pytest.fixture(autouse=True)
def ucx(monkeypatch):
    require_ucx(monkeypatch)   # skips only without the `ucx` extra; where it is, UCX must work


def test_tables_run_over_ucx():
    """Server-held tables (SGD and Adagrad) with a dense head, 2 workers x 2 servers over UCX,
    with the job's secret: the tables' requests ride their table streams, UCX endpoints here,
    authenticated by the streams' hello."""
    pytest.importorskip("torch")
    script, done = JOBS["tables"]
    run = bpslaunch(script, workers=2, servers=2, env=transport_env("ucx"), timeout=180)
    assert run.rc == 0, run.log
    assert len(run.lines(done)) == 2, run.log


def test_a_ucx_job_without_a_secret():
    """bpslaunch --local --no-auth over UCX: no secret, so no CURVE on the ZeroMQ endpoints
    and no hello on the UCX streams; exact all the same (tables without a secret: across
    machines, below)."""
    script, done = JOBS["sums"]
    run = bpslaunch(script, workers=2, servers=2, env=transport_env("ucx"), extra=["--no-auth"],
                    timeout=180)
    assert run.rc == 0, run.log
    assert len(run.lines(done)) == 2, run.log


@needs_netns
@pytest.mark.parametrize("job,secret", [("sums", False), ("tables", False), ("sums", True)])
def test_a_ucx_job_across_machines(job, secret):
    """bpslaunch --local's plan spread over four emulated machines (the scheduler and worker i
    on w{i}, server j on s{j}), each process advertising its machine's address, UCX over TCP
    on their network: without a secret (before issue 39 the servers' tables endpoint was the
    ucxx engine's there) and with one (CURVE, and the UCX streams' hello)."""
    if job == "tables":
        pytest.importorskip("torch")
    script, done = JOBS[job]
    env = clean_env("UCX_", **FAST_ENV, **transport_env("ucx", UCX_NET_DEVICES="eth0"))
    if secret:
        env["BYTEPS_AUTH_SECRET"] = "a secret of this test"
    with netns.NetnsCluster(["w0", "w1", "s0", "s1"], rate_bits=0) as cluster:
        plan = on_hosts(local_job([sys.executable, *script], free_port(), workers=2,
                                  servers=2, host=cluster.ip("w0")), cluster)
        with Job(f"ucx-{job}") as g:
            workers = g.start(plan, env)
            g.wait(240)
            outs = [w.stdout() for w in workers]
    assert all(done in out for out in outs), outs
