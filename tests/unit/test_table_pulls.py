"""Table pulls answered by the native plane's I/O threads (csrc/dataplane_table_pulls.h),
driven through _core.DataServer, a shard's TableKernels and _core.TableClient on loopback: a
pull of the applied round is answered at once with the shard's rows, one of the next round
waits for the optimizer step that applies it, and every pull that breaks a rule (or comes
while the shard is closed or gone) reaches the tables' thread untouched."""
from __future__ import annotations

import gc
import threading

import numpy as np
import pytest

from byteps_like.embedding import NumpyTableShard, TableShard, TableSpec
from byteps_like.wire import (
    Header,
    MsgType,
    Role,
    decode_parts,
    encode,
    generation_flags,
    split_frames,
)

from ..support import wait_until
from .test_table_streams import JOB, MAXMSG, WORKERS, answers, client, kind, start_server, take

__all__ = ["kind"]   # the fixture, used by name

KEY, SHARDS, SHARD = 7, 2, 1
SPEC = TableSpec.make("emb", 1000, 4, init="normal", optimizer="adagrad", lr=0.1)


def rules(**kw) -> dict:
    base = dict(open=True, applied=3, generation=0, rows=SPEC.rows, rank_limit=WORKERS,
                park_limit=4, max_ids=1000, max_message=MAXMSG)
    base.update(kw)
    return base


def pull(rnd: int, ids, rank: int = 1, g: int = 0) -> list:
    ids = np.asarray(ids, np.int64)
    return encode(Header(MsgType.SPARSE_PULL, "int64", Role.WORKER, rank, generation_flags(g),
                         JOB, KEY, rnd, ids.size, ids.nbytes), ids)


def rows_of(answer) -> tuple[Header, np.ndarray]:
    server, h, m, p, lost = answer
    assert lost == ""
    msg = decode_parts(h, m, p)
    assert msg.header.type is MsgType.SPARSE_ROWS, msg.meta
    return msg.header, np.frombuffer(msg.payload, np.float32).reshape(-1, SPEC.dim)


@pytest.fixture
def served(kind):
    srv, port = start_server(kind)
    shard = TableShard(SPEC, SHARD, SHARDS)
    srv.table_serve(KEY, shard.kernels)
    cli = client(kind, port, rank=1)
    yield srv, shard, cli, (kind, port)
    cli.close()
    srv.close()


def test_a_pull_of_the_applied_round_is_answered_by_the_plane_with_the_shards_rows(served):
    srv, shard, cli, where = served
    shard.kernels.serve(**rules())
    ids = np.array([1, 999, 501, 1], np.int64)   # a repeat, the last row
    assert cli.send(0, *split_frames(pull(3, ids, g=2)))
    ((hdr, got),) = [rows_of(a) for a in answers(cli, 1)]
    ref = NumpyTableShard(SPEC, SHARD, SHARDS)
    assert np.array_equal(got, ref.rows(ids))   # made by the plane, the reference's bits
    assert (hdr.key, hdr.round, hdr.rank, hdr.job, hdr.flags) == (KEY, 3, 0, JOB,
                                                                  generation_flags(2))
    assert shard.kernels.pulls == {"answered": 1, "parked": 0}
    assert srv.stats()["table_pulls_answered"] == 1
    assert srv.table_requests(0.0) == []   # the tables' thread saw nothing


def test_a_pull_of_the_next_round_waits_for_the_step_that_applies_it(served):
    srv, shard, cli, where = served
    shard.kernels.serve(**rules())
    ids = np.array([3, 5, 7], np.int64)
    ref = NumpyTableShard(SPEC, SHARD, SHARDS)
    assert cli.send(0, *split_frames(pull(4, ids)))
    assert cli.send(0, *split_frames(pull(3, ids[:1])))   # behind it on the stream: answered
    ((hdr, got),) = [rows_of(a) for a in answers(cli, 1)]
    assert hdr.round == 3 and np.array_equal(got, ref.rows(ids[:1]))
    assert shard.kernels.pulls == {"answered": 1, "parked": 1}
    grad = np.arange(12, dtype=np.float32).reshape(3, 4) / 7
    shard.apply(ids, grad, applied=4)
    ref.apply(ids, grad)
    ((hdr, got),) = [rows_of(a) for a in answers(cli, 1)]
    assert hdr.round == 4 and np.array_equal(got, ref.rows(ids))   # after the step, exactly
    assert srv.table_requests(0.0) == []


