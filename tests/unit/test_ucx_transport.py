"""The UCX transport (byteps_like/transport/ucx_transport.py) at the endpoint level, over
loopback TCP (UCX_TLS=tcp UCX_NET_DEVICES=lo unless the environment says otherwise)."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

pytest.importorskip("ucxx", reason="the UCX transport needs ucxx (pip install 'byteps_like[ucx]')")

from byteps_like.config import load  # noqa: E402
from byteps_like.errors import ConfigError  # noqa: E402
from byteps_like.transport import Route, make_endpoint  # noqa: E402
from byteps_like.transport.ucx_transport import INLINE_MAX, StagingPool, UcxEndpoint, UcxZmqEndpoint  # noqa: E402

UCX_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo", "UCX_WARN_UNUSED_ENV_VARS": "n"}


@pytest.fixture(autouse=True)
def _loopback(monkeypatch):
    for k, v in UCX_ENV.items():
        if k not in os.environ:
            monkeypatch.setenv(k, v)


def wait_for(cond, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.002)


class Box:
    """Collects what an endpoint delivers, with the thread each message arrived on."""

    def __init__(self):
        self.items: list = []
        self.threads: set = set()
        self.cv = threading.Condition()

    def __call__(self, route, frames):
        with self.cv:
            self.items.append((route, frames))
            self.threads.add(threading.current_thread().name)
            self.cv.notify_all()

    def wait(self, n, timeout=20.0):
        with self.cv:
            assert self.cv.wait_for(lambda: len(self.items) >= n, timeout), \
                f"got {len(self.items)} of {n} messages"
        return self.items[:n]


@pytest.fixture
def pair():
    made = []

    def make(max_message_bytes=1 << 30, connections=1, echo=True):
        srv = UcxEndpoint("srv", max_message_bytes=max_message_bytes)
        cli = UcxEndpoint("cli")
        made.extend([cli, srv])
        srv_box, cli_box = Box(), Box()

        def on_srv(route, frames):
            srv_box(route, frames)
            if echo:
                srv.send(route, frames)
        srv.on_message = on_srv
        cli.on_message = cli_box
        addr = srv.bind("ucx://127.0.0.1:0")
        srv.start()
        cli.start()
        cli.connect("s", addr, connections)
        return srv, cli, srv_box, cli_box, addr
    yield make
    for ep in made:
        assert ep.close(0.5)


def as_bytes(f) -> bytes:
    return f if isinstance(f, bytes) else bytes(memoryview(f))


def test_multipart_round_trip_and_reply_by_ident(pair):
    srv, cli, srv_box, cli_box, _ = pair()
    big = np.arange(1 << 20, dtype=np.uint8)
    frames = [b"head", b"", os.urandom(INLINE_MAX + 1), big, memoryview(b"tail")]
    cli.send(Route(peer="s"), frames)
    (route, got), = cli_box.wait(1)
    assert route == Route(peer="s", conn=0)
    assert [as_bytes(f) for f in got] == [as_bytes(f) for f in frames]
    (sroute, _), = srv_box.wait(1)
    assert sroute.ident is not None and sroute.ident[:1] == b"U"


def test_64mib_message(pair):
    srv, cli, srv_box, cli_box, _ = pair()
    big = np.random.default_rng(1).integers(0, 255, 64 << 20, dtype=np.uint8)
    cli.send(Route(peer="s"), [b"h", big])
    (_, got), = cli_box.wait(1, timeout=60)
    assert np.array_equal(np.frombuffer(got[1], np.uint8), big)


def test_many_small_messages_arrive_in_order(pair):
    srv, cli, srv_box, cli_box, _ = pair()
    n = 3000
    for i in range(n):
        cli.send(Route(peer="s"), [b"%d" % i, b"x" * (i % 100)])
    got = cli_box.wait(n, timeout=60)
    assert [int(f[0]) for _, f in got] == list(range(n))
    assert all(len(f[1]) == i % 100 for i, (_, f) in enumerate(got))


def test_several_connections_per_peer(pair):
    srv, cli, srv_box, cli_box, _ = pair(connections=3)
    wait_for(lambda: cli.connections("s") == 3, what="3 connections")  # made on the I/O thread
    for c in range(3):
        for i in range(5):
            cli.send(Route(peer="s", conn=c), [b"%d:%d" % (c, i)])
    got = cli_box.wait(15)
    idents = {r.ident for r, _ in srv_box.wait(15)}
    assert len(idents) == 3                       # three distinct connections at the server
    for route, frames in got:                     # each reply came back on its own connection
        assert frames[0].startswith(b"%d:" % route.conn)
    for c in range(3):
        assert [f[0] for r, f in got if r.conn == c] == [b"%d:%d" % (c, i) for i in range(5)]


def test_call_soon_and_timers_run_on_the_io_thread(pair):
    srv, cli, srv_box, cli_box, _ = pair()
    seen, ticks = [], []
    cli.call_soon(lambda: seen.append(threading.current_thread().name))
    cli.add_timer(0.02, lambda: ticks.append(threading.current_thread().name))
    wait_for(lambda: seen and len(ticks) >= 3, what="call_soon and 3 timer ticks")
    assert set(seen) | set(ticks) == {"bpsl-ucx-cli"}
    cli.send(Route(peer="s"), [b"x"])
    cli_box.wait(1)
    assert cli_box.threads == {"bpsl-ucx-cli"} and srv_box.threads == {"bpsl-ucx-srv"}


def test_oversized_message_closes_only_that_connection(pair):
    srv, cli, srv_box, cli_box, addr = pair(max_message_bytes=1 << 20)
    cli.send(Route(peer="s"), [b"ok"])
    cli_box.wait(1)
    cli.send(Route(peer="s"), [b"big", np.zeros(2 << 20, np.uint8)])
    wait_for(lambda: srv.stats["rejected"] >= 1, what="the server to reject the message")
    assert len(srv_box.items) == 1               # never delivered
    assert srv.pool.stats()["allocated"] == 0    # and no memory was taken for it
    other = UcxEndpoint("other")                 # the server still serves everyone else
    box = Box()
    other.on_message = box
    other.start()
    try:
        other.connect("s", addr)
        other.send(Route(peer="s"), [b"again", np.ones(1000, np.uint8)])
        (_, got), = box.wait(1)
        assert got[0] == b"again"
    finally:
        assert other.close(0.5)


@pytest.mark.parametrize("head", [b"garbage!" * 4, b"BPSH\x01\x00\x00\x00",
                                  b"BPSH\x01\x00\x02\x00" + b"\x01\x01" + b"\xff" * 16])
def test_malformed_header_closes_the_connection_not_the_endpoint(pair, head):
    srv, cli, srv_box, cli_box, addr = pair()
    cli.send(Route(peer="s"), [b"ok"])
    cli_box.wait(1)

    def inject():   # a raw HEAD message, as a broken or hostile peer would send it
        conn = cli.conns.by_route[("s", 0)]
        arr = cli.Array(head)
        req = conn.ep.tag_send(arr, cli.L.UCXXTag((conn.peer_cid << 32) | 1))
        cli._sending.append((req, arr, conn))
    cli.call_soon(inject)
    wait_for(lambda: srv.stats["rejected"] >= 1, what="the server to reject the header")
    assert srv._thread.is_alive()
    other = UcxEndpoint("other")
    box = Box()
    other.on_message = box
    other.start()
    try:
        other.connect("s", addr)
        other.send(Route(peer="s"), [b"still serving"])
        assert box.wait(1)[0][1][0] == b"still serving"
    finally:
        assert other.close(0.5)


def test_staging_buffers_are_reused_across_rounds_but_not_while_held(pair):
    srv, cli, srv_box, cli_box, _ = pair(echo=False)
    payload = np.ones(1 << 20, np.uint8)
    for _rnd in range(5):         # frames dropped after delivery: one buffer serves every round
        cli.send(Route(peer="s"), [b"r", payload])
        srv_box.wait(1)
        srv_box.items.clear()
    st = srv.pool.stats()
    assert (st["allocated"], st["reused"]) == (1, 4), st
    srv_box.items.clear()
    held = []
    srv.on_message = lambda route, frames: held.append(np.frombuffer(frames[1], np.uint8)[10:])
    for rnd in range(3):          # a consumer keeps a view of each payload: no buffer reuse
        cli.send(Route(peer="s"), [b"r", payload * (rnd + 2)])
    wait_for(lambda: len(held) == 3, what="3 held messages")
    st = srv.pool.stats()
    assert st["allocated"] == 3 and st["lent"] == 3, st   # the free one plus two new ones
    assert [int(h[0]) for h in held] == [2, 3, 4]          # none was overwritten
    held.clear()                  # views gone: every buffer goes back to the pool
    assert srv.pool.stats()["lent"] == 0


def test_staging_pool_size_classes():
    assert StagingPool.size_class(1) == StagingPool.MIN_SIZE
    assert StagingPool.size_class(4096000) == 1 << 22
    assert StagingPool.size_class(1 << 22) == 1 << 22


def test_close_releases_everything(pair):
    srv, cli, srv_box, cli_box, _ = pair()
    cli.send(Route(peer="s"), [b"x", np.zeros(1 << 20, np.uint8)])
    cli_box.wait(1)
    thread = cli._thread
    assert cli.close(0.5)
    assert not thread.is_alive() and cli.closed
    assert cli._efd == -1 and cli.worker is None and not cli.conns.conns
    assert cli.pool.stats() == {"allocated": 1, "reused": 0, "lent": 0, "free": 0,
                                "free_bytes": 0}
    cli.send(Route(peer="s"), [b"after close"])   # dropped, no crash
    assert cli.close(0.5)                         # idempotent


def test_unreachable_peer_is_reported_not_hung():
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    ep = UcxEndpoint("lonely")
    errors = []
    ep.on_error = errors.append
    ep.start()
    ep.connect("s", f"ucx://127.0.0.1:{port}")
    ep.send(Route(peer="s"), [b"x"])
    try:
        wait_for(lambda: errors, timeout=60, what="the connection error")
    finally:
        assert ep.close(0.5)
    assert "cannot connect to s" in str(errors[0]) and "UCX_TLS=" in str(errors[0])


def _child(code: str, env: dict) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    full.update(env)
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True,
                          timeout=60)


NEW_ENDPOINT = """
from byteps_like.config import ucx_environment
from byteps_like.errors import ConfigError
from byteps_like.transport.ucx_transport import UcxEndpoint
try:
    UcxEndpoint("server 3", ucx_env=ucx_environment())
