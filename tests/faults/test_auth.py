"""Authentication: with BYTEPS_AUTH_SECRET set every TCP connection uses ZeroMQ CURVE with keys
derived from the secret, and the listening side's ZAP handler admits only the job's client key.
A peer without the secret cannot register, push or pull; the job is unaffected and exact."""
from __future__ import annotations

import numpy as np
import pytest
import zmq

from byteps_like.config import load
from byteps_like.errors import CommTimeoutError
from byteps_like.transport import derive_curve_keys
from byteps_like.wire import FLAG_DECLARE, Header, MsgType, Role, encode, job_hash
from byteps_like.worker.runtime import Runtime

from .cluster import running_cluster
from .hostile import HostileClient

pytestmark = pytest.mark.integration
SECRET = "s3cret-" + "x" * 40
JOB = job_hash("default")


def test_keys_are_deterministic_and_secret_dependent():
    a, b, c = derive_curve_keys(SECRET), derive_curve_keys(SECRET), derive_curve_keys("other")
    assert a == b and a != c
    assert a.server_public != a.client_public
    assert zmq.curve_public(a.client_secret) == a.client_public
    with pytest.raises(ValueError):
        derive_curve_keys("")


def _intruders(address: str) -> list[HostileClient]:
    wrong = derive_curve_keys("not the secret")
    right = derive_curve_keys(SECRET)
    return [
        HostileClient(address, timeout_ms=500),                                   # plain TCP
        HostileClient(address, timeout_ms=500,                                    # wrong secret
                      curve=(wrong.server_public, wrong.client_public, wrong.client_secret)),
        # knows the server's public key (public keys may leak) but not the client key
        HostileClient(address, timeout_ms=500,
                      curve=(right.server_public, *zmq.curve_keypair())),
    ]


def test_peers_without_the_secret_cannot_register_push_or_pull():
    with running_cluster(workers=2, extra={"BYTEPS_AUTH_SECRET": SECRET}) as c:
        outs = c.push_pull(lambda r: np.full(6, r + 1, np.float64), "w")
        assert all(np.array_equal(o, np.full(6, 3.0)) for o in outs), outs
        reg = encode(Header(MsgType.REGISTER, job=JOB), meta={"role": "worker", "host": "evil",
                                                              "port": 1, "pid": 1})
        push = encode(Header(MsgType.PUSH, "float64", Role.WORKER, 0, FLAG_DECLARE, JOB, 4242, 0,
                             6, 48), np.full(6, 1e9).tobytes(), {"name": "evil"})
        pull = encode(Header(MsgType.PULL, "none", Role.WORKER, 0, 0, JOB, 4242, 0))
        before = (c.sched.rejected, c.server.rejected)
        for client in _intruders(c.sched.address):
            assert client.send(reg, True) is None, "scheduler answered an unauthenticated peer"
            client.close()
        for client in _intruders(c.server.address):
            assert client.send(push, True) is None, "server answered an unauthenticated push"
            assert client.send(pull, True) is None, "server answered an unauthenticated pull"
            client.close()
        # nothing reached the application: no message was even decoded
        assert (c.sched.rejected, c.server.rejected) == before
        assert c.server.ep.auth is not None and c.server.ep.auth.denied >= 2
        assert c.server.native.stats()["keys"] == 1  # "w" alone: 4242 made no key
        outs = c.push_pull(lambda r: np.full(6, r + 1, np.float64), "w")
        assert all(np.array_equal(o, np.full(6, 3.0)) for o in outs), outs


def test_a_worker_with_the_wrong_secret_cannot_join():
    from byteps_like.scheduler import Scheduler

    from .cluster import cluster_env, free_port
    env = cluster_env(free_port(), workers=2, servers=1, BYTEPS_AUTH_SECRET=SECRET,
                      BYTEPS_REGISTER_TIMEOUT_SECONDS="2")
    sched = Scheduler(load(env={**env, "DMLC_ROLE": "scheduler"}))
    sched.start()
    try:
        w = Runtime(load(env={**env, "DMLC_ROLE": "worker", "BYTEPS_AUTH_SECRET": "guess"}))
        with pytest.raises(CommTimeoutError):
            w.init()
        assert not sched.nodes, "an unauthenticated worker registered"
        assert sched.wait(10) == 1  # the job never formed: registration timed out
    finally:
        sched.close()


def test_a_secret_file_works_and_an_unreadable_one_is_a_config_error(tmp_path):
    from byteps_like.errors import ConfigError
    from byteps_like.transport import auth_secret
    f = tmp_path / "secret"
    f.write_text(SECRET + "\n")
    assert auth_secret(load(env={"BYTEPS_AUTH_SECRET_FILE": str(f)})) == SECRET
    with pytest.raises(ConfigError, match="BYTEPS_AUTH_SECRET_FILE"):
        auth_secret(load(env={"BYTEPS_AUTH_SECRET_FILE": str(tmp_path / "missing")}))
    assert auth_secret(load(env={})) == ""
