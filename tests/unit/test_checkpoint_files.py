"""Checkpoint files of server-held tables are data, not trust (issue 41, item 4): every damaged
variant the audit tried -- truncated, bit-flipped, empty, another format, a decompression bomb,
NaN/inf rows, repeated ids -- is refused with an error naming the file, the table and what is
wrong (it was an "internal error" with a traceback, naming neither), before anything is
allocated for it, with the shard untouched; NaN/inf rows and repeated ids load without those
rows under BYTEPS_SPARSE_CHECKPOINT_REPAIR=drop. Files are written 0600 and atomically."""
from __future__ import annotations

import json
import os
import stat
import tracemalloc
import zipfile

import numpy as np
import pytest

from byteps_like import shardfile
from byteps_like.embedding import TableError, TableShard, TableSpec, load_shard, save_shard

ROWS, DIM = 1000, 8


def _table(opt: str = "adam") -> TableSpec:
    return TableSpec.make("user/emb", ROWS, DIM, optimizer=opt, lr=0.01)


def _saved(tmp_path, opt: str = "adam", shards: int = 1) -> list[str]:
    spec = _table(opt)
    paths = []
    for s in range(shards):
        shard = TableShard(spec, s, shards)
        ids = np.arange(s, ROWS, shards)[:50]
        shard.apply(ids, np.random.default_rng(s).normal(size=(50, DIM)).astype(np.float32))
        paths.append(save_shard(shard, str(tmp_path), "t"))
    return paths


def _fresh(opt: str = "adam") -> TableShard:
    shard = TableShard(_table(opt), 0, 1)
    shard.apply(np.array([7]), np.ones((1, DIM), np.float32))  # something a failed load keeps
    return shard


def _refused(tmp_path, shard: TableShard, words: str, **kw) -> str:
    before = (shard.made.copy(), shard.weights.copy())
    with pytest.raises(TableError) as ei:
        load_shard(shard, str(tmp_path), "t", **kw)
    msg = str(ei.value)
    assert "user%2femb.shard0of1.bpst" in msg and "table 'user/emb'" in msg, msg
    assert words in msg, msg
    assert np.array_equal(shard.made, before[0]) and np.array_equal(shard.weights, before[1])
    return msg


def _rewrite(path: str, fn) -> None:
    with open(path, "rb") as f:
        raw = bytearray(f.read())
    with open(path, "wb") as f:
        f.write(fn(raw))