except ConfigError as exc:
    print("CONFIGERROR", exc)
else:
    print("CREATED")
"""


@pytest.mark.parametrize("env,named", [
    ({"UCX_TLS": "rc", "UCX_NET_DEVICES": "lo"}, "UCX_TLS=rc"),
    ({"UCX_TLS": "tcp", "UCX_NET_DEVICES": "nosuchnic0"}, "UCX_NET_DEVICES=nosuchnic0")])
def test_no_usable_transport_is_a_clear_config_error(env, named):
    r = _child(NEW_ENDPOINT, env)
    assert "CONFIGERROR" in r.stdout, r.stdout + r.stderr
    assert "server 3: UCX found no usable transport" in r.stdout
    assert named in r.stdout and "docs/transports.md" in r.stdout


def test_missing_ucxx_is_a_clear_config_error():
    code = "import sys; sys.modules['ucxx'] = None\n" + NEW_ENDPOINT
    r = _child(code, UCX_ENV)
    assert "CONFIGERROR" in r.stdout, r.stdout + r.stderr
    assert "pip install 'byteps_like[ucx]'" in r.stdout


# ------------------------------------------------------------------ configuration, make_endpoint
@pytest.mark.parametrize("env", [{"BYTEPS_TRANSPORT": "ucx"}, {"DMLC_ENABLE_RDMA": "1"},
                                 {"DMLC_ENABLE_UCX": "1"}])
def test_ucx_is_selected_by_byteps_and_dmlc_names(env):
    assert load(env=env).transport.transport == "ucx"


def test_rdma_flag_contradicting_explicit_zmq_is_refused():
    with pytest.raises(ConfigError, match="DMLC_ENABLE_RDMA=1 .*BYTEPS_TRANSPORT='zmq'"):
        load(env={"DMLC_ENABLE_RDMA": "1", "BYTEPS_TRANSPORT": "zmq"})


@pytest.mark.parametrize("env", [{"BYTEPS_AUTH_SECRET": "s3cret", "DMLC_NODE_HOST": "10.1.2.3"},
                                 {}])
def test_a_ucx_job_with_a_secret_or_on_loopback_keeps_its_endpoint_on_zeromq(env):
    """Issue 41: the ucxx endpoint can neither authenticate nor listen on one address, so a
    UCX job with a secret (CURVE) or on loopback keeps its endpoint on ZeroMQ; the native
    data plane's UCX streams carry the data and prove the secret themselves."""
    from byteps_like.transport import ZmqEndpoint, data_scheme
    cfg = load(env={"BYTEPS_TRANSPORT": "ucx", **env})
    ep = make_endpoint("server", cfg)
    try:
        assert isinstance(ep, ZmqEndpoint) and data_scheme(cfg) == "tcp"
        assert (ep.curve is not None) == bool(env), ep.curve
    finally:
        ep.close(linger=0)


