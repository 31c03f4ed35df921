"""Bounded staleness in asynchronous mode (BYTEPS_ASYNC_STALENESS, issue 38 item 3) on the
native data plane, driven through _core.DataServer(async_mode=True).set_staleness and
_core.DataClient on loopback. Each worker pushes a one-hot vector (1 at its own rank), so the
value a pull answers counts, per worker, the pushes applied before it: the rounds each worker
had reached when the answer left. Holds are observed through the server's own count
(``stale_holds``), never by waiting for a time."""
from __future__ import annotations

import time

import numpy as np
import pytest

from byteps_like.transport.native import WIRE_CODE

from .test_native_dataplane import make_client, make_server, parts_of

F32 = WIRE_CODE["float32"]
_KEEP: list[np.ndarray] = []   # the pushed arrays, alive until their operations complete


def server(workers: int, staleness: int):
    srv, port = make_server(workers, async_mode=True)
    srv.set_staleness(staleness)
    return srv, port


def submit(cli, rank: int, workers: int, rnd: int, op: int, out: np.ndarray) -> None:
    x = np.zeros(workers, np.float32)
    x[rank] = 1.0
    _KEEP.append(x)
    cli.submit(op, 0, x.view(np.uint8), out.view(np.uint8), F32, 1, rnd,
               parts_of(x.nbytes, rnd, 1))


def push_pull(cli, rank: int, workers: int, rnd: int, op: int) -> np.ndarray:
    out = np.empty(workers, np.float32)
    submit(cli, rank, workers, rnd, op, out)
    assert cli.wait(op, 20.0), f"worker {rank}'s round {rnd} did not complete"
    c = cli.take(op)
    assert c[1], c
    return out


def wait_holds(srv, n: int, timeout: float = 20.0) -> None:
    """Until the server has held ``n`` pulls back (the event, not a time)."""
    deadline = time.monotonic() + timeout
    while srv.stats()["stale_holds"] < n:
        assert time.monotonic() < deadline, f"the server held {srv.stats()['stale_holds']} " \
                                            f"pulls, expected {n}"
        time.sleep(0.005)


def two_workers(cleanup, staleness: int):
    """A server of two workers with the bound ``staleness``, and the two workers' clients."""
    srv, port = server(2, staleness=staleness)
    clients = [make_client(r, [port]) for r in range(2)]
    cleanup += [srv, *clients]
    return srv, clients


def test_a_fast_worker_is_held_s_rounds_ahead_of_the_slowest(cleanup):
    srv, port = server(3, staleness=2)
    clients = [make_client(r, [port]) for r in range(3)]
    cleanup += [srv, *clients]
    for r in (1, 2):   # the slow workers push round 0
        push_pull(clients[r], r, 3, 0, 1)
    for rnd in range(3):   # rounds 0..2 need round <= 0 of the others: answered at once
        y = push_pull(clients[0], 0, 3, rnd, 10 + rnd)
        assert y[0] == rnd + 1 and y[0] - min(y[1], y[2]) <= 2
    assert srv.stats()["stale_holds"] == 0
    out = np.empty(3, np.float32)
    submit(clients[0], 0, 3, 3, 20, out)   # round 3 needs round 1 of workers 1 and 2
    wait_holds(srv, 1)
    assert not clients[0].wait(20, 0.0)
    push_pull(clients[1], 1, 3, 1, 2)      # worker 1 is at round 1, worker 2 still at 0
    assert not clients[0].wait(20, 0.0)
    assert srv.stats()["stale_holds"] == 1  # counted once, however often it was looked at
    y2 = push_pull(clients[2], 2, 3, 1, 2)  # the slowest reaches round 1: worker 0 goes on
    assert clients[0].wait(20, 20.0)
    assert clients[0].take(20)[1]
    # what worker 0's round 3 saw: its own 4 pushes, 2 of each other worker: 2 rounds ahead
    assert out.tolist() == [4.0, 2.0, 2.0]
    assert y2.tolist() == [4.0, 2.0, 2.0]   # worker 2's answer came after worker 0's push
    assert srv.rejected() == {}


def test_a_worker_that_left_or_joined_is_not_waited_for(cleanup):
    srv, clients = two_workers(cleanup, 1)
    push_pull(clients[1], 1, 2, 0, 1)
    push_pull(clients[0], 0, 2, 0, 1)
    push_pull(clients[0], 0, 2, 1, 2)
    out = np.empty(2, np.float32)
    submit(clients[0], 0, 2, 2, 3, out)    # needs worker 1's round 1
    wait_holds(srv, 1)
    srv.set_members([1], {})               # worker 1 in join(): released
    assert clients[0].wait(3, 20.0) and clients[0].take(3)[1]
    assert out.tolist() == [3.0, 1.0]
    srv.set_members([], {})                # back: worker 1 is waited for again
    submit(clients[0], 0, 2, 3, 4, out)
    wait_holds(srv, 2)
    assert not clients[0].wait(4, 0.0)
    srv.set_members([], {1: "worker rank 1 on 127.0.0.1 (pid 1) has finished"})
    assert clients[0].wait(4, 20.0) and clients[0].take(4)[1]
    for rnd in range(4, 9):                # gone for good: nobody holds worker 0 back
        push_pull(clients[0], 0, 2, rnd, 10 + rnd)
    assert srv.stats()["stale_holds"] == 2


def test_staleness_zero_is_unbounded_as_before(cleanup):
    srv, clients = two_workers(cleanup, 0)
    push_pull(clients[1], 1, 2, 0, 1)
    for rnd in range(12):      # worker 1 never pushes again: nothing waits for it
        y = push_pull(clients[0], 0, 2, rnd, 10 + rnd)
        assert y.tolist() == [rnd + 1, 1.0]
    assert srv.stats()["stale_holds"] == 0


def test_a_bound_lifted_releases_what_it_held(cleanup):
    srv, clients = two_workers(cleanup, 1)
    push_pull(clients[1], 1, 2, 0, 1)
    for rnd in range(2):
        push_pull(clients[0], 0, 2, rnd, 10 + rnd)
    out = np.empty(2, np.float32)
    submit(clients[0], 0, 2, 5, 3, out)    # round 5 of 1 ahead needs round 4
    wait_holds(srv, 1)
    srv.set_staleness(0)
    assert clients[0].wait(3, 20.0) and clients[0].take(3)[1]
    assert out.tolist() == [3.0, 1.0]


def test_bad_bounds_are_refused(cleanup):
    srv, _ = make_server(2, async_mode=True)
    sync, _ = make_server(2)
    cleanup += [srv, sync]
    with pytest.raises(ValueError, match="must be 0 .unbounded. or a number of rounds"):
        srv.set_staleness(-1)
    with pytest.raises(ValueError, match="asynchronous mode only"):
        sync.set_staleness(1)
    sync.set_staleness(0)   # the default is fine anywhere