def test_a_saved_file_is_0600_in_a_0700_folder_with_no_temporary_left(tmp_path):
    (path,) = _saved(tmp_path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    assert os.listdir(os.path.dirname(path)) == [os.path.basename(path)]
    shard = _fresh()
    assert load_shard(shard, str(tmp_path), "t") == 50


def test_a_save_that_fails_leaves_the_last_file_and_no_temporary(tmp_path, monkeypatch):
    (path,) = _saved(tmp_path)
    with open(path, "rb") as f:
        good = f.read()

    def broken(fd):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(shardfile.os, "fsync", broken)
    shard = TableShard(_table(), 0, 1)
    shard.apply(np.arange(10), np.ones((10, DIM), np.float32))
    with pytest.raises(OSError, match="No space"):
        save_shard(shard, str(tmp_path), "t")
    with open(path, "rb") as f:
        assert f.read() == good
    assert os.listdir(os.path.dirname(path)) == [os.path.basename(path)]


@pytest.mark.parametrize("cut", ["half", "header", "one byte", "checksum"])
def test_a_truncated_file_is_refused(tmp_path, cut):
    (path,) = _saved(tmp_path)
    size = os.path.getsize(path)
    keep = {"half": size // 2, "header": 10, "one byte": size - 1, "checksum": size - 32}[cut]
    _rewrite(path, lambda raw: raw[:keep])
    msg = _refused(tmp_path, _fresh(), "damaged")
    assert "Traceback" not in msg


@pytest.mark.parametrize("where", ["payload", "checksum", "header"])
def test_a_bit_flipped_file_is_refused(tmp_path, where):
    (path,) = _saved(tmp_path)
    size = os.path.getsize(path)

    def flip(raw: bytearray) -> bytearray:
        hlen = int.from_bytes(raw[8:12], "little")
        at = {"payload": 12 + hlen + 123, "checksum": size - 5, "header": 12 + hlen // 2}[where]
        raw[at] ^= 0x04
        return raw
    _rewrite(path, flip)
    _refused(tmp_path, _fresh(), "damaged" if where != "header" else "")


def test_an_empty_file_is_refused(tmp_path):
    (path,) = _saved(tmp_path)
    _rewrite(path, lambda raw: b"")
    _refused(tmp_path, _fresh(), "the file is empty")


@pytest.mark.parametrize("content,words", [
    (b"\x93NUMPY" + bytes(200), "not a table checkpoint shard"),
    (json.dumps({"format": 2}).encode(), "not a table checkpoint shard"),
    # a header a JSON parser recurses into until it gives up
    (shardfile.MAGIC + (200_000).to_bytes(4, "little") + b"[" * 200_000 + bytes(100),
     "its header is not readable JSON"),
    (shardfile.MAGIC + (5).to_bytes(4, "little") + b"[1,2]" + bytes(100),
     "its header is not a JSON object"),
])
def test_a_file_of_another_format_is_refused(tmp_path, content, words):
    (path,) = _saved(tmp_path)
    _rewrite(path, lambda raw: content)
    _refused(tmp_path, _fresh(), words)


def test_a_header_of_another_version_or_table_or_shard_is_refused(tmp_path):
    spec = _table()
    shard = TableShard(spec, 0, 1)
    state = shard.state()
    path = os.path.join(tmp_path, "t", "user%2femb.shard0of1.bpst")
    shardfile.write(path, {**spec.to_json(), "dim": DIM + 1}, 0, 1, state)
    _refused(tmp_path, _fresh(), "not the table being loaded")
    shardfile.write(path, spec.to_json(), 1, 2, state)  # renamed from another shard
    _refused(tmp_path, _fresh(), "it says it is shard 1 of 2")

    def version(raw: bytearray) -> bytes:
        hlen = int.from_bytes(raw[8:12], "little")
        head = raw[12:12 + hlen].replace(b'"format":2', b'"format":9')
        return bytes(raw[:12] + head + raw[12 + hlen:])
    shardfile.write(path, spec.to_json(), 0, 1, state)
    _rewrite(path, version)
    _refused(tmp_path, _fresh(), "format version 9; this byteps_like reads version 2")


def test_a_header_claiming_more_rows_than_the_file_holds_allocates_nothing(tmp_path):
    """The reader's own decompression bomb: a small file whose header claims 50M rows of dim 64
    with Adam's state (39 GB): the size check refuses it before any array exists."""
    spec = TableSpec.make("user/emb", 50_000_000, 64, optimizer="adam")
    path = os.path.join(tmp_path, "t", "user%2femb.shard0of1.bpst")
    shard = TableShard(spec, 0, 1)
    shardfile.write(path, spec.to_json(), 0, 1, shard.state())  # 0 rows

    def claim(raw: bytearray) -> bytes:
        hlen = int.from_bytes(raw[8:12], "little")
        head = json.loads(raw[12:12 + hlen])
        head["rows"] = 50_000_000
        head["arrays"] = shardfile.expected_arrays(["m", "v", "t"], 50_000_000, 64)
        new = json.dumps(head, separators=(",", ":"), sort_keys=True).encode()
        return bytes(raw[:8] + len(new).to_bytes(4, "little") + new + raw[12 + hlen:])
    _rewrite(path, claim)
    tracemalloc.start()
    try:
        with pytest.raises(TableError, match=r"truncated: the file has \d+ bytes, its header "
                                             r"describes \d+ \(50000000 rows of dim 64\)"):
            load_shard(shard, str(tmp_path), "t")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, peak  # it described 38 GB


def test_an_old_npz_file_and_a_decompression_bomb_are_refused_before_decompressing(tmp_path):
    """The previous format (an .npz zip): refused with what to do; a 256 MiB member compressed
    into a small file (the audit: +430-490 MB per server while loading) is never opened."""
    folder = tmp_path / "t"
    folder.mkdir()
    bomb = folder / "user%2femb.shard0of1.npz"
    with zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as z:
        with z.open("weights.npy", "w", force_zip64=True) as member:
            zeros = bytes(1 << 20)
            for _ in range(256):
                member.write(zeros)
    assert os.path.getsize(bomb) < 1 << 20
    tracemalloc.start()
    try:
        msg = str(pytest.raises(TableError, load_shard, _fresh(), str(tmp_path), "t").value)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "older byteps_like" in msg and "python -m byteps_like.shardfile convert" in msg, msg
    assert peak < 4 << 20, peak
    # the same file under the new name: its magic says what it is
    os.rename(bomb, folder / "user%2femb.shard0of1.bpst")
    _refused(tmp_path, _fresh(), "older byteps_like")


def test_an_old_npz_checkpoint_converts_once_and_loads(tmp_path):
    spec = _table("adagrad")
    shard = TableShard(spec, 0, 1)
    shard.apply(np.arange(20), np.ones((20, DIM), np.float32))
    folder = tmp_path / "t"
    folder.mkdir()
    spec_bytes = np.frombuffer(json.dumps(spec.to_json()).encode(), np.uint8)
    np.savez(folder / "user%2femb.shard0of1.npz", spec=spec_bytes, **shard.state())
    assert shardfile.main(["convert", str(folder)]) == 0
    fresh = TableShard(spec, 0, 1)
    assert load_shard(fresh, str(tmp_path), "t") == 20
    assert np.array_equal(fresh.rows(np.arange(20)), shard.rows(np.arange(20)))


def _with_bad_rows(tmp_path, kind: str) -> TableShard:
    spec = _table()
    shard = TableShard(spec, 0, 1)
    shard.apply(np.arange(40), np.ones((40, DIM), np.float32))
    state = shard.state()
    if kind == "nan":
        state["weights"][5, 3] = np.nan
    elif kind == "inf state":
        state["v"][9, 0] = np.inf
    else:  # a repeated id
        state["ids"][12] = state["ids"][11]
    path = os.path.join(tmp_path, "t", "user%2femb.shard0of1.bpst")
    shardfile.write(path, spec.to_json(), 0, 1, state)  # a valid checksum: the numbers are bad
    return shard


@pytest.mark.parametrize("kind,words,left_out", [
    ("nan", "1 row(s) hold NaN or inf (the first: row 5)", [5]),
    ("inf state", "1 row(s) hold NaN or inf (the first: row 9)", [9]),
    ("repeated id", "1 row id(s) appear more than once (the first: 11)", [11, 12])])
def test_nan_rows_and_repeated_ids_are_refused_or_dropped_by_policy(tmp_path, kind, words,
                                                                    left_out):
    saved = _with_bad_rows(tmp_path, kind)
    msg = _refused(tmp_path, _fresh(), words)
    assert "BYTEPS_SPARSE_CHECKPOINT_REPAIR=drop" in msg, msg
    shard = _fresh()
    assert load_shard(shard, str(tmp_path), "t", repair="drop") == 40 - len(left_out)
    keep = np.setdiff1d(np.arange(40), left_out)
    assert np.array_equal(shard.rows(keep), saved.rows(keep))
    fresh = TableShard(_table(), 0, 1)
    assert np.array_equal(shard.rows(np.array(left_out)), fresh.rows(np.array(left_out)))
    assert np.isfinite(shard.weights).all() and np.isfinite(shard.v).all()


def test_a_load_charges_the_budget_while_it_reads_and_gives_it_back(tmp_path):
    _saved(tmp_path, shards=2)
    held = []

    def charge(n: int) -> bool:
        if n > 0 and sum(held) + n > budget:
            return False
        held.append(n)
        return True
    budget = 1 << 30
    shard = TableShard(_table(), 0, 1)
    assert load_shard(shard, str(tmp_path), "t", charge=charge) == 100
    assert sum(held) == 0 and max(held) == 50 * (8 + 4 * DIM * 3 + 4)
    budget, held = 60 * (8 + 4 * DIM * 3 + 4), []   # room for one file's rows, not two
    msg = str(pytest.raises(TableError, load_shard, _fresh(), str(tmp_path), "t",
                            charge=charge).value)
    assert "do not fit in the server's memory budget (BYTEPS_SERVER_MAX_BYTES)" in msg, msg
    assert "shard1of2" in msg and sum(held) == 0