def test_ucx_transport_keeps_control_on_zeromq_and_one_io_thread():
    import zmq
    ctx = zmq.Context()
    cfg = load(env={"BYTEPS_TRANSPORT": "ucx", "DMLC_NODE_HOST": "10.1.2.3"})
    a = make_endpoint("a", cfg, context=ctx)
    b = make_endpoint("b", cfg, context=ctx)
    assert isinstance(a, UcxZmqEndpoint)
    box = Box()
    a.on_message = lambda route, frames: (box(route, frames), a.send(route, [b"re"] + frames))
    b.on_message = box
    try:
        tcp = a.bind("tcp://127.0.0.1:0")
        ucx = a.bind("ucx://127.0.0.1:0")
        a.start()
        b.start()
        b.connect("ctl", tcp)
        b.connect("data", ucx)
        b.send(Route(peer="ctl"), [b"over zmq"])
        b.send(Route(peer="data"), [b"over ucx"])
        got = box.wait(4)
        by_first = {as_bytes(f[0]) if as_bytes(f[0]) != b"re" else b"re " + as_bytes(f[1]): r
                    for r, f in got}
        assert by_first[b"re over zmq"] == Route(peer="ctl")
        assert by_first[b"re over ucx"] == Route(peer="data")
        assert by_first[b"over ucx"].ident[:1] == b"U"
        assert by_first[b"over zmq"].ident[:1] != b"U"
        assert box.threads == {"bpsl-ucx-a", "bpsl-ucx-b"}   # never the ZeroMQ threads
    finally:
        assert a.close(0.5) and b.close(0.5)
        ctx.term()
