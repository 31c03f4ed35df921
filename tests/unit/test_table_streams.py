"""Server-held tables' streams on the native data plane (csrc/dataplane_tables.h), driven
through _core.DataServer's table inbox and _core.TableClient on loopback, over TCP and UCX:
requests and answers arrive exactly, a stream whose requests wait past its share is not read
until they are taken, the hello's and the stream's rules hold, and a lost server is reported."""
from __future__ import annotations

import socket

import numpy as np
import pytest

from byteps_like import _core
from byteps_like.wire import (
    FLAG_TABLE,
    Header,
    MsgType,
    Role,
    decode_parts,
    encode,
    split_frames,
)

from ..native_stream import HDR, closed_by_peer, recv_exact, require_ucx
from ..support import wait_until

JOB = 0x7AB1E
MAXMSG = 8 << 20
WORKERS = 2   # machines: a table stream may carry process ranks up to WORKERS * 256


@pytest.fixture(params=["tcp", "ucx"])
def kind(request, monkeypatch):
    if request.param == "ucx":
        require_ucx(monkeypatch)
    return request.param


def start_server(kind: str):
    srv = _core.DataServer(WORKERS, 0, JOB, 1, MAXMSG, 1 << 30, 64)
    port = srv.listen_ucx("127.0.0.1", 0) if kind == "ucx" else srv.listen("127.0.0.1", 0)
    srv.start()
    return srv, port


def client(kind: str, port: int, rank: int = 3):
    cli = _core.TableClient(rank, JOB, MAXMSG)
    cli.connect(0, "127.0.0.1", port, 10.0, ucx=kind == "ucx")
    return cli


def pull(rank: int, key: int, rnd: int, ids: np.ndarray) -> list:
    return encode(Header(MsgType.SPARSE_PULL, "int64", Role.WORKER, rank, 0, JOB, key, rnd,
                         ids.size, ids.nbytes), ids)


def take(srv, n: int) -> list:
    got: list = []
    assert wait_until(lambda: got.extend(srv.table_requests(0.2)) or len(got) >= n, 20.0)
    return got


def answers(cli, n: int) -> list:
    got: list = []
    assert wait_until(lambda: got.extend(cli.answers(0.2)) or len(got) >= n, 20.0)
    return got


def test_requests_and_answers_arrive_exactly_with_their_meta(kind):
    srv, port = start_server(kind)
    cli = client(kind, port, rank=WORKERS * 256 - 1)   # the last process rank a stream may carry
    try:
        ids = np.arange(1000, dtype=np.int64) * 7
        create = encode(Header(MsgType.SPARSE_CREATE, "none", Role.WORKER, WORKERS * 256 - 1, 0,
                               JOB, 5, 0), meta={"spec": {"name": "emb"}, "shard": 0})
        for frames in (create, pull(WORKERS * 256 - 1, 5, 1, ids)):
            assert cli.send(0, *split_frames(frames))
        (s1, h1, m1, p1), (s2, h2, m2, p2) = take(srv, 2)
        assert s1 == s2   # the same stream
        first, second = decode_parts(h1, m1, p1), decode_parts(h2, m2, p2)
        assert first.header.type is MsgType.SPARSE_CREATE and first.meta == {
            "spec": {"name": "emb"}, "shard": 0}
        assert second.header.rank == WORKERS * 256 - 1 and second.header.round == 1
        assert np.array_equal(np.frombuffer(second.payload, np.int64), ids)
        rows = np.random.default_rng(0).standard_normal((1000, 4)).astype(np.float32)
        answer = encode(Header(MsgType.SPARSE_ROWS, "float32", Role.SERVER, 0, 0, JOB, 5, 1,
                               rows.size, rows.nbytes), rows)
        assert srv.table_send(s2, *split_frames(answer))
        ((server, h, m, p, lost),) = answers(cli, 1)
        assert server == 0 and lost == ""
        got = decode_parts(h, m, p)
        assert got.header.type is MsgType.SPARSE_ROWS
        assert np.array_equal(np.frombuffer(got.payload, np.float32).reshape(1000, 4), rows)
        with pytest.raises(ValueError, match="nbytes or FLAG_META"):   # a header that lies
            srv.table_send(s2, answer[0], None, b"")
    finally:
        cli.close()
        srv.close()


