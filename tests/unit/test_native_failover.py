"""Losing a server on the native data plane, driven through _core.DataServer and
_core.DataClient on loopback (csrc/dataplane_failover.h, dataplane_server_failover.cc): the
parts of a lost server wait instead of failing, its keys move to the survivors (only its
keys), each moved key is seeded with the last round its workers completed, and the open
rounds are pushed again, so every worker gets exactly the sums an uninterrupted job gives,
including a round whose answer reached one worker and not the other."""
from __future__ import annotations

import socket
import struct
import threading

import numpy as np
import pytest

from byteps_like import _core, wire
from byteps_like.transport.native import WIRE_CODE

from ..native_stream import HDR, recv_exact
from .test_native_dataplane import JOB, MAXMSG, PART, connect, make_server, parts_of


@pytest.fixture(autouse=True)
def tcp_streams():
    """These tests play a server over raw TCP sockets: the data plane's TCP streams."""
    from . import test_native_dataplane as nd
    nd.STREAM["kind"] = "tcp"
    yield


def failover_client(rank: int, ports: list[int]):
    cli = _core.DataClient(rank, JOB, 2, 4 * PART, MAXMSG)
    cli.set_failover(True)
    for i, port in enumerate(ports):
        connect(cli, i, port, 2)
    return cli


def submit(cli, op, x, y, rnd, nservers, divisor=1):
    cli.submit(op, 0, x.view(np.uint8), y.view(np.uint8), WIRE_CODE["float32"], divisor, rnd,
               parts_of(x.nbytes, rnd, nservers))


def lost_notices(cli, server: int, timeout: float = 10.0) -> list:
    """The client's "server_lost" notices for ``server`` (waited for, up to ``timeout``)."""
    import time
    end = time.monotonic() + timeout
    seen = []
    while time.monotonic() < end and not seen:
        for comp in cli.completions(0.2):
            if comp[2] == "server_lost" and comp[3] == server:
                seen.append(comp)
    return seen


def fail_over(clients, lost: list[int]) -> None:
    """What the worker runtime does on the scheduler's FAILOVER and RESUME notices."""
    for cli in clients:
        cli.failover(lost, True)
    for cli in clients:
        assert cli.wait_seeds(10.0) == ""
    for cli in clients:
        cli.resume()


def take(cli, op, timeout=20.0):
    assert cli.wait(op, timeout), "the operation did not complete"
    comp = cli.take(op)
    assert comp[1], f"operation failed: {comp[2]} {comp[4]!r}"
    return comp


def test_owner_moves_only_the_lost_servers_keys():
    keys = range(5000)
    before = {k: _core.failover_owner(k, [0, 1, 2, 3]) for k in keys}
    after = {k: _core.failover_owner(k, [0, 1, 3]) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == 2 for k in moved)
    assert all(after[k] == before[k] for k in keys if before[k] != 2)
    counts = np.bincount([after[k] for k in moved], minlength=4)
    assert counts[2] == 0 and min(counts[[0, 1, 3]]) > len(moved) / 5  # spread, not piled up
    assert _core.failover_owner(7, []) == -1


def test_a_lost_server_mid_round_costs_nothing(cleanup):
    """Two workers, three servers; server 1 is lost while round 2 is open on every server
    (worker 0 pushed it, worker 1 not yet). Every round's average is exact, before, across and
    after the loss, and the moved keys were summed by their new servers."""
    srvs = [make_server(2, rank=r) for r in range(3)]
    cleanup += [s for s, _ in srvs]
    ports = [p for _, p in srvs]
    clients = [failover_client(r, ports) for r in range(2)]
    cleanup += clients
    n = (10 * PART) // 4
    rng = np.random.default_rng(3)
    for rnd in range(5):
        xs = [rng.standard_normal(n).astype(np.float32) for _ in clients]
        ys = [np.empty_like(x) for x in xs]
        want = (xs[0] + xs[1]) / np.float32(2)
        if rnd != 2:
            for cli, x, y in zip(clients, xs, ys):
                submit(cli, 10 + rnd, x, y, rnd, 3, divisor=2)
        else:
            submit(clients[0], 12, xs[0], ys[0], rnd, 3, divisor=2)
            srvs[1][0].close()  # lost while round 2 waits for worker 1
            for cli in clients:
                assert lost_notices(cli, 1), "no server_lost notice for server 1"
            submit(clients[1], 12, xs[1], ys[1], rnd, 3, divisor=2)
            fail_over(clients, [1])
        for cli, y in zip(clients, ys):
            take(cli, 10 + rnd)
            np.testing.assert_array_equal(y, want)
    for i in (0, 2):  # the survivors took server 1's keys: more rounds summed than before
        assert srvs[i][0].stats()["rounds"] > 0
    stats = clients[0].stats()
    assert stats["parked"] == 0 and stats["keys_kept"] == 10


