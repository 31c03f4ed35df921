"""push_pull on real local clusters: every dtype, sizes from 1 element to 64 MiB, 1/2/4 workers
with 1/2 servers, asynchronous mode and declaration mismatches; the core cases over both
transports, ZeroMQ and UCX (docs/transports.md)."""
from __future__ import annotations

import importlib.util
import os

import pytest

from ..native_stream import UCX_EXTRA
from .harness import bpslaunch, worker

pytestmark = pytest.mark.integration

SMALL = [1, 7, 1000, 70001]  # 70001 elements cross several 64 KiB partitions

_UCX = pytest.mark.skipif(importlib.util.find_spec("libucx") is None,
                          reason="libucx not installed (pip install 'byteps_like[ucx]')")
ZMQ, UCX = "zmq", pytest.param("ucx", marks=_UCX)  # BYTEPS_TRANSPORT: TCP or UCX streams


def transport_env(transport: str, **env: str) -> dict:
    """``env`` plus what selects ``transport``; UCX stays on loopback TCP unless the user set
    UCX_TLS / UCX_NET_DEVICES."""
    env["BYTEPS_TRANSPORT"] = transport
    if transport == "ucx":
        env.setdefault("UCX_TLS", os.environ.get("UCX_TLS", "tcp"))
        env.setdefault("UCX_NET_DEVICES", os.environ.get("UCX_NET_DEVICES", "lo"))
        env.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    return env


@pytest.mark.parametrize("workers,servers,transport", [
    (1, 1, ZMQ), (1, 2, ZMQ), (2, 1, ZMQ), (2, 2, ZMQ), (4, 1, ZMQ), (4, 2, ZMQ),
    pytest.param(2, 2, "ucx", marks=_UCX), pytest.param(4, 1, "ucx", marks=_UCX)])
def test_every_dtype_exact(workers, servers, transport):
    run = bpslaunch(worker("pushpull_check.py", *SMALL), workers=workers, servers=servers,
                    env=transport_env(transport, BYTEPS_PARTITION_BYTES="64K",
                                      BYTEPS_SCHEDULING_CREDIT="2"))
    assert run.rc == 0, run.log
    ok = run.lines("OK rank")
    assert len(ok) == workers, run.log
    assert all(f"of {workers}: {2 * 6 * len(SMALL)} tensors checked" in ln for ln in ok), run.log


@pytest.mark.parametrize("transport", [ZMQ, UCX])
def test_two_local_ranks_per_machine(transport):
    run = bpslaunch(worker("pushpull_check.py", 5, 5000), workers=2, servers=1, local_size=2,
                    env=transport_env(transport, ROUNDS="1"))
    assert run.rc == 0, run.log
    assert len(run.lines("of 4: 12 tensors checked")) == 4, run.log


@pytest.mark.parametrize("transport", [ZMQ, UCX])
def test_64mib_tensor_two_servers(transport):
    n = (64 << 20) // 4  # 64 MiB of float32 (and the other dtypes at the same element count)
    run = bpslaunch(worker("pushpull_check.py", n), workers=2, servers=2,
                    env=transport_env(transport, ROUNDS="1"), timeout=240)
    assert run.rc == 0, run.log
    assert len(run.lines("OK rank")) == 2, run.log


_NATIVE_UCX = pytest.mark.skipif(
    importlib.util.find_spec("libucx") is None,
    reason="libucx not installed (pip install 'byteps_like[ucx]')")


@_NATIVE_UCX
def test_ucx_transport_runs_on_the_native_data_plane():
    """BYTEPS_TRANSPORT=ucx: the compiled data plane carries the partitions over UCX streams
    (a job refuses to start where they cannot be used), exact, 2 workers x 2 servers,
    partitions of every stream, several rounds."""
    from byteps_like.transport import ucx_native
    why = ucx_native.load()   # the ucx extra is here (_NATIVE_UCX): UCX must work
    assert not why, (f"{UCX_EXTRA}, but the native plane's UCX streams are unavailable: {why}. "
                     "Build _core again in this environment: `pip install --no-deps -e .`")
    run = bpslaunch(worker("pushpull_check.py", *SMALL), workers=2, servers=2,
                    env=transport_env("ucx", REPORT_PLANE="1",
                                      BYTEPS_PARTITION_BYTES="64K", BYTEPS_DATA_STREAMS="2"))
    assert run.rc == 0, run.log
    assert len(run.lines(f"of 2: {2 * 6 * len(SMALL)} tensors checked")) == 2, run.log
    planes = run.lines("PLANE rank")
    assert len(planes) == 2 and all("native_streams=4" in ln for ln in planes), run.log


def test_one_machine_of_four_local_ranks():
    run = bpslaunch(worker("pushpull_check.py", *SMALL), workers=1, servers=1, local_size=4,
                    env={"ROUNDS": "1", "BYTEPS_PARTITION_BYTES": "64K"})
    assert run.rc == 0, run.log
    assert len(run.lines(f"of 4: {6 * len(SMALL)} tensors checked")) == 4, run.log


@pytest.mark.parametrize("force", [False, True])
def test_one_machine_keeps_push_pull_on_the_machine(force):
    """DMLC_NUM_WORKER=1 with 2 local ranks: bpslaunch starts no server and push_pull is the
    shared-memory reduction alone, exact; BYTEPS_FORCE_DISTRIBUTED=1 (with a server asked for)
    keeps the path through the server."""
    env = {"ROUNDS": "2", "REPORT_PLANE": "1"}
    if force:
        env["BYTEPS_FORCE_DISTRIBUTED"] = "1"
    run = bpslaunch(worker("pushpull_check.py", 5, 70001), workers=1,
                    servers=1 if force else None, local_size=2, env=env)
    assert run.rc == 0, run.log
    assert len(run.lines("of 2: 24 tensors checked")) == 2, run.log
    planes = run.lines("PLANE rank")
    assert len(planes) == 2, run.log
    for ln in planes:
        if force:
            assert "single_machine=False servers=1" in ln, run.log
        else:
            assert "single_machine=True servers=0 pushed=0" in ln, run.log
    if force:  # the local root pushed the machine's sums to the server
        assert any("pushed=0" not in ln for ln in planes), run.log
