"""Bounds of the native data plane that hold for the whole server, not per stream (issue 29):
the memory of replies left unread, the connection slots of streams that have not said hello."""
from __future__ import annotations

import logging
import socket
import struct
import time

import numpy as np
import pytest

from byteps_like import _core
from byteps_like.transport.native import WIRE_CODE

from ..native_stream import closed_by_peer
from ..unit.test_native_dataplane import JOB, MAXMSG, make_client, parts_of
from .unread_replies import measure

pytestmark = pytest.mark.integration

MB = 1 << 20


def test_replies_left_unread_cost_the_server_a_bounded_share_given_back_at_close():
    """16 streams each say hello and send 100,000 pulls of undeclared keys, reading none of
    the error replies. Every reply used to be queued (~180 bytes each, so ~+200 MB here and
    +1.55 GB for 150 streams of 65,000); now a stream over its share of the server's 32 MiB
    reply budget is not read until its peer reads, and the memory goes back when the streams
    close."""
    r = measure(conns=16, pulls=100_000)
    print(f"\nRSS {r['base'] / MB:.0f} -> {r['peak'] / MB:.0f} MB, {r['after'] / MB:.0f} MB "
          f"after close; {r['stats']}")
    st = r["stats"]
    assert st["paused"] == 16, st                            # every stream stopped being read
    assert st["queued_bytes"] <= (32 << 20) + 16 * (4 << 10), st
    assert r["peak"] - r["base"] < 80 * MB, r
    assert r["after"] - r["base"] < 12 * MB, r                # given back
    # the requests it did read were answered (not dropped), each counted once
    assert r["rejected"] == {"pull of an undeclared key": st["rejected"]}


