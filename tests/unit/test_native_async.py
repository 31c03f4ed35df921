"""Asynchronous mode (BYTEPS_ENABLE_ASYNC) on the native data plane, driven directly through
_core.DataServer(async_mode=True) and _core.DataClient on loopback: every push is added to the
key's value at once, a pull answers the value (whole pushes only), no rounds across workers;
the checks of declarations, dtypes, sizes and hostile streams stay (issue 29)."""
from __future__ import annotations

import socket
import struct
import time

import numpy as np

from byteps_like.transport.native import WIRE_CODE, decode_error
from byteps_like.wire import DTYPE_CODE, pack_decl

from ..native_stream import HDR, RawUcx, closed_by_peer
from .test_native_dataplane import (  # stream: the module runs over both streams
    JOB,
    over_ucx,
    parts_of,
    stream,  # noqa: F401
)
from .test_native_dataplane import make_client as native_client
from .test_native_dataplane import make_server as native_server

F32 = WIRE_CODE["float32"]
PUSH, PULL, PULL_RESP, HELLO = 20, 22, 23, 24
FLAG_META, FLAG_DECLARE, FLAG_PULL, FLAG_COMPRESSED = 1, 2, 8, 16
WORKER = 2


def make_server(workers: int, *, budget: int = 1 << 32):
    return native_server(workers, budget=budget, async_mode=True)


def make_client(rank: int, ports: list[int], credit: int = 1 << 20):
    return native_client(rank, ports, credit=credit)


def push_pull(cli, x, y, rnd, op, nservers=1, parts=None, timeout=20.0):
    cli.submit(op, 0, x.view(np.uint8), y.view(np.uint8), WIRE_CODE[x.dtype.name], 1, rnd,
               parts if parts is not None else parts_of(x.nbytes, rnd, nservers))
    assert cli.wait(op, timeout), "the operation did not complete"
    return cli.take(op)


