"""Server-held embedding tables (issue 31), without sockets: the spec's checks, the initial values
(independent of the number of servers), the per-row sums and the optimizers against references
written here from their formulas, and a one-process job's table."""
from __future__ import annotations

import queue
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from byteps_like.embedding import (
    TableError,
    TableShard,
    TableSpec,
    initial_rows,
    shard_rows,
    split_by_shard,
    state_bytes,
    sum_rows,
)
from byteps_like.wire import Header, MsgType
from tests.support import wait_until


@pytest.mark.parametrize("kw,text", [
    ({"dtype": "float16"}, "dtype 'float16' is not supported yet"),
    ({"optimizer": "rmsprop"}, "unknown optimizer 'rmsprop'"),
    ({"init": "ones"}, "unknown initializer 'ones'"),
    ({"optimizer": "sgd", "beta1": 0.9}, "sgd takes lr, not beta1"),
    ({"optimizer": "adam", "lr": float("nan")}, "lr must be a finite number"),
    ({"optimizer": "sgd", "lr": -1.0}, "must not be negative"),
    ({"seed": -1}, "seed must be an integer"),
])
def test_a_bad_spec_is_refused_naming_the_table(kw, text):
    with pytest.raises(TableError, match="table 'emb'") as info:
        TableSpec.make("emb", 10, 4, **kw)
    assert text in str(info.value)


@pytest.mark.parametrize("meta,text", [
    ({"name": "e", "rows": 0, "dim": 4}, "rows must be an integer in 1.."),
    ({"name": "e", "rows": 10, "dim": True}, "dim must be an integer"),
    ({"name": "", "rows": 10, "dim": 4}, "a table name is a string"),
    ({"name": "e", "rows": 10, "dim": 4, "optimizer_args": [1]}, "must be a mapping"),
    ([1, 2], "a table declaration is a JSON object"),
])
def test_a_peers_declaration_is_checked_field_by_field(meta, text):
    with pytest.raises(TableError, match=text):
        TableSpec.from_json(meta)


def test_the_spec_round_trips_through_json():
    spec = TableSpec.make("emb", 1000, 16, init="uniform", init_args={"low": -1, "high": 1},
                          seed=7, optimizer="adam", lr=0.5)
    assert TableSpec.from_json(spec.to_json()) == spec
    assert spec.optimizer_args == {"lr": 0.5, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8}


def test_cyclic_sharding_covers_every_row_once():
    rows, shards = 1001, 3
    assert sum(shard_rows(rows, s, shards) for s in range(shards)) == rows
    ids = np.array([5, 0, 7, 3, 1000, 2, 4], np.int64)
    order, parts = split_by_shard(ids, shards)
    assert [p.tolist() for p in parts] == [[0, 3], [7, 1000, 4], [5, 2]]
    assert np.array_equal(ids[order], np.concatenate(parts))


def test_a_push_is_split_into_each_shards_records_as_numpy_would():
    from byteps_like import _core
    rng = np.random.default_rng(3)
    ids = rng.permutation(5000)[:777].astype(np.int64)
    grads = rng.standard_normal((777, 5)).astype(np.float32)
    order, counts = _core.table_split(ids, 4)
    ref = np.argsort(ids % 4, kind="stable")   # the numpy split it replaced
    assert np.array_equal(order, ref) and counts.tolist() == np.bincount(ids % 4).tolist()
    records = _core.table_push_records(ids, grads, order, counts)
    at = 0
    for s, rec in enumerate(records):
        n = int(counts[s])
        want = np.concatenate([ids[ref[at:at + n]].view(np.uint8),
                               grads[ref[at:at + n]].reshape(-1).view(np.uint8)])
        assert rec.dtype == np.uint8 and np.array_equal(rec, want)
        at += n
    with pytest.raises(ValueError, match="negative"):
        _core.table_split(np.array([3, -1], np.int64), 2)
    with pytest.raises(ValueError, match="counts add up"):
        _core.table_push_records(ids, grads, order, counts[:-1])


@pytest.mark.parametrize("init", ["normal", "uniform", "zeros"])
def test_initial_rows_do_not_depend_on_the_number_of_servers(init):
    spec = TableSpec.make("emb", 10_007, 12, init=init, seed=11)
    ids = np.random.default_rng(0).choice(spec.rows, 500, replace=False)
    one = TableShard(spec, 0, 1).rows(ids)
    for shards in (2, 3):
        got = np.empty_like(one)
        order, parts = split_by_shard(ids, shards)
        got[order] = np.concatenate([TableShard(spec, s, shards).rows(p)
                                     for s, p in enumerate(parts)])
        assert np.array_equal(got, one)
    assert np.array_equal(one, initial_rows(spec, ids))
    other_seed = initial_rows(TableSpec.make("emb", 10_007, 12, init=init, seed=12), ids)
    assert (init == "zeros") == np.array_equal(one, other_seed)


