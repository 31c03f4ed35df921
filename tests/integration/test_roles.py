"""The scheduler and server roles on their own: registration timeouts, refused peers, hostile
frames on a live server."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import zmq

from byteps_like.config import load
from byteps_like.errors import ConfigError
from byteps_like.scheduler import Scheduler
from byteps_like.server import Server
from byteps_like.wire import Header, MsgType, Role, decode, encode, job_hash
from byteps_like.worker.runtime import Runtime
from tests.support import free_port

pytestmark = pytest.mark.integration


def role_env(port: int, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "BYTEPS_"))}
    env.update({"DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": str(port),
                "DMLC_NUM_WORKER": "2", "DMLC_NUM_SERVER": "1",
                "BYTEPS_REGISTER_TIMEOUT_SECONDS": "2", "BYTEPS_LOG_LEVEL": "INFO"})
    env.update(extra)
    return env


def test_registration_timeout_names_who_is_missing():
    port = free_port()
    p = subprocess.run([sys.executable, "-m", "byteps_like.scheduler"], env=role_env(port),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 1, p.stderr
    assert "registration timed out after 2 s" in p.stderr, p.stderr
    assert "0 of 2 workers and 0 of 1 servers joined" in p.stderr, p.stderr
    assert "worker ids not seen: [0, 1]" in p.stderr, p.stderr


def test_bad_setting_exits_2_with_the_variable_named():
    p = subprocess.run([sys.executable, "-m", "byteps_like.server"],
                       env=role_env(free_port(), BYTEPS_PARTITION_BYTES="4x"),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert "BYTEPS_PARTITION_BYTES='4x' (environment)" in p.stderr, p.stderr


@pytest.fixture
def cluster():
    """Scheduler, one server and two in-process workers over TCP loopback."""
    port = free_port()
    env = {k: v for k, v in role_env(port).items() if k.startswith(("DMLC_", "BYTEPS_"))}
    env["BYTEPS_REGISTER_TIMEOUT_SECONDS"] = "30"
    sched = Scheduler(load(env={**env, "DMLC_ROLE": "scheduler"}))
    sched.start()
    server = Server(load(env={**env, "DMLC_ROLE": "server"}))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    workers = [Runtime(load(env={**env, "DMLC_ROLE": "worker", "DMLC_WORKER_ID": str(i)}))
               for i in range(2)]
    inits = [threading.Thread(target=w.init) for w in workers]
    for th in inits:
        th.start()
    for th in inits:
        th.join(30)
    assert all(w.initialized for w in workers)
    yield sched, server, workers
    for w in workers:
        threading.Thread(target=w.shutdown, daemon=True).start()
    assert sched.wait(30) == 0
    t.join(30)
    sched.close()


def test_server_survives_hostile_frames(cluster):
    sched, server, workers = cluster
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 5000)
    s.connect(server.address)
    job = job_hash("default")
    hostile = [
        [b"garbage"],
        [b"BPSL" + b"\x00" * 10],
        [b"XXXX" + Header(MsgType.PUSH).pack()[4:]],
        # claims 1000 float32 but carries 3 bytes
        [Header(MsgType.PUSH, "float32", Role.WORKER, 0, 0, job, 1, 0, 1000, 4000).pack(), b"abc"],
        # a rank that is not part of the job
        encode(Header(MsgType.PUSH, "float32", Role.WORKER, 99, 0, job, 1, 0, 1, 4), b"\0" * 4),
        # another job's tag
        encode(Header(MsgType.PUSH, "float32", Role.WORKER, 0, 0, job ^ 1, 1, 0, 1, 4), b"\0" * 4),
        # first push of a key without a declaration
        encode(Header(MsgType.PUSH, "float32", Role.WORKER, 0, 0, job, 12345, 0, 1, 4), b"\0" * 4),
    ]
    for frames in hostile:
        s.send_multipart(frames)
        reply = decode(s.recv_multipart())
        assert reply.header.type is MsgType.ERROR
        assert reply.meta and reply.meta["message"], reply
    s.close()
    assert server.rejected >= 5
    # the job is unharmed
    outs = [None, None]

    def go(i):
        outs[i] = workers[i].push_pull_async(np.full(5, i + 1, np.int32), name="t",
                                             average=False).wait(30)
    ts = [threading.Thread(target=go, args=(i,)) for i in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert all(np.array_equal(o, np.full(5, 3)) for o in outs)


@pytest.mark.parametrize("setting, value", [("DMLC_NUM_WORKER", "3"), ("DMLC_NUM_SERVER", "2")])
def test_a_node_told_another_job_size_is_refused_at_registration(setting, value):
    """A scheduler of 2 workers and 1 server, a worker told otherwise: its init() fails at once
    with a ConfigError naming both values and the worker (issue 30: it waited, and the job
    ran on, or hung, without complaint)."""
    port = free_port()
    env = {k: v for k, v in role_env(port).items() if k.startswith(("DMLC_", "BYTEPS_"))}
    env["BYTEPS_REGISTER_TIMEOUT_SECONDS"] = "20"
    sched = Scheduler(load(env={**env, "DMLC_ROLE": "scheduler"}))
    sched.start()
    try:
        w = Runtime(load(env={**env, "DMLC_ROLE": "worker", "DMLC_WORKER_ID": "1",
                              setting: value}))
        t0 = time.monotonic()
        with pytest.raises(ConfigError) as err:
            w.init()
        assert time.monotonic() - t0 < 10, "refused at registration, not at its timeout"
        mine = "2" if setting == "DMLC_NUM_WORKER" else "1"
        text = str(err.value)
        assert f"{setting}={value} but the scheduler has {setting}={mine}" in text, text
        assert "worker on 127.0.0.1 (pid" in text and "DMLC_WORKER_ID=1" in text, text
        assert sched.rejections.counts == {"registration refused": 1}, sched.rejections.counts
    finally:
        sched.close()