def test_a_stream_whose_requests_wait_is_not_read_until_they_are_taken(kind):
    """Nobody takes the requests: the stream stops being read once they are over its share
    of the server's reply budget (32 MiB for one stream), so the server holds at most that
    and one request more; taking them lets the rest in, every one, in order."""
    srv, port = start_server(kind)
    cli = client(kind, port)
    try:
        ids = np.zeros((1 << 20) // 8, np.int64)   # 1 MiB a request
        n = 48
        for rnd in range(n):
            assert cli.send(0, *split_frames(pull(3, 1, rnd, ids)))
        assert wait_until(lambda: srv.stats()["paused"] == 1, 20.0)
        held = srv.table_requests(0.0)
        assert 0 < len(held) <= 33 and srv.stats()["paused"] in (0, 1)
        rest = take(srv, n - len(held))
        rounds = [decode_parts(h, m, p).header.round for _s, h, m, p in held + rest]
        assert rounds == list(range(n))
        assert wait_until(lambda: srv.stats()["paused"] == 0)
    finally:
        cli.close()
        srv.close()


def test_messages_queued_while_the_loop_writes_arrive_whole_and_in_order(kind):
    """The stream's I/O thread writes a TCP message without the stream's lock, so the sender
    queues the next ones meanwhile: 600 requests of 0-600 KiB, each filled with its own
    round, sent back to back while the server takes them, arrive whole, in order, each with
    its own bytes (a write that lost a queued message's place would mix two rounds)."""
    srv, port = start_server(kind)
    cli = client(kind, port)
    try:
        rng = np.random.default_rng(7)
        sizes = rng.integers(0, 600 << 10, 600) // 8
        got: list = []
        for rnd, n in enumerate(sizes):
            assert cli.send(0, *split_frames(pull(3, 1, rnd, np.full(n, rnd, np.int64))))
            got.extend(srv.table_requests(0.0))
        got.extend(take(srv, len(sizes) - len(got)))
        assert len(got) == len(sizes)
        for rnd, ((_s, h, m, p), n) in enumerate(zip(got, sizes)):
            msg = decode_parts(h, m, p)
            assert msg.header.round == rnd
            ids = np.frombuffer(msg.payload, np.int64)
            assert ids.size == n and (ids == rnd).all(), rnd
    finally:
        cli.close()
        srv.close()


def raw_hello(port: int, rank: int, flags: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(HDR.pack(b"BPSL", 1, MsgType.HELLO, 0, Role.WORKER, rank, flags, JOB, 0, 0, 0, 0))
    return s


def test_the_hello_and_the_stream_keep_their_rules():
    srv, port = start_server("tcp")
    try:
        # a process rank past the machines x 256 a table stream may carry: no hello back
        assert closed_by_peer(raw_hello(port, WORKERS * 256, FLAG_TABLE))
        # a data stream's rank is a machine's: a process rank past them is refused there
        assert closed_by_peer(raw_hello(port, WORKERS, 0))
        ids = np.arange(4, dtype=np.int64)
        # a table request on a data stream, and a push on a table stream, close the stream
        for flags, frames in ((0, pull(0, 1, 0, ids)),
                              (FLAG_TABLE, encode(Header(MsgType.PUSH, "float32", Role.WORKER,
                                                         0, 0, JOB, 1, 0, 4, 16),
                                                  np.zeros(4, np.float32)))):
            s = raw_hello(port, 0, flags)
            assert HDR.unpack(recv_exact(s, HDR.size))[2] == MsgType.HELLO
            s.sendall(b"".join(bytes(memoryview(f)) for f in frames))
            assert closed_by_peer(s)
        # a request over BYTEPS_MAX_MESSAGE_BYTES is refused before anything is allocated
        s = raw_hello(port, 0, FLAG_TABLE)
        recv_exact(s, HDR.size)
        s.sendall(HDR.pack(b"BPSL", 1, MsgType.SPARSE_PULL, 6, Role.WORKER, 0, 0, JOB, 1, 0,
                           (MAXMSG + 8) // 8, MAXMSG + 8))
        assert closed_by_peer(s)
        assert srv.table_requests(0.0) == []
    finally:
        srv.close()


def test_a_lost_server_is_reported_on_the_stream(kind):
    srv, port = start_server(kind)
    cli = client(kind, port)
    try:
        srv.close()
        ((server, _h, _m, _p, lost),) = answers(cli, 1)
        assert server == 0 and lost
        assert not cli.send(0, *split_frames(pull(3, 1, 0, np.zeros(1, np.int64))))
    finally:
        cli.close()


def test_a_worker_holds_at_most_its_budget_of_answers_then_tcp_holds_the_server(kind):
    """A server that answers faster than the worker's Python takes the answers (or sends ones
    nobody asked for): the table client holds at most its answer budget (here 4 MiB) and one
    answer more, and its loop waits meanwhile (a request sent then is not written until the
    answers are taken); every answer arrives, in order, once they are."""
    srv, port = start_server(kind)
    cli = _core.TableClient(3, JOB, MAXMSG, answer_budget=4 << 20)
    cli.connect(0, "127.0.0.1", port, 10.0, ucx=kind == "ucx")
    try:
        assert cli.send(0, *split_frames(pull(3, 1, 0, np.zeros(1, np.int64))))
        ((stream, *_rest),) = take(srv, 1)
        rows = np.zeros((1 << 20) // 4, np.float32)   # 1 MiB an answer
        n = 64
        for rnd in range(n):
            answer = encode(Header(MsgType.SPARSE_ROWS, "float32", Role.SERVER, 0, 0, JOB, 1,
                                   rnd, rows.size, rows.nbytes), rows)
            assert srv.table_send(stream, *split_frames(answer))
        # full: one answer more would be over the budget
        assert wait_until(lambda: cli.stats()["answers_held"] + (1 << 20) > 4 << 20, 20.0)
        assert cli.stats()["answers_held"] <= (4 << 20) + (1 << 20) + 512
        # the loop waits for room: a request queued now is not written
        assert cli.send(0, *split_frames(pull(3, 1, 99, np.zeros(1, np.int64))))
        assert srv.table_requests(0.5) == []
        got = answers(cli, n)
        assert [decode_parts(h, m, p).header.round for _s, h, m, p, _lost in got] == list(
            range(n))
        ((_stream, h, m, p),) = take(srv, 1)   # written once the answers were taken
        assert decode_parts(h, m, p).header.round == 99
    finally:
        cli.close()
        srv.close()
