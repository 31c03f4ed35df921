"""The examples run end to end, every framework's: real processes on loopback, each under the
watchdog (tests/support.py). The deadlines catch hangs, not slowness: they hold on this 2-core
machine shared with other jobs (load average 20-30), where the digits examples take 2-4x
their quiet-machine time.

- PyTorch: examples/pytorch/train_digits.py on 2 workers + 1 server reaches >= 0.9 accuracy,
  also as a plain single process, and with onebit / top-k compression within 0.02 of the
  uncompressed accuracy on a fraction of the bytes; examples/pytorch/synthetic_benchmark.py,
  tiny: byteps_like on 2 workers, DDP over gloo with 2 processes, and the --compare driver; the
  summary lines parse.
- TensorFlow: examples/tensorflow/train_digits.py, also compressed by BYTEPS_COMPRESSOR*
  settings alone; synthetic_benchmark_tf2.py, tiny.
- Keras: examples/keras/train_digits.py with fit.
- MXNet (in .venv-mxnet, from this same file): examples/mxnet/train_digits.py on 2 workers,
  uncompressed and with BytePS's onebit compression_params, and standalone; and, in any
  environment, the error a broken MXNet import gives.
"""
from __future__ import annotations

import math
import re
import sys
import textwrap
from pathlib import Path

import pytest

from tests.frameworks.envs import TF_ENV, importable
from tests.integration.harness import bpslaunch
from tests.support import clean_env, free_port, run

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "pytorch"
DIGITS = EXAMPLES / "train_digits.py"
BENCH = EXAMPLES / "synthetic_benchmark.py"
TINY = ["--model", "mlp", "--mlp-hidden", "32", "--mlp-layers", "1", "--image-size", "8",
        "--num-classes", "10", "--batch-size", "8", "--num-warmup-batches", "1",
        "--num-batches-per-iter", "2", "--num-iters", "3", "--threads", "1"]
NUM = r"([0-9]+\.[0-9]+)"


def needs(*modules: str):
    """Skip, saying why, unless every module imports here (sklearn for the digits data)."""
    whys = [w for w in map(importable, modules) if w]
    return pytest.mark.skipif(bool(whys), reason="; ".join(whys))


# -- PyTorch ------------------------------------------------------------------------------------
def summary(text: str, workers: int, prefix: str = "") -> tuple[float, float]:
    per = re.search(rf"^{re.escape(prefix)}Img/sec per worker: {NUM} \+-{NUM}$", text, re.M)
    tot = re.search(rf"^{re.escape(prefix)}Total img/sec on {workers} worker\(s\): {NUM} "
                    rf"\+-{NUM}$", text, re.M)
    assert per and tot, text
    per_mean, total_mean = float(per.group(1)), float(tot.group(1))
    assert per_mean > 0 and total_mean > 0, text
    assert total_mean == pytest.approx(per_mean * workers, rel=0.01, abs=0.2), text
    return per_mean, total_mean


@pytest.mark.timeout(200)
@needs("torch")
def test_torch_train_digits_two_workers_reaches_accuracy():
    pytest.importorskip("sklearn")
    r = bpslaunch([str(DIGITS)], workers=2, servers=1, timeout=180)
    assert r.rc == 0, r.log
    m = re.search(r"^\[worker 0\] final test accuracy: ([0-9.]+) \(2 workers, (\d+) steps\)$",
                  r.out, re.M)
    assert m, r.log
    assert float(m.group(1)) >= 0.9, r.log
    assert "epoch  10/10" in r.out, r.log
    assert "final test accuracy" not in "".join(r.lines("[worker 1]")), r.log  # rank 0 only


@pytest.mark.timeout(150)
@needs("torch")
def test_torch_train_digits_standalone_without_launcher():
    pytest.importorskip("sklearn")
    r = run([sys.executable, str(DIGITS), "--epochs", "3"], 120,
            clean_env("MASTER_", "RANK", "WORLD_SIZE"), merge=True)
    rc, out = r.rc, r.out
    assert rc == 0, out
    m = re.search(r"^final test accuracy: ([0-9.]+) \(1 workers, (\d+) steps\)$", out, re.M)
    assert m and float(m.group(1)) > 0.8, out


