"""Tests of the ZeroMQ endpoint over inproc:// (shared context) and tcp://127.0.0.1 loopback."""
from __future__ import annotations

import queue
import re
import threading
import time

import numpy as np
import pytest
import zmq

from byteps_like.errors import ProtocolError
from byteps_like.transport import Route, ZmqEndpoint
from byteps_like.wire import Header, MsgType, decode, encode
from tests.support import wait_until

WAIT = 5.0


class Node:
    """A started-or-not endpoint whose received messages land in a queue."""

    def __init__(self, ep: ZmqEndpoint):
        self.ep = ep
        self.inbox: queue.Queue = queue.Queue()
        self.errors: list[BaseException] = []
        ep.on_message = lambda route, frames: self.inbox.put(
            (route, frames, threading.current_thread()))
        ep.on_error = self.errors.append

    def recv(self, timeout: float = WAIT):
        route, frames, thread = self.inbox.get(timeout=timeout)
        return route, frames, thread

    def recv_bytes(self, timeout: float = WAIT):
        route, frames, _ = self.recv(timeout)
        return route, [f.bytes for f in frames]

    def io_thread(self) -> threading.Thread:
        return self.ep._thread


@pytest.fixture
def make_node(zmq_context):
    made: list[Node] = []

    def make(name: str, **kw) -> Node:
        node = Node(ZmqEndpoint(name, context=zmq_context, **kw))
        made.append(node)
        return node

    yield make
    for node in reversed(made):
        close_within(node.ep, WAIT)


