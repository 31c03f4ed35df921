"""No open door (issue 41): every transport and launcher path authenticates its peers by
default, and a job on loopback listens on loopback only. A stranger on the machine that knows
the protocol, the job's tag and a server's data port, but not the secret, tries to push forged
values into a running job (tests/faults/strangers.py) while the job checks every sum."""
from __future__ import annotations

import pytest

from .strangers import attack

pytestmark = pytest.mark.integration


def test_a_stranger_cannot_push_into_a_local_ucx_job():
    """bpslaunch --local over UCX (UCX_TLS=tcp): the job makes its secret as over TCP, its
    UCX streams run the authenticated hello, and nothing of it listens off loopback. Before
    issue 41 the job ran unauthenticated (a forged push landed at try 5,078 of 10,000) and
    UCX's TCP transport listened on every interface's address."""
    r = attack("ucx", tries=100)
    log = r.pop("log")
    assert r["auth"], log                       # the secret was made for the job
    assert r["tries"] == 100 and r["accepted"] == 0, r
    assert r["non_loopback"] == [] and r["listening"], r
    assert r["rc"] == 0 and len(r["exact"]) == 2 and not r["wrong"], log
    # every try was refused by the proof of the secret, and the server said so
    assert "authentication failed: " in log, log


def test_a_stranger_cannot_push_into_a_single_node_torchrun_job():
    """torchrun --standalone, no byteps_like setting: local rank 0 makes the job's one-time
    secret and shares it through a file of mode 0600, so the stranger's pushes are refused
    (before issue 41 the job was unauthenticated and a forged push landed at try 6); global
    rank 0 says once that the job is authenticated."""
    r = attack("torchrun", tries=200)
    log = r.pop("log")
    assert r["auth"], log
    assert r["tries"] == 200 and r["accepted"] == 0, r
    assert r["non_loopback"] == [] and r["listening"], r
    assert r["rc"] == 0 and len(r["exact"]) == 2 and not r["wrong"], log
    assert log.count("authenticated with a one-time secret of the job") == 1, log
    assert "authentication failed: " in log, log
