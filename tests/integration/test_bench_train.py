"""Smoke tests of ``python -m byteps_like.bench train``: a tiny ``--quick`` run (the MLP, 2 CPU
workers, byteps_like and DDP over gloo, 3 steps) on loopback, under the harness's watchdog and the
test's own (:func:`.bench_run.bench` kills the whole process group on a hang)."""
from __future__ import annotations

import importlib.util
import json
import math

import pytest

from .bench_run import bench, dump, parse_table

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                 reason="torch is not installed")]

COLUMNS = ["model", "mode", "device", "workers", "servers", "rate", "step ms", "samples/s",
           "vs local", "bound ms", "step/bound", "exchange ms", "exchange GB/s", "single GB/s",
           "exch/single"]
KEYS = {"model", "mode", "device", "workers", "servers", "rate", "step_s", "samples_per_s",
        "batch", "gradients", "gradient_bytes", "step_times_s", "vs_local"}
BPS_KEYS = {"exchange_s", "exchange_gbps", "single_tensor_s", "single_tensor_gbps", "bound_s",
            "step_over_bound", "compression"}


def test_train_quick_smoke(tmp_path):
    out, png = tmp_path / "train.json", tmp_path / "train.png"
    r = bench("train", "--quick", "--models", "mlp", "--steps", "3", "--warmup", "1", "--batch", "8",
              "--exchange-repeats", "2", "--json", str(out), "--plot", str(png), timeout=150)
    assert r.returncode == 0, dump(r)
    assert "command: python -m byteps_like.bench train --quick" in r.stdout
    rows = parse_table(r.stdout, COLUMNS)
    assert [(row["model"], row["mode"]) for row in rows] == [
        ("mlp", "local"), ("mlp", "byteps_like"), ("mlp", "ddp (gloo)")], r.stdout
    for row in rows:
        assert row["device"] == "cpu" and row["rate"] == "loopback", row
        for col in ("step ms", "samples/s", "vs local"):
            assert float(row[col]) > 0, (col, row)
    bps_row = rows[1]
    assert bps_row["workers"] == "2" and bps_row["servers"] == "1", bps_row
    for col in ("bound ms", "step/bound", "exchange ms", "exchange GB/s", "single GB/s",
                "exch/single"):
        assert float(bps_row[col]) > 0, (col, bps_row)
    assert rows[0]["vs local"] == "1.00" and rows[2]["bound ms"] == "n/a"
    for mode in ("local", "byteps_like", "ddp"):
        assert f"[train] mlp {mode}: starting" in r.stderr, r.stderr
    assert "[train] mlp byteps_like: done in" in r.stderr, r.stderr

    records = json.loads(out.read_text())
    assert [x["mode"] for x in records] == ["local", "byteps_like", "ddp"]
    for x in records:
        assert KEYS <= set(x), KEYS - set(x)
        assert x["model"] == "mlp" and x["device"] == "cpu" and x["rate"] == "loopback"
        assert x["step_s"] > 0 and x["samples_per_s"] > 0 and len(x["step_times_s"]) == 3
        assert x["batch"] == 8 and x["gradients"] == 34 and x["gradient_bytes"] > 8 << 20
    local, bps, ddp = records
    assert (local["workers"], bps["workers"], ddp["workers"]) == (1, 2, 2)
    assert bps["servers"] == 1 and ddp["backend"] == "gloo"
    assert BPS_KEYS <= set(bps), BPS_KEYS - set(bps)
    assert bps["exchange_s"] > 0 and bps["single_tensor_gbps"] > 0
    assert bps["bound_s"] == max(bps["compute_s"], bps["single_tensor_s"])
    assert math.isclose(bps["samples_per_s"], 16 / bps["step_s"])
    # the same seeds, the same averaged gradients: byteps_like and DDP train identically
    assert math.isclose(bps["loss"], ddp["loss"], rel_tol=1e-4), (bps["loss"], ddp["loss"])
    if importlib.util.find_spec("matplotlib") is not None:
        assert f"plot: {png}" in r.stdout and png.read_bytes()[:4] == b"\x89PNG"
    else:
        assert "plot: matplotlib is not installed" in r.stdout


def test_train_failing_child_names_itself_and_exits_nonzero():
    # 100-byte partitions are below BYTEPS_PARTITION_BYTES's minimum: every role refuses to start
    r = bench("train", "--quick", "--models", "mlp", "--modes", "byteps_like", "--steps", "1",
              "--warmup", "0",
              "--env", "BYTEPS_PARTITION_BYTES=100", timeout=90)
    assert r.returncode == 1, dump(r)
    assert "[train] mlp byteps_like failed" in r.stderr, dump(r)
    assert "stderr tail" in r.stderr and "BYTEPS_PARTITION_BYTES" in r.stderr, dump(r)
    assert "1 run(s) failed" in r.stderr
    assert not any(ln.startswith("|") for ln in r.stdout.splitlines()), r.stdout


def test_train_usage_errors():
    r = bench("train", "--help", timeout=60)
    assert r.returncode == 0 and "--quick" in r.stdout and "--rate" in r.stdout, dump(r)
    r = bench("train", "--modes", "local,nonsense", timeout=60)
    assert r.returncode == 2 and "--modes" in r.stderr, dump(r)
    if importlib.util.find_spec("torchvision") is None:
        r = bench("train", "--models", "resnet50", "--device", "cpu", timeout=60)
        assert r.returncode == 2 and "torchvision" in r.stderr, dump(r)


def test_train_ratios_and_table():
    """vs local and the bound, from made-up records (no processes)."""
    from byteps_like.bench.train import Setup, add_ratios, format_table
    s = Setup(device="cuda", gpus=1, workers=2, servers=1, rate_bits=None,
              steps=3, warmup=1, batch=0, amp=True, compression="none", exchange_repeats=2,
              cross_barrier=False,
              threads_local=0, threads_worker=0, timeout=60, extra_env={}, ddp_backend="auto",
              horovod_python=None)
    base = {"model": "m", "device": "cuda", "gpus_used": 1, "rate": "loopback", "batch": 4}
    recs = [{**base, "mode": "local", "workers": 1, "servers": 0, "step_s": 0.1,
             "samples_per_s": 40.0},
            {**base, "mode": "byteps_like", "workers": 2, "servers": 1, "step_s": 0.25,
             "samples_per_s": 32.0, "single_tensor_s": 0.3, "exchange_s": 0.2,
             "exchange_gbps": 1.0, "single_tensor_gbps": 2.0, "compression": "none"},
            {**base, "mode": "ddp", "workers": 2, "servers": 0, "step_s": 0.2,
             "samples_per_s": 40.0, "backend": "gloo"}]
    add_ratios(s, recs)
    local, bps, ddp = recs
    # two workers share one GPU: their compute is two local steps
    assert bps["compute_s"] == pytest.approx(0.2) and bps["vs_local"] == pytest.approx(0.8)
    assert ddp["vs_local"] == pytest.approx(1.0) and local["vs_local"] == 1.0
    assert bps["bound_s"] == 0.3 and bps["step_over_bound"] == pytest.approx(0.25 / 0.3)
    lines = format_table(recs).splitlines()
    cells = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:]]
    assert cells[1][:6] == ["m", "byteps_like", "cuda x1", "2", "1", "loopback"]
    assert cells[1][6:] == ["250.0", "32.0", "0.80", "300.0", "0.83", "200.0", "1.000",
                            "2.000", "0.50"]
    assert cells[2][1] == "ddp (gloo)" and cells[2][4] == "-" and cells[2][9] == "n/a"
