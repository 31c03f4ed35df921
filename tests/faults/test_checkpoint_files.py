"""A damaged checkpoint file on a running job (issue 41, items 4 and 9): each variant is refused
by the servers with an error that names the file, the table and what is wrong -- the audit saw
an "internal error" naming neither, with a traceback, 20 in one run -- the servers keep serving,
their memory budget is back where it was, and a good checkpoint then loads exactly."""
from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from byteps_like.errors import BytePSError

from .cluster import running_cluster

pytestmark = pytest.mark.integration
ROWS, DIM = 4000, 8


def _damage(path: str, kind: str) -> None:
    with open(path, "rb") as f:
        raw = bytearray(f.read())
    if kind == "truncated":
        raw = raw[:len(raw) // 2]
    elif kind == "bit-flipped":
        raw[len(raw) // 2] ^= 0x10
    elif kind == "empty":
        raw = bytearray()
    else:  # another format
        raw = bytearray(b"PK\x03\x04" + bytes(100))
    with open(path, "wb") as f:
        f.write(raw)


def test_damaged_checkpoint_files_are_refused_naming_file_and_table(tmp_path):
    kinds = ["truncated", "bit-flipped", "empty", "wrong-format"]
    tables = {}

    def run(w):
        t = tables[w.rank()] = w.sparse.create("emb", ROWS, DIM, init="uniform", seed=3,
                                               optimizer="adagrad", lr=0.1)
        ids = np.arange(w.rank(), ROWS, 7)
        t.pull(ids)
        t.push(ids, np.ones((len(ids), DIM), np.float32))
        t.save("good")
        return t.pull(np.arange(ROWS))

    extra = {"BYTEPS_SPARSE_CHECKPOINT_DIR": str(tmp_path)}
    with running_cluster(workers=2, servers=2, extra=extra) as c:
        want = c.run_all(run)[0]
        assert not isinstance(want, BaseException), want
        held = [s.store_bytes() for s in c.servers]
        for kind in kinds:
            shutil.copytree(tmp_path / "good", tmp_path / kind)
            _damage(str(tmp_path / kind / "emb.shard1of2.bpst"), kind)

        def loads(w):
            t, errors = tables[w.rank()], []
            for kind in kinds:
                try:
                    t.load(kind)
                    errors.append(None)
                except BytePSError as exc:
                    errors.append(str(exc))
            t.load("good")
            return errors, t.pull(np.arange(ROWS))
        results = c.run_all(loads)
        assert [s.store_bytes() for s in c.servers] == held
    for r in results:
        assert not isinstance(r, BaseException), r
        errors, got = r
        for kind, msg in zip(kinds, errors):
            assert msg is not None, f"{kind}: loaded"
            assert os.path.join(kind, "emb.shard1of2.bpst") in msg, msg
            assert "table 'emb'" in msg and "internal" not in msg, msg
            assert ("damaged" in msg or "empty" in msg or "older byteps_like" in msg), msg
        assert np.array_equal(got, want)
