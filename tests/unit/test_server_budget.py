"""A server's memory budget (issue 41, item 5): the default (80% of the machine's memory) is
shared by the servers of one machine, so two local servers no longer take 160% of it between
them; and a compressed declaration's codec is charged to the budget before it is made, so a
declaration of a few bytes cannot make the server allocate a partition's worth first."""
from __future__ import annotations

import numpy as np

from byteps_like.compression import Compression
from byteps_like.config import load
from byteps_like.transport import native
from byteps_like.transport.native import decode_error

from .test_native_codec import _decl, _native_server, _push_all
from .test_torchrun import tr_env


def test_local_servers_share_the_default_budget():
    whole = int(native.machine_memory() * 0.8)
    alone = load(env={"DMLC_NUM_SERVER": "1", "DMLC_NUM_WORKER": "1"})
    assert native.local_servers(alone) == 1 and native.store_budget(alone) == whole
    # bpslaunch --local: every node on loopback, so every server of the job is on this machine
    two = load(env={"DMLC_NUM_SERVER": "2", "DMLC_NUM_WORKER": "2",
                    "DMLC_PS_ROOT_URI": "127.0.0.1"})
    assert native.local_servers(two) == 2 and native.store_budget(two) == whole // 2
    # a routable address: servers on other machines; one here unless the launcher says more
    routable = {"DMLC_NUM_SERVER": "4", "DMLC_NUM_WORKER": "2", "DMLC_PS_ROOT_URI": "10.1.2.3",
                "DMLC_NODE_HOST": "10.1.2.4"}
    assert native.local_servers(load(env=routable)) == 1
    told = load(env={**routable, "BYTEPS_SERVER_LOCAL_SIZE": "2"})
    assert native.local_servers(told) == 2 and native.store_budget(told) == whole // 2
    # an explicit budget is each server's own
    mine = load(env={**routable, "BYTEPS_SERVER_LOCAL_SIZE": "2",
                     "BYTEPS_SERVER_MAX_BYTES": "1GiB"})
    assert native.store_budget(mine) == 1 << 30


def test_torchrun_servers_per_node_share_the_default_budget():
    cfg = load(env=tr_env(rank=0, world=4, local_rank=0, local_world=2,
                          BYTEPS_TORCHRUN_SERVERS_PER_NODE="3"))
    assert cfg.server.local_servers == 3
    assert cfg.source("server.local_servers").startswith("torchrun")
    assert native.store_budget(cfg) == int(native.machine_memory() * 0.8) // 3


def test_a_compressed_declarations_codec_is_charged_before_it_is_made(cleanup):
    """A budget that holds the push's two buffers but not the codec's residual (error feedback,
    n floats) and accumulator: refused naming the budget before the codec exists, nothing held;
    a budget that holds them serves the key and charges them."""
    comp, n = Compression.topk(0.01, error_feedback=True), 100000
    p = np.array(comp.make_codec(n, role="worker", key=5).encode(np.ones(n, np.float32), 0))
    srv, clis = _native_server(cleanup, 1, budget=4 * p.nbytes)
    (c,) = _push_all(clis, [p], [np.empty_like(p)], 0, 1, _decl("w", comp, n))
    assert not c[1], c
    msg = decode_error(c[4])[1]
    assert "its codec needs" in msg and "BYTEPS_SERVER_MAX_BYTES" in msg, msg
    assert "worker rank 0" in msg and "key 5" in msg, msg
    assert srv.stats()["store_bytes"] == 0 and srv.stats()["keys"] == 0
    assert srv.rejected() == {"server memory budget exhausted": 1}
    srv2, clis2 = _native_server(cleanup, 1, budget=4 * (2 * n) + 4 * p.nbytes + (1 << 16))
    (c,) = _push_all(clis2, [p], [np.empty_like(p)], 0, 1, _decl("w", comp, n))
    assert c[1], c
    assert srv2.stats()["store_bytes"] >= 2 * p.nbytes + 2 * 4 * n
