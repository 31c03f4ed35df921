"""The native data plane's UCX streams as active messages (csrc/dataplane_ucx_link.cc): a
message's header travels eagerly, a large payload in rendezvous pieces received straight into
the framing's target (a server's chunks or its round buffer, a worker's output). What must hold:
large payloads land intact whatever their alignment, a piece larger than a read is still read
right, a hostile piece is refused before it is received, a stream paused for its unread
replies whose peer keeps sending is closed at its bound (not after the 10 s unread timeout),
and a process forked after UCX was loaded gets a clear error instead of its parent's context.
UCX runs on loopback TCP (UCX_TLS=tcp UCX_NET_DEVICES=lo unless the environment says
otherwise)."""
from __future__ import annotations

import os
import socket
import time

import numpy as np
import pytest

from byteps_like import _core
from byteps_like.transport import ucx_native
from byteps_like.transport.native import WIRE_CODE
from byteps_like.wire import pack_decl

from ..native_stream import HDR, RawUcx, require_ucx

JOB = 0xBEEF
MAXMSG = 1 << 28
F32 = WIRE_CODE["float32"]
PUSH, PULL, PULL_RESP, HELLO = 20, 22, 23, 24
FLAG_META, FLAG_DECLARE, FLAG_PULL = 1, 2, 8
WORKER = 2


@pytest.fixture(autouse=True)
def ucx(monkeypatch):
    require_ucx(monkeypatch)


def server(cleanup, workers: int, *, async_mode: bool = False, tcp: bool = False):
    srv = _core.DataServer(workers, 0, JOB, 2, MAXMSG, 1 << 32, 64, async_mode=async_mode)
    port = srv.listen("127.0.0.1", 0) if tcp else srv.listen_ucx("127.0.0.1", 0)
    srv.start()
    cleanup.append(srv)
    return srv, port


def client(cleanup, rank: int, port: int, *, credit: int = 64 << 20, tcp: bool = False):
    cli = _core.DataClient(rank, JOB, 2, credit, MAXMSG)
    cli.connect(0, "127.0.0.1", port, 2, 10.0, ucx=not tcp)
    cleanup.append(cli)
    return cli