class DyingServer:
    """A server that answers a round to some workers and dies before the others: the one case
    the workers cannot rebuild from their buffers. It speaks just enough of the data plane:
    hello, then each push acknowledged, its declaration read, its payload kept; when every
    worker has pushed a key's round it sends the sum to the workers in ``answer``.
    :meth:`die` closes every stream."""

    def __init__(self, workers: int, answer: set[int]):
        self.workers, self.answer = workers, answer
        self.cut: set[int] = set()   # workers sent only the first half of an answer's payload
        self.rest: dict[int, tuple[socket.socket, bytes]] = {}   # ... and what :meth:`go_on` sends
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.port = self.lsock.getsockname()[1]
        self.socks: list[socket.socket] = []
        self.pushes: dict[tuple[int, int], dict[int, tuple[socket.socket, bytes]]] = {}
        self.answered = 0
        self.lock = threading.Lock()
        self.dead = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self.dead.is_set():
            try:
                s, _ = self.lsock.accept()
            except OSError:
                return
            with self.lock:
                self.socks.append(s)
            threading.Thread(target=self._serve, args=(s,), daemon=True).start()

    def _header(self, mtype, key=0, rnd=0, flags=0, dtype=0, count=0, nbytes=0):
        return HDR.pack(b"BPSL", 1, mtype, dtype, 1, 0, flags, JOB, key, rnd, count, nbytes)

    def _serve(self, s: socket.socket):
        try:
            h = HDR.unpack(recv_exact(s, HDR.size))
            s.sendall(self._header(wire.MsgType.HELLO, key=h[8]))
            while not self.dead.is_set():
                _m, _v, mtype, dtype, _role, rank, flags, _j, key, rnd, count, nbytes = \
                    HDR.unpack(recv_exact(s, HDR.size))
                if flags & wire.FLAG_META:
                    (mlen,) = struct.unpack("<I", recv_exact(s, 4))
                    recv_exact(s, mlen)
                payload = recv_exact(s, nbytes)
                s.sendall(self._header(wire.MsgType.PUSH_ACK, key=key, rnd=rnd))
                self._pushed(s, rank, key, rnd, dtype, count, payload)
        except (OSError, AssertionError, struct.error):
            pass

    def _pushed(self, s, rank, key, rnd, dtype, count, payload):
        with self.lock:
            got = self.pushes.setdefault((key, rnd), {})
            got[rank] = (s, payload)
            if len(got) < self.workers:
                return
            total = sum(np.frombuffer(p, np.float32) for _s, p in got.values())
            for r in sorted(self.answer):
                msg = (self._header(wire.MsgType.PULL_RESP, key=key, rnd=rnd, dtype=dtype,
                                    count=count, nbytes=len(payload))
                       + total.astype(np.float32).tobytes())
                half = HDR.size + len(payload) // 2 if r in self.cut else len(msg)
                got[r][0].sendall(msg[:half])
                if half < len(msg):
                    self.rest[r] = (got[r][0], msg[half:])
            self.answered += 1

    def go_on(self, rank: int) -> None:
        """The rest of the answer cut for worker ``rank``."""
        s, rest = self.rest.pop(rank)
        s.sendall(rest)

    def close(self):
        self.die()

    def die(self):
        self.dead.set()
        self.lsock.close()
        for s in self.socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()


def good_and_scripted(cleanup):
    """Two workers' failover clients and two servers: a real one (index 0) and a
    :class:`DyingServer` (index 1) that answers both workers until told otherwise."""
    good, gport = make_server(2, rank=0)
    cleanup.append(good)
    scripted = DyingServer(2, answer={0, 1})
    cleanup.append(scripted)
    clients = [failover_client(r, [gport, scripted.port]) for r in range(2)]
    cleanup += clients
    return good, scripted, clients