def test_initial_values_have_the_asked_distribution():
    ids = np.arange(20_000)
    normal = initial_rows(TableSpec.make("e", 20_000, 16, init_args={"mean": 1, "std": 2}), ids)
    assert abs(normal.mean() - 1) < 0.02 and abs(normal.std() - 2) < 0.02
    uni = initial_rows(TableSpec.make("e", 20_000, 16, init="uniform",
                                      init_args={"low": -3, "high": 5}), ids)
    assert uni.min() >= -3 and uni.max() < 5 and abs(uni.mean() - 1) < 0.05
    assert normal.dtype == uni.dtype == np.float32


def test_pushes_are_summed_per_row_in_list_order():
    ids = [np.array([3, 1]), np.array([1, 9]), np.array([9, 3, 1])]
    grads = [np.full((len(i), 2), v, np.float32) for i, v in zip(ids, (1e8, 1.0, -1e8))]
    uniq, sums = sum_rows(ids, grads, 2)
    assert uniq.tolist() == [1, 3, 9]
    # (0 + 1e8) + 1 + -1e8 in float32 is 0 (the 1 is lost), in that order only
    want = np.float32(np.float32(1e8) + np.float32(1.0)) + np.float32(-1e8)
    assert sums[:, 0].tolist() == [want, 0.0, np.float32(1.0) + np.float32(-1e8)]
    assert want == 0.0  # the other order, 1e8 + -1e8 + 1, would give 1


def test_a_push_that_repeats_an_id_adds_each_of_its_rows():
    """Workers send each row once, but a push that repeats an id must count every row (a plain
    fancy-indexed add would keep only the last), in list order like the rest."""
    rng = np.random.default_rng(5)
    ids = [np.array([4, 2, 4, 7, 4]), np.array([2, 7]), np.array([7, 7, 1])]
    grads = [rng.standard_normal((len(i), 3)).astype(np.float32) for i in ids]
    uniq, sums = sum_rows(ids, grads, 3)
    all_ids = np.concatenate(ids)
    want_ids, inv = np.unique(all_ids, return_inverse=True)
    want = np.zeros((len(want_ids), 3), np.float32)
    np.add.at(want, inv, np.concatenate(grads))
    assert uniq.tolist() == want_ids.tolist() and np.array_equal(sums, want)


def reference(opt: str, args: dict, w, state, ids, g):
    """One lazy step of ``opt`` in float64 on the rows ``ids``, from the textbook formulas."""
    w, g = w.astype(np.float64), g.astype(np.float64)
    lr, eps = args["lr"], args.get("eps", 0.0)
    if opt == "sgd":
        w[ids] -= lr * g
    elif opt == "adagrad":
        state["a"][ids] += g * g
        w[ids] -= lr * g / (np.sqrt(state["a"][ids]) + eps)
    else:
        b1, b2 = args["beta1"], args["beta2"]
        state["t"][ids] += 1
        t = state["t"][ids][:, None]
        state["m"][ids] = b1 * state["m"][ids] + (1 - b1) * g
        state["v"][ids] = b2 * state["v"][ids] + (1 - b2) * g * g
        mhat = state["m"][ids] / (1 - b1 ** t)
        vhat = state["v"][ids] / (1 - b2 ** t)
        w[ids] -= lr * mhat / (np.sqrt(vhat) + eps)
    return w


@pytest.mark.parametrize("opt,kw", [("sgd", {"lr": 0.1}), ("adagrad", {"lr": 0.1}),
                                    ("adam", {"lr": 0.01})])
def test_optimizers_follow_their_formulas_on_the_touched_rows_only(opt, kw):
    spec = TableSpec.make("emb", 300, 8, init="uniform", seed=3, optimizer=opt, **kw)
    shard = TableShard(spec)
    rng = np.random.default_rng(1)
    w = initial_rows(spec, np.arange(spec.rows)).astype(np.float64)
    state = {"a": np.zeros((300, 8)), "m": np.zeros((300, 8)), "v": np.zeros((300, 8)),
             "t": np.zeros(300, np.int64)}
    for _step in range(6):
        ids = np.sort(rng.choice(100, 40, replace=False))  # rows 100.. are never touched
        g = rng.normal(size=(40, 8)).astype(np.float32)
        shard.apply(ids, g)
        w = reference(opt, spec.optimizer_args, w, state, ids, g)
    got = shard.rows(np.arange(spec.rows))
    np.testing.assert_allclose(got, w, rtol=1e-6, atol=1e-7)
    assert np.array_equal(got[100:], initial_rows(spec, np.arange(100, 300)))


