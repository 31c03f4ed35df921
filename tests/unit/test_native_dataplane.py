"""The native data plane (csrc/dataplane.cc) driven directly through _core.DataServer and
_core.DataClient on loopback: exact sums, averages, several servers and streams, errors that
name their cause, hostile peers, lost servers, the stall report."""
from __future__ import annotations

import socket
import struct
import time

import numpy as np
import pytest

from byteps_like import _core
from byteps_like.transport.native import WIRE_CODE, decode_error
from byteps_like.wire import ITEMSIZE, pack_decl, parse_decl

from ..native_stream import HDR, RawUcx, closed_by_peer, require_ucx

JOB = 0xC0FFEE
MAXMSG = 1 << 28
PART = 64 << 10

#: the stream implementation the module's tests run over (the `stream` fixture sets it): the
#: rules, bounds and errors are the same over TCP sockets and UCX endpoints
STREAM = {"kind": "tcp"}


@pytest.fixture(autouse=True, params=["tcp", "ucx"])
def stream(request, monkeypatch):
    """Every test of the module (and of test_native_async) once over TCP streams and once
    over UCX streams (UCX_TLS=tcp on loopback unless the environment says otherwise, read
    when the process first loads UCX; skipped only without the `ucx` extra)."""
    if request.param == "ucx":
        require_ucx(monkeypatch)
    STREAM["kind"] = request.param
    yield request.param
    STREAM["kind"] = "tcp"


def over_ucx() -> bool:
    return STREAM["kind"] == "ucx"


def listen(srv) -> int:
    """The server listening on loopback over the test's stream kind; returns its port."""
    return srv.listen_ucx("127.0.0.1", 0) if over_ucx() else srv.listen("127.0.0.1", 0)


def connect(cli, server: int, port: int, streams: int = 2, timeout: float = 5.0) -> None:
    cli.connect(server, "127.0.0.1", port, streams, timeout, ucx=over_ucx())


def make_server(workers: int, *, budget: int = 1 << 32, conns: int = 256, rank: int = 0,
                async_mode: bool = False):
    srv = _core.DataServer(workers, rank, JOB, 2, MAXMSG, budget, conns, async_mode=async_mode)
    port = listen(srv)
    srv.start()
    return srv, port


def make_client(rank: int, ports: list[int], streams: int = 2, credit: int = 4 * PART):
    cli = _core.DataClient(rank, JOB, 2, credit, MAXMSG)
    for i, port in enumerate(ports):
        connect(cli, i, port, streams)
    return cli


