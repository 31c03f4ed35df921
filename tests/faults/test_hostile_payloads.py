"""The audit's compressed payloads on a running job (issue 41, item 5): a peer's push whose
numbers are what no encoder writes for a finite tensor -- a NaN or infinite onebit scale or
dithering norm, a NaN or infinite top-k / random-k value, a top-k index twice (the audit: 74
instead of 77) -- is refused by the server with an error naming the sender's rank and counted
under that rank (here a stranger on a job without a secret, claiming rank 0); nothing of it
reaches a sum, and the real job, a compressed tensor included, stays exact."""
from __future__ import annotations

import pytest

from tests.unit.test_payload_semantics import CASES, N, _good

from .cluster import running_cluster
from .hostile import NATIVE_ERROR, native_stream
from .test_hostile_server import _exact_rounds, _native_compressed, _native_replies

pytestmark = pytest.mark.integration


def test_bad_numbers_in_compressed_pushes_are_refused_naming_and_counting_the_sender():
    with running_cluster(workers=2) as c:
        _exact_rounds(c, 1)
        srv = c.server
        port, job = srv.control.data_port, srv.job
        cases = sorted(CASES)
        with native_stream(port, job) as s:
            for i, case in enumerate(cases):
                comp, damage, _words = CASES[case]
                bad = damage(_good(comp)).tobytes()
                s.sendall(_native_compressed(job, 930_000 + i, comp, N, bad))
            replies = _native_replies(s, len(cases))
        for case, (mtype, meta) in zip(cases, replies):
            assert mtype == NATIVE_ERROR, (case, mtype, meta)
            msg = meta["message"]
            assert "worker rank 0" in msg and "malformed payload" in msg, (case, msg)
            assert CASES[case][2] in msg, (case, msg)
        rej = srv.rejections()
        assert rej.get("malformed compressed payload from worker rank 0") == len(cases), rej
        _exact_rounds(c, 2)
