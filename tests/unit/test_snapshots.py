"""Incremental snapshots of table shards (server/snapshots.py): what a chain holds, what a
restore rebuilds, and what the files cost against the rows they hold."""
from __future__ import annotations

import os

import numpy as np
import pytest

from byteps_like.embedding import TableShard, TableSpec
from byteps_like.server import snapshots
from byteps_like.shardfile import TableError


def _rounds(shard: TableShard, rng: np.random.Generator, n: int, touched: int) -> None:
    for _ in range(n):
        ids = np.unique(rng.integers(0, shard.spec.rows, touched)) * shard.shards + shard.shard
        ids = ids[ids < shard.spec.rows]
        shard.apply(ids, rng.standard_normal((len(ids), shard.spec.dim)).astype(np.float32))


def _write_chain(shard: TableShard, folder: str, every: int, rounds: int,
                 rng: np.random.Generator, touched: int = 40) -> dict[int, dict]:
    """``rounds`` rounds on ``shard``, a snapshot every ``every``; the full state at each."""
    writer = snapshots.Writer(lambda: 0)
    states = {}
    try:
        for r in range(every, rounds + 1, every):
            _rounds(shard, rng, every, touched)
            writer.put(os.path.join(folder, f"r{r:010d}.bpst"), shard.spec, shard.shard,
                       shard.shards, shard.take_changes())
            states[r] = shard.state()
        writer.flush()
    finally:
        writer.close()
    return states


@pytest.mark.parametrize("optimizer,kw", [("sgd", {"lr": 0.1}), ("adam", {"lr": 0.01})])
def test_a_restore_rebuilds_the_shard_of_any_round_of_its_chain(tmp_path, optimizer, kw):
    spec = TableSpec.make("t", 1000, 8, optimizer=optimizer, seed=3, **kw)
    shard = TableShard(spec, 1, 3)
    states = _write_chain(shard, str(tmp_path), 3, 12, np.random.default_rng(0))
    assert snapshots.chain(str(tmp_path), 3) == [3, 6, 9, 12]
    for upto in (6, 12):
        again = TableShard(spec, 1, 3)
        again.rows(np.arange(1, 1000, 3))   # rows made since: forgotten by the restore
        snapshots.restore(again, str(tmp_path), 3, upto)
        want, got = states[upto], again.state()
        assert set(got) == set(want)
        for name in want:
            assert np.array_equal(got[name], want[name]), name
    fresh = TableShard(spec, 1, 3)
    snapshots.restore(fresh, str(tmp_path), 3, 0)   # round 0: the initial rows
    assert not fresh.made.any()


def test_a_chain_ends_at_its_first_hole_and_a_restore_past_it_is_refused(tmp_path):
    spec = TableSpec.make("t", 100, 4, seed=1)
    _write_chain(TableShard(spec), str(tmp_path), 2, 8, np.random.default_rng(1))
    os.remove(tmp_path / f"r{6:010d}.bpst")
    assert snapshots.chain(str(tmp_path), 2) == [2, 4]
    assert snapshots.newest_round([str(tmp_path), str(tmp_path / "none")], 2) == 0
    assert snapshots.newest_round([str(tmp_path)], 2) == 4
    with pytest.raises(TableError, match="do not reach round 8"):
        snapshots.restore(TableShard(spec), str(tmp_path), 2, 8)


def test_snapshot_files_cost_little_more_than_the_changed_rows(tmp_path):
    """Each snapshot holds only the rows updated since the previous one: its file is at most
    1.2 x those rows' bytes (ids, weights, optimizer state)."""
    spec = TableSpec.make("big", 200_000, 32, optimizer="adagrad", lr=0.1, seed=2)
    shard = TableShard(spec)
    rng = np.random.default_rng(2)
    changed = written = 0
    for r in (1, 2, 3):
        _rounds(shard, rng, 1, 5_000)
        state = shard.take_changes()
        changed += sum(a.nbytes for a in state.values())
        path = tmp_path / f"r{r:010d}.bpst"
        w = snapshots.Writer(lambda: 0)
        w.put(str(path), spec, 0, 1, state)
        w.flush()
        w.close()
        written += path.stat().st_size
        assert len(state["ids"]) < 5_000 and not shard.changed.any()
    assert written <= 1.2 * changed, (written, changed)
    print(f"snapshot bytes / changed rows' bytes: {written / changed:.4f}")


def test_a_writer_that_cannot_write_says_so_to_whoever_waits(tmp_path):
    spec = TableSpec.make("t", 10, 2, seed=1)
    (tmp_path / "file").write_text("x")
    errors: list = []
    w = snapshots.Writer(lambda: 0)
    w.put(str(tmp_path / "file" / "r.bpst"), spec, 0, 1, TableShard(spec).state(),
          errors.append)
    w.flush()
    w.close()
    assert len(errors) == 1 and "cannot write" in errors[0] and w.failed
