"""Losing a server (BYTEPS_SERVER_FAILOVER, docs/reliability.md "Losing a server"): real jobs
under bpslaunch --local whose worker rank 0 kills a server mid-round (tests/faults/workers/
lose_server.py). The job goes on and every worker's final parameters are bit for bit those of
the same job uninterrupted; with the setting off, or with every server lost, the job fails
naming the server."""
from __future__ import annotations

import re

import numpy as np
import pytest

from tests.integration.harness import bpslaunch

pytestmark = pytest.mark.integration

SCRIPT = "tests/faults/workers/lose_server.py"
STEPS = 12


def run(tmp_path, tag: str, kills: str = "", *, workers: int = 2, servers: int = 2,
        local_size: int = 1, compressor: str = "", env: dict | None = None,
        restarts: int = 0, steps: int = STEPS):
    """The job under bpslaunch --local; ``restarts``: --server-restarts (0 here unless a test
    is about replacements: a lost server stays lost)."""
    out = tmp_path / tag
    args = [SCRIPT, str(out), str(steps), kills] + ([compressor] if compressor else [])
    r = bpslaunch(args, workers=workers, servers=servers, local_size=local_size,
                  env=env, timeout=150, extra=["--server-restarts", str(restarts)])
    return r, out


def params(out, rank: int) -> list[np.ndarray]:
    with np.load(f"{out}.{rank}.npz") as f:
        return [f[k] for k in f.files]


