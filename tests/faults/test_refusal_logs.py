"""Refusals are logged at a bounded rate (issue 41, item 7): a client that knows the server's
public key but not the job's client key, retrying its CURVE handshake as fast as it can, cost
one WARNING line per connection (18,200 lines, 1.78 MB in 30 s). The ZAP handler now counts
refusals through the same summariser as malformed data (transport/base.py Drops): the first at
once, then one line per interval with the count, and the last window's count at close."""
from __future__ import annotations

import logging
import time

import pytest
import zmq

from byteps_like.transport import derive_curve_keys
from byteps_like.transport.zmq_transport import ZmqEndpoint

pytestmark = pytest.mark.integration
SECRET = "s3cret-" + "y" * 40


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.WARNING:
            self.lines.append(record.getMessage())


def test_a_client_failing_curve_over_and_over_costs_a_few_log_lines():
    keys = derive_curve_keys(SECRET)
    root = logging.getLogger("byteps_like")
    got = _Lines()
    root.addHandler(got)
    ctx = zmq.Context()
    ep = ZmqEndpoint("server", context=ctx, curve=keys)
    try:
        address = ep.bind("tcp://127.0.0.1:0")
        ep.start()
        assert ep.auth is not None
        attempts, deadline = 0, time.monotonic() + 60.0
        pub, sec = zmq.curve_keypair()  # knows the server's key, not the job's client key
        while ep.auth.denied < 300:     # every connection is one handshake refused
            assert time.monotonic() < deadline, f"only {ep.auth.denied} refusals in 60 s"
            s = ctx.socket(zmq.DEALER)
            s.curve_serverkey, s.curve_publickey, s.curve_secretkey = keys.server_public, pub, sec
            s.linger = 0
            s.connect(address)
            try:   # a handshake refused before this send leaves no pipe: a send would block
                s.send(b"hello", zmq.NOBLOCK)
            except zmq.Again:
                pass
            attempts += 1
            s.poll(20)
            s.close(0)
        auth_of = ep.auth
    finally:
        ep.close(linger=0)  # the last ZAP user: the authenticator stops and flushes its count
        ctx.term()
        root.removeHandler(got)
    auth = [line for line in got.lines if line.startswith("authentication:")]
    assert auth and len(got.lines) <= 10, got.lines
    assert auth[0].startswith("authentication: refused 1 CURVE client: its client key is not "
                              "this job's"), auth
    counted = sum(int(line.split("refused ")[1].split(" ")[0]) for line in auth)
    assert counted == auth_of.refusals.total == auth_of.denied >= 300, (counted, auth)


def test_native_hmac_refusals_and_malformed_streams_cost_a_summary_line():
    """The native plane counts its refusals in C++ (a stream whose HMAC proof is wrong, a stream
    that is not the protocol); the server logs them as one summary line per interval with the
    counts (server/core.py log_rejections), never a line per stream."""
    import os
    import socket

    from byteps_like.wire import job_hash

    from ..native_stream import HDR
    from .cluster import running_cluster
    caplog_lines = _Lines()
    server_log = logging.getLogger("byteps_like.server")
    server_log.addHandler(caplog_lines)
    job = job_hash("default")
    n = 150
    try:
        with running_cluster(workers=1, extra={"BYTEPS_AUTH_SECRET": SECRET}) as c:
            srv, port = c.server, c.server.control.data_port
            for i in range(n):
                s = socket.create_connection(("127.0.0.1", port), timeout=10)
                if i % 3:  # knows the protocol but not the key: its proof is refused
                    s.sendall(HDR.pack(b"BPSL", 1, 24, 0, 2, 0, 32, job, 0, 0, 0, 32)
                              + os.urandom(32))
                    s.recv(HDR.size + 64, socket.MSG_WAITALL)
                    s.sendall(HDR.pack(b"BPSL", 1, 24, 0, 2, 0, 32, job, 0, 0, 0, 32)
                              + os.urandom(32))
                else:      # not the protocol at all
                    s.sendall(os.urandom(HDR.size))
                s.recv(1)  # closed by the server
                s.close()
            deadline = time.monotonic() + 30
            while sum(srv.native.rejected().values()) < n:
                assert time.monotonic() < deadline, srv.native.rejected()
                time.sleep(0.02)
            during = list(caplog_lines.lines)
            srv.log_rejections()  # what the server's timer writes every interval
            summary = caplog_lines.lines[len(during):]
    finally:
        server_log.removeHandler(caplog_lines)
    assert len(during) <= 5, during
    assert len(summary) == 1, summary
    refused = srv.native.rejected()
    assert refused.get("authentication failed", 0) == 2 * n // 3, refused
    assert f"authentication failed: {2 * n // 3}" in summary[0], summary
