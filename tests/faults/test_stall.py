"""The stall inspector: a round some workers pushed and others did not is reported by its server
to the scheduler, which logs the tensor names and missing ranks, and (optionally) fails the job."""
from __future__ import annotations

import logging
import time

import numpy as np
import pytest

from byteps_like.errors import PeerLostError

from .cluster import running_cluster

pytestmark = pytest.mark.integration


def _wait(pred, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


def test_stall_is_logged_with_tensor_name_and_missing_ranks():
    caplog = _Records()
    logging.getLogger("byteps_like.scheduler").addHandler(caplog)
    with running_cluster(workers=3, extra={"BYTEPS_STALL_CHECK_TIME_SECONDS": "0.5"}) as c:
        # every worker completes a round of 'ok'; only ranks 0 and 2 push 'lonely'
        assert all(np.array_equal(o, np.full(4, 6)) for o in c.push_pull(
            lambda r: np.full(4, r + 1, np.int32), "ok")), "warm-up failed"
        handles = [c.workers[r].push_pull_async(np.ones(4, np.int32), name="lonely",
                                                average=False) for r in (0, 2)]
        assert _wait(lambda: c.sched.stall_log, 10), "no stall reported"
        text = c.sched.stall_log[0]
        assert "'lonely'" in text and "missing worker ranks [1]" in text, text
        assert "'ok'" not in text, text
        assert any("stall inspector" in r.getMessage() for r in caplog.records)
        # the late worker arrives: the round completes and the job goes on
        late = c.workers[1].push_pull_async(np.ones(4, np.int32), name="lonely", average=False)
        for h in [*handles, late]:
            assert np.array_equal(h.wait(30), np.full(4, 3))
        assert len(c.sched.stall_log) == 1  # one report per stalled round, not one per check
        assert c.sched.exit_code is None
    logging.getLogger("byteps_like.scheduler").removeHandler(caplog)


def test_stall_shutdown_fails_every_worker_naming_the_missing_rank():
    with running_cluster(workers=2, extra={"BYTEPS_STALL_CHECK_TIME_SECONDS": "0.3",
                                           "BYTEPS_STALL_SHUTDOWN_TIME_SECONDS": "1.5"}) as c:
        c.failed_on_purpose = True
        t0 = time.monotonic()
        h = c.workers[0].push_pull_async(np.ones(4, np.float32), name="grad.w", average=False)
        with pytest.raises(PeerLostError) as info:
            h.wait(30)
        elapsed = time.monotonic() - t0
        assert elapsed < 10, elapsed
        msg = str(info.value)
        assert "stall inspector" in msg and "'grad.w'" in msg and "[1]" in msg, msg
        assert info.value.role == "worker" and info.value.rank == 1
        assert c.sched.wait(10) == 1
        assert "grad.w" in c.sched.failure
        # the stalled worker itself is told too
        assert _wait(lambda: c.workers[1].control.fatal is not None, 10)
        assert isinstance(c.workers[1].control.fatal, PeerLostError)
