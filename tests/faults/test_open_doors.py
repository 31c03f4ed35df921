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
    assert r["tries"] == 100 and r["accepted"] == 0 and r["job_ran_throughout"], r
    assert r["scheduler"] == "refused", r       # the control plane is on CURVE too
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
    assert r["tries"] == 200 and r["accepted"] == 0 and r["job_ran_throughout"], r
    assert r["scheduler"] == "refused", r
    assert r["non_loopback"] == [] and r["listening"], r
    assert r["rc"] == 0 and len(r["exact"]) == 2 and not r["wrong"], log
    assert log.count("authenticated with a one-time secret of the job") == 1, log
    assert "authentication failed: " in log, log


def test_a_torchrun_job_whose_worker_was_killed_leaves_no_shared_memory(tmp_path):
    """Issue 41: a SIGKILLed torchrun worker left its job's segments (8, ~39 MB) and nothing
    swept them. Every process of a job now holds its files' lock, so the next job on the
    machine (torchrun here; any launcher's) removes what the dead job left, and its own at
    its end: nothing remains."""
    import json
    import os
    import signal
    import time
    from pathlib import Path

    from ..support import watch
    from .strangers import job_command, spawn
    shm = tmp_path / "shm"
    shm.mkdir()
    info, stop = str(tmp_path / "info.json"), str(tmp_path / "stop")
    cmd, env = job_command("torchrun", info, stop)
    env["BYTEPS_SHM_DIR"] = str(shm)
    proc = spawn(cmd, env)
    deadline = time.monotonic() + 120
    # the job is up and its local reduction made its segments
    while not (os.path.exists(info) and any(n.endswith(tuple("0123456789"))
                                            for n in os.listdir(shm))):
        assert proc.poll() is None and time.monotonic() < deadline, watch(proc, 30)
        time.sleep(0.05)
    victim = json.loads(Path(info).read_text())["workers"]["1"]
    os.kill(victim, signal.SIGKILL)
    rc, out, err = watch(proc, 120, "torchrun job")
    assert rc != 0, out + err
    left = os.listdir(shm)
    # then another torchrun job on the machine, which ends normally
    info2, stop2 = str(tmp_path / "info2.json"), str(tmp_path / "stop2")
    Path(stop2).touch()
    cmd, env = job_command("torchrun", info2, stop2)
    env["BYTEPS_SHM_DIR"] = str(shm)
    rc, out, err = watch(spawn(cmd, env), 120, "the next torchrun job")
    assert rc == 0 and out.count("EXACT 1") == 2, out + err
    assert os.listdir(shm) == [], (left, out + err)
    print(f"\nleft by the killed job: {sorted(left)}; after the next job: none")