def parts(nbytes: int, part: int, rnd: int):
    out = []
    offs = range(0, nbytes, part)
    for i, off in enumerate(offs):
        decl = (pack_decl("big", [nbytes // 4], "float32", i, len(offs),
                          min(part, nbytes - off) // 4) if rnd == 0 else None)
        out.append((i, 0, i, off, min(part, nbytes - off), decl))
    return out


def hello(rank: int) -> bytes:
    return HDR.pack(b"BPSL", 1, HELLO, 0, WORKER, rank, 0, JOB, 0, 0, 0, 0)


def raw(port: int, rank: int, timeout: float = 10.0) -> RawUcx:
    s = RawUcx(port, timeout=timeout)
    s.sendall(hello(rank))
    assert HDR.unpack(s.recv(HDR.size, socket.MSG_WAITALL))[2] == HELLO
    return s


@pytest.mark.parametrize("workers,tcp", [(1, False), (2, False), (1, True)])
def test_large_partitions_land_intact_round_after_round(workers, tcp, cleanup):
    """Partitions of 9 MiB + 1,332 bytes (two 4 MiB pieces and a ragged one), summed in
    chunks (two workers) or received straight into the round's buffer (one worker, over UCX
    and TCP alike), four rounds of other values each: every element is the exact sum."""
    _srv, port = server(cleanup, workers, tcp=tcp)
    clis = [client(cleanup, r, port, tcp=tcp) for r in range(workers)]
    n, part = (20 << 20) // 4 + 77, (9 << 20) + 1332
    base = np.arange(n, dtype=np.float32) % 1000
    for rnd in range(4):
        xs = [base + 1000 * (rnd + 1) * (r + 1) for r in range(workers)]
        ys = [np.empty_like(base) for _ in range(workers)]
        for cli, x, y in zip(clis, xs, ys):
            cli.submit(rnd + 1, 0, x.view(np.uint8), y.view(np.uint8), F32, 1, rnd,
                       parts(x.nbytes, part, rnd))
        for cli in clis:
            assert cli.wait(rnd + 1, 30.0)
            assert cli.take(rnd + 1)[1]
        want = sum(xs)
        for y in ys:
            np.testing.assert_array_equal(y, want)


def test_a_piece_larger_than_the_read_is_read_right(cleanup):
    """A peer that reads a 1 MiB reply a few bytes at a time: its rendezvous piece is larger
    than the read, so it is received whole and handed out in order."""
    srv, port = server(cleanup, 2)
    cli = client(cleanup, 0, port)
    x = np.arange((1 << 20) // 4, dtype=np.float32)
    y = np.empty_like(x)
    cli.submit(1, 0, x.view(np.uint8), y.view(np.uint8), F32, 1, 0, parts(x.nbytes, x.nbytes, 0))
    s = raw(port, 1)
    z = np.full_like(x, 5)
    s.sendall(HDR.pack(b"BPSL", 1, PUSH, F32, WORKER, 1, FLAG_PULL, JOB, 0, 0, z.size, z.nbytes)
              + z.tobytes())
    assert cli.wait(1, 20.0) and cli.take(1)[1]
    got = bytearray()
    while len(got) < 2 * HDR.size + x.nbytes:
        chunk = s.recv(7777)
        assert chunk, f"closed after {len(got)} bytes"
        got += chunk
    s.close()
    assert HDR.unpack(bytes(got[:HDR.size]))[2] == 21   # PUSH_ACK first
    h = HDR.unpack(bytes(got[HDR.size:2 * HDR.size]))
    assert h[2] == PULL_RESP and h[11] == x.nbytes
    np.testing.assert_array_equal(np.frombuffer(bytes(got[2 * HDR.size:]), np.float32), x + 5)


def test_an_oversized_rendezvous_piece_is_refused_before_it_is_received(cleanup):
    """After a valid push header of 8 MiB, a peer sends its payload as one 8 MiB rendezvous
    piece (senders cut at 4 MiB): the server refuses the piece without receiving it, the
    sender's send fails, the stream is closed and counted as malformed."""
    srv, port = server(cleanup, 2)
    s = raw(port, 0)
    nbytes = 8 << 20
    decl = pack_decl("t", [nbytes // 4], "float32", 0, 1, nbytes // 4)
    s.sendall(HDR.pack(b"BPSL", 1, PUSH, F32, WORKER, 0, FLAG_META | FLAG_DECLARE, JOB, 0, 0,
                       nbytes // 4, nbytes) + len(decl).to_bytes(4, "little") + decl)
    with pytest.raises(RuntimeError, match="send failed"):
        s._s.send(b"\0" * nbytes, 10.0, True)
    deadline = time.monotonic() + 5
    while not srv.rejected() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert srv.rejected() == {"malformed": 1}
    assert srv.stats()["pushes"] == 0
    s.close()


def test_a_paused_stream_whose_peer_keeps_sending_is_closed_at_its_bound(cleanup):
    """A peer pulls a 32 MiB value (the reply's bytes are charged to its stream, which is
    then not read) and keeps sending: what UCX receives for the stream is bounded (32 MiB),
    and the stream is closed as one that leaves its replies unread at once, not after the
    10 s unread timeout."""
    srv, port = server(cleanup, 2, async_mode=True)
    cli = client(cleanup, 0, port)
    x = np.ones((32 << 20) // 4, np.float32)
    y = np.empty_like(x)
    cli.submit(1, 0, x.view(np.uint8), y.view(np.uint8), F32, 1, 0, parts(x.nbytes, x.nbytes, 0))
    assert cli.wait(1, 20.0) and cli.take(1)[1]
    s = raw(port, 1)
    s.sendall(HDR.pack(b"BPSL", 1, PULL, F32, WORKER, 1, 0, JOB, 0, 0, 0, 0))
    deadline = time.monotonic() + 5
    while srv.stats()["paused"] < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert srv.stats()["paused"] == 1
    t0 = time.monotonic()
    junk = b"\xff" * (1 << 20)
    for _ in range(40):   # 40 MiB that the paused stream does not read (the server drops
        try:              # what is over its bound as it comes)
            s.sendall(junk)
        except RuntimeError:   # the server closed the stream meanwhile
            break
    while srv.stats()["unread_closed"] < 1 and time.monotonic() - t0 < 5:
        time.sleep(0.02)
    assert srv.stats()["unread_closed"] == 1
    assert time.monotonic() - t0 < 5
    s.close()


def test_a_forked_child_gets_a_clear_error_instead_of_the_parents_context():
    assert ucx_native.load() == ""
    pid = os.fork()
    if pid == 0:   # the child: never returns into pytest
        code = 1
        try:
            why = _core.ucx_unavailable()
            ok = "is a fork of it" in why and ucx_native.load() == why
            srv = _core.DataServer(1, 0, JOB, 1, MAXMSG, 1 << 20, 8)
            try:
                srv.listen_ucx("127.0.0.1", 0)
            except RuntimeError as exc:
                ok = ok and "cannot use its parent's UCX context" in str(exc)
            else:
                ok = False
            code = 0 if ok else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert _core.ucx_unavailable() == ""   # the parent keeps its context