def test_sgd_is_bit_exact_against_float32_numpy():
    spec = TableSpec.make("emb", 50, 4, optimizer="sgd", lr=0.3)
    shard = TableShard(spec)
    w = initial_rows(spec, np.arange(50))
    g = np.random.default_rng(2).normal(size=(50, 4)).astype(np.float32)
    shard.apply(np.arange(50), g)
    assert np.array_equal(shard.rows(np.arange(50)), w - np.float32(0.3) * g)


def test_state_bytes_count_the_optimizer_state():
    sgd = TableSpec.make("e", 1000, 16)
    assert state_bytes(sgd, 1000) - state_bytes(sgd, 0) == 1000 * (64 + 2)
    ada = TableSpec.make("e", 1000, 16, optimizer="adagrad")
    assert state_bytes(ada, 1000) - state_bytes(ada, 0) == 1000 * (128 + 2)
    adam = TableSpec.make("e", 1000, 16, optimizer="adam")
    assert state_bytes(adam, 1000) - state_bytes(adam, 0) == 1000 * (192 + 4 + 2)


def test_a_one_process_job_holds_its_table_itself():
    from byteps_like.worker.runtime import Runtime
    rt = Runtime()
    rt.init()
    try:
        t = rt.sparse.create("emb", 100, 4, init="zeros", optimizer="sgd", lr=1.0)
        ids = np.array([5, 7, 5])
        assert np.array_equal(t.pull(ids), np.zeros((3, 4), np.float32))
        t.push(ids, np.ones((3, 4), np.float32))  # row 5 twice: its gradients add up
        assert t.pull([5, 7, 8])[:, 0].tolist() == [-2.0, -1.0, 0.0]
        with pytest.raises(IndexError, match=r"table 'emb' on worker rank 0: row id 100 is out "
                                             r"of range \(the table has 100 rows\)"):
            t.pull([1, 100])
        with pytest.raises(IndexError, match="row id -3 is negative"):
            t.push([-3], np.zeros((1, 4), np.float32))
        with pytest.raises(ValueError, match="1000000000 ids in one request, more than"):
            t.pull(np.broadcast_to(np.int64(0), (10 ** 9,)))
        with pytest.raises(TypeError, match="row ids must be integers"):
            t.pull([0.5])
        with pytest.raises(TableError, match="table 'emb' exists already"):
            rt.sparse.create("emb", 100, 4)
    finally:
        rt.shutdown()


def test_bench_jobs_are_spread_over_the_emulated_hosts():
    """bench sparse and bench train place a job on network namespaces the same way
    (harness.on_hosts): the scheduler and worker i on w{i}, server j on s{j}."""
    from byteps_like.bench import harness

    class Hosts:
        def exec_argv(self, host, argv):
            return ["in", host, *argv]

        def ip(self, host):
            return f"10.0.0.{host}"
    specs = harness.local_job(["train.py"], 9000, workers=2, servers=2)
    assert harness.on_hosts(specs, None) is specs
    where = {(p.role, p.rank): (p.argv[1], p.env["DMLC_NODE_HOST"])
             for p in harness.on_hosts(specs, Hosts())}
    assert where == {("scheduler", None): ("w0", "10.0.0.w0"), ("server", 0): ("s0", "10.0.0.s0"),
                     ("server", 1): ("s1", "10.0.0.s1"), ("worker", 0): ("w0", "10.0.0.w0"),
                     ("worker", 1): ("w1", "10.0.0.w1")}


