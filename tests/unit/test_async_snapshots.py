"""The asynchronous mode's snapshot files (server/async_snapshots.py): what is written is read
back; a damaged, truncated, foreign or oversized file is refused by name before its values are
used."""
from __future__ import annotations

import os
import struct

import pytest

from byteps_like.server.async_snapshots import MAGIC, SnapshotError, path_for, read, write


def _values() -> list[tuple[int, int, bytes]]:
    return [(3, 0, bytes(range(16))), (1 << 40, 0, b""), (7, 2, bytes(range(250)) * 4)]


def test_a_snapshot_reads_back_as_written(tmp_path):
    path = path_for(str(tmp_path), 1234, 1)
    n = write(path, 1234, 1, _values(), 99.5)
    assert os.path.getsize(path) == n and oct(os.stat(path).st_mode & 0o777) == "0o600"
    head, values = read(path, n)
    assert head["job"] == 1234 and head["rank"] == 1 and head["time"] == 99.5
    assert values == {k: (d, v) for k, d, v in _values()}
    assert [p for p in os.listdir(os.path.dirname(path))] == ["server1.bpsa"]  # no temporary


@pytest.mark.parametrize("damage,words", [
    ("flip", "checksum mismatch"), ("truncate", "checksum mismatch"),
    ("short", "not an asynchronous snapshot"), ("magic", "not an asynchronous snapshot"),
    ("header", "header of"), ("offset", "is not in the file")])
def test_a_damaged_snapshot_is_refused_naming_it(tmp_path, damage, words):
    import hashlib
    import json
    path = path_for(str(tmp_path), 1, 0)
    write(path, 1, 0, _values(), 1.0)
    with open(path, "rb") as f:
        raw = bytearray(f.read())
    if damage == "flip":
        raw[len(raw) // 2] ^= 1
    elif damage == "truncate":
        del raw[-40:]
    elif damage == "short":
        raw = raw[:10]
    elif damage == "magic":
        raw[:8] = b"NOTASNAP"
    else:   # a consistent checksum over a header that lies
        head = json.dumps({"format": 1, "keys": [[3, 0, 0, 99999]]}).encode()
        hlen = 1 << 30 if damage == "header" else len(head)
        body = MAGIC + struct.pack("<I", hlen) + head + b"x" * 16
        raw = bytearray(body + hashlib.sha256(body).digest())
    with open(path, "wb") as f:
        f.write(raw)
    with pytest.raises(SnapshotError, match=words) as err:
        read(path, 1 << 20)
    assert path in str(err.value)


def test_a_snapshot_over_the_budget_is_refused_before_it_is_read(tmp_path):
    path = path_for(str(tmp_path), 1, 0)
    n = write(path, 1, 0, _values(), 1.0)
    with pytest.raises(SnapshotError, match=f"{n} bytes, over the {n - 1}"):
        read(path, n - 1)
    with pytest.raises(SnapshotError, match="No such file"):
        read(str(tmp_path / "missing.bpsa"), n)