def stall(text: str) -> float:
    """Longest step minus the median step of rank 0 (STEP_TIMES)."""
    times = [float(x) for x in re.search(r"STEP_TIMES ([\d. ]+)", text).group(1).split()]
    return max(times) - float(np.median(times))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference: the same jobs with no server lost, keyed by (servers, local_size)."""
    tmp = tmp_path_factory.mktemp("reference")
    cache: dict = {}

    def get(servers: int = 2, local_size: int = 1, compressor: str = ""):
        key = (servers, local_size, compressor)
        if key not in cache:
            r, out = run(tmp, f"ref{servers}{local_size}{compressor}", servers=servers,
                         local_size=local_size, compressor=compressor)
            assert r.rc == 0, r.out + r.err
            cache[key] = params(out, 0)
        return cache[key]
    return get


def assert_same(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert np.array_equal(x, y), f"tensor w{i}: max difference {np.abs(x - y).max()}"


@pytest.mark.parametrize("kills", ["0:1:KILL", "5:1:KILL"],
                         ids=["during-declaration", "sigkill-mid-round"])
def test_a_lost_server_costs_nothing(tmp_path, uninterrupted, kills):
    r, out = run(tmp_path, "k", kills)
    text = r.out + r.err
    assert r.rc == 0, text
    assert "KILLED server" in text
    lost = kills.split(":")[1]
    # found by its streams or its launcher, not by the heartbeat timeout; said once by rank 0
    assert re.search(rf"scheduler: lost server rank {lost} .*(data streams|exited)", text), text
    assert len(re.findall(r"worker 0: lost server rank \d+; .* stalled", text)) == 1, text
    assert "the job finished without server" in text
    assert_same(params(out, 0), uninterrupted())
    assert_same(params(out, 1), uninterrupted())
    print(f"stall (longest step - median step): {stall(text):.3f} s")


def test_sigterm_makes_a_server_leave_announced(tmp_path, uninterrupted):
    """SIGTERM mid-round (server/preempt.py SigtermLeave: how Kubernetes deletes a pod): the
    server announces its leave, the scheduler moves its keys before it exits (not found by
    its exit or its streams), it exits 0 and the sums are the uninterrupted job's, bit for
    bit."""
    r, out = run(tmp_path, "k", "7:0:TERM")
    text = r.out + r.err
    assert r.rc == 0, text
    assert "KILLED server 0" in text and "server 0: SIGTERM; announcing its leave" in text, text
    assert re.search(r"scheduler: lost server rank 0 .*: it announced its leave \(SIGTERM\)",
                     text), text
    assert not re.search(r"lost server rank 0 .*(data streams|exited|heartbeat)", text), text
    assert len(re.findall(r"worker 0: lost server rank 0; .* stalled", text)) == 1, text
    assert "failed" not in text.lower() and "killed by" not in text, text
    assert_same(params(out, 0), uninterrupted())
    assert_same(params(out, 1), uninterrupted())
    print(f"stall (longest step - median step): {stall(text):.3f} s")


def test_sigterm_with_failover_off_ends_the_job_as_before(tmp_path):
    """BYTEPS_SERVER_FAILOVER=0: SIGTERM keeps its default (the server ends at once) and the
    job fails naming the server, as before the announced leave existed."""
    r, _ = run(tmp_path, "k", "5:1:TERM", env={"BYTEPS_SERVER_FAILOVER": "0"})
    text = r.out + r.err
    assert r.rc != 0, text
    assert "announcing its leave" not in text, text
    assert re.search(r"server 1 \(pid \d+\) (failed|exited).*(SIGTERM|143)", text), text


def test_sigterm_of_the_last_server_ends_the_job_after_the_leave_is_refused(tmp_path):
    """Server 1 SIGKILLed, then the last server SIGTERMed: the scheduler cannot let it go (it
    is the job's last server) and says so; the server waits LEAVE_WAIT_S for a word that does
    not come, then ends as SIGTERM would have, and the job fails naming it."""
    r, _ = run(tmp_path, "k", "3:1:KILL,6:0:TERM", steps=5000)   # runs on past the wait
    text = r.out + r.err
    assert r.rc != 0, text
    assert "server 0: SIGTERM; announcing its leave" in text, text
    assert re.search(r"scheduler: server rank 0 .*announced its leave \(SIGTERM\), but the job "
                     r"cannot lose it \(it is the job's last server\)", text), text
    assert "did not let it go within 5 s of its announced leave: ending now" in text, text
    assert re.search(r"server 0 \(pid \d+\) (failed|exited).*(SIGTERM|143)", text), text


def test_a_preemption_notice_file_makes_a_server_leave_announced(tmp_path, uninterrupted):
    """BYTEPS_PREEMPTION_NOTICE_FILE (server/preempt.py): worker rank 0 writes server 1's notice
    mid-round; the server announces its leave, the scheduler moves its keys before it exits
    (not found by its exit or its streams: no stall of detection), it exits 0, and the sums
    are those of the uninterrupted job, bit for bit."""
    notice = tmp_path / "notice-{rank}"
    r, out = run(tmp_path, "k", "5:1:NOTICE",
                 env={"BYTEPS_PREEMPTION_NOTICE_FILE": str(notice)})
    text = r.out + r.err
    assert r.rc == 0, text
    assert re.search(r"NOTICE for server 1 at step 5: failover 1 after", text), text
    assert re.search(r"server 1: preemption notice in .*notice-1: TERMINATE at .*; announcing "
                     r"its leave", text), text
    assert re.search(r"scheduler: lost server rank 1 .*: it announced its leave \(preemption "
                     r"notice", text), text
    assert not re.search(r"lost server rank 1 .*(data streams|exited|heartbeat)", text), text
    assert len(re.findall(r"worker 0: lost server rank 1; .* stalled", text)) == 1, text
    assert "unexpected" not in text and "failed" not in text.lower(), text
    assert_same(params(out, 0), uninterrupted())
    assert_same(params(out, 1), uninterrupted())
    # (rank 0's step 5 also holds the wait for the server's next look at the file, up to 1 s)
    print("failover stall: " + re.search(r"the job stalled ([\d.]+ s)", text).group(1))


def test_two_servers_lost_one_after_the_other(tmp_path, uninterrupted):
    r, out = run(tmp_path, "k", "3:1:KILL,8:2:KILL", servers=3)
    text = r.out + r.err
    assert r.rc == 0, text
    assert "failover 2" in text
    assert_same(params(out, 0), uninterrupted(servers=3))


def test_several_worker_processes_per_machine(tmp_path, uninterrupted):
    """Local reduction: the local root's partitions go through the pipeline, one native
    operation each; a lost server's wait and move the same way."""
    r, out = run(tmp_path, "k", "4:0:KILL", local_size=2)
    assert r.rc == 0, r.out + r.err
    ref = uninterrupted(local_size=2)
    for rank in range(4):
        assert_same(params(out, rank), ref)


def test_a_compressed_tensor_with_error_feedback(tmp_path, uninterrupted):
    """onebit with error feedback on the largest tensor: the workers' residuals are theirs and
    go on; the server's residual of a moved key starts again at zero on its new server (as at
    the job's start), so that tensor differs from the uninterrupted run by what the residual
    held, identically on every worker; every other tensor is bit for bit the same."""
    r, out = run(tmp_path, "k", "5:1:KILL", compressor="onebit")
    assert r.rc == 0, r.out + r.err
    got0, got1 = params(out, 0), params(out, 1)
    assert_same(got0, got1)
    ref = uninterrupted(compressor="onebit")
    for i, (x, y) in enumerate(zip(got0, ref)):
        if i != 5:
            assert np.array_equal(x, y), f"tensor w{i} differs"
    assert np.all(np.isfinite(got0[5]))


def test_with_failover_off_a_lost_server_ends_the_job(tmp_path):
    r, _ = run(tmp_path, "k", "4:1:KILL", env={"BYTEPS_SERVER_FAILOVER": "0"})
    text = r.out + r.err
    assert r.rc != 0
    assert "PeerLostError" in text and "server rank 1" in text
    assert "server 1 (pid" in text and "failed first: killed by SIGKILL" in text


def test_losing_every_server_ends_the_job_naming_it(tmp_path):
    r, _ = run(tmp_path, "k", "3:1:KILL,6:0:KILL")
    text = r.out + r.err
    assert r.rc != 0
    assert "no server of the job is left" in text, text
    assert "failed first: killed by SIGKILL" in text


def test_over_ucx_streams(tmp_path, uninterrupted):
    """The same over the native plane's UCX streams (UCX_TLS=tcp on loopback)."""
    env = {"BYTEPS_TRANSPORT": "ucx", "UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo",
           "UCX_WARN_UNUSED_ENV_VARS": "n"}
    r, out = run(tmp_path, "k", "5:1:KILL", env=env)
    text = r.out + r.err
    assert r.rc == 0, text
    assert "stalled" in text
    assert_same(params(out, 0), uninterrupted())


def test_a_hung_server_is_lost_by_its_silence(tmp_path, uninterrupted):
    """SIGSTOP: the server's streams stay open and nothing exits; the scheduler finds it by
    its heartbeats (BYTEPS_HEARTBEAT_TIMEOUT_SECONDS, 3 s here), its keys move, and at the end
    bpslaunch stops it instead of failing the job."""
    r, out = run(tmp_path, "k", "5:1:STOP")
    text = r.out + r.err
    assert r.rc == 0, text
    assert re.search(r"scheduler: lost server rank 1 .*no heartbeat", text), text
    assert "stopping server 1" in text
    assert_same(params(out, 0), uninterrupted())


def test_an_elastic_job_loses_a_worker_and_a_server(tmp_path):
    """Elastic workers and failover at once: 3 workers and 2 servers; worker rank 2 dies at
    step 2 (the job re-forms with 2), then rank 0 SIGKILLs server 0 at step 5 (its keys move).
    Every sum of every step is exact for the epoch's size (test_elastic's check)."""
    from tests.integration.harness import worker
    from tests.integration.test_elastic import check_sums, job_env, records
    r = bpslaunch(worker("elastic_numpy.py", 10, "kill=2@2", "killserver=5", "slow=0.05"),
                  workers=3, servers=2, env=job_env(), timeout=150,
                  extra=["--elastic", "--min-workers", "2", "--max-restarts", "0"])
    log = r.out + r.err
    assert r.rc == 0, log
    recs = records(r.out)
    check_sums(recs, log)
    assert max(rec.get("step", -1) for rec in recs) == 10  # every step done (1..10)
    assert re.search(r"scheduler: lost server rank 0 .*failover 1", log), log


TABLES = "tests/faults/workers/lose_server_tables.py"


def run_tables(tmp_path, tag: str, kills: str = "", *, servers: int = 2, survival: str = "",
               optimizer: str = "sgd", restarts: int = 0, steps: int = 14,
               env: dict | None = None, workers: int = 2, local_size: int = 1):
    out = tmp_path / tag
    full = {"BYTEPS_SPARSE_SURVIVAL": survival} if survival else {}
    full.update(env or {})
    r = bpslaunch([TABLES, str(out), str(steps), kills, optimizer], workers=workers,
                  servers=servers, local_size=local_size, env=full, timeout=150,
                  extra=["--server-restarts", str(restarts)])
    return r, out


def tables(out, rank: int) -> dict:
    with np.load(f"{out}.{rank}.npz") as f:
        return {k: f[k] for k in f.files}


@pytest.fixture(scope="module")
def tables_uninterrupted(tmp_path_factory):
    """The reference for the table jobs, without replication (it changes no bit), by
    (servers, optimizer)."""
    tmp = tmp_path_factory.mktemp("tables-reference")
    cache: dict = {}

    def get(servers: int = 2, optimizer: str = "sgd") -> dict:
        if (servers, optimizer) not in cache:
            r, out = run_tables(tmp, f"ref{servers}{optimizer}", servers=servers,
                                optimizer=optimizer)
            assert r.rc == 0, r.out + r.err
            cache[servers, optimizer] = tables(out, 0)
        return cache[servers, optimizer]
    return get


def assert_same_tables(got: dict, ref: dict) -> None:
    for k in ("rows", "dense"):
        if k not in ref:
            continue
        assert np.array_equal(got[k], ref[k]), f"{k}: max difference {np.abs(got[k] - ref[k]).max()}"


def test_a_job_with_server_held_tables_fails_naming_them(tmp_path):
    """Without replication a table's shard lives on its server only: losing a server of a job
    with tables is an error that names the shard, the table and what to do."""
    r, _ = run_tables(tmp_path, "k", "3:1:pull")
    text = r.out + r.err
    assert r.rc != 0, text
    assert "shard 1 of table 'emb' is lost: its server was lost" in text, text
    assert "load the last checkpoint" in text


@pytest.mark.parametrize("kills,optimizer", [("5:1:push", "sgd"), ("4:0:pull", "adam"),
                                             ("6:0:push", "adagrad")],
                         ids=["mid-push", "before-pull-adam", "primary-mid-push-adagrad"])
def test_replicated_tables_survive_a_lost_server_bit_for_bit(tmp_path, tables_uninterrupted,
                                                             kills, optimizer):
    """BYTEPS_SPARSE_SURVIVAL=replicate: each shard also lives on the next server, which
    applies every round; a SIGKILLed server's shards are served by their copies and the tables
    (rows and optimizer state) end exactly as in the uninterrupted job."""
    r, out = run_tables(tmp_path, "k", kills, survival="replicate", optimizer=optimizer)
    text = r.out + r.err
    assert r.rc == 0, text
    assert "KILLED server" in text and "rejected" not in text and "dropped" not in text, text
    ref = tables_uninterrupted(optimizer=optimizer)
    assert_same_tables(tables(out, 0), ref)
    assert_same_tables(tables(out, 1), ref)


def test_replicated_tables_lose_two_servers_that_are_not_neighbours(tmp_path,
                                                                    tables_uninterrupted):
    """Four servers, 0 then 2 lost: every shard keeps one copy (shard s lives on s and s+1)."""
    r, out = run_tables(tmp_path, "k", "3:0:push,7:2:pull", servers=4, survival="replicate")
    text = r.out + r.err
    assert r.rc == 0, text
    assert "failover 2" in text
    assert_same_tables(tables(out, 1), tables_uninterrupted(servers=4))


def test_losing_both_copies_of_a_shard_ends_the_job_naming_it(tmp_path):
    r, _ = run_tables(tmp_path, "k", "3:1:push,7:2:pull", servers=4, survival="replicate")
    text = r.out + r.err
    assert r.rc != 0, text
    assert "shard 1 of table 'emb' is lost: both servers holding it" in text, text


@pytest.mark.parametrize("servers,kills", [(2, "7:1:push"), (3, "8:0:pull"), (2, "6:0:push")],
                         ids=["2-servers-mid-push", "3-servers-before-pull",
                              "during-a-snapshot"])
def test_snapshots_roll_the_tables_back_to_the_newest_one(tmp_path, tables_uninterrupted,
                                                          servers, kills):
    """BYTEPS_SPARSE_SURVIVAL=snapshot, every 3 rounds: a SIGKILLed server's shard moves to the
    next server, which rebuilds it from its snapshots, and every table goes back to the newest
    round the lost shard's snapshots hold. The rows each worker then pulls at every round up to
    it are exactly those of the uninterrupted job at that round; each worker is told how many
    steps it lost (at most K + 1: it may have been a round ahead); the workers end alike. The
    third case kills a server as it takes a snapshot (the round before was its last of a
    period)."""
    every = 3
    r, out = run_tables(tmp_path, "k", kills, servers=servers, survival="snapshot",
                        env={"BYTEPS_SPARSE_SNAPSHOT_STEPS": str(every),
                             "BYTEPS_SPARSE_CHECKPOINT_DIR": str(tmp_path / "ck")})
    text = r.out + r.err
    assert r.rc == 0, text
    went = re.search(r"table 'emb' went back \d+ round\(s\) to round (\d+)", text)
    assert went, text
    back_to = int(went.group(1))
    assert back_to % every == 0 and back_to > 0
    lost = {int(w): int(n) for w, n in re.findall(r"\[worker (\d)\] ROLLED_BACK (\d+)", text)}
    # a worker whose push of the round the tables went back to was cut off sends it again
    assert len(lost) == 2 and all(0 <= n <= every + 1 for n in lost.values()), text
    ref = tables_uninterrupted(servers=servers)
    by_round = dict(zip(ref["trace_rounds"].tolist(), ref["trace"]))
    for rank in (0, 1):
        got = tables(out, rank)
        rounds = got["trace_rounds"].tolist()
        if lost[rank]:   # it went back: a round it pulled comes again
            assert any(b <= a for a, b in zip(rounds, rounds[1:])), rounds
        for rnd, rows in zip(rounds, got["trace"]):
            if rnd <= back_to:
                assert np.array_equal(rows, by_round[rnd]), f"rank {rank}, round {rnd}"
    assert_same_tables(tables(out, 0), {"rows": tables(out, 1)["rows"]})


@pytest.mark.parametrize("at", [None, 9], ids=["newest", "round-9"])
def test_another_job_restores_snapshots_onto_another_number_of_servers(tmp_path, at):
    """table.load_snapshots: a job of 3 servers writes snapshots every 3 rounds (Adam); a new
    job of 2 servers restores them (the newest round every shard holds, or round 9) and trains
    on from the step after: its rows end bit for bit as the first job's after the same steps
    (the rows and the optimizer state came back, whichever server holds them now)."""
    ck = tmp_path / "ck"
    env = {"BYTEPS_SPARSE_SNAPSHOT_STEPS": "3", "BYTEPS_SPARSE_CHECKPOINT_DIR": str(ck)}
    r, first = run_tables(tmp_path, "a", servers=3, survival="snapshot", optimizer="adam",
                          steps=12, env=env)
    assert r.rc == 0, r.out + r.err
    [folder] = [p.name for p in ck.iterdir()]   # snapshots-<job>: its servers log it
    load = folder + (f"@{at}" if at is not None else "")
    r, out = run_tables(tmp_path, "b", servers=2, survival="snapshot", optimizer="adam",
                        steps=12, env={**env, "LOAD_SNAPSHOTS": load})
    text = r.out + r.err
    assert r.rc == 0, text
    assert re.findall(r"\[worker \d\] LOADED round (\d+)", text) == [str(at or 12)] * 2, text
    want = tables(first, 0)["rows"]
    for rank in (0, 1):
        assert np.array_equal(tables(out, rank)["rows"], want), f"rank {rank}"
    # a folder that is not one is refused by name, before anything is read
    r, _ = run_tables(tmp_path, "c", servers=2, survival="snapshot", optimizer="adam", steps=1,
                      env={**env, "LOAD_SNAPSHOTS": "../etc"})
    assert r.rc != 0 and "name a job's snapshot folder under" in r.out + r.err, r.out + r.err


def test_a_replacement_server_leaves_the_tables_on_their_copies(tmp_path, tables_uninterrupted):
    """bpslaunch starts the lost server again: it takes its dense keys back, while its table
    shards stay on their copies (a replacement holds no table)."""
    r, out = run_tables(tmp_path, "k", "4:1:push", survival="replicate", restarts=1, steps=16)
    text = r.out + r.err
    assert r.rc == 0, text
    assert "restarted server 1 as pid" in text, text
    ref_dir = tmp_path / "ref16"
    ref_dir.mkdir()
    r2, ref = run_tables(ref_dir, "u", steps=16)
    assert r2.rc == 0, r2.out + r2.err
    assert_same_tables(tables(out, 0), tables(ref, 0))


def test_a_replacement_takes_its_keys_back(tmp_path, uninterrupted):
    """bpslaunch starts a lost server again (--server-restarts); the new one takes the lost
    one's rank, and its keys move back to it at a round boundary. Server 1 then server 0 are
    lost and replaced, one after the other: the parameters are still bit for bit those of the
    uninterrupted job."""
    r, out = run(tmp_path, "k", "3:1:KILL,4:1:WAIT,8:0:KILL,9:2:WAIT", restarts=3, steps=16)
    text = r.out + r.err
    assert r.rc == 0, text
    assert "REPLACED 1" in text and "REPLACED 2" in text, text
    assert re.search(r"server rank 1 on .* replaces server rank 1 on", text), text
    assert re.search(r"server rank 0 on .* replaces server rank 0 on", text), text
    assert len(re.findall(r"a replacement server joined; its keys moved back", text)) == 2
    assert "restarted server 1 as pid" in text and "restarted server 0 as pid" in text
    ref_dir = tmp_path / "ref16"
    ref_dir.mkdir()
    r2, ref = run(ref_dir, "u", steps=16)
    assert r2.rc == 0, r2.out + r2.err
    assert_same(params(out, 0), params(ref, 0))
    assert_same(params(out, 1), params(ref, 0))


def test_bench_failover_reports_a_real_model_losing_a_server(tmp_path):
    """`python -m byteps_like.bench failover` (the MLP on the CPU, no replacement: whether one
    comes before the last of 16 quick steps is the machine's timing): the loss costs no step
    and the final parameters equal the uninterrupted run's."""
    import json
    import subprocess
    import sys
    out = tmp_path / "f.json"
    r = subprocess.run([sys.executable, "-m", "byteps_like.bench", "failover", "--model", "mlp",
                        "--steps", "16", "--batch", "16", "--server-restarts", "0",
                        "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    rec = json.loads(out.read_text())
    assert rec["steps_lost"] == 0 and rec["max_param_diff"] == 0.0, rec
    assert rec["replaced_at_step"] == -1 and rec["stall_s"] >= 0, rec
    assert "run-to-run |dparam|" in r.stdout


@pytest.mark.parametrize("kills", ["5:scheduler:KILL", "5:scheduler:KILL,25:1:KILL"],
                         ids=["scheduler", "scheduler-then-a-server"])
def test_a_restarted_scheduler_is_found_again(tmp_path, uninterrupted, kills):
    """The scheduler SIGKILLed mid-run: bpslaunch starts it again at the same address
    (--scheduler-restarts), every node registers again with its rank, and the job goes on: no
    data round stops (no data crosses the scheduler), no step is lost, the parameters are bit
    for bit the uninterrupted run's. Then a server lost while the new scheduler gathers the
    nodes, or after (the machine's timing decides which): either way it is lost and its keys
    move."""
    r, out = run(tmp_path, "k", kills, steps=40)
    text = r.out + r.err
    assert r.rc == 0, text
    assert "restarting it (restart 1 of 3)" in text, text
    assert re.search(r"scheduler: restarted: all \d nodes of the job re-registered", text), text
    if "25:1" in kills:
        assert re.search(r"did not register again with the restarted scheduler|"
                         r"scheduler: lost server rank 1 ", text), text
    ref_dir = tmp_path / "ref40"
    ref_dir.mkdir()
    r2, ref = run(ref_dir, "u", steps=40)
    assert r2.rc == 0, r2.out + r2.err
    assert_same(params(out, 0), params(ref, 0))


def test_with_scheduler_restarts_off_a_lost_scheduler_ends_the_job(tmp_path):
    out = tmp_path / "k"
    r = bpslaunch([SCRIPT, str(out), "20", "5:scheduler:KILL"], workers=2, servers=2,
                  timeout=120, extra=["--scheduler-restarts", "0", "--server-restarts", "0"])
    assert r.rc != 0
    assert re.search(r"scheduler \(pid \d+\) failed first: killed by SIGKILL", r.err), r.out + r.err


@pytest.mark.parametrize("survival,kills", [("", ""), ("replicate", "5:1:push")],
                         ids=["plain", "replicated-server-lost"])
def test_tables_with_two_worker_processes_per_machine(tmp_path, survival, kills):
    """BYTEPS_LOCAL_SIZE=2: every worker process pushes and pulls its own rows (the servers
    count processes for the tables: server/table.py Pushers), so 2 machines of 2 processes end
    with the tables of 4 machines of one, bit for bit (Adam), also when a server is lost with
    replication."""
    r, ref = run_tables(tmp_path, "ref", workers=4, optimizer="adam", steps=8)
    assert r.rc == 0, r.out + r.err
    r, out = run_tables(tmp_path, "k", kills, workers=2, local_size=2, optimizer="adam",
                        steps=8, survival=survival)
    text = r.out + r.err
    assert r.rc == 0, text
    assert ("KILLED server 1" in text) == bool(kills), text
    for rank in range(4):
        assert np.array_equal(tables(out, rank)["rows"], tables(ref, 0)["rows"]), rank


def test_asynchronous_parameters_go_back_to_the_lost_servers_snapshot(tmp_path):
    """BYTEPS_ASYNC_SNAPSHOT_SECONDS (server/async_snapshots.py): asynchronous mode keeps the
    model on the servers; each writes its values every 0.2 s, and when server 1 is SIGKILLed the
    server left takes its keys from its newest snapshot before the workers go on. Rank 0 counts
    its own pushes in the answers: the kept keys hold every one, the moved keys every one but
    those the lost server applied after its snapshot (never fewer than the snapshot rank 0
    waited for; starting again from zero would give at most STEPS - KILL); the job ends 0, and
    bpslaunch starts no replacement (its keys would come back without their newest values:
    the scheduler refuses one in an asynchronous job)."""
    env = {"BYTEPS_ENABLE_ASYNC": "1", "BYTEPS_ASYNC_SNAPSHOT_SECONDS": "0.2",
           "BYTEPS_SPARSE_CHECKPOINT_DIR": str(tmp_path / "ck")}
    r = bpslaunch(["tests/faults/workers/lose_server_async.py", "300", "10", "30"], workers=2,
                  servers=2, env=env, timeout=150, extra=["--server-restarts", "1"])
    text = r.out + r.err
    assert r.rc == 0, text
    assert "KILLED server 1" in text, text
    assert re.search(r"server 0: the parameters of lost server 1's 4 key\(s\) go back to its "
                     r"snapshot of [\d.]+ s ago", text), text
    assert "restarted server" not in text, text   # bpslaunch --server-restarts: not here
    # the workers are told how far back the moved keys went
    assert re.search(r"worker 0: the parameters server 1 held went back to its snapshot, "
                     r"[\d.]+ s old when its keys moved", text), text
    low, high = (float(x) for x in re.search(r"FINAL (\S+) (\S+)", text).groups())
    want_low, want_high = (float(x) for x in re.search(r"EXPECT (\S+) (\S+)", text).groups())
    assert want_low <= low <= high <= want_high + 1, text
    assert high == want_high, text   # the keys that stayed lost nothing


def test_asynchronous_mode_without_snapshots_cannot_lose_a_server(tmp_path):
    """Without BYTEPS_ASYNC_SNAPSHOT_SECONDS a lost server ends an asynchronous job, naming it
    (its part of the model is gone), as before."""
    env = {"BYTEPS_ENABLE_ASYNC": "1", "BYTEPS_SPARSE_CHECKPOINT_DIR": str(tmp_path / "ck")}
    r = bpslaunch(["tests/faults/workers/lose_server_async.py", "40", "-1", "30"], workers=2,
                  servers=2, env=env, timeout=150, extra=["--server-restarts", "0"])
    text = r.out + r.err
    assert r.rc != 0, text
    assert re.search(r"server 1 \(pid \d+\) failed: killed by SIGKILL", text), text