def test_checkpoint_files_restore_onto_any_number_of_shards_and_are_checked(tmp_path):
    from byteps_like.embedding import load_shard, save_shard
    spec = TableSpec.make("user/emb", 1000, 4, optimizer="adagrad", lr=0.5)
    old = [TableShard(spec, s, 2) for s in range(2)]
    rng = np.random.default_rng(0)
    for s, shard in enumerate(old):
        ids = np.arange(s, 1000, 2)[:100]
        shard.apply(ids, rng.normal(size=(100, 4)).astype(np.float32))
    paths = [save_shard(shard, str(tmp_path), "t1") for shard in old]
    assert [p.rsplit("/", 2)[1:] for p in paths] == [["t1", "user%2femb.shard0of2.bpst"],
                                                     ["t1", "user%2femb.shard1of2.bpst"]]
    new = [TableShard(spec, s, 3) for s in range(3)]
    assert sum(load_shard(shard, str(tmp_path), "t1") for shard in new) == 200
    rows, acc = np.empty((1000, 4), np.float32), np.empty((1000, 4), np.float32)
    for s, o in enumerate(old):
        rows[s::2], acc[s::2] = o.rows(np.arange(s, 1000, 2)), o.acc
    for shard in new:   # the same rows and accumulators, whatever the sharding
        mine = np.arange(shard.shard, 1000, 3)
        assert np.array_equal(shard.rows(mine), rows[mine])
        assert np.array_equal(shard.acc, acc[mine])
    with pytest.raises(TableError, match="checkpoint 'nope' not found"):
        load_shard(new[0], str(tmp_path), "nope")
    with pytest.raises(TableError, match="checkpoint tag '../x'"):
        save_shard(new[0], str(tmp_path), "../x")
    with pytest.raises(TableError, match="BYTEPS_SPARSE_CHECKPOINT_DIR"):
        save_shard(new[0], "", "t1")
    other = TableShard(TableSpec.make("user/emb", 1000, 8, optimizer="adagrad"), 0, 1)
    with pytest.raises(TableError, match="not the table being loaded"):
        load_shard(other, str(tmp_path), "t1")
    (tmp_path / "t1" / "user%2femb.shard1of2.bpst").unlink()
    with pytest.raises(TableError, match="no complete set of shard files"):
        load_shard(new[0], str(tmp_path), "t1")


def test_sparse_embedding_alone_is_nn_embedding_with_sgd_and_one_forward_per_step():
    torch = pytest.importorskip("torch")
    import byteps_like.torch as bt
    from byteps_like.errors import BytePSError
    from byteps_like.worker.runtime import default_runtime, reset_default_runtime
    reset_default_runtime()
    bt.init()
    try:
        emb = bt.SparseEmbedding(50, 3, init="uniform", seed=4, lr=0.5)
        ref = torch.nn.Embedding(50, 3)
        with torch.no_grad():
            ref.weight.copy_(torch.from_numpy(initial_rows(emb.table.spec, np.arange(50))))
        ids = torch.tensor([[1, 2, 2], [7, 1, 0]])
        out = emb(ids)
        assert out.shape == (2, 3, 3) and torch.equal(out, ref(ids))
        (out ** 2).sum().backward()
        (ref(ids) ** 2).sum().backward()
        torch.optim.SGD(ref.parameters(), lr=0.5).step()
        np.testing.assert_allclose(emb.table.pull(np.arange(50)), ref.weight.detach().numpy(),
                                   rtol=1e-6, atol=1e-7)
        emb(ids)   # a training forward whose backward never runs
        with pytest.raises(BytePSError, match="before the previous one's backward"):
            emb(ids)
        with torch.no_grad():
            emb(ids)   # evaluation only reads
        # a new elastic epoch moves the table's step on (SparseTables.new_epoch): the forward
        # it cut short is void, the next one is the epoch's first
        emb.table.step += 1 << 32
        (emb(ids) ** 2).sum().backward()
        with pytest.raises(TypeError, match="ids must be int32 or int64"):
            emb(torch.tensor([0.5]))
    finally:
        default_runtime().shutdown()
        reset_default_runtime()


class _Inbox:
    """What the tables' thread reads of the native plane (DataServer.table_requests and
    table_wake), fed by the test."""

    def __init__(self):
        self.q: queue.SimpleQueue = queue.SimpleQueue()

    def table_requests(self, timeout: float) -> list:
        try:
            item = self.q.get(timeout=timeout)
        except queue.Empty:
            return []
        return [] if item is None else [item]

    def table_wake(self) -> None:
        self.q.put(None)


