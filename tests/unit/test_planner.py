"""``bpslaunch plan`` (launcher/planner.py): BytePS's analysis, the recommendations, and a check
of its predictions against the emulated-cluster benchmark's committed measurements."""
from __future__ import annotations

import json
import math
import pathlib

import pytest

from byteps_like.launcher import planner
from byteps_like.launcher.cli import main as cli_main
from byteps_like.partition import mixed_mode_fraction

REPO = pathlib.Path(__file__).resolve().parents[2]
CLUSTER_JSON = REPO / "docs" / "img" / "cluster.json"
GIB = 1 << 30


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8, 16])
def test_formula_limits(n):
    s, b = GIB, 100e9
    if n == 1:
        assert planner.ps_time(1, 0, s, b) == 0
        return
    # k = 0 (colocated) equals the ring all-reduce; k = n reaches S/B; k > n gains nothing
    assert math.isclose(planner.ps_time(n, 0, s, b), planner.allreduce_time(n, s, b))
    assert math.isclose(planner.ps_time(n, n, s, b), s * 8 / b)
    assert planner.ps_time(n, 2 * n, s, b) == planner.ps_time(n, n, s, b)
    times = [planner.ps_time(n, k, s, b) for k in range(n + 1)]
    assert all(a >= c for a, c in zip(times, times[1:]))   # every CPU machine helps


@pytest.mark.parametrize("n,k", [(2, 1), (4, 1), (4, 2), (4, 3), (8, 5), (4, 4), (4, 9)])
def test_mixed_fraction_matches_core(n, k):
    assert math.isclose(planner.mixed_fraction(n, k), mixed_mode_fraction(n, k))


@pytest.mark.parametrize("workers,cpu,placement,servers,k", [
    (1, 0, "colocated", 1, 0),
    (1, 4, "colocated", 1, 0),
    (4, 0, "colocated", 4, 0),
    (4, 2, "mixed", 6, 2),
    (4, 4, "dedicated", 4, 4),
    (4, 10, "dedicated", 4, 4),
])
def test_recommendation(workers, cpu, placement, servers, k):
    p = planner.plan(workers, 8, 100, cpu)
    assert (p.placement, p.servers, p.dedicated_servers) == (placement, servers, k)
    assert p.env()["DMLC_NUM_SERVER"] == str(servers)
    assert p.env()["BYTEPS_LOCAL_SIZE"] == "8"
    assert math.isclose(p.push_pull_seconds,
                        planner.ps_time(workers, k, planner.DEFAULT_MODEL_BYTES, 100e9))


def test_mixed_plan_fraction_and_note():
    p = planner.plan(4, 8, 25, 2)
    assert math.isclose(p.dedicated_fraction, 0.6)   # 2*2*3 / (16 + 8 - 4)
    assert any("2 more CPU machine(s)" in n for n in p.notes)
    assert p.speedup_vs_allreduce > 1


@pytest.mark.parametrize("gbps,size", [(0.4, 1 << 20), (1, 2 << 20), (10, 8 << 20),
                                       (100, 8 << 20), (0.01, 1 << 20)])
def test_partition_size(gbps, size):
    assert planner.partition_bytes(gbps * 1e9) == size


@pytest.mark.parametrize("args", [(0, 1, 10, 0), (2, 0, 10, 0), (2, 1, 0, 0), (2, 1, 10, -1)])
def test_invalid(args):
    with pytest.raises(ValueError):
        planner.plan(*args)


def test_cli_text_and_json(capsys):
    assert cli_main(["plan", "--workers", "4", "--gpus-per-worker", "8", "--nic-gbps", "100",
                     "--cpu-nodes", "2"]) == 0
    out = capsys.readouterr().out
    assert "placement: mixed" in out and "servers: 6" in out
    assert "BYTEPS_PARTITION_BYTES=8388608" in out
    assert "expected push_pull of 0.25 GiB: 25.8 ms" in out
    assert cli_main(["plan", "--workers", "2", "--gpus-per-worker", "1", "--nic-gbps", "1",
                     "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["placement"] == "colocated" and doc["servers"] == 2
    assert cli_main(["plan", "--workers", "0", "--gpus-per-worker", "1",
                     "--nic-gbps", "1"]) == 2
    assert "at least 1 worker" in capsys.readouterr().err


def _benchmark():
    if not CLUSTER_JSON.exists():
        pytest.skip(f"{CLUSTER_JSON} is missing (python -m byteps_like.bench cluster --json)")
    return [r for r in json.loads(CLUSTER_JSON.read_text()) if r["system"] == "byteps_like"]


def test_predictions_against_the_emulated_cluster():
    """The committed run of ``bench cluster`` (docs/performance.md): every byteps_like
    measurement lies between 0.75 and 1.05 of the planner's time at the measured link rate
    (it can only beat the analysis by noise), and for each (n, size) the placement the
    planner recommends with k spare CPU machines is the fastest measured one."""
    records = _benchmark()
    assert records
    for r in records:
        predicted = planner.ps_time(r["n"], r["k"], r["bytes"], r["link_bits_per_second"])
        assert math.isclose(predicted, r["theory_seconds"], rel_tol=1e-9), r
        ratio = predicted / r["seconds"]
        assert 0.75 <= ratio <= 1.05, (r, ratio)
    for n, size in {(r["n"], r["bytes"]) for r in records}:
        runs = {r["k"]: r["seconds"] for r in records if (r["n"], r["bytes"]) == (n, size)}
        best_k = max(runs)
        p = planner.plan(n, 1, records[0]["link_bits_per_second"] / 1e9, best_k, size)
        if n > 2:   # at n = 2 the analysis gives S/B for every k: nothing to choose
            assert p.dedicated_servers == best_k
            assert runs[best_k] == min(runs.values()), (n, size, runs)
