"""Hostile peers against a live server's resources (issue 19, the server's part): memory a
declaration can make the server take, state kept for keys it rejects, rejections that fail a
real key, internal errors, the log, and what error replies hand out. Every test runs a real
two-worker job (in-process cluster over TCP loopback, tests/faults/cluster.py) whose results are
checked exactly before and after the attack. The data moves on the native data plane
(csrc/dataplane*.cc), compressed keys included; the server's ZeroMQ socket (control, tables)
refuses pushes and pulls, counted, leaving no state."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import time

import numpy as np
import pytest

from byteps_like.compression import Compression, native_params
from byteps_like.wire import (
    DECL_MAX_BYTES,
    DECL_MAX_NAME,
    DECL_MAX_SPEC,
    ERR_PROTOCOL,
    FLAG_COMPRESSED,
    FLAG_DECLARE,
    Header,
    MsgType,
    Role,
    encode,
    pack_decl,
)

from ..native_stream import closed_by_peer
from .cluster import running_cluster
from .hostile import (
    JOB,
    NATIVE_ERROR,
    NATIVE_PULL,
    NATIVE_PUSH,
    HostileClient,
    _push,
    compressed_push,
    native_msg,
    native_reply,
    native_stream,
    onebit_payload,
    pull,
    rss_bytes,
    send_burst,
    topk_payload,
)

pytestmark = pytest.mark.integration
MiB = 1 << 20
N = 40000   # elements of the real job's tensors
NATIVE_ACK = int(MsgType.PUSH_ACK)


def _exact_rounds(c, rounds: int, compressed: bool = True) -> None:
    """The real job: float32 (uncompressed), int64 and, when ``compressed``, a top-k tensor with
    k = every element (so its sum is exact too), checked exactly every round."""
    for _ in range(rounds):
        r = c.workers[0]._tensors["real.w"].round if "real.w" in c.workers[0]._tensors else 0
        outs = c.push_pull(lambda k: np.arange(N, dtype=np.float32) * (k + 1) + r, "real.w")
        want = np.arange(N, dtype=np.float32) * 3 + 2 * r
        assert all(isinstance(o, np.ndarray) and np.array_equal(o, want) for o in outs), outs
        outs = c.push_pull(lambda k: np.full(7, 10 ** 12 + k, np.int64), "real.i")
        assert all(np.array_equal(o, np.full(7, 2 * 10 ** 12 + 1)) for o in outs), outs
        if compressed:
            topk = Compression.topk(N)
            outs = c.run_all(lambda w: w.push_pull_async(
                np.arange(N, dtype=np.float32) - w.rank() * 3 + r, name="real.c", average=False,
                compression=topk).wait(30))
            want = np.arange(N, dtype=np.float32) * 2 - 3 + 2 * r
            assert all(isinstance(o, np.ndarray) and np.array_equal(o, want) for o in outs), outs


@contextlib.contextmanager
def _native_job(rounds: int):
    """A job of two workers on the native data plane (the default) after ``rounds`` exact
    rounds: ``(cluster, its server)``."""
    with running_cluster(workers=2) as c:
        _exact_rounds(c, rounds, compressed=False)
        yield c, c.server


def _wait_for(pred, timeout: float = 20.0) -> None:
    """Poll ``pred`` until it holds; fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def _native_compressed(job: int, key: int, comp, count: int, payload: bytes,
                       dtype: str = "float32") -> bytes:
    """A native compressed push that declares ``count`` elements of ``dtype`` (a worker's
    declaration of one partition, with the built-in codec's parameters)."""
    decl = pack_decl(f"evil.{key}", [count], dtype, 0, 1, count,
                     native_params(comp, max(1, min(count, 1 << 31))), comp.spec())
    return native_msg(NATIVE_PUSH, 0, job, key=key, dtype=7, count=len(payload),
                      nbytes=len(payload), flags=FLAG_DECLARE | FLAG_COMPRESSED, meta=decl,
                      payload=payload)


def _native_replies(s, n: int) -> list:
    """The next ``n`` replies of a native stream: (type, meta)."""
    out = []
    for _ in range(n):
        h, meta, _ = native_reply(s)
        out.append((h[2], meta))
    return out


def _keys_of(c, name: str) -> list[int]:
    return [p[2] for p in c.workers[0]._tensors[name].parts]


def _error(msg, label: str = "") -> str:
    assert msg.header.type is MsgType.ERROR, (label, msg.header)
    return msg.meta["message"]


