"""BYTEPS_TRANSPORT=ucx at the configuration and endpoint level: what selects it, and that
every UCX job keeps its node endpoints (control, the server-held tables) on ZeroMQ, CURVE with
a secret, while the native data plane's streams are UCX (issue 39 retired the ucxx endpoint
that a UCX job without a secret and off loopback used for the tables)."""
from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from byteps_like.config import load
from byteps_like.errors import ConfigError
from byteps_like.transport import Route, ZmqEndpoint, make_endpoint


@pytest.mark.parametrize("env", [{"BYTEPS_TRANSPORT": "ucx"}, {"DMLC_ENABLE_RDMA": "1"},
                                 {"DMLC_ENABLE_UCX": "1"}])
def test_ucx_is_selected_by_byteps_and_dmlc_names(env):
    assert load(env=env).transport.transport == "ucx"


def test_rdma_flag_contradicting_explicit_zmq_is_refused():
    with pytest.raises(ConfigError, match="DMLC_ENABLE_RDMA=1 .*BYTEPS_TRANSPORT='zmq'"):
        load(env={"DMLC_ENABLE_RDMA": "1", "BYTEPS_TRANSPORT": "zmq"})


@pytest.mark.parametrize("secret", [False, True])
@pytest.mark.parametrize("host", ["127.0.0.1", "10.1.2.3"])
def test_every_ucx_job_keeps_its_endpoint_on_zeromq(secret, host):
    """With or without a secret, on loopback or off it (the case that had the ucxx endpoint):
    a ZeroMQ endpoint, CURVE exactly when there is a secret, that carries a request and its
    answer over tcp://."""
    import zmq
    env = {"BYTEPS_TRANSPORT": "ucx", "DMLC_NODE_HOST": host,
           **({"BYTEPS_AUTH_SECRET": "s3cret"} if secret else {})}
    cfg = load(env=env)
    ctx = zmq.Context()
    srv = make_endpoint("server", cfg, context=ctx)
    cli = make_endpoint("worker", cfg, context=ctx)
    got: list = []
    answered: list = []
    srv.on_message = lambda route, frames: (got.append(bytes(frames[0])),
                                            srv.send(route, [b"re " + bytes(frames[0])]))
    cli.on_message = lambda route, frames: answered.append((route, bytes(frames[0])))
    try:
        assert isinstance(srv, ZmqEndpoint) and isinstance(cli, ZmqEndpoint)
        assert (srv.curve is not None) is secret and (cli.curve is not None) is secret
        address = srv.bind("tcp://127.0.0.1:0")
        srv.start()
        cli.start()
        cli.connect("server-0", address)
        cli.send(Route(peer="server-0"), [b"table pull"])
        from tests.support import wait_until
        assert wait_until(lambda: answered, timeout=20), "no answer over the ZeroMQ endpoint"
        assert got == [b"table pull"] and answered == [(Route(peer="server-0"), b"re table pull")]
    finally:
        cli.close(linger=0)
        srv.close(linger=0)
        ctx.term()


def test_a_ucx_server_address_is_refused_naming_the_replacement():
    """ucx:// addresses were the ucxx endpoint's: a server given one says what to do."""
    from byteps_like.server import Server
    cfg = load(env={"DMLC_ROLE": "server", "DMLC_NUM_WORKER": "1", "DMLC_NUM_SERVER": "1"})
    with pytest.raises(ConfigError) as err:
        Server(cfg, address="ucx://127.0.0.1:0")
    text = str(err.value)
    assert "server address ucx://127.0.0.1:0" in text and "retired in issue 39" in text
    assert "listens on tcp://" in text and "BYTEPS_TRANSPORT=ucx" in text


NO_UCXX = """
import sys
sys.modules['ucxx'] = sys.modules['libucxx'] = None   # importing either now fails
from byteps_like.config import load
from byteps_like.transport import ZmqEndpoint, make_endpoint, native
cfg = load(env={'BYTEPS_TRANSPORT': 'ucx', 'DMLC_NODE_HOST': '10.1.2.3'})
native.check(cfg)   # the data plane's UCX streams: libucp loaded, else a ConfigError
ep = make_endpoint('server', cfg)
assert isinstance(ep, ZmqEndpoint), ep
ep.close(linger=0)
print('UCX STREAMS WITHOUT UCXX')
"""


def test_the_ucx_streams_need_libucx_not_ucxx(monkeypatch):
    """The `ucx` extra is libucx alone: with ucxx unimportable, a UCX job's data plane loads
    libucp and its endpoint is ZeroMQ."""
    from ..native_stream import require_ucx
    require_ucx(monkeypatch)   # skips only where the extra is not installed, else must work
    assert importlib.util.find_spec("libucx") is not None
    r = subprocess.run([sys.executable, "-c", NO_UCXX], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "UCX STREAMS WITHOUT UCXX" in r.stdout, r.stdout + r.stderr
