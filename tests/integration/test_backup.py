"""Backup workers (BYTEPS_BACKUP_WORKERS; docs/reliability.md, "Backup workers") on real local
clusters: rounds complete without the slow worker's push, its late pushes are dropped and
counted, it catches up with the same sums in the same order, every worker's sequence of
averages and final model are the same bits, a worker too far behind is named in an error, and
b=0 waits for everyone as before. The slow worker waits for the others' progress (files), not
for a time: a job whose rounds still wait for it fails at that gate instead of hanging."""
from __future__ import annotations

import re

import pytest

from .harness import bpslaunch, worker

pytestmark = pytest.mark.integration

PARTS = 5  # 70001 float32 in partitions of 64 KiB (BYTEPS_PARTITION_BYTES=64K)


def run_job(tmp_path, *, steps: int, gate: int, sleep: float = 0.0, backup: int = 1,
            servers: int = 1, slow: int = 2, local_size: int = 1, **env: str):
    base = {"BYTEPS_PARTITION_BYTES": "64K", "BYTEPS_BACKUP_WORKERS": str(backup),
            "BYTEPS_SERVER_FAILOVER": "0", "BYTEPS_LOG_LEVEL": "INFO", **env}
    return bpslaunch(worker("backup_check.py", steps, slow, gate, sleep, tmp_path),
                     workers=3, servers=servers, env=base, timeout=180, local_size=local_size)


def per_rank(run, tag: str) -> dict[int, str]:
    out = {}
    for line in run.lines(f"{tag} rank"):
        m = re.search(rf"{tag} rank (\d+): (\S*)", line)
        assert m, line
        out[int(m.group(1))] = m.group(2)
    return out


def values(run) -> dict[int, list[float]]:
    return {r: [float(v) for v in text.split(",")] for r, text in per_rank(run, "VALS").items()}


def server_counts(run) -> tuple[int, int]:
    """(rounds completed without every push, late pushes dropped), all servers together."""
    short = late = 0
    for line in [ln for ln in run.err.splitlines() if "backup workers (BYTEPS_BACKUP" in ln]:
        m = re.search(r"(\d+) rounds completed without every worker's push, (\d+) late pushes",
                      line)
        assert m, line
        short, late = short + int(m.group(1)), late + int(m.group(2))
    return short, late


@pytest.mark.parametrize("servers", [1, 2])
def test_rounds_complete_without_the_straggler_and_it_catches_up(tmp_path, servers):
    """The two fast workers complete all 6 rounds while the slow one has pushed none (it
    waits for their sixth step); then its 6 push_pulls return the kept sums at once, its pushes
    dropped. Every rank saw the average of ranks 0 and 1 in every round, the same bits."""
    steps = 6
    run = run_job(tmp_path, steps=steps, gate=steps, servers=servers)
    assert run.rc == 0, run.log
    assert run.lines("GATE rank 2: the others completed 6 steps without it"), run.log
    seq = per_rank(run, "SEQ")
    assert sorted(seq) == [0, 1, 2] and len(set(seq.values())) == 1, run.log
    vals = values(run)
    assert all(v == [1.5 * (s + 1) for s in range(steps)] for v in vals.values()), vals
    assert server_counts(run) == (steps * PARTS, steps * PARTS), run.log


def test_several_processes_per_machine_average_alike(tmp_path):
    """3 machines of 2 local ranks; machine 0 (ranks 0 and 1) is the slow one: the others
    complete 4 rounds without it. Every one of the 6 ranks, the local ranks that get the sum
    from their machine's root included, divides by the same count: the mean of ranks 2-5."""
    steps = 4
    run = run_job(tmp_path, steps=steps, gate=steps, slow=0, local_size=2)
    assert run.rc == 0, run.log
    seq = per_rank(run, "SEQ")
    assert sorted(seq) == list(range(6)) and len(set(seq.values())) == 1, run.log
    vals = values(run)
    assert all(v == [4.5 * (s + 1) for s in range(steps)] for v in vals.values()), vals
    assert server_counts(run) == (steps * PARTS, steps * PARTS), run.log


def test_the_torch_plugin_fused_gradients_and_broadcast(tmp_path):
    """DistributedOptimizer with BYTEPS_BACKUP_WORKERS=1: the broadcast waits for every rank
    (different initial weights become rank 0's); ranks 0 and 1 complete their 5 steps without
    rank 2, whose fused gradient pushes are all late; every rank ends with the same weights."""
    steps = 5
    run = bpslaunch(worker("backup_torch.py", steps, tmp_path), workers=3, servers=1,
                    env={"BYTEPS_BACKUP_WORKERS": "1", "BYTEPS_SERVER_FAILOVER": "0",
                         "BYTEPS_LOG_LEVEL": "INFO"}, timeout=180)
    assert run.rc == 0, run.log
    params = per_rank(run, "PARAMS")
    assert sorted(params) == [0, 1, 2] and len(set(params.values())) == 1, run.log
    short, late = server_counts(run)
    assert short == late and late >= steps, run.log  # every step's fused keys, all late


def test_a_sleeping_straggler_every_rank_applies_the_same_sums(tmp_path):
    """Rank 2 sleeps every step and falls behind by 3 rounds first: whichever rounds
    completed without whom, every rank's averages and final model are the same bits, and each
    average is the mean of two or three ranks' gradients."""
    steps = 12
    run = run_job(tmp_path, steps=steps, gate=3, sleep=0.05)
    assert run.rc == 0, run.log
    seq = per_rank(run, "SEQ")
    assert sorted(seq) == [0, 1, 2] and len(set(seq.values())) == 1, run.log
    vals = values(run)
    assert len({tuple(v) for v in vals.values()}) == 1, vals
    means = {1.5, 2.0, 2.5}  # ranks {0,1}, {0,2} or {0,1,2}, {1,2}: gradients rank + 1
    for s, v in enumerate(vals[0]):
        assert any(v == m * (s + 1) for m in means), (s, v)
    assert v_first_rounds_without_rank2(vals[0]), vals[0]
    short, late = server_counts(run)
    assert short >= 3 * PARTS and late >= 3 * PARTS, run.log


def v_first_rounds_without_rank2(v: list[float]) -> bool:
    return v[:3] == [1.5, 3.0, 4.5]


def test_a_worker_behind_more_than_the_bound_is_named(tmp_path):
    """BYTEPS_BACKUP_MAX_LAG=2: the slow worker asks for round 0 when 6 rounds completed
    without it; its push_pull raises FellBehindError naming its rank, host, the tensor and
    how far behind it is, never a silently different model."""
    run = run_job(tmp_path, steps=6, gate=6, BYTEPS_BACKUP_MAX_LAG="2")
    assert run.rc != 0, run.log
    err = [ln for ln in run.log.splitlines() if "FellBehindError" in ln]
    assert err, run.log
    text = err[-1]
    assert "worker rank 2 (host 127.0.0.1)" in text, text
    assert "'grad'" in text and "5 rounds behind" in text, text
    assert "BYTEPS_BACKUP_MAX_LAG" in text, text


def test_no_backup_waits_for_every_worker(tmp_path):
    """b=0: every round is the average of all three ranks (the slow one sleeps; nobody
    skips it), no round is short, nothing is dropped."""
    steps = 4
    run = run_job(tmp_path, steps=steps, gate=0, sleep=0.05, backup=0)
    assert run.rc == 0, run.log
    vals = values(run)
    assert all(v == [2.0 * (s + 1) for s in range(steps)] for v in vals.values()), vals
    assert "backup workers (BYTEPS_BACKUP" not in run.err, run.log