@pytest.mark.parametrize("case", ["bad id", "other shard", "old round", "two ahead", "old gen",
                                  "rank", "too many", "closed"])
def test_a_pull_that_breaks_a_rule_goes_to_the_tables_thread_untouched(served, case):
    srv, shard, cli, where = served
    shard.kernels.serve(**rules(generation=1, max_ids=8, open=case != "closed"))
    ids, rnd, g, rank = [1, 3], 3, 1, 1
    if case == "bad id":
        ids = [1, 1001]
    elif case == "other shard":
        ids = [1, 2]
    elif case == "old round":
        rnd = 2
    elif case == "two ahead":
        rnd = 5
    elif case == "old gen":
        g = 0
    elif case == "rank":
        cli = client(*where, rank=WORKERS)   # a stream's rank past the tables' ranks
        rank = WORKERS
    elif case == "too many":
        ids = list(range(1, 19, 2))
    try:
        assert cli.send(0, *split_frames(pull(rnd, ids, rank=rank, g=g)))
        ((_s, h, m, p),) = take(srv, 1)
        msg = decode_parts(h, m, p)
        assert msg.header.round == rnd and np.array_equal(np.frombuffer(msg.payload, np.int64),
                                                          ids)
        assert shard.kernels.pulls == {"answered": 0, "parked": 0}
    finally:
        cli.close()


def test_closing_a_shard_gives_its_parked_pulls_back_and_a_gone_shard_answers_none(served):
    srv, shard, cli, where = served
    shard.kernels.serve(**rules())
    assert cli.send(0, *split_frames(pull(4, [1, 3])))
    assert cli.send(0, *split_frames(pull(4, [5])))
    assert wait_parked(shard, 2)
    back = shard.kernels.serve(**rules(open=False))
    assert [np.frombuffer(decode_parts(h, m, p).payload, np.int64).tolist()
            for _s, h, m, p in back] == [[1, 3], [5]]
    assert srv.table_requests(0.0) == []   # given back to the caller, not queued
    other = TableShard(SPEC, SHARD, SHARDS)
    srv.table_serve(KEY, other.kernels)
    other.kernels.serve(**rules())
    del other
    gc.collect()   # its kernels are gone: the plane reads the arrays no more
    assert cli.send(0, *split_frames(pull(3, [1])))
    ((_s, h, m, p),) = take(srv, 1)
    assert decode_parts(h, m, p).header.round == 3


def wait_parked(shard, n: int) -> bool:
    return wait_until(lambda: shard.kernels.pulls["parked"] >= n, 20.0)


def test_a_pull_answered_by_the_plane_sees_a_step_whole_never_half_applied(served):
    """The gather holds the shard's lock that the optimizer step holds: while a thread applies
    steps of -1 to every row of a zeros table, every answer's rows are equal to each other."""
    srv, _shard, cli, _where = served
    flat = TableSpec.make("flat", 1000, 4, init="zeros", optimizer="sgd", lr=1.0)
    shard = TableShard(flat, SHARD, SHARDS)
    srv.table_serve(KEY, shard.kernels)
    shard.kernels.serve(**rules(rows=flat.rows, max_ids=flat.rows))
    ids = np.arange(SHARD, flat.rows, SHARDS, dtype=np.int64)   # every row of the shard
    ones = np.ones((len(ids), flat.dim), np.float32)
    steps, pulls = 400, 200
    stepper = threading.Thread(target=lambda: [shard.apply(ids, ones) for _ in range(steps)])
    stepper.start()
    for _ in range(pulls):
        assert cli.send(0, *split_frames(pull(3, ids)))
    got = [rows_of(a)[1] for a in answers(cli, pulls)]
    stepper.join()
    for rows in got:
        assert rows.shape == (len(ids), flat.dim) and np.all(rows == rows[0, 0]), rows
    assert shard.rows(ids[:1])[0, 0] == -steps
