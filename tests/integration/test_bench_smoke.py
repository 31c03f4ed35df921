"""Smoke tests of ``python -m byteps_like.bench``: tiny sizes, real processes on loopback.

Each run is a subprocess in its own session under a watchdog: on a hang the whole process group
is killed and the test fails with everything the benchmark printed.
"""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

COLUMNS = ["size", "bps time ms", "bps GB/s", "raw zmq GB/s", "bps/raw", "gloo GB/s", "bps/gloo"]
HAS_TORCH = importlib.util.find_spec("torch") is not None


def bench(*args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "byteps_like.bench", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, stdin=subprocess.DEVNULL)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # SIGTERM first: the benchmark then kills its own children's process groups
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        pytest.fail(f"watchdog: {' '.join(cmd)} hung for {timeout} s and was killed\n"
                    f"--- stdout ---\n{out}\n--- stderr ---\n{err}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def dump(r: subprocess.CompletedProcess) -> str:
    return f"exit {r.returncode}\n--- stdout ---\n{r.stdout}\n--- stderr ---\n{r.stderr}"


def parse_table(stdout: str) -> list[dict[str, str]]:
    lines = [ln for ln in stdout.splitlines() if ln.startswith("|")]
    assert len(lines) >= 3, stdout
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header == COLUMNS, header
    assert set(lines[1]) <= set("|-:"), lines[1]
    return [dict(zip(header, (c.strip() for c in ln.strip("|").split("|")))) for ln in lines[2:]]


def numeric(row: dict[str, str], *cols: str) -> None:
    for c in cols:
        value = float(row[c])  # raises on n/a or garbage
        assert value > 0, (c, row)


def test_pushpull_smoke_without_gloo(tmp_path):
    out = tmp_path / "bench.json"
    r = bench("pushpull", "--sizes", "64K,1M", "--repeats", "1", "--warmup", "0",
              "--skip-gloo", "--json", str(out))
    assert r.returncode == 0, dump(r)
    rows = parse_table(r.stdout)
    assert [row["size"] for row in rows] == ["64KiB", "1MiB"], r.stdout
    for row in rows:
        numeric(row, "bps time ms", "bps GB/s", "raw zmq GB/s", "bps/raw")
        assert row["gloo GB/s"] == "n/a" and row["bps/gloo"] == "n/a", row
    assert "command: python -m byteps_like.bench pushpull" in r.stdout
    assert "nproc=" in r.stdout and "pyzmq" in r.stdout
    assert "[pushpull] byteps_like: done" in r.stderr, r.stderr
    data = json.loads(out.read_text())
    assert [x["nbytes"] for x in data["results"]] == [65536, 1 << 20]
    assert data["results"][0]["bps"]["median_s"] > 0 and data["results"][0]["gloo"] is None


@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
def test_pushpull_smoke_with_gloo():
    r = bench("pushpull", "--sizes", "64K", "--repeats", "2", "--warmup", "1",
              "--workers", "2", "--servers", "1", timeout=180)
    assert r.returncode == 0, dump(r)
    (row,) = parse_table(r.stdout)
    assert row["size"] == "64KiB"
    numeric(row, *COLUMNS[1:])


def test_pushpull_child_failure_exits_nonzero_with_its_stderr():
    # 100-byte partitions are below BYTEPS_PARTITION_BYTES's minimum: every role refuses to start
    r = bench("pushpull", "--sizes", "64K", "--repeats", "1", "--warmup", "0", "--skip-gloo",
              "--partition-bytes", "100", timeout=60)
    assert r.returncode != 0, dump(r)
    assert "byteps_like failed" in r.stderr and "BYTEPS_PARTITION_BYTES" in r.stderr, dump(r)
    assert not any(ln.startswith("|") for ln in r.stdout.splitlines()), r.stdout


def test_bench_dispatcher():
    r = bench("nonsense", timeout=30)
    assert r.returncode == 2 and "unknown benchmark 'nonsense'" in r.stderr, dump(r)
    r = bench("--help", timeout=30)
    assert r.returncode == 0 and "pushpull" in r.stdout and "sum" in r.stdout, dump(r)
    r = bench("pushpull", "--help", timeout=30)
    assert r.returncode == 0 and "--partition-bytes" in r.stdout, dump(r)
    if importlib.util.find_spec("byteps_like.bench.summation") is not None:
        r = bench("sum", "--help", timeout=30)
        assert r.returncode == 0, dump(r)
