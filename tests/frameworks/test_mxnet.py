"""byteps_like.mxnet on real local clusters: Gluon equivalence with single-process training, the
API, errors, broadcasts and the priority order on the wire.

MXNet 1.9.1 needs numpy < 1.24, so these tests run in their own environment
(``bash scripts/setup_mxnet.sh``; ``scripts/test.sh`` does both). In the main environment they
skip, except the check of the error a broken MXNet import gives.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from tests.integration.harness import bpslaunch

try:
    with warnings.catch_warnings():  # MXNet 1.9.1 touches numpy's deprecated aliases
        warnings.simplefilter("ignore", DeprecationWarning)
        import mxnet  # noqa: F401
    HAVE_MXNET = True
except Exception:  # noqa: BLE001 - absent, or broken by numpy>=1.24
    HAVE_MXNET = False

needs_mxnet = pytest.mark.skipif(not HAVE_MXNET, reason="mxnet is not importable here "
                                 "(it runs in .venv-mxnet: bash scripts/setup_mxnet.sh)")
WORKERS = Path(__file__).parent / "workers"
ROOT = Path(__file__).parents[2]


def run(script: str, *args: object, workers: int = 2, timeout: float = 90):
    return bpslaunch([str(WORKERS / script), *map(str, args)], workers=workers, servers=1,
                     timeout=timeout)


@needs_mxnet
@pytest.mark.integration
@pytest.mark.parametrize("mode", ["sgd", "adam", "optimizer", "fp16"])
def test_gluon_equivalence_with_one_process_on_the_whole_batch(mode):
    r = run("mx_equivalence.py", mode, 5)
    assert r.rc == 0, r.log
    assert len(r.lines(f"EQUIV OK {mode}")) == 2, r.log


@needs_mxnet
@pytest.mark.integration
def test_gluon_equivalence_on_four_workers():
    r = run("mx_equivalence.py", "sgd", 3, workers=4)
    assert r.rc == 0, r.log
    assert len(r.lines("EQUIV OK sgd")) == 4, r.log


@needs_mxnet
@pytest.mark.integration
@pytest.mark.parametrize("mode", ["errors", "broadcast", "ops", "join"])
def test_api(mode):
    n = 3 if mode in ("errors", "join") else 2
    r = run("mx_api.py", mode, workers=n)
    assert r.rc == 0, r.log
    assert len(r.lines(f"API OK {mode}")) == n, r.log


@needs_mxnet
@pytest.mark.integration
def test_gradients_go_on_the_wire_first_parameter_first():
    r = run("mx_api.py", "priority")
    assert r.rc == 0, r.log
    wire = r.lines("PRIORITY wire order")[0].split(":", 1)[-1].split()
    assert wire == sorted(wire) and wire[0] == "p_dense0_bias", r.log


ONEBIT = '{"compressor": "onebit", "ef": "vanilla", "momentum": "nesterov", "scaling": true}'


@needs_mxnet
@pytest.mark.integration
@pytest.mark.parametrize("compression", [None, ONEBIT], ids=["uncompressed", "onebit"])
def test_example_train_digits_two_workers_reaches_accuracy(compression):
    """Also with BytePS's compression_params for onebit with error feedback and Nesterov
    momentum (every tensor compressed): the servers aggregate the compressed pushes."""
    extra = ["--compression-params", compression] if compression else []
    r = bpslaunch([str(ROOT / "examples" / "mxnet" / "train_digits.py"), *extra], workers=2,
                  servers=1, timeout=90, env={"BYTEPS_MIN_COMPRESS_BYTES": "0"})
    assert r.rc == 0, r.log
    m = re.search(r"^\[worker 0\] final test accuracy: ([0-9.]+) \(2 workers, (\d+) steps\)$",
                  r.out, re.M)
    assert m and float(m.group(1)) >= 0.9, r.log
    wire = re.search(r"^\[worker 0\] bytes on the wire: (\d+) pushed", r.out, re.M)
    assert wire, r.log
    if compression:  # onebit: 1/32 of the gradient bytes, plus the uncompressed broadcasts
        assert int(wire.group(1)) < 1_500_000, r.log


@needs_mxnet
def test_example_train_digits_standalone_without_launcher():
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "mxnet" / "train_digits.py"),
                        "--epochs", "3"], capture_output=True, text=True, timeout=60,
                       env={k: v for k, v in os.environ.items()
                            if not k.startswith(("DMLC_", "BYTEPS_"))})
    assert r.returncode == 0, r.stdout + r.stderr
    m = re.search(r"^final test accuracy: ([0-9.]+) \(1 workers, (\d+) steps\)$", r.stdout,
                  re.M)
    assert m and float(m.group(1)) >= 0.85, r.stdout


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
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert "numpy>=1.23,<1.24" in r.stdout and "mxnet==1.9.1" in r.stdout, r.stdout
    assert "has no attribute 'bool'" in r.stdout and "setup_mxnet.sh" in r.stdout, r.stdout
