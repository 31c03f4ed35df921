"""Server-held embedding tables (issue 31) on a real cluster: 2 workers and 2 servers over TCP
loopback (threads of this process, tests/faults/cluster.py), against a one-process numpy
reference that applies the summed row gradients; bad requests and a table over the budget."""
from __future__ import annotations

import numpy as np
import pytest

from byteps_like.embedding import TableSpec, initial_rows
from byteps_like.errors import MismatchError, RemoteError
from byteps_like.wire import MsgType
from tests.faults.cluster import running_cluster

pytestmark = pytest.mark.integration

ROWS, DIM, STEPS, BATCH = 5000, 8, 5, 300


def batch(rank: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    """A worker's unique ids (Zipf-skewed, so the workers share the hot rows) and gradients."""
    rng = np.random.default_rng([rank, step])
    ids = np.unique(np.minimum(rng.zipf(1.3, BATCH), ROWS) - 1)
    return ids, rng.normal(size=(len(ids), DIM)).astype(np.float32)


def reference(spec: TableSpec, workers: int) -> np.ndarray:
    """The table after STEPS steps, in one process: summed gradients, lazy optimizer."""
    w = initial_rows(spec, np.arange(ROWS))
    a = spec.optimizer_args
    acc = np.zeros_like(w)
    m, v, t = np.zeros((ROWS, DIM), np.float64), np.zeros((ROWS, DIM), np.float64), np.zeros(ROWS)
    for step in range(STEPS):
        g = np.zeros((ROWS, DIM), np.float32)
        touched = np.zeros(ROWS, bool)
        for r in range(workers):
            ids, grads = batch(r, step)
            g[ids] += grads
            touched[ids] = True
        u, gu = np.flatnonzero(touched), g[touched]
        if spec.optimizer == "sgd":   # float32, the formula as written: bit-exact
            w[u] = w[u] - np.float32(a["lr"]) * gu
        elif spec.optimizer == "adagrad":
            acc[u] += gu.astype(np.float64) ** 2
            w[u] = w[u] - a["lr"] * gu / (np.sqrt(acc[u]) + a["eps"])
        else:
            t[u] += 1
            m[u] = a["beta1"] * m[u] + (1 - a["beta1"]) * gu
            v[u] = a["beta2"] * v[u] + (1 - a["beta2"]) * gu.astype(np.float64) ** 2
            tt = t[u][:, None]
            w[u] = w[u] - a["lr"] * (m[u] / (1 - a["beta1"] ** tt)) / (
                np.sqrt(v[u] / (1 - a["beta2"] ** tt)) + a["eps"])
    return w


def ok(results: list) -> list:
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


@pytest.fixture(scope="module")
def cluster():
    with running_cluster(workers=2, servers=2,
                         extra={"BYTEPS_SERVER_MAX_BYTES": str(64 << 20),
                                "BYTEPS_SPARSE_MAX_IDS": "2000"}) as c:
        yield c


@pytest.mark.parametrize("opt,kw", [("sgd", {"lr": 0.1}), ("adagrad", {"lr": 0.05}),
                                    ("adam", {"lr": 0.01})])
def test_two_workers_two_servers_match_the_one_process_reference(cluster, opt, kw):
    spec = TableSpec.make(f"emb-{opt}", ROWS, DIM, init="uniform", seed=5, optimizer=opt, **kw)

    def train(w):
        t = w.sparse.create(spec.name, ROWS, DIM, init="uniform", seed=5, optimizer=opt, **kw)
        for step in range(STEPS):
            ids, grads = batch(w.rank(), step)
            rows = t.pull(ids)
            assert rows.shape == (len(ids), DIM)
            t.push(ids, grads)
        # waits for the last step's update; at most BYTEPS_SPARSE_MAX_IDS per server a pull
        return np.concatenate([t.pull(np.arange(a, a + 2500)) for a in (0, 2500)])
    tables = ok(cluster.run_all(train))
    want = reference(spec, 2)
    assert np.array_equal(tables[0], tables[1])
    if opt == "sgd":
        assert np.array_equal(tables[0], want)
    else:
        np.testing.assert_allclose(tables[0], want, rtol=1e-6, atol=1e-7)


def test_the_servers_metrics_count_the_tables(cluster):
    """A step of a new table: every server counts its round and the rows it updated, its
    tables' bytes are what it holds for them, and the plane's I/O threads answered every pull
    (each worker pulls each server twice: the first answered at once, the second once the
    step's pushes are applied)."""
    before = [srv._metrics_sample() for srv in cluster.servers]

    def step(w):
        t = w.sparse.create("emb-metrics", 1000, 4)
        t.pull(np.arange(10))
        t.push(np.arange(10), np.ones((10, 4), np.float32))
        t.pull([0])   # waits for the update
    ok(cluster.run_all(step))
    for srv, b in zip(cluster.servers, before):
        m = srv._metrics_sample()
        assert m["byteps_server_table_rounds"] == b["byteps_server_table_rounds"] + 1, m
        assert m["byteps_server_table_rows_updated"] == b["byteps_server_table_rows_updated"] + 5
        answered = m["byteps_server_table_pulls_answered"] - b["byteps_server_table_pulls_answered"]
        assert answered == 2 * len(cluster.workers), m
        assert 0 <= m["byteps_server_table_pulls_parked"] - b["byteps_server_table_pulls_parked"] \
            <= len(cluster.workers)
        assert m["byteps_server_table_bytes"] == sum(t.charged
                                                     for t in srv.sparse.tables.values())


def test_bad_ids_are_refused_by_the_server_and_change_nothing(cluster):
    """Requests that skip the worker's own checks (sent as a hostile peer would): the server
    names the table, the id and the rank, holds no more memory, and the table goes on."""
    held = [s.store_bytes() for s in cluster.servers]

    def bad(w):
        t = w.sparse.create("emb-bad", 1000, 4, init="zeros")
        out = []
        for ids in (np.array([-5], np.int64), np.array([1000], np.int64),
                    np.arange(0, 4002, 2, dtype=np.int64), np.array([1], np.int64)):
            payloads = [(ids, None), (np.zeros(0, np.int64), None)]  # all to server 0
            try:
                t.owner.call(t, MsgType.SPARSE_PULL, 0, payloads, 10.0)
                out.append(None)
            except RemoteError as exc:
                out.append(str(exc))
        rows = t.pull(np.arange(10))  # still served
        t.push(np.arange(10), np.ones((10, 4), np.float32))
        return out, rows
    results = ok(cluster.run_all(bad))
    for rank, (texts, rows) in enumerate(results):
        assert f"from worker rank {rank}: row id -5 is negative" in texts[0]
        assert "table 'emb-bad'" in texts[0]
        assert "row id 1000 is out of range (the table has 1000 rows)" in texts[1]
        assert "carries 2001 ids, more than 2000 (BYTEPS_SPARSE_MAX_IDS)" in texts[2]
        assert "row id 1 is held by server 1, not this one" in texts[3]
        assert np.array_equal(rows, np.zeros((10, 4), np.float32))
    first = next(s for s in cluster.servers if s.rank == 0)
    assert first.rejections()["bad row id"] >= 6 and first.rejections()["too many ids"] >= 2
    grown = [s.store_bytes() - h for s, h in zip(cluster.servers, held)]
    assert grown == [500 * (16 + 2) + 4096] * 2   # the table's shard, nothing more


def test_a_table_over_the_memory_budget_is_refused(cluster):
    held = [s.store_bytes() for s in cluster.servers]

    def big(w):
        return w.sparse.create("emb-big", 10_000_000, 64, optimizer="adagrad")
    results = cluster.run_all(big)
    for rank, exc in enumerate(results):
        assert isinstance(exc, RemoteError), exc
        text = str(exc)
        assert "table 'emb-big' (table id" in text and f"worker rank {rank}" in text
        assert "over the budget of 67108864 bytes (BYTEPS_SERVER_MAX_BYTES)" in text
    assert [s.store_bytes() for s in cluster.servers] == held
    assert all("emb-big" not in {t.spec.name for t in s.sparse.tables.values()}
               for s in cluster.servers)


def test_workers_that_declare_different_tables_get_a_mismatch(cluster):
    def declare(w):
        return w.sparse.create("emb-mix", 100, 4 + w.rank())
    results = cluster.run_all(declare)
    errors = [r for r in results if isinstance(r, BaseException)]
    assert errors and all(isinstance(e, MismatchError) for e in errors)
    assert "worker rank 0 declared 'emb-mix' (100 x 4" in str(errors[0])
    assert "worker rank 1 declared 'emb-mix' (100 x 5" in str(errors[0])
    # the refused declaration keeps its table id on every worker: the next table is served
    tables = ok(cluster.run_all(lambda w: w.sparse.create("emb-after-mix", 100, 4)))
    assert len({t.table_id for t in tables}) == 1
    ok(cluster.run_all(lambda w: tables[cluster.workers.index(w)].pull([1, 2])))


@pytest.mark.parametrize("workers,servers", [(1, 0), (2, 2)])
def test_torch_modules_train_like_dense_tables_in_one_process(workers, servers):
    """SparseEmbedding (SGD) and SparseEmbeddingBag (Adagrad) with a dense head through
    DistributedOptimizer, real processes through bpslaunch; one worker alone holds the tables
    itself."""
    pytest.importorskip("torch")
    from .harness import bpslaunch, worker
    run = bpslaunch(worker("sparse_torch.py"), workers=workers, servers=servers or None,
                    timeout=120)
    assert run.rc == 0, run.log
    assert len(run.lines("tables and head match")) == workers, run.log


def test_bench_sparse_reports_both_modes_against_the_floor(tmp_path):
    """``bench sparse`` on loopback with a small model: one record per mode with the fields
    the issue asks for; the sparse tables' bytes stay within 1.2 of the floor, the dense
    ones carry every row, and the local baseline (no communication) sends nothing."""
    pytest.importorskip("torch")
    import json

    from .bench_run import bench, dump
    out = tmp_path / "sparse.json"
    r = bench("sparse", "--rows", "20000", "--batch", "512", "--steps", "3", "--warmup", "1",
              "--dense-steps", "2", "--dense-warmup", "0", "--json", str(out), timeout=180)
    assert r.returncode == 0, dump(r)
    records = {rec["mode"]: rec for rec in json.loads(out.read_text())}
    assert set(records) == {"sparse", "dense", "ddp", "local"}
    for rec in records.values():
        for key in ("mode", "rows", "dim", "workers", "servers", "rate", "step_s",
                    "bytes_per_step", "floor_bytes_per_step"):
            assert rec[key] is not None, (key, rec)
        assert rec["workers"] == 2 and rec["rate"] == "loopback"
        assert rec["servers"] == (0 if rec["mode"] in ("ddp", "local") else 2)
    local = records["local"]   # the baseline: the same model and steps, nothing on the wire
    assert local["bytes_per_step"] == 0 and local["steps"] == records["sparse"]["steps"]
    assert local["step_s"] > 0 and local["tables_over_floor"] is None
    sparse, dense = records["sparse"], records["dense"]
    assert 1.0 <= sparse["tables_over_floor"] <= 1.2, sparse
    rows_bytes = sum(sparse["tables"]) * 64 * 4
    assert dense["pushpull_bytes_per_step"] >= 2 * rows_bytes, dense
    assert "| step / sparse step |" in r.stdout and dense["dense_over_sparse"] > 0, r.stdout


@pytest.mark.parametrize("opt,kw", [("sgd", {"lr": 0.1}), ("adam", {"lr": 0.01})])
def test_a_checkpoint_restores_onto_another_number_of_servers(tmp_path, opt, kw):
    """Train 3 steps on 2 servers, save, train 2 more; a new job of 3 servers loads the
    checkpoint and trains the same 2 steps: the same table, bit for bit (rows and optimizer
    state restored, re-sharded)."""
    def steps(w, t, a: int, b: int) -> None:
        for step in range(a, b):
            ids, grads = batch(w.rank(), step)
            t.pull(ids)
            t.push(ids, grads)

    def first(w):
        t = w.sparse.create("emb", ROWS, DIM, init="uniform", seed=5, optimizer=opt, **kw)
        steps(w, t, 0, 3)
        t.save("step3")
        steps(w, t, 3, 5)
        return t.pull(np.arange(ROWS))

    def second(w):
        t = w.sparse.create("emb", ROWS, DIM, init="uniform", seed=5, optimizer=opt, **kw)
        t.load("step3")
        steps(w, t, 3, 5)
        return t.pull(np.arange(ROWS))
    extra = {"BYTEPS_SPARSE_CHECKPOINT_DIR": str(tmp_path)}
    with running_cluster(workers=2, servers=2, extra=extra) as c:
        want = ok(c.run_all(first))[0]
    assert sorted(p.name for p in (tmp_path / "step3").iterdir()) == [
        "emb.shard0of2.bpst", "emb.shard1of2.bpst"]
    with running_cluster(workers=2, servers=3, extra=extra) as c:
        got = ok(c.run_all(second))
    assert np.array_equal(got[0], want) and np.array_equal(got[1], want)


def test_tensorflow_indexed_slices_travel_as_rows():
    """DistributedGradientTape(sparse_as_dense=False): a tf.Variable table's gradient is
    averaged as rows (2 workers, 2 servers), eager and in tf.function."""
    pytest.importorskip("tensorflow")
    from .harness import bpslaunch, worker
    run = bpslaunch(worker("sparse_tf.py"), workers=2, servers=2, timeout=180)
    assert run.rc == 0, run.log
    assert len(run.lines("OK rank")) == 2, run.log


def test_the_click_through_example_reaches_the_one_process_auc():
    """examples/pytorch/train_ctr_sparse.py on 2 workers and 2 servers reaches the AUC of the
    same script in one process (within 0.005), near the true model's."""
    pytest.importorskip("torch")
    import re
    import sys
    from pathlib import Path

    from tests.support import FAST_ENV, clean_env, run

    from .harness import bpslaunch
    example = Path(__file__).resolve().parents[2] / "examples" / "pytorch" / "train_ctr_sparse.py"
    pattern = r"final test AUC: ([0-9.]+) \((\d) workers; the true model's ([0-9.]+)\)"
    alone = run([sys.executable, str(example)], 120, clean_env(**FAST_ENV))
    assert alone.rc == 0, alone.log
    dist = bpslaunch([str(example)], workers=2, servers=2, timeout=180)
    assert dist.rc == 0, dist.log
    (one, n1, best), = re.findall(pattern, alone.out)
    (two, n2, _), = re.findall(pattern, dist.out)
    assert (n1, n2) == ("1", "2")
    assert abs(float(one) - float(two)) <= 0.005, (one, two)
    assert float(two) >= float(best) - 0.02, (two, best)


def test_a_table_round_some_workers_did_not_push_is_reported_as_stalled():
    """The stall inspector sees the tables' rounds too: worker 0 pushed, worker 1 did not."""
    from tests.support import wait_until
    with running_cluster(workers=2, servers=1,
                         extra={"BYTEPS_STALL_CHECK_TIME_SECONDS": "0.2"}) as c:
        tables = ok(c.run_all(lambda w: w.sparse.create("emb-stall", 100, 4)))
        w0 = next(w for w in c.workers if w.rank() == 0)
        t0 = next(t for w, t in zip(c.workers, tables) if w is w0)
        t0.push([1, 2], np.ones((2, 4), np.float32))
        srv = c.servers[0]
        assert wait_until(lambda: srv.stalled_rounds(), 10)
        (entry,) = srv.stalled_rounds()
        assert entry["name"] == "table emb-stall" and entry["round"] == 0
        assert entry["pushed"] == [0] and entry["missing"] == [1]
        t1 = next(t for w, t in zip(c.workers, tables) if w is not w0)
        t1.push([], np.zeros((0, 4), np.float32))
        assert wait_until(lambda: not srv.stalled_rounds(), 10)


def test_tables_with_join_follow_the_rules_of_dense_keys():
    """join() with a server-held table (tests/integration/test_join.py's uneven steps), the
    dense tensors on the native data plane: while ranks are in join() a table's round needs the
    others' pushes only and its average divides by them; after the join every rank continues
    at the round the job reached."""
    import json

    from .harness import bpslaunch, worker
    steps = [5, 3, 4]
    run = bpslaunch(worker("join_check.py", ",".join(map(str, steps)), "join", "float32",
                           "table"), workers=3, servers=2, timeout=120)
    assert run.rc == 0, run.log
    recs = [json.loads(ln[ln.index("{"):]) for ln in run.out.splitlines()
            if ln.startswith("[worker") and "{" in ln]
    want, row = {}, 0.0
    for s in range(max(steps)):   # SGD, lr 1: down by the average of the ranks still in
        want[s] = row
        still_in = [q for q in range(3) if steps[q] > s]
        row -= sum(q + 1 for q in still_in) / len(still_in)
    got = [(r["step"], r["row"]) for r in recs if "row" in r]
    assert sorted(got) == sorted((s, want[s]) for q in range(3) for s in range(steps[q])), (
        got, run.log)
    ends = [(r["row_after"], r["row_end"]) for r in recs if "row_after" in r]
    assert ends == [(row, row - 3)] * 3, (ends, row, run.log)


def test_a_rank_that_ends_without_join_fails_the_table_naming_it():
    """A rank that finishes without join() while another still pushes the table: the other
    gets PeerLeftError naming it and the round it never pushed, well within the timeouts."""
    import json

    from .harness import bpslaunch, worker
    run = bpslaunch(worker("join_check.py", "6,2", "nojoin", "float32", "tableonly"),
                    workers=2, servers=1, timeout=90)
    assert run.rc != 0, run.log
    left = [json.loads(ln[ln.index("{"):]) for ln in run.out.splitlines()
            if ln.startswith("[worker") and "peer_left" in ln]
    assert len(left) == 1 and left[0]["rank"] == 0, run.log
    assert left[0]["peer_left"] == 1 and left[0]["last_round"] == 1, run.log
    text = left[0]["message"]
    assert "round 2 of table 'emb' can never complete" in text and "worker rank 1" in text, text
    assert run.elapsed < 30, run.log


def test_async_mode_applies_each_push_as_it_arrives():
    """BYTEPS_ENABLE_ASYNC: no rounds. A push updates its rows at once, alone (an averaged one
    divided by the job's workers); a pull reads the rows as they are, whoever pushed."""
    ones = np.ones((2, 4), np.float32)
    with running_cluster(workers=2, servers=2, extra={"BYTEPS_ENABLE_ASYNC": "1"}) as c:
        tables = ok(c.run_all(lambda w: w.sparse.create("emb-async", 100, 4, init="zeros",
                                                        lr=1.0)))
        t0, t1 = (t for _w, t in sorted(zip([w.rank() for w in c.workers], tables)))
        t0.push([1, 2], ones)                 # worker 1 pushes nothing: no round waits for it
        assert np.array_equal(t0.pull([1, 2, 3])[:, 0], [-1, -1, 0])
        t0.push([1, 2], ones)                 # two steps ahead of worker 1
        assert np.array_equal(t1.pull([1, 2])[:, 0], [-2, -2])
        t1.push([1, 2], 4 * ones, average=True)   # / 2 workers
        assert np.array_equal(t0.pull([1, 2, 3])[:, 0], [-4, -4, 0])
        assert all(s.sparse.rounds_applied == 3 for s in c.servers)   # each push, each server


def test_a_billion_ids_are_refused_before_anything_is_allocated(cluster):
    """The issue's last target: 10^9 ids in one request, a negative id, an out-of-range id. On
    the worker each is refused, naming the table, the id or the count and the rank, before a
    copy of the ids (10^9 ids here are a broadcast view: no memory behind them); a peer's
    request that claims 10^9 ids is refused by the server's decoder before any buffer is
    made. The table goes on."""
    import tracemalloc

    from byteps_like.wire import Header, Role, encode, job_hash
    from tests.faults.hostile import HostileClient
    huge = np.broadcast_to(np.int64(3), (10**9,))
    huge_grads = np.broadcast_to(np.float32(0), (10**9, 4))

    def ask(t):   # refused on the worker: no message, so one worker at a time
        texts = []
        tracemalloc.start()
        try:
            for call in (lambda: t.pull(huge), lambda: t.push(huge, huge_grads),
                         lambda: t.pull([5, -1]), lambda: t.pull([5, 1000])):
                try:
                    call()
                    texts.append(None)
                except (ValueError, IndexError) as exc:
                    texts.append(f"{type(exc).__name__}: {exc}")
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        return texts, peak
    tables = ok(cluster.run_all(lambda w: w.sparse.create("emb-huge", 1000, 4, init="zeros")))
    for w, t in zip(cluster.workers, tables):
        texts, peak = ask(t)
        who = f"table 'emb-huge' on worker rank {w.rank()}"
        assert texts[0] == texts[1] == (f"ValueError: {who}: 1000000000 ids in one request, "
                                        "more than 4000 (BYTEPS_SPARSE_MAX_IDS per server); "
                                        "split the batch"), texts
        assert texts[2] == f"IndexError: {who}: row id -1 is negative", texts
        assert texts[3] == (f"IndexError: {who}: row id 1000 is out of range (the table has "
                            "1000 rows)"), texts
        assert peak < 1 << 20, peak   # the threads' own work, not a copy of 10^9 ids (8 GB)
    table_id = tables[0].table_id
    srv = next(s for s in cluster.servers if s.rank == 0)
    held, malformed = srv.store_bytes(), srv.rejections().get("malformed", 0)
    client = HostileClient(srv.address)
    try:
        for mtype, dtype, size in ((MsgType.SPARSE_PULL, "int64", 8),
                                   (MsgType.SPARSE_PUSH, "uint8", 1)):
            h = Header(mtype, dtype, Role.WORKER, 0, 0, job_hash("default"), table_id, 0,
                       10**9, size * 10**9)
            reply = client.send(encode(h, b"\0" * 8), expect_reply=True)
            assert reply is not None, mtype
            text = reply[-1].decode()
            assert '"kind":"protocol"' in text and "payload" in text, text
    finally:
        client.close()
    assert srv.rejections()["malformed"] == malformed + 2
    assert srv.store_bytes() == held

    def step(w):   # the table goes on
        t = tables[cluster.workers.index(w)]
        t.pull([0, 1])
        t.push([0, 1], np.ones((2, 4), np.float32))
        return t.pull([0, 1])
    for rows in ok(cluster.run_all(step)):
        assert np.array_equal(rows, np.full((2, 4), -0.02, np.float32))


def test_a_bounded_allgather_stops_every_rank_naming_the_one_over(cluster):
    """The TF rows path's bound (allgather_array's max_rows, BYTEPS_SPARSE_MAX_IDS there): a
    rank over it makes every rank raise, naming it, before the result is allocated; a gather
    within it goes on."""
    from byteps_like.worker.broadcast import allgather_array
    results = cluster.run_all(lambda w: allgather_array(
        w, np.zeros((3 + w.rank(), 2), np.float32), "bounded", max_rows=3,
        bound="BYTEPS_SPARSE_MAX_IDS"))
    for w, exc in zip(cluster.workers, results):
        assert isinstance(exc, ValueError), exc
        assert str(exc) == (f"allgather 'bounded' on worker rank {w.rank()}: worker rank(s) [1] "
                            "bring [4] rows, more than 3 (BYTEPS_SPARSE_MAX_IDS); nothing was "
                            "gathered")
    for out in ok(cluster.run_all(lambda w: allgather_array(
            w, np.full((2, 2), w.rank(), np.float32), "bounded.ok", max_rows=3))):
        assert np.array_equal(out[:, 0], [0, 0, 1, 1])


def test_a_push_returns_once_sent_and_a_refusal_raises_at_the_tables_next_call(cluster):
    """A synchronous job pipelines a table's push (worker/sparse.py SparseTables.pipelined):
    push() returns with its answer to come, and the table's next call waits for it first. A
    server's refusal raises there, and the table is back at the refused push's step: pushed
    again, the round completes."""
    ones = np.ones((2, 4), np.float32)
    tables = ok(cluster.run_all(lambda w: w.sparse.create("emb-ahead", 100, 4, init="zeros",
                                                          lr=1.0)))
    t0, t1 = (t for _r, t in sorted(zip([w.rank() for w in cluster.workers], tables),
                                    key=lambda p: p[0]))
    assert t0.owner.pipelined and t1.owner.pipelined
    t0.push([1, 2], ones)                        # summed: the round's first push...
    assert t0.pushing is not None and t0.step == 1
    t0.owner.settle(t0)                          # ...on the server once answered
    assert t0.pushing is None
    t1.push([1, 2], ones, average=True)          # refused: averaged in a summed round
    assert t1.step == 1
    with pytest.raises(MismatchError, match="averaged and summed|is averaged"):
        t1.pull([1])
    assert t1.pushing is None and t1.step == 0
    t1.push([1, 2], ones)                        # round 0 again, summed
    assert np.array_equal(t1.pull([1, 2, 3])[:, 0], [-2, -2, 0])
    assert np.array_equal(t0.pull([1, 2, 3])[:, 0], [-2, -2, 0])
    assert t0.step == t1.step == 1