def test_requests_that_come_before_the_servers_rank_wait_for_it():
    """A worker is told the node table when the server is, and can ask a server before that
    server has read its own rank from it: the tables' thread serves such requests only once
    the node table came (a declaration checked against rank -1 was refused, in CI)."""
    from byteps_like.server import sparse as sp

    admitted = threading.Event()
    seen: list[tuple[int, bool]] = []
    waits: list[float] = []

    def wait_admitted(timeout: float) -> bool:
        waits.append(timeout)
        return admitted.wait(timeout)
    srv = SimpleNamespace(cfg=SimpleNamespace(server=SimpleNamespace(
                              sparse_max_ids=1 << 20, sparse_survival="none",
                              sparse_snapshot_steps=100, sparse_checkpoint_dir="")),
                          required=2, num_workers=2, rank=0, async_mode=False,
                          control=SimpleNamespace(wait_admitted=wait_admitted,
                                                  shutting_down=False, fatal=None),
                          native=_Inbox())
    srv.cfg.transport = SimpleNamespace(max_message_bytes=1 << 20)
    service = sp.SparseService(srv)
    service.process = lambda route, msg: seen.append(   # type: ignore
        (msg.header.key, admitted.is_set()))
    service.start()
    try:
        for key in range(3):
            srv.native.q.put((1, Header(MsgType.SPARSE_CREATE, rank=0, key=key).pack(), b"", b""))
        assert wait_until(lambda: len(waits) >= 2)   # the thread is waiting, nothing served
        assert seen == []
        admitted.set()
        assert wait_until(lambda: len(seen) == 3)
    finally:
        service.close()
    assert seen == [(0, True), (1, True), (2, True)]


def test_the_tables_count_worker_processes_and_join_by_machine():
    """server/table.py Pushers: 3 machines of 2 processes push as ranks 0..5; L comes with the
    first declaration and every later one must agree; a machine in join() or gone takes both
    its processes with it."""
    from byteps_like.server.table import MAX_LOCAL_SIZE, Pushers

    p = Pushers(3)
    assert p.limit() == 3 * MAX_LOCAL_SIZE   # before any declaration: any local size
    assert p.declare(2, 7) == "rank 7 is not below 3 machines x 2 processes"
    assert p.declare(0, 0) == f"local size 0 is not 1..{MAX_LOCAL_SIZE}"
    assert p.declare(True, 0) is not None and p.per_machine == 0
    assert p.declare(2, 5) is None and p.limit() == 6
    assert "the tables have 2" in p.declare(3, 0)
    p.joined, p.left = frozenset({1}), {2: "gone"}
    assert p.joined_ranks() == {2, 3} and p.left_ranks() == {4: "gone", 5: "gone"}
    assert p.of(range(3)) == 6 and p.of(p.joined) == 2
    assert p.missing({0, 1}, 3) == [4, 5] and p.missing({0, 1, 4, 5}, 3) == []


def test_a_table_round_waits_for_every_rank_not_joined_whoever_joined_after_pushing():
    """Worker rank 0 pushes round 0 (acknowledged at once) and joins; ranks 1 and 3 push: the
    round still waits for rank 2, whose push completes it with all four pushes summed. (The
    round counted 3 pushes against the 3 ranks not joined and completed without rank 2, whose
    push then came to a closed round: seen in CI as a rejected 'push of round 7 ... that this
    rank has pushed already' at the end of a job.)"""
    from byteps_like.server import sparse as sp
    from byteps_like.server.table import Pushers

    applied: list[list[int]] = []
    svc = sp.SparseService.__new__(sp.SparseService)   # no server: the round logic alone
    svc.ranks, svc.required = Pushers(4), 4
    svc._apply = lambda table: applied.append(sorted(table.pushes))   # type: ignore
    table = SimpleNamespace(pushes={})
    table.pushes[0] = "push of rank 0"
    svc._complete_if_ready(table)
    svc.ranks.joined = frozenset({0})   # apply_members, without its doom check
    for rank in (1, 3):
        table.pushes[rank] = f"push of rank {rank}"
        svc._complete_if_ready(table)
    assert applied == []
    table.pushes[2] = "push of rank 2"
    svc._complete_if_ready(table)
    assert applied == [[0, 1, 2, 3]]
    svc.ranks.joined = frozenset({0, 1, 2, 3})   # everyone joined: an empty round waits,
    applied.clear()                               # one a rank pushed completes (the scheduler
    svc._complete_if_ready(SimpleNamespace(pushes={}))   # sends this before its reset)
    assert applied == []
    svc._complete_if_ready(SimpleNamespace(pushes={1: "the last push of rank 1"}))
    assert applied == [[1]]


