"""The server's receive-and-sum path over TCP (csrc/dataplane_server_sum.cc and
dataplane_server_stream.cc, docs/performance.md "Server CPU"): a chunk's first push whose bytes
all wait in the socket is received straight into the store, the others into a cache-sized
scratch piece and summed as they arrive. Whichever way each chunk went, the sums are exact and
every worker gets the same bytes."""
from __future__ import annotations

import numpy as np

from byteps_like import _core
from byteps_like.transport.native import WIRE_CODE
from byteps_like.wire import ITEMSIZE, pack_decl

JOB = 0xB0B
MAXMSG = 1 << 28
PART = 4 << 20            # a partition of many chunks (the server's chunk is 256 KiB)
ROUNDS_FOR_A_LANDING = 40


def _parts(nbytes: int, rnd: int, dtype: str):
    out = []
    for i, off in enumerate(range(0, nbytes, PART)):
        decl = None
        if rnd == 0:
            decl = pack_decl("land", [nbytes // ITEMSIZE[dtype]], dtype, i, -(-nbytes // PART),
                             min(PART, nbytes - off) // ITEMSIZE[dtype])
        out.append((i, 0, i, off, min(PART, nbytes - off), decl))
    return out


def _round(clients, vals, dtype: str, rnd: int):
    outs = [np.empty_like(v) for v in vals]
    for cli, x, y in zip(clients, vals, outs):
        cli.submit(rnd + 1, 0, x.view(np.uint8), y.view(np.uint8), WIRE_CODE[dtype], 1, rnd,
                   _parts(x.nbytes, rnd, dtype))
    for cli in clients:
        assert cli.wait(rnd + 1, 30.0), "the operation did not complete"
        assert cli.take(rnd + 1)[1], "the operation failed"
    return outs


def test_chunks_land_in_the_store_or_are_summed_and_the_sums_stay_exact(cleanup):
    workers = 3
    srv = _core.DataServer(workers, 0, JOB, 2, MAXMSG, 1 << 32, 64)
    port = srv.listen("127.0.0.1", 0)
    srv.start()
    cleanup.append(srv)
    clients = []
    for r in range(workers):
        cli = _core.DataClient(r, JOB, 2, 2 * PART, MAXMSG)
        cli.connect(0, "127.0.0.1", port, 2, 5.0)
        clients.append(cli)
        cleanup.append(cli)
    rng = np.random.default_rng(38)
    n = (3 * PART + 12345 * 4) // 4   # a ragged last partition and a ragged last chunk
    landed = rounds = 0
    # rounds until at least one chunk went straight into the store (each round checks every
    # sum): whether a chunk's bytes all wait when its stream gets to it depends on timing
    while rounds < ROUNDS_FOR_A_LANDING and (landed == 0 or rounds < 3):
        # integers in float32: exact whatever the order of the additions
        vals = [rng.integers(-(1 << 12), 1 << 12, n).astype(np.float32) for _ in clients]
        outs = _round(clients, vals, "float32", rounds)
        want = (vals[0] + vals[1] + vals[2]).tobytes()
        assert all(o.tobytes() == want for o in outs), f"round {rounds}: a wrong sum"
        rounds += 1
        landed = srv.stats()["landed_bytes"]
    assert landed > 0, f"no chunk was received straight into the store in {rounds} rounds"
    # every landed chunk is a whole chunk of a push: at most what the pushes brought
    assert landed <= srv.stats()["bytes_summed"]