# ---- item 1: memory amplification by declarations ---------------------------------------------

@contextlib.contextmanager
def _budget_cluster():
    """A job of 2 workers whose server has a 64 MiB budget (BYTEPS_SERVER_MAX_BYTES) and 4 MiB
    partitions, after 2 exact rounds: (cluster, server, its data port, job, RSS now)."""
    extra = {"BYTEPS_SERVER_MAX_BYTES": "64MiB", "BYTEPS_PARTITION_BYTES": "4MiB"}
    with running_cluster(workers=2, extra=extra) as c:
        _exact_rounds(c, 2)
        srv = c.server
        yield c, srv, srv.control.data_port, srv.job, rss_bytes()


def test_compressed_declarations_cannot_amplify_memory():
    """A compressed declaration of 268M elements with a 28-byte top-k payload made the server
    zero and keep a 1 GiB float32 accumulator (4 messages: 76 MB -> 4.28 GB). Now a declaration
    must fit one partition (BYTEPS_PARTITION_BYTES of its dtype) and every store is charged to
    BYTEPS_SERVER_MAX_BYTES, so a flood of the largest legal declarations stops at the budget."""
    with _budget_cluster() as (c, srv, port, job, before):
        big = 268_000_000
        topk, onebit = Compression.topk(1), Compression.onebit()
        attack = [_native_compressed(job, 900_001 + i, topk, big, topk_payload(big))
                  for i in range(2)]
        attack.append(_native_compressed(job, 900_010, onebit, 1 << 27, onebit_payload(1 << 27)))
        # the largest declarations a worker could make (float16: 2M elements, an 8 MiB float32
        # accumulator each), with error feedback (a float32 residual more on the server)
        part = (4 * MiB) // 2
        ef = Compression.topk(1, error_feedback=True)
        flood = [_native_compressed(job, 910_000 + i, ef, part, topk_payload(part), "float16")
                 for i in range(24)]
        with native_stream(port, job) as s:
            s.sendall(b"".join(attack))
            texts = [meta["message"] for _t, meta in _native_replies(s, len(attack))]
            s.sendall(b"".join(flood))
            replies = _native_replies(s, len(flood))
        assert all("BYTEPS_PARTITION_BYTES" in t for t in texts), texts
        taken = [m for t, m in replies if t == NATIVE_ACK]
        refused = [m["message"] for t, m in replies if t == NATIVE_ERROR]
        assert taken and refused and len(taken) + len(refused) == len(flood)
        assert all("BYTEPS_SERVER_MAX_BYTES" in t for t in refused), refused[:3]
        grew = rss_bytes() - before
        print(f"\nRSS growth under the attack: {grew / MiB:.0f} MiB; keys taken "
              f"{len(taken)}, refused {len(refused)}; rejections {srv.rejections()}")
        assert grew < 300 * MiB, grew
        assert srv.store_bytes() <= 64 * MiB
        rej = srv.rejections()
        assert rej.get("bad compressor declaration") == 3, rej
        assert rej.get("server memory budget exhausted") == len(refused), rej
        _exact_rounds(c, 2)