def test_a_round_answered_to_one_worker_only_is_seeded_to_the_other(cleanup):
    """Server 1 sums round 1 of its key and answers worker 0 only, then dies. Worker 0 has
    completed round 1 and goes on to round 2; worker 1 has not. Worker 0 seeds its answer on
    the key's new server, worker 1's retried push of round 1 is answered from the seed, and
    both then sum round 2 there: the same results as without the loss, on both workers."""
    good, dying, clients = good_and_scripted(cleanup)
    n = (2 * PART) // 4  # two partitions: key 0 on server 0, key 1 on the dying server 1
    rng = np.random.default_rng(5)
    xs = [[rng.standard_normal(n).astype(np.float32) for _ in range(2)] for _ in range(3)]
    want = [(a + b) for a, b in xs]
    ys = [[np.empty(n, np.float32) for _ in range(2)] for _ in range(3)]
    # round 0: answered to both
    for r, cli in enumerate(clients):
        submit(cli, 100, xs[0][r], ys[0][r], 0, 2)
    for r, cli in enumerate(clients):
        take(cli, 100)
        np.testing.assert_array_equal(ys[0][r], want[0])
    # round 1: the dying server answers worker 0 only, then closes everything
    dying.answer = {0}
    for r, cli in enumerate(clients):
        submit(cli, 101, xs[1][r], ys[1][r], 1, 2)
    take(clients[0], 101)
    np.testing.assert_array_equal(ys[1][0], want[1])
    dying.die()
    for cli in clients:
        assert lost_notices(cli, 1)
    assert not clients[1].wait(101, 0.2)  # worker 1 waits for key 1's answer
    submit(clients[0], 102, xs[2][0], ys[2][0], 2, 2)  # worker 0 is a round ahead
    fail_over(clients, [1])
    take(clients[1], 101)
    np.testing.assert_array_equal(ys[1][1], want[1])
    submit(clients[1], 102, xs[2][1], ys[2][1], 2, 2)
    for r, cli in enumerate(clients):
        take(cli, 102)
        np.testing.assert_array_equal(ys[2][r], want[2])
    # worker 0 seeded round 1; worker 1's seed of round 0 was taken too when it came first
    assert good.stats()["seeds"] in (1, 2) and good.stats()["retries_answered"] == 1


def wait_stat(cli, name: str, at_least: int, timeout: float = 20.0) -> int:
    """The client's stat ``name`` once it reaches ``at_least`` (asserted within ``timeout``)."""
    import time
    end = time.monotonic() + timeout
    while (got := cli.stats()[name]) < at_least:
        assert time.monotonic() < end, f"{name} stayed at {got} (waited for {at_least})"
        time.sleep(0.005)
    return got


