"""The PyTorch examples run end to end: real processes on loopback, each under a watchdog.

- examples/pytorch/train_digits.py on 2 workers + 1 server (bpslaunch) reaches >= 0.9 accuracy,
  and also runs as a plain single process;
- examples/pytorch/synthetic_benchmark.py, tiny: byteps_like on 2 workers, DDP over gloo with 2
  processes, and the --compare driver; the summary lines parse.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.harness import bpslaunch

pytest.importorskip("torch")
pytestmark = pytest.mark.integration

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "pytorch"
DIGITS = EXAMPLES / "train_digits.py"
BENCH = EXAMPLES / "synthetic_benchmark.py"
TINY = ["--model", "mlp", "--mlp-hidden", "32", "--mlp-layers", "1", "--image-size", "8",
        "--num-classes", "10", "--batch-size", "8", "--num-warmup-batches", "1",
        "--num-batches-per-iter", "2", "--num-iters", "3", "--threads", "1"]
NUM = r"([0-9]+\.[0-9]+)"


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DMLC_", "BYTEPS_", "MASTER_", "RANK", "WORLD_SIZE"))}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def run(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run ``cmd`` in its own session; on a hang kill its process group and fail with output."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env or clean_env(), stdin=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)   # a --compare driver then stops its own children
        try:
            out, _ = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        pytest.fail(f"watchdog: {' '.join(cmd)} hung for {timeout} s and was killed\n{out}")
    return proc.returncode, out


def summary(text: str, workers: int, prefix: str = "") -> tuple[float, float]:
    per = re.search(rf"^{re.escape(prefix)}Img/sec per worker: {NUM} \+-{NUM}$", text, re.M)
    tot = re.search(rf"^{re.escape(prefix)}Total img/sec on {workers} worker\(s\): {NUM} "
                    rf"\+-{NUM}$", text, re.M)
    assert per and tot, text
    per_mean, total_mean = float(per.group(1)), float(tot.group(1))
    assert per_mean > 0 and total_mean > 0, text
    assert total_mean == pytest.approx(per_mean * workers, rel=0.01, abs=0.2), text
    return per_mean, total_mean


@pytest.mark.timeout(75)
def test_train_digits_two_workers_reaches_accuracy():
    pytest.importorskip("sklearn")
    r = bpslaunch([str(DIGITS)], workers=2, servers=1, timeout=60)
    assert r.rc == 0, r.log
    m = re.search(r"^\[worker 0\] final test accuracy: ([0-9.]+) \(2 workers, (\d+) steps\)$",
                  r.out, re.M)
    assert m, r.log
    assert float(m.group(1)) >= 0.9, r.log
    assert "epoch  10/10" in r.out, r.log
    assert "final test accuracy" not in "".join(r.lines("[worker 1]")), r.log  # rank 0 only


@pytest.mark.timeout(45)
def test_train_digits_standalone_without_launcher():
    pytest.importorskip("sklearn")
    rc, out = run([sys.executable, str(DIGITS), "--epochs", "3"], timeout=40)
    assert rc == 0, out
    m = re.search(r"^final test accuracy: ([0-9.]+) \(1 workers, (\d+) steps\)$", out, re.M)
    assert m and float(m.group(1)) > 0.8, out


@pytest.mark.timeout(60)
def test_synthetic_benchmark_byteps_two_workers():
    r = bpslaunch([str(BENCH), *TINY, "--fp16-pushpull"], workers=2, servers=1, timeout=45)
    assert r.rc == 0, r.log
    summary(r.out, 2, prefix="[worker 0] ")
    assert len(r.lines("[worker 0] Iter #")) == 3, r.log
    assert "Gradient compression: fp16" in r.out, r.log
    assert not r.lines("[worker 1] Total img/sec"), r.log  # rank 0 reports


@pytest.mark.timeout(60)
def test_synthetic_benchmark_ddp_gloo_two_processes():
    from byteps_like.bench._procs import ChildFailed, ProcGroup, free_port
    env = clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2")
    with ProcGroup("ddp-test") as g:
        procs = [g.spawn(f"ddp-{r}", [sys.executable, str(BENCH), *TINY, "--ddp-gloo"],
                         {**env, "RANK": str(r)}) for r in range(2)]
        try:
            g.wait(45)
        except ChildFailed as exc:
            pytest.fail(str(exc))
        out0, out1 = procs[0].stdout(), procs[1].stdout()
    assert "Framework: torch DistributedDataParallel (gloo)" in out0, out0
    summary(out0, 2)
    assert "Total img/sec" not in out1, out1


@pytest.mark.timeout(80)
def test_synthetic_benchmark_compare_driver_prints_table():
    rc, out = run([sys.executable, str(BENCH), "--compare", "--workers", "2", *TINY,
                   "--timeout", "40"], timeout=75)
    assert rc == 0, out
    rows = [ln for ln in out.splitlines() if ln.startswith("|")]
    assert len(rows) == 3, out
    assert [c.strip() for c in rows[0].strip("|").split("|")] == [
        "workers", "byteps_like img/s total", "ddp-gloo img/s total", "ratio"], out
    cells = [c.strip() for c in rows[2].strip("|").split("|")]
    assert cells[0] == "2", out
    bps_total = float(cells[1].split(" +-")[0])
    ddp_total = float(cells[2].split(" +-")[0])
    assert bps_total > 0 and ddp_total > 0, out
    assert float(cells[3]) == pytest.approx(bps_total / ddp_total, abs=0.01), out


def _digits(*args: str) -> tuple[float, int]:
    r = bpslaunch([str(DIGITS), "--epochs", "30", "--cosine", *args], workers=2, servers=1,
                  timeout=90, env={"BYTEPS_MIN_COMPRESS_BYTES": "0"})
    assert r.rc == 0, r.log
    acc = re.search(r"^\[worker 0\] final test accuracy: ([0-9.]+)", r.out, re.M)
    wire = re.search(r"^\[worker 0\] bytes on the wire: (\d+) pushed", r.out, re.M)
    assert acc and wire, r.log
    return float(acc.group(1)), int(wire.group(1))


@pytest.mark.timeout(240)
def test_digits_with_compression_matches_uncompressed_accuracy():
    """onebit and top-k 1%, both with error feedback and the momentum applied before
    compression (BytePS's recipe), train the digits MLP to within 0.02 of the uncompressed
    accuracy while pushing a small fraction of the bytes. Every tensor is compressed
    (BYTEPS_MIN_COMPRESS_BYTES=0); the run is deterministic (two workers: the server's sums
    do not depend on arrival order)."""
    pytest.importorskip("sklearn")
    base, base_bytes = _digits("--compressor", "none")
    assert base >= 0.95
    for comp, most in (("onebit", 1 / 20), ("topk", 1 / 20)):
        acc, pushed = _digits("--compressor", comp, "--k", "0.01", "--error-feedback",
                              "--compressor-momentum")
        assert acc >= base - 0.02, (comp, acc, base)
        assert pushed < base_bytes * most, (comp, pushed, base_bytes)