def test_declarations_share_one_budget_on_the_native_plane():
    """The native plane charged a store only its two buffers; a 1 MiB declaration of a 1-element
    key was kept for 8 bytes of budget. Now the declaration and the store's bookkeeping are
    charged too, and compressed stores draw on the same BYTEPS_SERVER_MAX_BYTES; and a
    declaration is at most DECL_MAX_BYTES (csrc/decl.h): a longer meta frame is refused
    unread."""
    with _budget_cluster() as (c, srv, port, job, before):
        # compressed stores first (8 MiB accumulators) take from the budget
        part = (4 * MiB) // 2
        topk = Compression.topk(1)
        with native_stream(port, job) as s:
            s.sendall(b"".join(_native_compressed(job, 920_000 + i, topk, part,
                                                  topk_payload(part), "float16")
                               for i in range(3)))
            replies = _native_replies(s, 3)
        assert all(t == NATIVE_ACK for t, _m in replies), replies
        held = srv.store_bytes()
        assert held >= 3 * 4 * part
        # a 1 MiB meta frame is no declaration: refused before it is read, the stream closed
        with native_stream(port, job) as s:
            big = native_msg(NATIVE_PUSH, 0, job, key=929_999, dtype=1, count=1, nbytes=4,
                             flags=FLAG_DECLARE, meta=b"x" * (MiB - 100))
            s.sendall(big[:56])  # its header and the meta's length: enough to be refused
            assert closed_by_peer(s)
        assert srv.rejections().get("oversized meta") == 1, srv.rejections()
        # then native pushes of one element with the largest declaration each
        spec = {"name": "x" * (DECL_MAX_SPEC - 20)}
        decl = pack_decl("x" * DECL_MAX_NAME, [1], "float32", 0, 1, 1, compressor=spec)
        assert len(decl) > DECL_MAX_BYTES - 1000
        pushes, refused = 800, 0
        with native_stream(port, job) as s:
            for i in range(pushes):
                s.sendall(native_msg(NATIVE_PUSH, 0, job, key=930_000 + i, dtype=1, count=1,
                                     nbytes=4, flags=FLAG_DECLARE, meta=decl,
                                     payload=b"\0" * 4))
                if i % 16 == 15 or i == pushes - 1:  # a round trip now and then: the replies
                    s.sendall(native_msg(NATIVE_PULL, 0, job, key=1 << 40))
                    while True:
                        h, meta, _ = native_reply(s)
                        if h[8] == 1 << 40:
                            break
                        if h[2] == NATIVE_ERROR:
                            assert "BYTEPS_SERVER_MAX_BYTES" in meta["message"], meta
                            refused += 1
        taken = pushes - refused
        stats = srv.native.stats()
        grew = rss_bytes() - before
        print(f"\nRSS growth: {grew / MiB:.0f} MiB; native keys taken {taken}, refused "
              f"{refused}; store bytes {stats['store_bytes']}")
        assert stats["store_bytes"] <= 64 * MiB, stats
        assert taken * len(decl) <= 64 * MiB - held and refused > 0, (taken, refused)
        assert grew < 300 * MiB, grew
        # and a compressed store past the budget is refused
        with native_stream(port, job) as s:
            s.sendall(_native_compressed(job, 921_000, topk, part, topk_payload(part),
                                         "float16"))
            ((t, meta),) = _native_replies(s, 1)
        assert t == NATIVE_ERROR and "BYTEPS_SERVER_MAX_BYTES" in meta["message"], meta
        # the keys held keep serving (a compressed push needs room to be received: the flood
        # left less than one declaration's worth)
        _exact_rounds(c, 2, compressed=False)


# ---- item 4: the round before the declaration -------------------------------------------------

def test_far_round_push_with_a_false_declaration_fails_nothing_native():
    """A push for round 10^6 with a declaration that does not match failed the real key, and
    both real workers got a MismatchError blaming innocent rank 0: the round is checked first."""
    with _native_job(1) as (c, srv):
        key = _keys_of(c, "real.w")[0]
        with native_stream(srv.control.data_port, srv.job) as s:
            s.sendall(native_msg(NATIVE_PUSH, 0, srv.job, key=key, rnd=10 ** 6, dtype=1,
                                 count=N, nbytes=4 * N, flags=FLAG_DECLARE,
                                 meta=pack_decl("evil", [N], "float32", 0, 1, N), payload=b"\0" * (4 * N)))
            h, meta, _ = native_reply(s)
        assert h[2] == NATIVE_ERROR and meta["kind"] == ERR_PROTOCOL, meta
        assert srv.rejections().get("push out of round") == 1, srv.rejections()
        _exact_rounds(c, 2, compressed=False)


# ---- items 8 and 9: no state for rejected keys; pulls of round -1 ------------------------------

def test_data_over_zeromq_is_refused_leaving_no_state():
    """600,000 pulls of distinct undeclared keys grew a server from 76 to 137 MB: every
    well-formed message made a key -> engine entry. Data moves on the native plane now: the
    server's ZeroMQ socket refuses every push and pull, counted, keeping nothing."""
    with running_cluster(workers=2) as c:
        _exact_rounds(c, 1)
        srv = c.server
        keys = srv.native.stats()["keys"]
        hc = HostileClient(srv.address, timeout_ms=20000)
        n = 50_000
        before = rss_bytes()
        replies = send_burst(hc, [pull(1_000_000 + i) for i in range(n)], keep=False)
        replies += send_burst(hc, [_push(2_000_000 + i) for i in range(2000)],   # undeclared
                              keep=False)
        replies += send_burst(hc, [compressed_push(3_000_000 + i, {"name": "pickle"}, 8,   # bad
                                                   topk_payload(8)) for i in range(2000)],
                              keep=False)
        grew = rss_bytes() - before
        hc.close()
        assert replies == [MsgType.ERROR] * len(replies)
        print(f"\nRSS growth {grew / MiB:.1f} MiB")
        assert grew < 64 * MiB, grew
        assert srv.rejections().get("data over ZeroMQ") == n + 4000, srv.rejections()
        assert srv.native.stats()["keys"] == keys
        _exact_rounds(c, 1)