def test_an_answer_landing_while_its_part_is_parked_is_not_taken(cleanup):
    """Server 1 announces its leave (it stays up while its keys move): round 1 of its key is
    answered whole to worker 0, and to worker 1 only halfway when the failover parks worker 1's
    part. The rest of that answer then lands; it is not the part's any more (the part goes
    again), so it neither completes the push_pull nor overwrites its gradient (the push is in
    place: dst is src), and the part's push again is a retry, answered from worker 0's seed.
    Before, that answer completed the part, its push again went out as a fresh push of round 1,
    and the new server refused it ("a round that is not open"), as a SIGTERMed server's
    failover did in CI."""
    good, leaving, clients = good_and_scripted(cleanup)
    n = (2 * PART) // 4  # two partitions: key 0 on server 0, key 1 on server 1
    rng = np.random.default_rng(7)
    xs = [[rng.standard_normal(n).astype(np.float32) for _ in range(2)] for _ in range(3)]
    want = [a + b for a, b in xs]
    for r, cli in enumerate(clients):
        submit(cli, 100, xs[0][r], xs[0][r], 0, 2)   # in place, as a framework's gradient is
    for r, cli in enumerate(clients):
        take(cli, 100)
        np.testing.assert_array_equal(xs[0][r], want[0])
    grads = [x.copy() for x in xs[1]]
    leaving.cut = {1}
    in0 = clients[1].stats()["bytes_in"]
    for r, cli in enumerate(clients):
        submit(cli, 101, xs[1][r], xs[1][r], 1, 2)
    take(clients[0], 101)
    # worker 1 read both push acknowledgements, key 0's whole answer, and key 1's answer's
    # header and half its payload (so the client took that header before the failover)
    wait_stat(clients[1], "bytes_in", in0 + 4 * HDR.size + PART + PART // 2)
    for cli in clients:
        cli.failover([1], True)
    for cli in clients:
        assert cli.wait_seeds(10.0) == ""
    leaving.go_on(1)
    assert wait_stat(clients[1], "stale_answers", 1) == 1
    assert not clients[1].wait(101, 0)
    np.testing.assert_array_equal(xs[1][1][n // 2:], grads[1][n // 2:])   # still its gradient
    for cli in clients:
        cli.resume()
    take(clients[1], 101)
    np.testing.assert_array_equal(xs[1][1], want[1])
    for r, cli in enumerate(clients):
        submit(cli, 102, xs[2][r], xs[2][r], 2, 2)
    for r, cli in enumerate(clients):
        take(cli, 102)
        np.testing.assert_array_equal(xs[2][r], want[2])
    assert good.stats()["retries_answered"] == 1


def test_an_answer_landed_as_a_failover_comes_completes_and_seeds_the_new_server(cleanup):
    """The window between an answer's copy into dst and its part's completion: worker 0 has
    round 1 of key 1 (on server 1, which announced its leave) in its in-place gradient when the
    failover comes, worker 1 only half of it. Neither has completed the round, so the failover
    seeds nothing. Worker 0's part is not parked (pushed again, its gradient would be the sum):
    it completes, and seeds the key's new server late, and worker 1's push again is answered
    from that seed. Before, the part was parked, the answer dropped as stale and the sum pushed
    again as worker 0's gradient."""
    good, leaving, clients = good_and_scripted(cleanup)
    n = PART // 4  # one partition, key 1: on server 1

    def push(cli, op, x, rnd):
        cli.submit(op, 0, x.view(np.uint8), x.view(np.uint8), WIRE_CODE["float32"], 1, rnd,
                   parts_of(x.nbytes, rnd, 2, key_base=1))

    rng = np.random.default_rng(11)
    xs = [[rng.standard_normal(n).astype(np.float32) for _ in range(2)] for _ in range(3)]
    want = [a + b for a, b in xs]
    for r, cli in enumerate(clients):
        push(cli, 100, xs[0][r], 0)
    for r, cli in enumerate(clients):
        take(cli, 100)
        np.testing.assert_array_equal(xs[0][r], want[0])
    leaving.cut = {1}
    clients[0].hold_landed(True)
    in1 = clients[1].stats()["bytes_in"]
    for r, cli in enumerate(clients):
        push(cli, 101, xs[1][r], 1)
    assert wait_stat(clients[0], "landed_held", 1) == 1  # in dst, its part not completed
    np.testing.assert_array_equal(xs[1][0], want[1])
    wait_stat(clients[1], "bytes_in", in1 + 2 * HDR.size + PART // 2)  # ack, header, half
    for cli in clients:
        cli.failover([1], True)
    for cli in clients:
        assert cli.wait_seeds(10.0) == ""
    assert clients[0].stats()["late_seeds"] == 0
    clients[0].hold_landed(False)
    take(clients[0], 101)
    np.testing.assert_array_equal(xs[1][0], want[1])
    assert clients[0].stats()["late_seeds"] == 1
    assert clients[0].wait_seeds(10.0) == ""  # the late seed was taken
    leaving.go_on(1)
    assert wait_stat(clients[1], "stale_answers", 1) == 1
    for cli in clients:
        cli.resume()
    take(clients[1], 101)
    np.testing.assert_array_equal(xs[1][1], want[1])
    assert good.stats()["seeds"] == 1 and good.stats()["retries_answered"] == 1
    for r, cli in enumerate(clients):
        push(cli, 102, xs[2][r], 2)
    for r, cli in enumerate(clients):
        take(cli, 102)
        np.testing.assert_array_equal(xs[2][r], want[2])