def _raw(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def _closed(s: socket.socket) -> bool:
    s.settimeout(0)
    try:
        return s.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def test_streams_that_never_say_hello_cannot_lock_out_a_worker():
    """A server of 16 slots and a job secret: peers without the secret open 40 streams and say
    nothing. At most a quarter of the slots hold streams without a hello, the oldest making
    room for a new one, so the worker that connects next gets its streams and its rounds."""
    key = b"k" * 32
    srv = _core.DataServer(1, 0, JOB, 2, MAXMSG, 1 << 30, 16, key)
    port = srv.listen("127.0.0.1", 0)
    srv.start()
    held = []
    try:
        for _ in range(40):
            held.append(_raw(port))
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:   # until all were accepted and the evicted closed
            st = srv.stats()
            if st["connections"] == 40 and st["live_connections"] <= 4:
                break
            time.sleep(0.02)
        assert srv.stats()["live_connections"] <= 4, srv.stats()
        assert srv.rejected() == {"stream without hello evicted for a new one": 36}
        assert sum(_closed(s) for s in held[:36]) == 36
        assert not any(_closed(s) for s in held[36:])
        cli = _core.DataClient(0, JOB, 2, 1 << 20, MAXMSG, key)
        try:
            cli.connect(0, "127.0.0.1", port, 2, 5.0)
            x = np.arange(1000, dtype=np.float32)
            y = np.zeros_like(x)
            cli.submit(1, 0, x.view(np.uint8), y.view(np.uint8), WIRE_CODE["float32"], 1, 0,
                       parts_of(x.nbytes, 0, 1))
            assert cli.wait(1, 10.0)
            assert cli.take(1)[1], "the worker's round failed"
            assert (y == x).all()
        finally:
            cli.close()
    finally:
        for s in held:
            s.close()
        srv.close()


def test_a_stream_that_said_hello_keeps_its_slot():
    """Streams that said hello are not evicted: with the slots full of them a new connection
    is refused and counted, and the streams keep working."""
    srv = _core.DataServer(2, 0, JOB, 2, MAXMSG, 1 << 30, 16)
    port = srv.listen("127.0.0.1", 0)
    srv.start()
    clients = []
    try:
        for r in range(2):
            clients.append(make_client(r, [port], streams=8))
        s = _raw(port)
        assert closed_by_peer(s, 5.0)
        assert srv.rejected() == {"too many connections": 1}
        x = np.ones(1000, np.float32)
        ys = [np.zeros_like(x) for _ in clients]
        for cli, y in zip(clients, ys):
            cli.submit(1, 0, x.view(np.uint8), y.view(np.uint8), WIRE_CODE["float32"], 1, 0,
                       parts_of(x.nbytes, 0, 1))
        for cli in clients:
            assert cli.wait(1, 10.0) and cli.take(1)[1]
        assert all((y == 2).all() for y in ys)
    finally:
        for c in clients:
            c.close()
        srv.close()



def test_the_last_window_of_rejections_is_summed_up_at_shutdown():
    """Rejections after the last periodic summary (one a minute) used to be lost at shutdown: a
    50 s job with ~9.75 M rejected pulls left no line. The server writes the last window's
    summary when it closes, both data paths."""
    from .cluster import running_cluster
    from .hostile import NATIVE_ERROR, NATIVE_PULL, native_msg, native_reply, native_stream

    class Lines(logging.Handler):
        def __init__(self):
            super().__init__(logging.WARNING)
            self.lines = []

        def emit(self, record):
            if "since the last summary" in record.getMessage():
                self.lines.append(record.getMessage())

    got = Lines()
    logger = logging.getLogger("byteps_like.server")
    logger.addHandler(got)
    try:
        with running_cluster(workers=2) as c:
            srv = c.server
            with native_stream(srv.control.data_port, srv.job) as s:
                for k in range(25):
                    s.sendall(native_msg(NATIVE_PULL, 0, srv.job, key=5_000_000 + k))
                for _ in range(25):
                    assert native_reply(s)[0][2] == NATIVE_ERROR
            assert got.lines == []   # the timer's summary is a minute away
    finally:
        logger.removeHandler(got)
    assert len(got.lines) == 1 and "pull of an undeclared key: 25" in got.lines[0], got.lines


def test_large_meta_frames_being_read_share_one_budget():
    """Streams that said hello announce 1 MiB declarations and send 10 bytes of each: every one
    made the server hold 1 MiB for as long as it liked (4 GB with 4,096 streams). A meta frame
    on a data stream is now at most the largest declaration (DECL_MAX_BYTES, csrc/decl.h; a
    longer one is refused unread), and large ones being read share 16 MiB for the whole
    server; a stream past it is closed and counted, and what closed streams held is given
    back."""
    from byteps_like.wire import DECL_MAX_BYTES

    from ..native_stream import closed_by_peer
    from .hostile import NATIVE_PUSH, native_msg, native_stream

    n = 250
    fit = (16 << 20) // DECL_MAX_BYTES   # 238 of the largest declarations
    srv = _core.DataServer(1, 0, JOB, 2, MAXMSG, 1 << 30, n + 8)
    port = srv.listen("127.0.0.1", 0)
    srv.start()
    streams = []
    try:
        head = native_msg(NATIVE_PUSH, 0, JOB, key=1, dtype=WIRE_CODE["float32"], count=1,
                          nbytes=4, flags=1 | 2)  # META | DECLARE: the length follows
        s = native_stream(port, JOB)
        s.sendall(head + struct.pack("<I", 1 << 20) + b"{" * 10)
        assert closed_by_peer(s)   # 1 MiB: no declaration is that long
        for _ in range(n):
            s = native_stream(port, JOB)
            s.sendall(head + struct.pack("<I", DECL_MAX_BYTES) + b"{" * 10)
            streams.append(s)
        deadline = time.monotonic() + 10
        while ((srv.stats()["msgs_in"] < 2 * n + 2 or srv.stats()["live_connections"] > fit)
               and time.monotonic() < deadline):
            time.sleep(0.02)
        assert srv.stats()["meta_bytes"] == fit * DECL_MAX_BYTES
        assert srv.rejected() == {"meta frames over the server's budget": n - fit,
                                  "oversized meta": 1}
        assert sum(_closed(s) for s in streams) == n - fit
        for s in streams:
            s.close()
        while srv.stats()["live_connections"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert srv.stats()["meta_bytes"] == 0
    finally:
        for s in streams:
            s.close()
        srv.close()


@pytest.mark.slow
def test_replies_left_unread_stay_bounded_when_streams_open_one_by_one():
    """Issue 41, the connection-order case: 150 streams opened one at a time, each sending
    its 65,000 pulls until the server answered them or stopped reading it before the next
    opens. A stream's share was 32 MiB over the streams open when it was read, so the first
    ones kept large shares (+111 MB peak, against ~+35 MB with every stream open first); with
    the global cap (only the least share while the server's replies are over the budget) the
    peak stays within the budget, whatever the order."""
    r = measure(conns=150, pulls=65_000, one_by_one=True)
    print(f"\nRSS {r['base'] / MB:.0f} -> peak {r['peak'] / MB:.0f} MB, {r['after'] / MB:.0f} MB "
          f"after close; {r['stats']}")
    st = r["stats"]
    assert r["peak"] - r["base"] <= 50 * MB, r
    assert st["queued_bytes"] <= (32 << 20) + 150 * (20 << 10), st
    assert r["rejected"]["pull of an undeclared key"] == st["rejected"] - r["rejected"].get(
        "replies left unread", 0), r
