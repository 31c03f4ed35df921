"""Smoke test of ``python -m byteps_like.bench local``: a tiny run (L=2, 64 KiB, 1 repeat) with
real processes on loopback, in its own session under a watchdog."""
from __future__ import annotations

import functools
import json
import os

import pytest

from .bench_run import bench as _bench
from .bench_run import dump

pytestmark = pytest.mark.integration
bench = functools.partial(_bench, timeout=150.0)  # this file's watchdog default

COLUMNS = ["L", "size", "push_pull ms", "algbw GB/s", "single-process ms", "overhead ms",
           "local red. GB/s", "memcpy GB/s", "ratio to memcpy"]
HOST_COLUMNS = ["size", "memcpy ms", "memcpy GB/s", "numpy add ms", "numpy add GB/s"]


def tables(stdout: str) -> list[list[dict[str, str]]]:
    """Every markdown table in the output, as rows of {column: cell}."""
    found, block = [], []
    for line in stdout.splitlines() + [""]:
        if line.startswith("|"):
            block.append(line)
            continue
        if block:
            header = [c.strip() for c in block[0].strip("|").split("|")]
            assert len(block) >= 3 and set(block[1]) <= set("|-:"), block
            found.append([dict(zip(header, (c.strip() for c in ln.strip("|").split("|"))))
                          for ln in block[2:]])
            assert all(len(row) == len(header) for row in found[-1]), block
            block = []
    return found


def test_bench_local_tiny(tmp_path):
    out = tmp_path / "local.json"
    r = bench("local", "--local-sizes", "2", "--sizes", "64K", "--repeats", "1", "--warmup", "0",
              "--json", str(out))
    assert r.returncode == 0, dump(r)
    found = tables(r.stdout)
    assert len(found) >= 2, r.stdout
    (row,) = found[0]
    assert list(row) == COLUMNS, r.stdout
    assert row["L"] == "2" and row["size"] == "64KiB", row
    for c in ("push_pull ms", "algbw GB/s", "single-process ms", "memcpy GB/s"):
        assert float(row[c]) > 0, (c, row)
    float(row["overhead ms"])  # may be negative within noise
    for c in ("local red. GB/s", "ratio to memcpy"):
        assert row[c] == "n/a" or float(row[c]) > 0, (c, row)
    (host,) = found[1]
    assert list(host) == HOST_COLUMNS and host["size"] == "64KiB", r.stdout
    assert float(host["memcpy GB/s"]) > 0 and float(host["numpy add GB/s"]) > 0, host
    assert "overhead ms" in r.stdout and "(a) - (b)" in r.stdout  # the columns are explained
    assert "GPU section skipped:" in r.stdout or "GPU section (" in r.stdout, r.stdout
    data = json.loads(out.read_text())
    (res,) = data["results"]
    assert res["local_size"] == 2 and res["nbytes"] == 65536
    assert len(res["pushpull"]["per_worker_s"]) == 2  # both local ranks reported
    assert res["pushpull"]["median_s"] > 0 and res["single"]["median_s"] > 0
    # every rank unlinks its shared-memory segments (bpsl-<job>-<port>-m<machine>-t<tensor>)
    port = data["scheduler_ports"]["L=2"]
    if os.path.isdir("/dev/shm"):
        left = [f for f in os.listdir("/dev/shm") if f.startswith("bpsl-")
                and f"-{port}-m" in f]
        assert not left, left


def test_bench_local_rejects_bad_options():
    r = bench("local", "--local-sizes", "0", timeout=30)
    assert r.returncode == 2 and "--local-sizes" in r.stderr, dump(r)
    r = bench("local", "--help", timeout=30)
    assert r.returncode == 0 and "ratio to memcpy" in r.stdout, dump(r)