@pytest.mark.timeout(150)
@needs("torch")
def test_torch_synthetic_benchmark_byteps_two_workers():
    r = bpslaunch([str(BENCH), *TINY, "--fp16-pushpull"], workers=2, servers=1, timeout=120)
    assert r.rc == 0, r.log
    summary(r.out, 2, prefix="[worker 0] ")
    assert len(r.lines("[worker 0] Iter #")) == 3, r.log
    assert "Gradient compression: fp16" in r.out, r.log
    assert not r.lines("[worker 1] Total img/sec"), r.log  # rank 0 reports


@pytest.mark.timeout(150)
@needs("torch")
def test_torch_synthetic_benchmark_ddp_gloo_two_processes():
    from byteps_like.bench.harness import ChildFailed, Job
    env = clean_env("MASTER_", "RANK", "WORLD_SIZE", MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(free_port()), WORLD_SIZE="2")
    with Job("ddp-test") as g:
        procs = [g.spawn(f"ddp-{r}", [sys.executable, str(BENCH), *TINY, "--ddp-gloo"],
                         {**env, "RANK": str(r)}) for r in range(2)]
        try:
            g.wait(120)
        except ChildFailed as exc:
            pytest.fail(str(exc))
        out0, out1 = procs[0].stdout(), procs[1].stdout()
    assert "Framework: torch DistributedDataParallel (gloo)" in out0, out0
    summary(out0, 2)
    assert "Total img/sec" not in out1, out1


@pytest.mark.timeout(200)
@needs("torch")
def test_torch_synthetic_benchmark_compare_driver_prints_table():
    r = run([sys.executable, str(BENCH), "--compare", "--workers", "2", *TINY, "--timeout", "120"],
            180, clean_env("MASTER_", "RANK", "WORLD_SIZE"), merge=True)
    rc, out = r.rc, r.out
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


def _torch_digits(*args: str) -> tuple[float, int]:
    r = bpslaunch([str(DIGITS), "--epochs", "30", "--cosine", *args], workers=2, servers=1,
                  timeout=90, env={"BYTEPS_MIN_COMPRESS_BYTES": "0"})
    assert r.rc == 0, r.log
    acc = re.search(r"^\[worker 0\] final test accuracy: ([0-9.]+)", r.out, re.M)
    wire = re.search(r"^\[worker 0\] bytes on the wire: (\d+) pushed", r.out, re.M)
    assert acc and wire, r.log
    return float(acc.group(1)), int(wire.group(1))


@needs("torch")
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_torch_digits_with_compression_matches_uncompressed_accuracy():
    """onebit and top-k 1%, both with error feedback and the momentum applied before
    compression (BytePS's recipe), train the digits MLP to within 0.02 of the uncompressed
    accuracy while pushing a small fraction of the bytes. Every tensor is compressed
    (BYTEPS_MIN_COMPRESS_BYTES=0); the run is deterministic (two workers: the server's sums
    do not depend on arrival order)."""
    pytest.importorskip("sklearn")
    base, base_bytes = _torch_digits("--compressor", "none")
    assert base >= 0.95
    for comp, most in (("onebit", 1 / 20), ("topk", 1 / 20)):
        acc, pushed = _torch_digits("--compressor", comp, "--k", "0.01", "--error-feedback",
                              "--compressor-momentum")
        assert acc >= base - 0.02, (comp, acc, base)
        assert pushed < base_bytes * most, (comp, pushed, base_bytes)


# -- TensorFlow and Keras -----------------------------------------------------------------------
TF_EXAMPLES = ROOT / "examples" / "tensorflow"


def _tf_digits(momentum: float, **env: str) -> tuple[float, int]:
    r = bpslaunch([str(TF_EXAMPLES / "train_digits.py"), "--epochs", "20", "--cosine",
                   "--deterministic", "--momentum", str(momentum)], workers=2, servers=1,
                  env={**TF_ENV, **env}, timeout=300)
    assert r.rc == 0, r.log
    (line,) = r.lines("final test accuracy:")
    (wire,) = r.lines("bytes on the wire:")
    return (float(line.split("accuracy:")[1].split()[0]),
            int(wire.split("wire:")[1].split()[0]))


