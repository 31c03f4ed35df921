"""byteps_like.keras and byteps_like.tensorflow.keras with model.fit on 2 workers.

Equivalence: a small float64 model trained with fit on each worker's shards ends with the same
weights as one process trained on the whole batches (tolerance 1e-9), with byteps_like.keras
in eager mode (run_eagerly=True, SGD with momentum) and with byteps_like.tensorflow.keras in
compiled steps (tf.function, Adam); rank 1 starts from different weights, so
BroadcastGlobalVariablesCallback is exercised too. The other callbacks are checked against
their definitions (tests/frameworks/workers/keras_fit.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.harness import bpslaunch

pytest.importorskip("tensorflow")
pytest.importorskip("keras")
pytestmark = pytest.mark.integration

WORKERS = Path(__file__).parent / "workers"
# TensorFlow can hold the GIL for seconds (imports, tracing): a tolerant heartbeat, so a busy
# machine does not read as a lost peer
TF_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_ENABLE_ONEDNN_OPTS": "0",
          "BYTEPS_HEARTBEAT_TIMEOUT_SECONDS": "15"}


def test_keras_fit_equivalence_and_callbacks():
    r = bpslaunch([str(WORKERS / "keras_fit.py")], workers=2, servers=1, env=TF_ENV,
                  timeout=150)
    assert r.rc == 0, r.log
    for check in ["eager", "graph", "metric_average", "lr_warmup", "lr_schedule",
                  "broadcast_global_variables"]:
        assert len(r.lines(f"KERAS OK {check} ")) == 2, f"{check}\n{r.log}"
    assert len(r.lines("KERAS DONE")) == 2, r.log


EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "keras" / "train_digits.py"


def test_keras_digits_example_trains_with_fit():
    pytest.importorskip("sklearn")
    r = bpslaunch([str(EXAMPLE), "--epochs", "5"], workers=2, servers=1, env=TF_ENV,
                  timeout=150)
    assert r.rc == 0, r.log
    (line,) = r.lines("final test accuracy:")
    assert float(line.split("accuracy:")[1].split()[0]) >= 0.9, r.log
