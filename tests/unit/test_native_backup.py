"""Backup workers on the native data plane, driven through _core.DataServer and
_core.DataClient on loopback (csrc/dataplane_server_backup.cc): a key declared with
"backup": b completes a round with all but b pushes and answers their count; a late push is
dropped and answered with its round's kept sum; a worker behind the kept rounds gets the
"behind" error; a bad declaration is refused."""
from __future__ import annotations

import json

import numpy as np
import pytest

from byteps_like.transport.native import WIRE_CODE

from .test_native_dataplane import make_client, make_server, parts_of

N = 3 * (64 << 10) // 4  # three partitions of float32


@pytest.fixture(autouse=True)
def tcp_streams():
    from . import test_native_dataplane as nd
    nd.STREAM["kind"] = "tcp"
    yield


KEEP: list = []  # the arrays of operations in flight: the client reads and writes them


def submit(cli, op, x, y, rnd, backup=1, divisor=3):
    KEEP.extend((x, y))
    cli.submit(op, 0, x.view(np.uint8), y.view(np.uint8), WIRE_CODE["float32"], divisor, rnd,
               parts_of(x.nbytes, rnd, 1, decl_extra={"backup": backup} if backup else None))


def take(cli, op, timeout=20.0):
    assert cli.wait(op, timeout), "the operation did not complete"
    return cli.take(op)


def grad(rank: int, rnd: int) -> np.ndarray:
    return np.full(N, (rank + 1) * (rnd + 1), np.float32) + (np.arange(N) % 7).astype(np.float32)


def job(cleanup, max_lag=64):
    KEEP.clear()
    srv, port = make_server(3)
    srv.set_backup_max_lag(max_lag)
    clients = [make_client(r, [port]) for r in range(3)]
    cleanup += [srv] + clients
    return srv, clients


def test_rounds_complete_without_the_last_push_and_the_late_one_catches_up(cleanup):
    srv, clients = job(cleanup)
    ys = {r: [] for r in range(3)}
    for rnd in range(4):  # ranks 0 and 1 alone: every round completes with their two pushes
        for r in (0, 1):
            y = np.empty(N, np.float32)
            submit(clients[r], 100 * r + rnd, grad(r, rnd), y, rnd)
        for r in (0, 1):
            comp = take(clients[r], 100 * r + rnd)
            assert comp[1], comp
            assert comp[9] == 2  # the pushes summed travel with the answer
        ys[0].append(y)
    for rnd in range(4):  # rank 2 pushes every round late: each answered at once, its push dropped
        y = np.empty(N, np.float32)
        submit(clients[2], 200 + rnd, grad(2, rnd), y, rnd)
        comp = take(clients[2], 200 + rnd)
        assert comp[1], comp
        np.testing.assert_array_equal(y, (grad(0, rnd) + grad(1, rnd)) / np.float32(2))
    st = srv.stats()
    assert st["late_pushes_dropped"] == 4 * 3 and st["backup_rounds"] == 4 * 3
    assert st["lag_errors"] == 0


def test_a_worker_behind_the_kept_rounds_is_told_so(cleanup):
    srv, clients = job(cleanup, max_lag=1)
    for rnd in range(4):
        for r in (0, 1):
            submit(clients[r], 100 * r + rnd, grad(r, rnd), np.empty(N, np.float32), rnd)
        for r in (0, 1):
            assert take(clients[r], 100 * r + rnd)[1]
    submit(clients[2], 7, grad(2, 0), np.empty(N, np.float32), 0)
    comp = take(clients[2], 7)
    assert not comp[1]
    meta = json.loads(comp[4])
    assert meta["kind"] == "behind" and meta["rank"] == 2 and meta["behind"] == 3, meta
    assert "worker rank 2 asked for round 0, 3 rounds behind" in meta["message"], meta
    assert "BYTEPS_BACKUP_MAX_LAG" in meta["message"]
    # round 2 is still kept (the newest and one before it): rank 2 may resume from there
    y = np.empty(N, np.float32)
    submit(clients[2], 8, grad(2, 2), y, 2, backup=0)
    assert take(clients[2], 8)[1]
    np.testing.assert_array_equal(y, (grad(0, 2) + grad(1, 2)) / np.float32(2))
    assert srv.stats()["lag_errors"] >= 1


def test_without_the_declaration_every_round_waits_for_everyone(cleanup):
    """Ranks 0 and 1 push first; their answers are the average of all three all the same."""
    srv, clients = job(cleanup)
    ys = [np.empty(N, np.float32) for _ in range(3)]
    for r in range(3):
        submit(clients[r], r, grad(r, 0), ys[r], 0, backup=0)
    for r in range(3):
        comp = take(clients[r], r)
        assert comp[1] and comp[9] == 0  # everyone summed: no count in the answer
        np.testing.assert_array_equal(
            ys[r], (grad(0, 0) + grad(1, 0) + grad(2, 0)) / np.float32(3))
    assert srv.stats()["backup_rounds"] == 0


@pytest.mark.parametrize("backup", [3, 7, 0xFFFF])
def test_a_bad_backup_declaration_is_refused(cleanup, backup):
    srv, clients = job(cleanup)
    submit(clients[0], 1, grad(0, 0), np.empty(N, np.float32), 0, backup=backup)
    comp = take(clients[0], 1)
    assert not comp[1]
    assert "BYTEPS_BACKUP_WORKERS must be 1 to 2" in comp[4].decode(), comp


def test_no_room_to_keep_a_round_fails_the_key_naming_the_budget(cleanup):
    """A budget with room for the key's two buffers but not for a kept copy of its sum: the
    round's completion fails the key, every waiting worker told why, nothing kept silently."""
    KEEP.clear()
    n = (64 << 10) // 4  # one partition
    srv, port = make_server(3, budget=2 * (64 << 10) + 4096)
    clients = [make_client(r, [port]) for r in range(3)]
    cleanup += [srv] + clients
    for r in (0, 1):
        x = np.full(n, r + 1, np.float32)
        KEEP.extend([x, np.empty_like(x)])
        clients[r].submit(r, 0, x.view(np.uint8), KEEP[-1].view(np.uint8),
                          WIRE_CODE["float32"], 3, 0,
                          parts_of(x.nbytes, 0, 1, decl_extra={"backup": 1}))
    for r in (0, 1):
        comp = take(clients[r], r)
        assert not comp[1], comp
        text = json.loads(comp[4])["message"]
        assert "BYTEPS_SERVER_MAX_BYTES" in text and "to keep round 0's sum" in text, text
    assert srv.stats()["store_bytes"] <= 2 * (64 << 10) + 4096