@needs("tensorflow")
@pytest.mark.slow
@pytest.mark.timeout(960)
def test_tensorflow_digits_example_trains_also_compressed():
    """The example trains; with onebit and with top-k 1% (error feedback, momentum before
    compression), chosen by BYTEPS_COMPRESSOR* settings alone (the script passes no
    compression), it reaches within 0.02 of the uncompressed accuracy on a fraction of the
    bytes. TF's CPU kernels are not bit-reproducible run to run even with op determinism, so
    the learning rate decays along a cosine: without it onebit's final accuracy varied by
    0.04 between runs; with it, 12 runs (2 seeds x none/onebit/top-k x 2) fell in
    0.972-0.986."""
    pytest.importorskip("sklearn")
    base, base_bytes = _tf_digits(0.9)
    assert base >= 0.9
    common = {"BYTEPS_MIN_COMPRESS_BYTES": "0", "BYTEPS_COMPRESSOR_ERROR_FEEDBACK": "1",
              "BYTEPS_COMPRESSOR_MOMENTUM": "0.9"}
    for comp in ("onebit", "topk"):
        acc, pushed = _tf_digits(0.0, BYTEPS_COMPRESSOR=comp, BYTEPS_COMPRESSOR_K="0.01",
                                 **common)
        assert acc >= base - 0.02, (comp, acc, base)
        assert pushed < base_bytes / 20, (comp, pushed, base_bytes)


@needs("tensorflow")
@pytest.mark.timeout(200)
def test_tensorflow_synthetic_benchmark_tf2_tiny():
    r = bpslaunch([str(TF_EXAMPLES / "synthetic_benchmark_tf2.py"), "--mlp-hidden", "32",
                   "--mlp-layers", "1", "--image-size", "8", "--num-classes", "10",
                   "--batch-size", "8", "--num-warmup-batches", "1", "--num-batches-per-iter",
                   "2", "--num-iters", "2", "--threads", "1"], workers=2, servers=1, env=TF_ENV,
                  timeout=180)
    assert r.rc == 0, r.log
    assert r.lines("Img/sec per worker:") and r.lines("Total img/sec on 2 worker(s):"), r.log


#: backup workers' kept rounds (BYTEPS_BACKUP_MAX_LAG) covering a whole run: on loaded cores one
#: of 3 workers can fall further behind than the default 64 rounds, which fails it by design
#: (tests/integration/test_backup.py tests that bound); these tests check the data path
NO_LAG_BOUND = {"BYTEPS_BACKUP_MAX_LAG": "1000"}


@needs("tensorflow", "keras")
@pytest.mark.timeout(200)
@pytest.mark.parametrize("workers, backup, epochs", [(2, 0, 5), (3, 1, 8)])
def test_keras_digits_example_trains_with_fit(workers, backup, epochs):
    """Through bps.DistributedPyDataset: with 3 workers and BYTEPS_BACKUP_WORKERS=1 each
    worker's epoch holds ceil(1437 / 2) samples, 23 batches of 32 (15 with b = 0), and the
    epoch-end callbacks (MetricAverageCallback) run without join(), which backup workers
    refuse. With b = 1 a round goes on without the slowest push: on loaded cores one worker
    can be the slowest in most rounds, and 5 epochs then reached 0.87 once; 8 give the
    rounds without it room."""
    pytest.importorskip("sklearn")
    r = bpslaunch([str(ROOT / "examples" / "keras" / "train_digits.py"), "--epochs", str(epochs)],
                  workers=workers, servers=1, timeout=180,
                  env={**TF_ENV, "BYTEPS_BACKUP_WORKERS": str(backup), **NO_LAG_BOUND})
    assert r.rc == 0, r.log
    (line,) = r.lines("final test accuracy:")
    assert float(line.split("accuracy:")[1].split()[0]) >= 0.9, r.log
    batches = math.ceil(math.ceil(1437 / (workers - backup)) / 32)
    assert len(r.lines(f"[worker 0] {batches}/{batches} - ")) == epochs, r.log