def parts_of(nbytes: int, rnd: int, nservers: int, name: str = "t", decl_extra: dict = None,
             key_base: int = 0):
    out = []
    offs = list(range(0, nbytes, PART))
    for i, off in enumerate(offs):
        decl = None
        if rnd == 0:
            d = {"name": name, "shape": [nbytes // 4], "dtype": "float32", "part": i,
                 "nparts": len(offs)}
            d.update(decl_extra or {})
            d.setdefault("count", min(PART, nbytes - off) // ITEMSIZE[d["dtype"]])
            decl = pack_decl(**d)
        key = key_base + i
        out.append((key, key % nservers, key, off, min(PART, nbytes - off), decl))
    return out


def run_round(clients, inputs, outputs, dtype, rnd, nservers, op, divisor=1, **kw):
    for cli, x, y in zip(clients, inputs, outputs):
        cli.submit(op, 0, x.view(np.uint8), y.view(np.uint8), WIRE_CODE[dtype], divisor, rnd,
                   parts_of(x.nbytes, rnd, nservers, **kw))
    comps = []
    for cli in clients:
        assert cli.wait(op, 20.0), "the operation did not complete"
        comps.append(cli.take(op))
    return comps


def server_and_client(cleanup: list, workers: int = 1, rank: int = 0, *, budget: int = 1 << 32,
                      **client_kw):
    """A server of ``workers`` workers and rank ``rank``'s client of it, both closed after the
    test (``cleanup``): ``(srv, port, cli)``."""
    srv, port = make_server(workers, budget=budget)
    cleanup.append(srv)
    cli = make_client(rank, [port], **client_kw)
    cleanup.append(cli)
    return srv, port, cli


@pytest.mark.parametrize("dtype", sorted(WIRE_CODE))
def test_exact_sums_every_dtype_several_rounds(dtype, cleanup):
    srvs = [make_server(3) for _ in range(2)]
    cleanup += [s for s, _ in srvs]
    ports = [p for _, p in srvs]
    clients = [make_client(r, ports) for r in range(3)]
    cleanup += clients
    npdt = np.uint16 if dtype == "bfloat16" else np.dtype(dtype)
    n = (300 << 10) // np.dtype(npdt).itemsize + 3  # several partitions, a ragged last one
    rng = np.random.default_rng(7)
    for rnd in range(3):
        if dtype == "bfloat16":  # small integers are exact in bfloat16: 0x3f80 is 1.0
            vals = [np.full(n, 0x3F80 + (r << 7), np.uint16) for r in range(3)]
        elif dtype.startswith("int"):
            vals = [rng.integers(-1000, 1000, n).astype(npdt) for r in range(3)]
        else:
            vals = [rng.integers(-8, 8, n).astype(npdt) for r in range(3)]
        outs = [np.empty_like(v) for v in vals]
        comps = run_round(clients, vals, outs, dtype, rnd, 2, op=rnd + 1)
        assert all(c[1] for c in comps), comps
        if dtype == "bfloat16":
            f = lambda a: (a.astype(np.uint32) << 16).view(np.float32)  # noqa: E731
            want = f(vals[0]) + f(vals[1]) + f(vals[2])
            for o in outs:
                np.testing.assert_array_equal(f(o), want)
        else:
            want = vals[0] + vals[1] + vals[2]
            for o in outs:
                np.testing.assert_array_equal(o, want)
        assert comps[0][7] == vals[0].nbytes  # bytes received


def test_average_divides_in_place_and_ints_floor(cleanup):
    srv, port = make_server(2)
    cleanup.append(srv)
    clients = [make_client(r, [port]) for r in range(2)]
    cleanup += clients
    xs = [np.full(1000, 3.0, np.float32), np.full(1000, 4.0, np.float32)]
    outs = [np.empty_like(x) for x in xs]
    assert srv.stats()["sum_ns"] == 0
    assert all(c[1] for c in run_round(clients, xs, outs, "float32", 0, 1, 1, divisor=2))
    assert (outs[0] == 3.5).all() and (outs[1] == 3.5).all()
    assert srv.stats()["sum_ns"] > 0   # the two pushes' sum, timed (byteps_server_sum_seconds)
    xi = [np.full(10, 3, np.int32), np.full(10, 4, np.int32)]
    oi = [np.empty_like(x) for x in xi]
    assert all(c[1] for c in run_round(clients, xi, oi, "int32", 0, 1, 2, divisor=2,
                                       key_base=100))
    assert (oi[0] == 3).all()


def test_busy_time_counts_only_while_partitions_are_in_flight(cleanup):
    """``busy_ns`` (auto compression's bandwidth is bytes over it): it grows while a sent
    partition waits for its answer and stands still while nothing is in flight."""
    srv, port = make_server(2)
    cleanup.append(srv)
    clients = [make_client(r, [port]) for r in range(2)]
    cleanup += clients
    x = [np.full(300_000, r + 1.0, np.float32) for r in range(2)]
    y = [np.empty_like(v) for v in x]
    assert clients[0].stats()["busy_ns"] == 0
    t0 = time.monotonic()
    clients[0].submit(1, 0, x[0].view(np.uint8), y[0].view(np.uint8), WIRE_CODE["float32"], 1, 0,
                      parts_of(x[0].nbytes, 0, 1))
    held = 0.2   # rank 0's partitions wait this long at least: the server needs rank 1's push
    time.sleep(held)
    clients[1].submit(1, 0, x[1].view(np.uint8), y[1].view(np.uint8), WIRE_CODE["float32"], 1, 0,
                      parts_of(x[1].nbytes, 0, 1))
    for cli in clients:
        assert cli.wait(1, 20.0) and cli.take(1)[1]
    wall = time.monotonic() - t0
    busy = clients[0].stats()["busy_ns"]
    assert held * 1e9 <= busy <= wall * 1e9, (busy, held, wall)
    np.testing.assert_array_equal(y[0], np.full_like(x[0], 3.0))
    time.sleep(0.05)   # nothing in flight: the counter must not move
    assert clients[0].stats()["busy_ns"] == busy


def test_priorities_and_completions_of_many_operations(cleanup):
    srv, port, cli = server_and_client(cleanup, credit=PART)   # one partition in flight at a time
    arrays = [np.full(200_000, i, np.float32) for i in range(6)]
    outs = [np.zeros_like(a) for a in arrays]
    # held until all six are queued: otherwise the first ones submitted may leave before the
    # more urgent ones exist (a loaded machine made the first one finish first)
    cli.set_paused(True)
    for i, (a, o) in enumerate(zip(arrays, outs)):
        cli.submit(i + 1, i % 3, a.view(np.uint8), o.view(np.uint8), WIRE_CODE["float32"], 1, 0,
                   parts_of(a.nbytes, 0, 1, name=f"t{i}", key_base=i << 16))
    cli.set_paused(False)
    got = {}
    deadline = time.monotonic() + 20
    while len(got) < 6 and time.monotonic() < deadline:
        for c in cli.completions(0.5):
            got[c[0]] = c
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    assert all(c[1] for c in got.values())
    for a, o in zip(arrays, outs):
        np.testing.assert_array_equal(a, o)
    # with one partition of credit, the more urgent operations finished first
    assert got[3][6] <= got[1][6] and got[6][6] <= got[4][6]
    st = srv.stats()
    assert st["rounds"] >= 6 and st["rejected"] == 0


def test_declaration_mismatch_names_both_sides(cleanup):
    srv, port = make_server(2)
    cleanup.append(srv)
    clients = [make_client(r, [port]) for r in range(2)]
    cleanup += clients
    x = np.ones(100, np.float32)
    outs = [np.empty_like(x), np.empty_like(x)]
    clients[0].submit(1, 0, x.view(np.uint8), outs[0].view(np.uint8), 1, 1, 0,
                      parts_of(x.nbytes, 0, 1, decl_extra={"shape": [100], "dtype": "float32"}))
    clients[1].submit(1, 0, x.view(np.uint8), outs[1].view(np.uint8), 1, 1, 0,
                      parts_of(x.nbytes, 0, 1, decl_extra={"shape": [10, 10],
                                                           "dtype": "float32"}))
    comps = [c.wait(1, 10.0) and c.take(1) for c in clients]
    assert not any(c[1] for c in comps), comps
    for c in comps:
        assert c[2] == "remote"
        kind, text = decode_error(c[4])
        assert kind == "mismatch"
        assert "'t' shape (100,) float32" in text and "'t' shape (10, 10) float32" in text
        assert "worker rank 0" in text and "worker rank 1" in text


@pytest.mark.parametrize("case", ["shape", "dtype"])
def test_size_or_dtype_differing_between_ranks_is_a_mismatch_naming_both(case, cleanup):
    """A tensor whose shape or dtype differs between ranks reaches the server as a push of
    another size or dtype that declares another tensor: a mismatch naming both sides (as on
    the ZeroMQ path), not a protocol error about one push's size."""
    srv, port = make_server(2)
    cleanup.append(srv)
    clients = [make_client(r, [port]) for r in range(2)]
    cleanup += clients
    xs = [np.ones(100, np.float32),
          np.ones(50, np.float32) if case == "shape" else np.ones(100, np.float64)]
    outs = [np.empty_like(x) for x in xs]
    for r, (cli, x, y) in enumerate(zip(clients, xs, outs)):
        decl = {"shape": list(x.shape), "dtype": x.dtype.name}
        cli.submit(1, 0, x.view(np.uint8), y.view(np.uint8), WIRE_CODE[x.dtype.name], 1, 0,
                   parts_of(x.nbytes, 0, 1, decl_extra=decl))
        if r == 0:   # rank 0's declaration is the key's
            assert cli.wait(1, 0.5) is False
    comps = [c.wait(1, 10.0) and c.take(1) for c in clients]
    assert not any(c[1] for c in comps), comps
    other = "'t' shape (50,) float32" if case == "shape" else "'t' shape (100,) float64"
    for c in comps:
        assert c[2] == "remote", c
        kind, text = decode_error(c[4])
        assert kind == "mismatch", text
        assert "'t' shape (100,) float32" in text and other in text, text
        assert "worker rank 0" in text and "worker rank 1" in text, text
    assert "wrong dtype or size for a declared key" not in srv.rejected()


def test_push_out_of_round_is_rejected_alone(cleanup):
    srv, port, cli = server_and_client(cleanup)
    x = np.ones(100, np.float32)
    y = np.empty_like(x)
    assert run_round([cli], [x], [y], "float32", 0, 1, 1)[0][1]
    bad = run_round([cli], [x], [y], "float32", 7, 1, 2)[0]  # round 7 while round 1 is open
    assert not bad[1]
    assert "not open" in decode_error(bad[4])[1]
    assert run_round([cli], [x * 2], [y], "float32", 1, 1, 3)[0][1]  # the key keeps serving
    assert (y == 2).all()
    assert srv.rejected() == {"push out of round": 1}


def test_undeclared_key(cleanup):
    srv, port, cli = server_and_client(cleanup)
    x = np.ones(10, np.float32)
    y = np.empty_like(x)
    c = run_round([cli], [x], [y], "float32", 3, 1, 1)[0]   # round 3 carries no declaration
    assert not c[1] and "carries no declaration" in decode_error(c[4])[1]
    assert srv.stats()["keys"] == 0
    assert run_round([cli], [x], [y], "float32", 0, 1, 3, key_base=600)[0][1]


def test_memory_budget_refuses_a_declaration(cleanup):
    srv, port, cli = server_and_client(cleanup, budget=1 << 20)
    x = np.ones(1 << 18, np.float32)   # 1 MiB: two buffers do not fit 1 MiB
    y = np.empty_like(x)
    c = run_round([cli], [x], [y], "float32", 0, 1, 1)[0]
    assert not c[1]
    assert "BYTEPS_SERVER_MAX_BYTES" in decode_error(c[4])[1]
    assert srv.stats()["store_bytes"] <= 1 << 20


def _raw(port: int):
    """A bare stream to the server: a socket, or a RawUcx with its methods over UCX."""
    if over_ucx():
        return RawUcx(port, timeout=5)
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def hello(rank=0, job=JOB, mtype=24):
    return HDR.pack(b"BPSL", 1, mtype, 0, 2, rank, 0, job, 0, 0, 0, 0)


def test_hostile_streams_are_closed_and_counted(cleanup):
    srv, port = make_server(2)
    cleanup.append(srv)
    s = _raw(port)                                   # garbage instead of a hello (bad magic)
    s.sendall(b"GET / HTTP/1.1\r\n" + b"x" * 100)
    assert closed_by_peer(s)
    s = _raw(port)                                   # another job's hello: no answer at all
    s.sendall(hello(job=JOB + 1))
    assert closed_by_peer(s)
    s = _raw(port)                                   # a rank out of range
    s.sendall(hello(rank=5))
    assert closed_by_peer(s)
    s = _raw(port)                                   # valid hello, then an absurd length
    s.sendall(hello())
    assert HDR.unpack(s.recv(HDR.size, socket.MSG_WAITALL))[2] == 24
    s.sendall(HDR.pack(b"BPSL", 1, 20, 1, 2, 0, 0, JOB, 1, 0, 1 << 60, 1 << 62))
    assert closed_by_peer(s)
    s = _raw(port)                                   # valid hello, then another rank's push
    s.sendall(hello(rank=0))
    s.recv(HDR.size, socket.MSG_WAITALL)
    s.sendall(HDR.pack(b"BPSL", 1, 20, 1, 2, 1, 0, JOB, 1, 0, 1, 4) + b"\0" * 4)
    assert closed_by_peer(s)
    s = _raw(port)                                   # a meta frame over 1 MiB
    s.sendall(hello())
    s.recv(HDR.size, socket.MSG_WAITALL)
    s.sendall(HDR.pack(b"BPSL", 1, 20, 1, 2, 0, 1 | 2, JOB, 1, 0, 1, 4) + struct.pack("<I", 2 << 20))
    assert closed_by_peer(s)
    deadline = time.monotonic() + 5
    while sum(srv.rejected().values()) < 6 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert srv.rejected() == {"malformed": 2, "bad hello": 2, "oversized meta": 1,
                              "wrong job or rank for this stream": 1}
    assert srv.stats()["keys"] == 0   # nothing was allocated for any of them
    # the server still serves real workers
    clients = [make_client(r, [port]) for r in range(2)]
    cleanup += clients
    xs = [np.full(10, r + 1.0, np.float32) for r in range(2)]
    outs = [np.empty_like(x) for x in xs]
    assert all(c[1] for c in run_round(clients, xs, outs, "float32", 0, 1, 1))
    assert (outs[0] == 3).all()


def test_a_count_that_overflows_times_itemsize_is_malformed(cleanup):
    """A forged PUSH of 2^61 + 1000 float64 in 8,000 bytes: count * 8 wraps to 8,000 in 64
    bits, so a multiplying check accepted it (and the server echoed the count back in its
    PULL_RESP). The stream is closed as malformed and nothing is allocated."""
    srv, port = make_server(1)
    cleanup.append(srv)
    s = _raw(port)
    s.sendall(hello())
    assert HDR.unpack(s.recv(HDR.size, socket.MSG_WAITALL))[2] == 24
    count, nbytes = (1 << 61) + 1000, 8000
    assert count * 8 % (1 << 64) == nbytes   # the wrap a multiplying check falls for
    decl = pack_decl("t", [1000], "float64", 0, 1, 1000)
    flags = 1 | 2 | 8   # META, DECLARE, PULL
    s.sendall(HDR.pack(b"BPSL", 1, 20, WIRE_CODE["float64"], 2, 0, flags, JOB, 1, 0, count,
                       nbytes) + struct.pack("<I", len(decl)) + decl + b"\0" * nbytes)
    assert closed_by_peer(s)
    deadline = time.monotonic() + 5
    while not srv.rejected() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert srv.rejected() == {"malformed": 1}
    assert srv.stats()["keys"] == 0 and srv.stats()["pushes"] == 0


def test_a_lost_server_fails_operations_naming_it(cleanup):
    srv, port = make_server(2)
    cli = make_client(0, [port])
    cleanup.append(cli)
    x = np.ones(1000, np.float32)
    y = np.empty_like(x)
    # worker 1 never pushes, so the round stays open; then the server goes away
    cli.submit(1, 0, x.view(np.uint8), y.view(np.uint8), 1, 1, 0, parts_of(x.nbytes, 0, 1))
    time.sleep(0.2)
    srv.close()
    assert cli.wait(1, 10.0)
    c = cli.take(1)
    assert not c[1] and c[2] == "peer_lost"
    assert b"server rank 0" in c[4] and str(port).encode() in c[4]
    # later operations to that server fail at once with the same reason
    cli.submit(2, 0, x.view(np.uint8), y.view(np.uint8), 1, 1, 1, parts_of(x.nbytes, 1, 1))
    assert cli.wait(2, 5.0) and cli.take(2)[2] == "peer_lost"


def test_stalls_report_the_pushed_ranks(cleanup):
    srv, port, cli = server_and_client(cleanup, 3, 1)
    x = np.ones(10, np.float32)
    y = np.empty_like(x)
    cli.submit(1, 0, x.view(np.uint8), y.view(np.uint8), 1, 1, 0, parts_of(x.nbytes, 0, 1))
    deadline = time.monotonic() + 5
    stalls = []
    while not stalls and time.monotonic() < deadline:
        time.sleep(0.05)
        stalls = srv.stalls(0.0)
    assert len(stalls) == 1
    key, rnd, age, pushed, decl = stalls[0]
    assert (key, rnd, pushed) == (0, 0, [1]) and age >= 0
    assert parse_decl(decl).name == "t"
    assert srv.stalls(3600.0) == []


def test_submit_checks_buffers(cleanup):
    srv, port, cli = server_and_client(cleanup)
    x = np.ones(10, np.float32)
    with pytest.raises(ValueError, match="does not fit"):
        cli.submit(1, 0, x, np.empty(5, np.float32), 1, 1, 0, parts_of(x.nbytes, 0, 1))
    with pytest.raises(ValueError, match="read-only"):
        cli.submit(1, 0, x, b"\0" * 40, 1, 1, 0, parts_of(x.nbytes, 0, 1))
    with pytest.raises(ValueError, match="cannot be summed"):
        cli.submit(1, 0, x, np.empty_like(x), 7, 1, 0, parts_of(x.nbytes, 0, 1))


def test_held_partitions_go_out_by_priority_then_fifo(cleanup):
    srv, port, cli = server_and_client(cleanup)
    cli.set_paused(True)
    arrays = [np.full(1000, i, np.float32) for i in range(5)]
    outs = [np.zeros_like(a) for a in arrays]
    prios = [0, 5, 0, 9, 5]
    for i, (a, o) in enumerate(zip(arrays, outs)):
        cli.submit(i + 1, prios[i], a.view(np.uint8), o.view(np.uint8), 1, 1, 0,
                   parts_of(a.nbytes, 0, 1, name=f"t{i}", key_base=i << 16))
    time.sleep(0.2)
    assert cli.completions(0.0) == [] and cli.take_dispatch_log() == []  # held
    cli.set_paused(False)
    for op in range(1, 6):
        assert cli.wait(op, 10.0) and cli.take(op)[1]
    assert [k >> 16 for k in cli.take_dispatch_log()] == [3, 1, 4, 0, 2]


def test_many_queued_declarations_on_one_stream(cleanup):
    """Dozens of messages with declarations queued on one stream go out in one write (up to
    four pieces each): a regression test for the gather list's bound."""
    srv, port, cli = server_and_client(cleanup, streams=1, credit=0)
    cli.set_paused(True)
    arrays = [np.full(16, i, np.float32) for i in range(60)]
    outs = [np.zeros_like(a) for a in arrays]
    for i, (a, o) in enumerate(zip(arrays, outs)):
        cli.submit(i + 1, 0, a.view(np.uint8), o.view(np.uint8), 1, 1, 0,
                   parts_of(a.nbytes, 0, 1, name=f"t{i}", key_base=i << 16))
    cli.set_paused(False)
    for op in range(1, 61):
        assert cli.wait(op, 10.0) and cli.take(op)[1]
    for a, o in zip(arrays, outs):
        np.testing.assert_array_equal(a, o)


# ---- the authenticated handshake (a job secret) --------------------------------------------
KEY = b"k" * 32


def test_hmac_sha256_matches_the_standard_library():
    import hashlib
    import hmac
    for key in (b"", b"k", KEY, b"x" * 64, b"y" * 65, bytes(range(200))):
        for msg in (b"", b"abc", b"m" * 55, b"m" * 56, b"m" * 64, bytes(range(256)) * 5):
            assert _core.hmac_sha256(key, msg) == hmac.new(key, msg, hashlib.sha256).digest()


def test_authenticated_streams_sum_exactly(cleanup):
    srv = _core.DataServer(2, 0, JOB, 2, MAXMSG, 1 << 30, 64, auth_key=KEY)
    port = listen(srv)
    srv.start()
    cleanup.append(srv)
    clients = []
    for r in range(2):
        cli = _core.DataClient(r, JOB, 2, 4 * PART, MAXMSG, auth_key=KEY)
        connect(cli, 0, port, 2)
        clients.append(cli)
    cleanup += clients
    xs = [np.full(50_000, r + 1.0, np.float32) for r in range(2)]
    outs = [np.empty_like(x) for x in xs]
    assert all(c[1] for c in run_round(clients, xs, outs, "float32", 0, 1, 1))
    assert (outs[0] == 3).all() and (outs[1] == 3).all()
    assert srv.rejected() == {}


def test_wrong_or_missing_secrets_are_refused_with_the_reason(cleanup):
    srv = _core.DataServer(1, 0, JOB, 1, MAXMSG, 1 << 30, 64, auth_key=KEY)
    port = listen(srv)
    srv.start()
    cleanup.append(srv)
    wrong = _core.DataClient(0, JOB, 1, 0, MAXMSG, auth_key=b"z" * 32)
    cleanup.append(wrong)
    with pytest.raises(RuntimeError, match="authentication failed.*BYTEPS_AUTH_SECRET"):
        connect(wrong, 0, port, 1)
    none = _core.DataClient(0, JOB, 1, 0, MAXMSG)
    cleanup.append(none)
    with pytest.raises(RuntimeError, match="BYTEPS_AUTH_SECRET"):
        connect(none, 0, port, 1)
    # a raw peer that knows the protocol but not the key: its proof is refused
    s = _raw(port)
    s.sendall(HDR.pack(b"BPSL", 1, 24, 0, 2, 0, 32, JOB, 0, 0, 0, 32) + b"n" * 32)
    reply = HDR.unpack(s.recv(HDR.size, socket.MSG_WAITALL))
    assert reply[2] == 24 and reply[6] & 32 and reply[11] == 64
    s.recv(64, socket.MSG_WAITALL)
    s.sendall(HDR.pack(b"BPSL", 1, 24, 0, 2, 0, 32, JOB, 0, 0, 0, 32) + b"\0" * 32)
    assert closed_by_peer(s)
    deadline = time.monotonic() + 5
    while srv.rejected().get("authentication failed", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert srv.rejected() == {"authentication failed": 2}, srv.rejected()
    assert srv.stats()["keys"] == 0
    # a worker with a secret against a server without one: told so, not left guessing
    plain, pport = make_server(1)
    cleanup.append(plain)
    keyed = _core.DataClient(0, JOB, 1, 0, MAXMSG, auth_key=KEY)
    cleanup.append(keyed)
    with pytest.raises(RuntimeError, match="does not authenticate"):
        connect(keyed, 0, pport, 1)
