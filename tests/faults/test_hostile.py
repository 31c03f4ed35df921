"""Hostile input against a live scheduler and server: each malformed or unauthorised message is
rejected (answered with an ERROR, or dropped by ZeroMQ), counted, and the real job keeps getting
exact results while it happens. Plus bounded fuzzing of the decoder (hypothesis, atheris)."""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from byteps_like.errors import ProtocolError
from byteps_like.wire import HEADER_SIZE, MsgType, decode, pack_decl

from ..native_stream import closed_by_peer
from .cluster import running_cluster
from .hostile import (
    HostileClient,
    native_msg,
    native_reply,
    native_stream,
    scheduler_cases,
    server_cases,
)

pytestmark = pytest.mark.integration
MAX_MSG = 64 * 1024
#: a well-formed declaration of another tensor than any real key
EVIL_DECL = pack_decl("evil", [4096], "float32", 0, 1, 4096)
SMALL = {"BYTEPS_MAX_MESSAGE_BYTES": str(MAX_MSG), "BYTEPS_PARTITION_BYTES": "16384"}


def _real_rounds(c, rounds: int, n: int = 10000) -> None:
    """The real job: partitioned float32 and int64 tensors, checked exactly."""
    for r in range(rounds):
        outs = c.push_pull(lambda k: np.arange(n, dtype=np.float32) * (k + 1) + r, "real.w")
        want = np.arange(n, dtype=np.float32) * 3 + 2 * r
        for o in outs:
            assert isinstance(o, np.ndarray), o
            assert np.array_equal(o, want)
        outs = c.push_pull(lambda k: np.full(7, 10 ** 12 + k, np.int64), "real.i")
        assert all(np.array_equal(o, np.full(7, 2 * 10 ** 12 + 1)) for o in outs), outs


@contextlib.contextmanager
def _job_running(c):
    """The real job's rounds go on in a thread while the body plays a hostile peer; at the end
    (0.5 s later) the thread stops, and none of its rounds may have failed."""
    stop = threading.Event()
    errors: list = []

    def job():
        try:
            while not stop.is_set():
                _real_rounds(c, 1)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
    t = threading.Thread(target=job, daemon=True)
    t.start()
    yield
    time.sleep(0.5)
    stop.set()
    t.join(60)
    assert not errors, errors


def test_server_and_scheduler_reject_and_count_hostile_input_while_the_job_runs():
    # the server's ZeroMQ socket (control, tables; it refuses pushes and pulls: the data moves
    # on the native data plane, which has its own test below)
    with running_cluster(workers=2, extra=SMALL) as c:
        _real_rounds(c, 1)   # declares the real keys
        srv = c.server
        real_key = c.workers[0]._tensors["real.w"].parts[0][2]
        cases = server_cases(real_key, MAX_MSG)
        with _job_running(c):
            before = srv.rejected
            hc = HostileClient(srv.address)
            outcomes = {}
            for _ in range(3):
                for label, frames, expect in cases:
                    reply = hc.send(frames, expect)
                    if expect:
                        assert reply is not None, f"{label}: no reply"
                        msg = decode(reply)
                        assert msg.header.type is MsgType.ERROR, label
                        outcomes[label] = msg.meta["message"]
                    else:
                        assert reply is None, label
            hc.close()
            for label, text in outcomes.items():  # data: "on the native data plane only"
                if label.startswith("compressed push") or "key" in label:
                    assert "native data plane" in text, (label, text)
            replied = sum(e for _l, _f, e in cases)
            assert srv.rejected - before == 3 * replied, (srv.rejected_by_reason, outcomes)
            # the scheduler
            sb = c.sched.rejected
            hs = HostileClient(c.sched.address)
            for label, frames, expect in scheduler_cases():
                reply = hs.send(frames, expect)
                assert reply is not None and decode(reply).header.type is MsgType.ERROR, label
            hs.close()
            assert c.sched.rejected - sb == len(scheduler_cases())
        _real_rounds(c, 2)
        assert c.sched.exit_code is None