def one_part(nbytes: int, rnd: int, key: int = 0):
    decl = pack_decl("t", [nbytes // 4], "float32", 0, 1, nbytes // 4)
    return [(key, 0, key, 0, nbytes, decl if rnd == 0 else None)]


def raw_stream(port: int, rank: int):
    s = (RawUcx(port, timeout=10) if over_ucx()
         else socket.create_connection(("127.0.0.1", port), timeout=10))
    s.sendall(HDR.pack(b"BPSL", 1, HELLO, 0, WORKER, rank, 0, JOB, 0, 0, 0, 0))
    assert HDR.unpack(s.recv(HDR.size, socket.MSG_WAITALL))[2] == HELLO
    return s


def test_each_push_is_added_at_once_and_a_pull_answers_the_value(cleanup):
    srvs = [make_server(2) for _ in range(2)]
    cleanup += [s for s, _ in srvs]
    ports = [p for _, p in srvs]
    clients = [make_client(r, ports) for r in range(2)]
    cleanup += clients
    n = (300 << 10) // 4 + 3  # several partitions over two servers, a ragged last one
    y = np.empty(n, np.float32)
    # worker 0 alone: no round waits for worker 1
    assert push_pull(clients[0], np.full(n, 1.0, np.float32), y, 0, 1, 2)[1]
    assert (y == 1).all()
    assert push_pull(clients[1], np.full(n, 2.0, np.float32), y, 0, 1, 2)[1]
    assert (y == 3).all()
    for op in range(2, 5):  # worker 0 pushes again and again, worker 1 does not
        assert push_pull(clients[0], np.full(n, 1.0, np.float32), y, op - 1, op, 2)[1]
        assert (y == op + 2).all()
    # no round is checked: a worker may push "round 0" again (without declaring it)
    assert push_pull(clients[1], np.zeros(n, np.float32), y, 0, 9, 2,
                     parts=[p[:5] + (None,) for p in parts_of(n * 4, 0, 2)])[1]
    assert (y == 6).all()
    stats = [s.stats() for s, _ in srvs]
    assert sum(s["pushes"] for s in stats) == 6 * len(parts_of(n * 4, 0, 2))
    assert sum(s["rounds"] for s in stats) == 0
    assert all(s.stalls(0.0) == [] for s, _ in srvs)
    assert all(s.rejected() == {} for s, _ in srvs)


def test_a_store_holds_one_buffer_charged_to_the_budget(cleanup):
    srv, port = make_server(1, budget=3 << 20)
    cleanup.append(srv)
    cli = make_client(0, [port])
    cleanup.append(cli)
    x = np.ones(1 << 19, np.float32)   # 2 MiB: one buffer fits 3 MiB (two would not)
    y = np.empty_like(x)
    assert push_pull(cli, x, y, 0, 1, parts=one_part(x.nbytes, 0))[1]
    held = srv.stats()["store_bytes"]
    assert x.nbytes < held < x.nbytes + (64 << 10)
    c = push_pull(cli, x, y, 0, 2, parts=one_part(x.nbytes, 0, key=1))  # a second does not
    assert not c[1] and "BYTEPS_SERVER_MAX_BYTES" in decode_error(c[4])[1]


def test_the_checks_of_the_synchronous_mode_stay(cleanup):
    srv, port = make_server(2)
    clients = [make_client(r, [port]) for r in range(2)]
    cleanup += [srv, *clients]
    x = np.ones(100, np.float32)
    y = np.empty_like(x)
    c = push_pull(clients[0], x, y, 3, 1)            # round 3 carries no declaration
    assert not c[1] and "carries no declaration" in decode_error(c[4])[1]
    assert push_pull(clients[0], x, y, 0, 2)[1]
    c = push_pull(clients[0], np.ones(50, np.float32), np.empty(50, np.float32), 1, 3)
    assert not c[1] and "but the key holds" in decode_error(c[4])[1]   # rejected alone
    assert push_pull(clients[0], x, y, 1, 4)[1] and (y == 2).all()
    # a worker declaring another tensor fails the key, naming both sides
    c = push_pull(clients[1], x, y, 0, 1, parts=parts_of(x.nbytes, 0, 1, name="u"))
    kind, text = decode_error(c[4])
    assert not c[1] and kind == "mismatch" and "worker rank 0" in text and "worker rank 1" in text
    c = push_pull(clients[0], x, y, 2, 5)
    assert not c[1] and decode_error(c[4])[0] == "mismatch"
    assert srv.rejected() == {"push of an undeclared key": 1,
                              "wrong dtype or size for a declared key": 1}
    # a compressed push is refused: compressed keys travel over ZeroMQ
    s = raw_stream(port, 0)
    s.sendall(HDR.pack(b"BPSL", 1, PUSH, DTYPE_CODE["uint8"], WORKER, 0, FLAG_COMPRESSED, JOB,
                       7, 0, 4, 4) + b"\0" * 4)
    h = HDR.unpack(s.recv(HDR.size, socket.MSG_WAITALL))
    assert h[2] == 30  # ERROR
    s.close()
    # hostile streams are still closed: an absurd length
    s = raw_stream(port, 0)
    s.sendall(HDR.pack(b"BPSL", 1, PUSH, F32, WORKER, 0, 0, JOB, 1, 0, 1 << 60, 1 << 62))
    assert closed_by_peer(s)


def test_a_reply_never_changes_under_its_writer(cleanup):
    """A pull whose reply is not read yet shares the value; a push that comes meanwhile sums
    into a copy, so the reply is the value at the pull; its bytes are charged to the queue."""
    srv, port = make_server(2)
    cleanup.append(srv)
    cli = make_client(0, [port], credit=64 << 20)
    cleanup.append(cli)
    nbytes = 32 << 20       # more than loopback's socket buffers take unread
    x = np.ones(nbytes // 4, np.float32)
    y = np.empty_like(x)
    assert push_pull(cli, x, y, 0, 1, parts=one_part(nbytes, 0))[1]
    s = raw_stream(port, 1)
    s.sendall(HDR.pack(b"BPSL", 1, PULL, F32, WORKER, 1, 0, JOB, 0, 0, 0, 0))
    deadline = time.monotonic() + 5
    while srv.stats()["queued_bytes"] < nbytes and time.monotonic() < deadline:
        time.sleep(0.02)
    assert srv.stats()["queued_bytes"] >= nbytes       # the reply's value, charged
    for op in range(2, 5):
        assert push_pull(cli, x, y, op - 1, op, parts=one_part(nbytes, op - 1))[1]
        assert (y == op).all()
    h = HDR.unpack(s.recv(HDR.size, socket.MSG_WAITALL))
    assert h[2] == PULL_RESP and h[11] == nbytes
    got = bytearray()
    while len(got) < nbytes:
        chunk = s.recv(min(1 << 20, nbytes - len(got)))
        assert chunk
        got += chunk
    s.close()
    assert (np.frombuffer(got, np.float32) == 1).all()  # the value when it pulled


def test_a_pull_waits_for_the_pushes_in_flight_and_a_push_cut_off_ends(cleanup):
    """A pull sees whole pushes: it waits while a push of the key is still arriving. A push
    cut off by its stream's loss ends there (the chunks it had summed stay)."""
    srv, port = make_server(2)
    cleanup.append(srv)
    cli = make_client(0, [port])
    cleanup.append(cli)
    nbytes = 1 << 20
    (_key, _srv, _conn, _off, _n, decl) = one_part(nbytes, 0)[0]
    s = raw_stream(port, 1)   # worker 1 declares the key and sends half of its push
    s.sendall(HDR.pack(b"BPSL", 1, PUSH, F32, WORKER, 1, FLAG_META | FLAG_DECLARE, JOB, 0, 0,
                       nbytes // 4, nbytes) + struct.pack("<I", len(decl)) + decl +
              np.full(nbytes // 8, 2.0, np.float32).tobytes())
    time.sleep(0.2)
    x = np.ones(nbytes // 4, np.float32)
    y = np.empty_like(x)
    cli.submit(1, 0, x.view(np.uint8), y.view(np.uint8), F32, 1, 0, one_part(nbytes, 0))
    assert not cli.wait(1, 0.5)       # worker 1's push is in flight: the pull waits
    s.close()
    assert cli.wait(1, 10.0)
    c = cli.take(1)
    assert c[1], c
    half = nbytes // 8
    assert (y[:half] == 3).all() and (y[half:] == 1).all()


def test_a_snapshot_copies_every_value_and_a_lost_servers_values_are_charged(cleanup):
    """server/async_snapshots.py's native half: async_values() is every key's value between
    two pushes; adopt_async() holds a lost server's value against the memory budget until a
    moved key's store takes it (refused, keeping nothing, when it does not fit; a second
    value of the same key replaces the first)."""
    srv, port = make_server(1, budget=3 << 20)
    cleanup.append(srv)
    cli = make_client(0, [port])
    cleanup.append(cli)
    x = np.arange(1 << 10, dtype=np.float32)
    y = np.empty_like(x)
    for op in (1, 2):
        assert push_pull(cli, x, y, op - 1, op, parts=one_part(x.nbytes, op - 1))[1]
    ((key, dtype, value),) = srv.async_values()
    assert key == 0 and dtype == F32 and np.array_equal(np.frombuffer(value, np.float32), 2 * x)
    held = srv.stats()["store_bytes"]
    assert srv.adopt_async(7, b"\0" * (1 << 20))
    assert srv.stats()["store_bytes"] == held + (1 << 20)
    assert srv.adopt_async(7, b"\0" * 100)            # replaces the first
    assert srv.stats()["store_bytes"] == held + 100
    assert not srv.adopt_async(8, b"\0" * (3 << 20))   # over the budget: nothing kept
    assert srv.stats()["store_bytes"] == held + 100