def close_within(ep: ZmqEndpoint, timeout: float) -> None:
    t = threading.Thread(target=ep.close, kwargs={"linger": 0.1}, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"{ep.name}: close() hung"


_counter = iter(range(1_000_000))


@pytest.fixture(params=["inproc", "tcp"])
def address(request):
    if request.param == "inproc":
        return f"inproc://test-srv-{next(_counter)}"
    return "tcp://127.0.0.1:0"


def start_pair(make_node, address, connections=1, **srv_kw):
    srv = make_node("srv", **srv_kw)
    bound = srv.ep.bind(address)
    srv.ep.start()
    cli = make_node("cli")
    cli.ep.start()
    cli.ep.connect("srv", bound, connections)
    return srv, cli, bound


# ------------------------------------------------------------------------------ binding
def test_bind_tcp_port_zero_returns_the_real_port(make_node):
    srv = make_node("srv")
    bound = srv.ep.bind("tcp://127.0.0.1:0")
    m = re.fullmatch(r"tcp://127\.0\.0\.1:(\d+)", bound)
    assert m and 0 < int(m.group(1)) < 65536, bound


def test_bind_inproc_returns_the_address(make_node):
    srv = make_node("srv")
    assert srv.ep.bind("inproc://named-srv") == "inproc://named-srv"


def test_bind_twice_is_refused(make_node):
    srv = make_node("srv")
    srv.ep.bind("inproc://twice")
    with pytest.raises(RuntimeError, match="already bound"):
        srv.ep.bind("inproc://twice-2")


def test_every_socket_has_the_message_size_limit(make_node):
    srv = make_node("srv", max_message_bytes=12345)
    srv.ep.bind("inproc://limit")
    srv.ep.connect("peer", "inproc://limit", 2)  # before start: runs here
    socks = [srv.ep._router, *srv.ep._dealers.values()]
    assert len(socks) == 3
    assert all(s.getsockopt(zmq.MAXMSGSIZE) == 12345 for s in socks)


# ------------------------------------------------------------------------------ request/reply
def test_dealer_with_two_connections_talks_to_router(make_node, address):
    srv, cli, _ = start_pair(make_node, address, connections=2)
    # the server echoes from its I/O thread, routed back by the client's identity
    srv.ep.on_message = lambda route, frames: (
        srv.inbox.put((route, frames, threading.current_thread())),
        srv.ep.send(Route(ident=route.ident), [b"echo", *frames]))
    assert wait_until(lambda: cli.ep.connections("srv") == 2)

    cli.ep.send(Route(peer="srv", conn=0), [b"a", b"0"])
    cli.ep.send(Route(peer="srv", conn=1), [b"b", b"1"])
    got_srv = [srv.recv() for _ in range(2)]
    idents = {route.ident for route, _, _ in got_srv}
    assert len(idents) == 2, "two connections must appear as two distinct clients"
    assert all(r.peer is None and r.ident for r, _, _ in got_srv)
    assert all(t is srv.io_thread() for _, _, t in got_srv), "on_message runs on the I/O thread"

    replies = [cli.recv_bytes() for _ in range(2)]
    by_conn = {route.conn: frames for route, frames in replies}
    assert all(route.peer == "srv" for route, _ in replies)
    assert by_conn == {0: [b"echo", b"a", b"0"], 1: [b"echo", b"b", b"1"]}


def test_reply_to_a_vanished_client_is_dropped_not_fatal(make_node, address):
    srv, cli, _ = start_pair(make_node, address)
    srv.ep.send(Route(ident=b"\x00nobody"), [b"x"])  # ROUTER_MANDATORY -> EHOSTUNREACH
    cli.ep.send(Route(peer="srv"), [b"still-alive"])
    assert srv.recv_bytes()[1] == [b"still-alive"]
    assert srv.errors == [] and srv.io_thread().is_alive()


def test_send_from_the_io_thread_and_call_soon_runs_there(make_node, address):
    srv, cli, _ = start_pair(make_node, address)
    ran_on = queue.Queue()

    def on_io():
        ran_on.put(threading.current_thread())
        cli.ep.send(Route(peer="srv"), [b"from-io"])

    cli.ep.call_soon(on_io)
    assert ran_on.get(timeout=WAIT) is cli.io_thread()
    assert cli.io_thread().name == "bpsl-io-cli"
    assert srv.recv_bytes()[1] == [b"from-io"]


def test_replies_to_a_client_that_does_not_read_are_dropped_at_the_mark_and_counted(
        make_node, zmq_context):
    """A client of the listening socket that asks and never reads: once its queue is at the
    high-water mark (and TCP's buffers are full), each further reply is dropped and counted,
    never queued without bound nor blocking the I/O thread; a client that reads is answered
    all the while."""
    srv = make_node("srv", hwm=4)
    bound = srv.ep.bind("tcp://127.0.0.1:0")
    srv.ep.on_message = lambda route, frames: srv.ep.send(route, [b"r" * (256 << 10)])
    srv.ep.start()
    mute = zmq_context.socket(zmq.DEALER)
    mute.setsockopt(zmq.RCVHWM, 1)
    mute.setsockopt(zmq.LINGER, 0)
    mute.connect(bound)
    reason = "reply to a client that does not read: its queue is at BYTEPS_SOCKET_HWM (4 messages)"
    try:
        for _ in range(400):   # 100 MiB of replies asked for: far past the mark and TCP
            mute.send(b"ask")
        assert wait_until(lambda: srv.ep.drops.counts.get(reason, 0) > 100, WAIT * 4)
        cli = make_node("cli")
        cli.ep.start()
        got: queue.Queue = queue.Queue()
        cli.ep.on_message = lambda route, frames: got.put(len(frames[0].bytes))
        cli.ep.connect("srv", bound)
        cli.ep.send(Route(peer="srv"), [b"ask"])
        assert got.get(timeout=WAIT) == 256 << 10
        assert srv.errors == [] and srv.io_thread().is_alive()
    finally:
        mute.close(0)


def test_send_from_many_threads(make_node, address):
    srv, cli, _ = start_pair(make_node, address)
    n_threads, n_msgs = 4, 50

    def sender(i):
        for j in range(n_msgs):
            cli.ep.send(Route(peer="srv"), [b"%d" % i, b"%d" % j])

    threads = [threading.Thread(target=sender, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    got = [srv.recv_bytes()[1] for _ in range(n_threads * n_msgs)]
    for i in range(n_threads):
        mine = [int(j) for tid, j in got if tid == b"%d" % i]
        assert mine == list(range(n_msgs)), "per-thread order must be preserved"


def test_close_sends_what_other_threads_queued_before_it(make_node):
    """close() from one thread must not overtake messages another thread queued before it
    (each thread has its own pipe into the I/O thread): the scheduler's SHUTDOWN to every node,
    queued by the thread that runs its handlers, was lost this way."""
    srv, cli, _ = start_pair(make_node, "tcp://127.0.0.1:0")
    cli.ep.send(Route(peer="srv"), [b"hello"])       # the connection is up before the burst
    assert srv.recv_bytes()[1] == [b"hello"]
    n = 300
    sent = threading.Event()

    def burst():
        for j in range(n):
            cli.ep.send(Route(peer="srv"), [b"%d" % j])
        sent.set()
    t = threading.Thread(target=burst)
    t.start()
    assert sent.wait(WAIT)
    assert cli.ep.close(linger=2.0)
    got = [int(srv.recv_bytes()[1][0]) for _ in range(n)]
    assert got == list(range(n))


def test_call_soon_keeps_per_thread_order_with_later_sends(make_node):
    """A thread that calls connect() (queued with call_soon) and then send() must see its
    connection made before its message is routed, even while another thread is half-way
    through its own call_soon(). Today the I/O thread pops whichever callable is first in a
    shared queue when *any* thread's wake-up token arrives, so the connect can be run late, the
    send finds no connection, and the KeyError kills the I/O thread."""
    srv = make_node("srv")
    bound = srv.ep.bind("inproc://order")
    srv.ep.start()
    cli = make_node("cli")
    cli.ep.start()

    other_put, release_other = threading.Event(), threading.Event()
    real_sender = cli.ep._sender

    def gated_sender():
        """The thread named 'other' stalls after queuing its callable, before its wake-up."""
        if threading.current_thread().name == "other":
            other_put.set()
            release_other.wait(WAIT)
        return real_sender()

    cli.ep._sender = gated_sender
    other_ran = threading.Event()
    other = threading.Thread(target=cli.ep.call_soon, args=(other_ran.set,), name="other")
    other.start()
    assert other_put.wait(WAIT)
    try:
        cli.ep.connect("srv", bound)
        cli.ep.send(Route(peer="srv"), [b"after-connect"])
        route, frames = srv.recv_bytes(timeout=2.0)
        assert frames == [b"after-connect"]
    finally:
        release_other.set()
        other.join(WAIT)
    assert other_ran.wait(WAIT)
    assert cli.errors == []


# ------------------------------------------------------------------------------ timers
def test_timer_added_before_start_fires_repeatedly_on_the_io_thread(make_node):
    node = make_node("t")
    ticks = queue.Queue()
    node.ep.add_timer(0.01, lambda: ticks.put((time.monotonic(), threading.current_thread())))
    node.ep.start()
    got = [ticks.get(timeout=WAIT) for _ in range(3)]
    assert all(t is node.io_thread() for _, t in got)
    assert got[1][0] - got[0][0] >= 0.005


def test_timer_added_after_start_fires(make_node):
    """ControlClient.connect_and_register() adds its heartbeat timer after ep.start(), while
    the I/O thread may be blocked in poll() with no timeout (no timers yet). The timer must
    fire without waiting for unrelated traffic to wake the loop."""
    node = make_node("t")
    node.ep.start()
    assert wait_until(lambda: node.io_thread().is_alive())
    time.sleep(0.05)  # let the loop block in poll(): that is the state being tested
    ticks = queue.Queue()
    node.ep.add_timer(0.01, lambda: ticks.put(threading.current_thread()))
    assert ticks.get(timeout=2.0) is node.io_thread()


def test_two_timers_interleave(make_node):
    node = make_node("t")
    seen = queue.Queue()
    node.ep.add_timer(0.01, lambda: seen.put("fast"))
    node.ep.add_timer(0.03, lambda: seen.put("slow"))
    node.ep.start()
    got = [seen.get(timeout=WAIT) for _ in range(8)]
    assert "slow" in got and got.count("fast") > got.count("slow")


# ------------------------------------------------------------------------------ big and oversized
def test_8_mib_numpy_payload_arrives_intact(make_node, address):
    srv, cli, _ = start_pair(make_node, address)
    arr = np.random.default_rng(0).standard_normal(2 * 1024 * 1024).astype(np.float32)
    assert arr.nbytes == 8 << 20
    header = Header(MsgType.PUSH, "float32", count=arr.size, nbytes=arr.nbytes, key=5)
    cli.ep.send(Route(peer="srv"), encode(header, arr))  # from a non-I/O thread, zero-copy
    route, frames, _ = srv.recv()
    msg = decode(frames, max_bytes=16 << 20)
    np.testing.assert_array_equal(np.frombuffer(msg.payload.buffer, np.float32), arr)
    # and back, from the server's I/O thread
    srv.ep.call_soon(lambda: srv.ep.send(route, [arr[::-1].copy()]))
    _, back, _ = cli.recv()
    np.testing.assert_array_equal(np.frombuffer(back[0].buffer, np.float32), arr[::-1])


def test_oversized_message_is_dropped_over_tcp(make_node):
    """ZeroMQ enforces MAXMSGSIZE in its TCP decoder: the receiver never sees the message,
    it drops the connection, and the sender's DEALER reconnects (as a new client identity);
    messages in flight on the dropped connection are lost, later ones arrive."""
    limit = 1 << 20
    srv, cli, _ = start_pair(make_node, "tcp://127.0.0.1:0", max_message_bytes=limit)
    cli.ep.send(Route(peer="srv"), [b"hello"])
    first_route, frames = srv.recv_bytes()
    assert frames == [b"hello"]

    big = np.ones(2 * limit, np.uint8)
    cli.ep.send(Route(peer="srv"), [big])
    arrived = None
    deadline = time.monotonic() + WAIT
    i = 0
    while arrived is None and time.monotonic() < deadline:
        cli.ep.send(Route(peer="srv"), [b"ping", b"%d" % i])
        i += 1
        try:
            route, frames, _ = srv.recv(timeout=0.05)
        except queue.Empty:
            continue
        sizes = [len(f.buffer) for f in frames]
        assert max(sizes) <= limit, f"the receiver saw an oversized message {sizes}"
        arrived = route, [f.bytes for f in frames]
    assert arrived is not None, "the connection never recovered after the oversized message"
    route, frames = arrived
    assert frames[0] == b"ping"
    assert route.ident != first_route.ident, "expected a reconnect under a new identity"
    assert srv.io_thread().is_alive() and cli.io_thread().is_alive()
    assert srv.errors == [] and cli.errors == []
    # the server answers the new identity
    srv.ep.send(Route(ident=route.ident), [b"pong"])
    assert cli.recv_bytes()[1] == [b"pong"]


def test_oversized_message_over_inproc_is_stopped_by_the_decoder(make_node):
    """ZeroMQ does not apply MAXMSGSIZE to inproc:// (no wire decoder): an oversized message may
    be delivered. Whatever the transport does, the wire decoder's max_bytes check rejects it."""
    limit = 1 << 16
    srv, cli, _ = start_pair(make_node, f"inproc://oversize-{next(_counter)}",
                             max_message_bytes=limit)
    payload = np.zeros(2 * limit, np.uint8)
    header = Header(MsgType.PUSH, "uint8", count=payload.size, nbytes=payload.nbytes)
    cli.ep.send(Route(peer="srv"), encode(header, payload))
    cli.ep.send(Route(peer="srv"), [b"after"])
    _, frames, _ = srv.recv()
    if len(frames) == 2:  # delivered
        with pytest.raises(ProtocolError, match="exceeds the limit"):
            decode(frames, max_bytes=limit)
        _, frames, _ = srv.recv()
    assert [f.bytes for f in frames] == [b"after"]
    assert srv.io_thread().is_alive()


# ------------------------------------------------------------------------------ errors and close
def test_send_to_an_unknown_peer_is_logged_and_the_io_thread_survives(make_node, address,
                                                                      caplog):
    srv, cli, _ = start_pair(make_node, address)
    cli.ep.on_error = lambda exc: cli.errors.append(exc)
    with caplog.at_level("ERROR", logger="byteps_like.transport"):
        cli.ep.send(Route(peer="nobody", conn=3), [b"x"])
        cli.ep.send(Route(peer="srv"), [b"after"])
        _, frames, _ = srv.recv()
    assert [f.bytes for f in frames] == [b"after"]
    assert any("nobody" in r.getMessage() for r in caplog.records)
    assert cli.errors == [] and cli.io_thread().is_alive()


def test_close_stops_the_io_thread(make_node, address):
    srv, cli, _ = start_pair(make_node, address)
    cli.ep.send(Route(peer="srv"), [b"x"])
    srv.recv()
    for node in (cli, srv):
        t = node.io_thread()
        close_within(node.ep, WAIT)
        assert not t.is_alive()


def test_close_from_the_io_thread_then_from_the_owner(make_node):
    node = make_node("n")
    node.ep.start()
    node.ep.call_soon(lambda: node.ep.close())
    t = node.io_thread()
    t.join(WAIT)
    assert not t.is_alive()
    close_within(node.ep, WAIT)  # the owner's close afterwards is harmless


def test_close_without_start(make_node):
    node = make_node("n")
    node.ep.bind("tcp://127.0.0.1:0")
    node.ep.connect("x", "tcp://127.0.0.1:1")
    close_within(node.ep, WAIT)


def test_close_with_a_timer_pending_does_not_hang(make_node):
    node = make_node("n")
    node.ep.add_timer(3600.0, lambda: None)
    node.ep.start()
    t0 = time.monotonic()
    close_within(node.ep, WAIT)
    assert time.monotonic() - t0 < WAIT


# ------------------------------------------------------------------------------ watch_link
def test_a_watched_connection_reports_up_down_and_refused(make_node):
    """Issue 40: the node side of the scheduler's liveness: ZeroMQ's socket monitor on the
    connection says when the peer answers (up), when its connection closes (down) and when an
    attempt is refused."""
    srv = make_node("srv")
    bound = srv.ep.bind("tcp://127.0.0.1:0")
    srv.ep.start()
    cli = make_node("cli")
    seen: queue.Queue = queue.Queue()
    assert cli.ep.watch_link("srv", seen.put)
    cli.ep.start()
    cli.ep.connect("srv", bound)

    def until(what: str) -> list[str]:
        got = []
        while what not in got:
            got.append(seen.get(timeout=WAIT))
        return got

    assert "connected" in until("up")
    close_within(srv.ep, WAIT)   # the peer goes: its connection closes
    until("down")
    assert "refused" in until("refused")   # and reconnecting is refused (nothing listens)


def test_an_unwatched_connection_has_no_monitor(make_node, address):
    srv, cli, _bound = start_pair(make_node, address)
    assert not cli.ep._links


def test_a_zap_authenticator_waits_for_its_predecessors_address_to_be_freed(monkeypatch):
    """libzmq frees a closed socket's inproc address on its reaper thread, after close()
    returns: a new authenticator of the same context retries a bind that finds
    inproc://zeromq.zap.01 still in use (it had failed a test with "Address already in use"),
    and raises once ZAP_REBIND_S has passed."""
    import threading

    import zmq
    from zmq.auth.thread import ThreadAuthenticator

    from byteps_like.transport import zmq_transport as zt
    ctx = zmq.Context()
    blocker = ctx.socket(zmq.PAIR)
    blocker.bind("inproc://zeromq.zap.01")
    auth = ThreadAuthenticator(ctx)
    tried = threading.Event()
    real_start = auth.start

    def start():
        tried.set()
        real_start()
    auth.start = start
    outcome: list = []
    t = threading.Thread(target=lambda: outcome.append(zt._start_zap(auth) or "started"))
    t.start()
    try:
        assert tried.wait(10)           # it tried while the address was held
        blocker.close(linger=0)         # the predecessor's socket goes
        t.join(10)
        assert outcome == ["started"] and auth.is_alive()
    finally:
        auth.stop()
        t.join(10)
    # an address that stays in use: the error, once ZAP_REBIND_S has passed (the blocker's own
    # bind waits for the stopped authenticator's address like _start_zap)
    blocker = ctx.socket(zmq.PAIR)

    def bound() -> bool:
        try:
            blocker.bind("inproc://zeromq.zap.01")
        except zmq.ZMQError:
            return False
        return True
    assert wait_until(bound, 10)
    monkeypatch.setattr(zt, "ZAP_REBIND_S", 0.05)
    other = ThreadAuthenticator(ctx)
    with pytest.raises(zmq.ZMQError, match="Address already in use"):
        zt._start_zap(other)
    blocker.close(linger=0)
    ctx.term()