def test_rejected_keys_leave_no_state_native():
    """Pulls of undeclared keys on the native plane: refused, counted, no key made."""
    with _native_job(1) as (c, srv):
        keys = srv.native.stats()["keys"]
        n = 50_000
        with native_stream(srv.control.data_port, srv.job) as s:
            for base in range(0, n, 1000):
                s.sendall(b"".join(native_msg(NATIVE_PULL, 0, srv.job, key=1_000_000 + i)
                                   for i in range(base, base + 1000)))
                for _ in range(1000):
                    h, meta, _ = native_reply(s)
                    assert h[2] == NATIVE_ERROR, h
        assert srv.native.stats()["keys"] == keys
        assert srv.rejections().get("pull of an undeclared key") == n
        _exact_rounds(c, 1, compressed=False)


def test_pull_of_round_minus_one_is_rejected_native(caplog):
    """The native plane answered a pull of round -1 of a key with no completed round with
    the key's second buffer, which no round had written (uninitialised heap memory); the
    Python engine raised an AttributeError for a compressed key's. Both are rejected, counted,
    with a clear error, and no traceback."""
    caplog.set_level(logging.WARNING, logger="byteps_like.server")
    with running_cluster(workers=2) as c:
        topk = Compression.topk(N)
        hs = [c.workers[0].push_pull_async(np.ones(N, np.float32), name="half.w",
                                           average=False),
              c.workers[0].push_pull_async(np.ones(N, np.float32), name="half.c",
                                           average=False, compression=topk)]
        srv = c.server
        uk, ck = _keys_of(c, "half.w")[0], _keys_of(c, "half.c")[0]
        _wait_for(lambda: srv.native.stats()["keys"] >= 2)
        with native_stream(srv.control.data_port, srv.job, rank=1) as s:
            for key, rnd in ((uk, -1), (ck, -1), (ck, 5)):
                s.sendall(native_msg(NATIVE_PULL, 1, srv.job, key=key, rnd=rnd))
                h, meta, payload = native_reply(s)
                assert h[2] == NATIVE_ERROR and meta["kind"] == ERR_PROTOCOL, (h, payload[:32])
                assert "internal" not in meta["message"].lower(), meta
        assert srv.rejections().get("pull out of round") == 3
        assert not [r for r in caplog.records if r.exc_info], "a traceback in the server log"
        hs += [c.workers[1].push_pull_async(np.ones(N, np.float32), name="half.w",
                                            average=False),
               c.workers[1].push_pull_async(np.ones(N, np.float32), name="half.c",
                                            average=False, compression=topk)]
        assert all(np.array_equal(h.wait(30), np.full(N, 2, np.float32)) for h in hs)
        _exact_rounds(c, 1)


# ---- item 10: the log ---------------------------------------------------------------------------

def test_rejections_are_logged_at_a_bounded_rate(caplog):
    """A 2-minute garbage run grew the log to 77 MB (359k lines): every rejection was logged.
    Now the first few of each reason are, then one summary line per interval with the counts."""
    caplog.set_level(logging.INFO, logger="byteps_like.server")
    with running_cluster(workers=2) as c:
        _exact_rounds(c, 1)
        srv = c.server
        key = _keys_of(c, "real.w")[0]
        hc = HostileClient(srv.address, timeout_ms=20000)
        kinds = [lambda i: [os.urandom(40 + i % 7)],                          # malformed
                 lambda i: _push(5, job=JOB ^ 1),                             # another job
                 lambda i: pull(7_000_000 + i),                               # data
                 lambda i: _push(key, count=N, rnd=10 ** 6 + i),              # data
                 lambda i: encode(Header(MsgType.BARRIER, job=JOB, rank=99))]  # not for it
        n = 4000
        start = len(caplog.records)
        replies = send_burst(hc, [kinds[i % len(kinds)](i) for i in range(n)])
        hc.close()
        assert len(replies) == n
        lines = [r for r in caplog.records[start:] if r.name == "byteps_like.server"]
        print(f"\n{len(lines)} log lines for {n} rejections")
        assert len(lines) <= 5 * len(kinds), [r.getMessage() for r in lines]
        srv.log_rejections()         # the summary the server's timer writes every interval
        summary = [r.getMessage() for r in caplog.records if "rejected" in r.getMessage()
                   and "since" in r.getMessage()]
        assert summary, [r.getMessage() for r in caplog.records[start:]]
        assert "malformed" in summary[-1] and "data over ZeroMQ" in summary[-1]
        srv.log_rejections()         # nothing new: no line
        assert [r.getMessage() for r in caplog.records if "since" in r.getMessage()] == summary
        _exact_rounds(c, 1)