def test_native_data_plane_rejects_hostile_streams_while_the_job_runs():
    with running_cluster(workers=2, extra=SMALL) as c:
        _real_rounds(c, 1)
        srv = c.server
        assert srv.native is not None and srv.control.data_port > 0
        port, job = srv.control.data_port, srv.job
        with _job_running(c):
            for _ in range(3):
                s = socket.create_connection(("127.0.0.1", port), timeout=10)   # not a peer at all
                s.sendall(b"\x16\x03\x01" + os.urandom(200))
                assert closed_by_peer(s)
                s = socket.create_connection(("127.0.0.1", port), timeout=10)   # another job
                s.sendall(native_msg(24, 0, job ^ 1))
                assert closed_by_peer(s)
                s = socket.create_connection(("127.0.0.1", port), timeout=10)   # no such rank
                s.sendall(native_msg(24, 7, job))
                assert closed_by_peer(s)
                # a push to the real key 0 for a far round, with a declaration that does not match:
                # rejected alone (the round is checked first), the key keeps serving
                s = native_stream(port, job)
                s.sendall(native_msg(20, 0, job, key=0, rnd=10 ** 6, dtype=1, count=4096,
                                      nbytes=16384, flags=2 | 8, meta=EVIL_DECL,
                                      payload=b"\0" * 16384))
                h, meta, _ = native_reply(s)
                assert h[2] == 30 and meta["kind"] == "protocol" and "not open" in meta["message"]
                # the wrong dtype for the real key, then a pull of a key nobody declared
                s.sendall(native_msg(20, 0, job, key=0, rnd=0, dtype=6, count=2, nbytes=16,
                                      payload=b"\0" * 16))
                h, meta, _ = native_reply(s)
                assert h[2] == 30 and "bytes of dtype code" in meta["message"]
                s.sendall(native_msg(22, 0, job, key=987654, rnd=0))
                h, meta, _ = native_reply(s)
                assert h[2] == 30 and "before any push" in meta["message"]
                # a length past BYTEPS_MAX_MESSAGE_BYTES: the stream is closed before any allocation
                s.sendall(native_msg(20, 0, job, key=5, dtype=1, count=MAX_MSG, nbytes=4 * MAX_MSG))
                assert closed_by_peer(s)
                s = native_stream(port, job, rank=1)  # a message claiming another rank than hello
                s.sendall(native_msg(22, 0, job, key=0))
                assert closed_by_peer(s)
        _real_rounds(c, 2)
        rej = srv.rejections()
        assert rej.get("malformed", 0) >= 6 and rej.get("bad hello", 0) >= 6, rej
        assert rej.get("push out of round") == 3, rej
        assert rej.get("wrong dtype or size for a declared key") == 3, rej
        assert rej.get("pull of an undeclared key") == 3, rej
        assert rej.get("wrong job or rank for this stream") == 3, rej
        assert srv.native.stats()["store_bytes"] < 1 << 20  # nothing allocated for them


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(frames=st.lists(st.one_of(
    st.binary(max_size=200),
    st.binary(min_size=HEADER_SIZE, max_size=HEADER_SIZE).map(lambda b: b"BPSL\x01" + b[5:]),
), min_size=1, max_size=4))
def test_decoder_fuzz_hypothesis(frames):
    try:
        msg = decode(frames, MAX_MSG)
    except ProtocolError:
        return
    assert msg.header.type in MsgType


ATHERIS_TARGET = r'''
import sys, atheris
with atheris.instrument_imports():
    from byteps_like.wire import decode
    from byteps_like.errors import ProtocolError

def one(data):
    fdp = atheris.FuzzedDataProvider(data)
    frames = [fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 120)) for _ in range(fdp.ConsumeIntInRange(1, 3))]
    try:
        decode(frames, 1 << 16)
    except ProtocolError:
        pass

atheris.Setup([sys.argv[0], "-runs=%d" % int(sys.argv[1]), "-seed=1"], one)
atheris.Fuzz()
'''


def test_decoder_fuzz_atheris(tmp_path):
    pytest.importorskip("atheris")
    script = tmp_path / "fuzz_wire.py"
    script.write_text(ATHERIS_TARGET)
    p = subprocess.run([sys.executable, str(script), "20000"], capture_output=True, text=True,
                       timeout=120, cwd=tmp_path, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert p.returncode == 0, p.stderr[-4000:]
    assert "Done 20000 runs" in p.stderr, p.stderr[-2000:]