# -- MXNet --------------------------------------------------------------------------------------
MX_DIGITS = ROOT / "examples" / "mxnet" / "train_digits.py"
ONEBIT = '{"compressor": "onebit", "ef": "vanilla", "momentum": "nesterov", "scaling": true}'


@needs("mxnet")
@pytest.mark.parametrize("compression", [None, ONEBIT], ids=["uncompressed", "onebit"])
def test_mxnet_train_digits_two_workers_reaches_accuracy(compression):
    """Also with BytePS's compression_params for onebit with error feedback and Nesterov
    momentum (every tensor compressed): the servers aggregate the compressed pushes."""
    extra = ["--compression-params", compression] if compression else []
    r = bpslaunch([str(MX_DIGITS), *extra], workers=2, servers=1, timeout=90,
                  env={"BYTEPS_MIN_COMPRESS_BYTES": "0"})
    assert r.rc == 0, r.log
    m = re.search(r"^\[worker 0\] final test accuracy: ([0-9.]+) \(2 workers, (\d+) steps\)$",
                  r.out, re.M)
    assert m and float(m.group(1)) >= 0.9, r.log
    assert "719 training samples on rank 0, 22 steps/epoch" in r.out, r.log   # the sampler's
    wire = re.search(r"^\[worker 0\] bytes on the wire: (\d+) pushed", r.out, re.M)
    assert wire, r.log
    if compression:  # onebit: 1/32 of the gradient bytes, plus the uncompressed broadcasts
        assert int(wire.group(1)) < 1_500_000, r.log


@needs("mxnet")
def test_mxnet_train_digits_with_a_backup_worker():
    """3 workers, BYTEPS_BACKUP_WORKERS=1: bps.DistributedSampler gives each worker
    ceil(1437 / 2) = 719 samples an epoch (not 479), and the job trains."""
    r = bpslaunch([str(MX_DIGITS)], workers=3, servers=1, timeout=90,
                  env={"BYTEPS_BACKUP_WORKERS": "1", **NO_LAG_BOUND})
    assert r.rc == 0, r.log
    assert "3 worker(s), 719 training samples on rank 0, 22 steps/epoch" in r.out, r.log
    m = re.search(r"^\[worker 0\] final test accuracy: ([0-9.]+) \(3 workers, 220 steps\)$",
                  r.out, re.M)
    assert m and float(m.group(1)) >= 0.9, r.log


@needs("mxnet")
def test_mxnet_train_digits_standalone_without_launcher():
    r = run([sys.executable, str(MX_DIGITS), "--epochs", "3"], 60, clean_env())
    assert r.rc == 0, r.log
    m = re.search(r"^final test accuracy: ([0-9.]+) \(1 workers, (\d+) steps\)$", r.out, re.M)
    assert m and float(m.group(1)) >= 0.85, r.out


def test_a_broken_mxnet_import_names_the_working_numpy_range(tmp_path):
    """What MXNet 1.9.1 does under numpy >= 1.24, simulated by a stand-in package."""
    fake = tmp_path / "mxnet"
    fake.mkdir()
    (fake / "__init__.py").write_text(
        "raise AttributeError(\"module 'numpy' has no attribute 'bool'\")\n")
    code = textwrap.dedent("""
        import byteps_like.mxnet as bps      # no mxnet needed for this
        bps.init(); assert bps.size() == 1
        try:
            bps.DistributedTrainer
        except ImportError as exc:
            print("ERROR:", exc)
    """)
    env = {"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin"}
    r = run([sys.executable, "-c", code], 60, env)
    assert r.rc == 0, r.log
    assert "numpy>=1.23,<1.24" in r.out and "mxnet==1.9.1" in r.out, r.out
    assert "has no attribute 'bool'" in r.out and "setup_mxnet.sh" in r.out, r.out
