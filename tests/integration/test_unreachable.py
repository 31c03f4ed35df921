"""An unreachable scheduler address (issue 40): a node whose connection attempts get no answer
at all fails within BYTEPS_SCHEDULER_CONNECT_TIMEOUT_SECONDS with one error naming the address.

The address never answers because the test makes it so, in a network namespace of its own: a
veth pair whose far end has no address, and a permanent neighbour entry for the scheduler's
address, so the node's SYNs leave on the near end and are dropped on the far one, with no
refusal and no ARP failure. Nothing leaves the namespace, let alone the machine. Creating a
namespace needs root, which CI has."""
from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import pytest

from tests.support import clean_env, spawn, watch

pytestmark = pytest.mark.integration

SILENT_ADDRESS = "10.254.0.2"   # inside the namespace: routed to a veth end that drops it


@pytest.fixture
def silent_namespace():
    assert os.geteuid() == 0, ("this test makes a network namespace (ip netns add), which needs "
                               "root; CI runs as root")
    name = f"bpsl-t-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        for cmd in (["ip", "link", "set", "lo", "up"],
                    ["ip", "link", "add", "va", "type", "veth", "peer", "name", "vb"],
                    ["ip", "addr", "add", "10.254.0.1/24", "dev", "va"],
                    ["ip", "link", "set", "va", "up"], ["ip", "link", "set", "vb", "up"],
                    ["ip", "neigh", "add", SILENT_ADDRESS, "lladdr", "02:00:00:00:00:02",
                     "dev", "va", "nud", "permanent"]):
            subprocess.run(["ip", "netns", "exec", name, *cmd], check=True)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def test_an_unreachable_scheduler_is_one_clear_error_within_the_timeout(silent_namespace):
    env = clean_env(DMLC_ROLE="worker", DMLC_NUM_WORKER="1", DMLC_NUM_SERVER="1",
                    DMLC_PS_ROOT_URI=SILENT_ADDRESS, DMLC_PS_ROOT_PORT="9000",
                    BYTEPS_SCHEDULER_CONNECT_TIMEOUT_SECONDS="3")
    code = "import byteps_like as bps; bps.init()"
    t0 = time.monotonic()
    rc, out, err = watch(spawn(["ip", "netns", "exec", silent_namespace, sys.executable, "-c",
                                code], env), 60, "worker")
    elapsed = time.monotonic() - t0
    assert rc != 0, err
    assert elapsed < 3 + 10, f"{elapsed:.1f} s\n{err}"   # the interpreter's start, on 2 cores
    assert err.count("no answer from the scheduler") == 1, err
    line = next(ln for ln in err.splitlines() if "no answer from the scheduler" in ln)
    assert line.startswith("byteps_like.errors.CommTimeoutError: worker on "), line
    assert f"tcp://{SILENT_ADDRESS}:9000 within 3 s" in line, line
    assert "BYTEPS_SCHEDULER_CONNECT_TIMEOUT_SECONDS" in line and "DMLC_PS_ROOT_URI" in line
    assert "WARNING" not in err, err