# ---- item 12: what error replies hand out --------------------------------------------------------

def _rounds_in(text: str, *rounds: int) -> list[int]:
    return [r for r in rounds if re.search(rf"(?<![\d-]){r}(?!\d)", text)]


def test_error_replies_carry_no_job_id_or_open_round_zmq():
    """A wrong job tag was answered with the job id, an out-of-round push with the open round;
    with those a fake rank-1 push gave worker 0 a wrong sum. Replies to a peer whose job is not
    known to be right carry neither the job's id nor its tag; the server's ZeroMQ socket
    answers no data message with a round."""
    with running_cluster(workers=2, extra={"BYTEPS_JOB_ID": "job-secret-19"}) as c:
        _exact_rounds(c, 5, compressed=False)      # round 5 open, round 4 completed
        srv = c.server
        key = _keys_of(c, "real.w")[0]
        hc = HostileClient(srv.address)
        foreign = send_burst(hc, [_push(5, job=JOB), [os.urandom(60)],
                                  [Header(MsgType.PUSH, "float32", Role.WORKER, 0, 0, 1234, 1,
                                          0, 1, 4).pack()[:20]]], window=1)
        for m in foreign:
            text = json.dumps(m.meta)
            assert "job-secret-19" not in text and str(srv.job) not in text, text
            assert m.header.job != srv.job, m.header
        wj = srv.job
        msgs = send_burst(hc, [_push(key, count=N, rnd=77, job=wj),
                               _push(key, count=N, rnd=3, job=wj),
                               encode(Header(MsgType.PULL, "none", Role.WORKER, 0, 0, wj, key, 9)),
                               encode(Header(MsgType.PULL, "none", Role.WORKER, 0, 0, wj, key, 2))],
                          window=1)
        hc.close()
        for m in msgs:
            text = json.dumps(m.meta)
            assert not _rounds_in(text, 5, 4), text
        _exact_rounds(c, 1, compressed=False)


def test_error_replies_carry_no_open_round_native():
    with _native_job(5) as (c, srv):
        key = _keys_of(c, "real.w")[0]
        with native_stream(srv.control.data_port, srv.job) as s:
            s.sendall(native_msg(NATIVE_PUSH, 0, srv.job, key=key, rnd=77, dtype=1, count=N,
                                 nbytes=4 * N, payload=b"\0" * (4 * N)))
            s.sendall(native_msg(NATIVE_PULL, 0, srv.job, key=key, rnd=9))
            s.sendall(native_msg(NATIVE_PULL, 0, srv.job, key=key, rnd=2))
            for _ in range(3):
                h, meta, _ = native_reply(s)
                assert h[2] == NATIVE_ERROR
                assert not _rounds_in(json.dumps(meta), 5, 4), meta
        _exact_rounds(c, 1, compressed=False)


# ---- item 3 on the native plane: a stream that never reads ------------------------------------

def test_a_native_stream_that_never_reads_loses_the_stream_not_the_server_its_memory():
    """Pulls of a completed round are answered at once; a peer that sends them and never reads
    used to grow the stream's send queue without bound. Past its share of the server's reply
    budget the stream is not read, and after 10 s without taking a byte it is closed (counted
    as unread_closed); the job goes on."""
    with _native_job(1) as (c, srv):
        (key,) = _keys_of(c, "real.i")
        rnd = c.workers[0]._tensors["real.i"].round - 1   # the last completed round
        burst = native_msg(NATIVE_PULL, 0, srv.job, key=key, rnd=rnd) * 10_000
        with native_stream(srv.control.data_port, srv.job) as s:
            s.settimeout(10)
            try:
                for _ in range(40):   # 400,000 pulls, not one reply read (kernel buffers
                    # hold the first ~100,000 replies)
                    s.sendall(burst)
            except OSError:
                pass  # the server closed the stream: what this test wants
            _wait_for(lambda: srv.native.stats()["unread_closed"] == 1)
        _exact_rounds(c, 2, compressed=False)