def test_phases_add_up_per_phase_and_a_step_record_keeps_the_median():
    """embedding.Phases counts seconds and calls per phase; StepPhases keeps each step's
    difference (with the CPU time of the thread and the process) and reports the medians."""
    import time

    from byteps_like.embedding import Phases, StepPhases
    ph = Phases()
    t = ph.add("a", time.perf_counter() - 0.5)
    ph.add("a", t - 0.25)
    ph.add("b", time.perf_counter())
    snap = ph.snapshot()
    assert snap["a"][1] == 2 and 0.75 <= snap["a"][0] < 5 and snap["b"][1] == 1
    assert Phases.since({"a": [3.0, 4], "c": [1.0, 1]}, {"a": [1.0, 1]}) == {
        "a": [2.0, 3], "c": [1.0, 1]}
    steps = StepPhases(keep=3)
    steps.end_step()                       # the first mark: no step yet
    for seconds in (0.1, 0.3, 0.2, 9.0, 0.4):   # the oldest two fall out of the record
        steps.add("gather", time.perf_counter() - seconds)
        steps.end_step()
    report = steps.report()
    assert report["steps"] == 3 and report["phases"]["gather"][1] == 1
    assert 0.4 <= report["phases"]["gather"][0] < 9.0   # the median of 0.2, 9.0, 0.4
    assert {"CPU: this thread", "CPU: the whole process"} <= set(report["phases"])


def test_bench_sparse_prints_where_the_time_goes():
    """bench sparse's breakdown: the workers' phases per timed step (mean of the workers) and
    the servers' from the line they log as they exit (mean of the servers), one table."""
    import json
    from collections import deque

    from byteps_like.bench import sparse as bench
    from byteps_like.embedding import PHASES_TAG
    res = [{"table_phases": {"pull: send": [0.010, 40]}},
           {"table_phases": {"pull: send": [0.030, 40]}}]
    servers = [SimpleNamespace(drain=lambda: None, err=deque([
        "[12:00:00 INFO server] server 0: table created",
        f"[12:00:01 INFO server] server {i}: {PHASES_TAG} " + json.dumps(
            {"steps": 9, "phases": {"queue wait": [0.002 * (i + 1), 8]}})])) for i in range(2)]
    servers.append(SimpleNamespace(drain=lambda: None, err=deque(["killed: no line"])))
    res[0]["server_phases"] = bench.server_phases(servers)   # type: ignore[arg-type]
    assert len(res[0]["server_phases"]) == 2
    rows = {(side, phase): (ms, calls) for side, phase, ms, calls in bench.breakdown(res, 10)}
    assert rows[("worker", "pull: send")] == pytest.approx((2.0, 4.0))
    assert rows[("server", "queue wait")] == pytest.approx((3.0, 8.0))
    text = bench.format_breakdown([{"mode": "sparse", "breakdown": bench.breakdown(res, 10)}])
    assert "| sparse | worker | pull: send" in text and "|    2.00 |" in text


def test_the_last_join_tells_the_servers_everyone_joined_before_the_reset():
    """scheduler/join.py: when the last worker joins, the servers first hear that every worker
    has joined (a table round that a rank a round ahead pushed alone completes: the other will
    never push it), then the empty membership whose acknowledgements release the workers. It
    went straight to the reset, and such a round stayed open (a snapshot rollback's job hung)."""
    from byteps_like.scheduler.join import Joins
    from byteps_like.scheduler.nodes import NodeInfo
    from byteps_like.transport import Route
    from byteps_like.wire import MsgType, Role

    sent: list[tuple[str, MsgType, object]] = []

    def node(role: Role, rank: int) -> NodeInfo:
        return NodeInfo(Route(ident=f"{role.name}{rank}".encode()), role, "127.0.0.1", 1, 1,
                        rank=rank)
    nodes = [node(Role.WORKER, 0), node(Role.WORKER, 1), node(Role.SERVER, 0)]
    host = SimpleNamespace(nodes={n.route.ident: n for n in nodes},
                           cfg=SimpleNamespace(cluster=SimpleNamespace(local_size=1)),
                           send=lambda n, t, meta, key=None: sent.append((n.role.name, t, meta)))
    joins = Joins(host)
    joins.join(nodes[0], {})
    assert [m["joined"] for _r, t, m in sent if t is MsgType.MEMBERS] == [[0]]
    joins.join(nodes[1], {})
    members = [m["joined"] for r, t, m in sent if t is MsgType.MEMBERS]
    assert members == [[0], [0, 1], []], members
    assert not any(t is MsgType.JOIN_DONE for _r, t, _m in sent)   # until the servers ack
    joins.members_ack(nodes[2], joins.members_epoch)
    assert sum(t is MsgType.JOIN_DONE for _r, t, _m in sent) == 2
