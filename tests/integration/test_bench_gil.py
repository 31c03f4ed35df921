"""Smoke tests of ``python -m byteps_like.bench gil``: tiny tensors, short windows, real
processes on loopback (ephemeral ports), each run in its own session under a watchdog. No timing
is asserted, only that every phase ran, produced positive rates and agreed across workers."""
from __future__ import annotations

import argparse
import functools
import json

import pytest

from .bench_run import bench as _bench
from .bench_run import dump, parse_table

pytestmark = pytest.mark.integration
bench = functools.partial(_bench, timeout=60.0)  # this file's watchdog default

COLUMNS = ["size", "pp alone GB/s", "pp busy-main GB/s", "pp ratio", "pp busy-proc GB/s",
           "proc ratio", "loop alone M/s", "loop w/ comm M/s", "loop ratio", "proc loop ratio"]
TINY = ["--seconds", "0.3", "--warmup-seconds", "0.05", "--repeat", "1"]


def positive(*values) -> None:
    for v in values:
        assert v is not None and float(v) > 0, values


def test_gil_one_worker_tiny(tmp_path):
    out = tmp_path / "gil.json"
    r = bench("gil", "--sizes", "64K,0.25", *TINY, "--json", str(out))
    assert r.returncode == 0, dump(r)
    rows = parse_table(r.stdout, COLUMNS)
    assert [row["size"] for row in rows] == ["64KiB", "256KiB"], r.stdout
    for row in rows:
        positive(*(row[c] for c in COLUMNS[1:]))
    assert "w/ comm / alone" in r.stdout   # the columns are explained
    assert "[gil] done" in r.stderr, r.stderr
    data = json.loads(out.read_text())
    assert data["workers"] == 1 and data["servers"] == 1 and data["control"] is True
    # one worker machine still goes through the server (the benchmark forces it)
    assert data["per_worker"][0]["bytes_pushed"] > 0, data["per_worker"][0]
    assert data["command"].startswith("python -m byteps_like.bench gil")
    assert [x["nbytes"] for x in data["results"]] == [65536, 262144]
    assert 0 < data["worker_switch_interval_s"] <= 1
    assert "workers' thread switch interval" in r.stdout
    for res in data["results"]:
        med = res["median"]
        positive(med["pp_alone_gbps"], med["pp_busy_main_gbps"], med["pp_busy_process_gbps"],
                 med["loop_alone_per_s"], med["loop_with_comm_per_s"],
                 med["spinner_with_comm_per_s"], res["pp_ratio"], res["proc_ratio"],
                 res["loop_ratio"], res["proc_loop_ratio"])
        assert res["repeat"] == 1 and len(res["pp_alone_gbps"]) == 1
        for phase in ("comm_alone", "busy_main", "busy_process"):
            (rounds,) = res["rounds"][phase]          # one worker
            assert rounds[0] >= 1, (phase, rounds)


def test_gil_two_workers_run_the_same_rounds(tmp_path):
    out = tmp_path / "gil.json"
    r = bench("gil", "--workers", "2", "--sizes", "64K", *TINY, "--skip-control",
              "--json", str(out))
    assert r.returncode == 0, dump(r)
    (row,) = parse_table(r.stdout, COLUMNS)
    positive(row["pp alone GB/s"], row["pp busy-main GB/s"], row["loop alone M/s"],
             row["loop w/ comm M/s"])
    assert row["pp busy-proc GB/s"] == "n/a" and row["proc ratio"] == "n/a", row
    assert row["proc loop ratio"] == "n/a", row
    data = json.loads(out.read_text())
    (res,) = data["results"]
    assert len(data["per_worker"]) == 2 and "busy_process" not in res["rounds"]
    for phase in ("comm_alone", "busy_main"):
        w0, w1 = res["rounds"][phase]
        assert w0 == w1, (phase, w0, w1)   # agreed through the summed stop votes


def test_gil_rejects_bad_options():
    r = bench("gil", "--sizes", "3B", timeout=30)
    assert r.returncode == 2 and "size '3B'" in r.stderr, dump(r)
    r = bench("gil", "--repeat", "0", timeout=30)
    assert r.returncode == 2 and "--repeat" in r.stderr, dump(r)
    r = bench("gil", "--help", timeout=30)
    assert r.returncode == 0 and "loop ratio" in r.stdout and "--seconds" in r.stdout, dump(r)


def test_spin_and_window_accounting():
    import threading
    import time

    from byteps_like.bench.gil import bytes_in_window, parse_mib, spin
    assert parse_mib("4") == 4 << 20 and parse_mib("0.25") == 256 << 10
    assert parse_mib("64K") == 64 << 10 and parse_mib("1M") == 1 << 20
    for bad in ("0", "3B", "x", "-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_mib(bad)
    # rounds [0,1], [1,2], [2,3] of 100 bytes; window [0.5, 2.5]: half, all, half
    spans = [(0.0, 1.0), (1.0, 2.0), (2.0, 3.0)]
    assert bytes_in_window(spans, 0.5, 2.5, 100) == pytest.approx(200)
    assert bytes_in_window(spans, 3.0, 4.0, 100) == 0
    done = threading.Event()
    done.set()
    assert spin(time.perf_counter() + 10, done) == 0   # stops at once when told
    assert spin(time.perf_counter() + 0.01) > 0
