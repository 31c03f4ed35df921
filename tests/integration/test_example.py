"""The quick-start job: the digits MLP trained on a local cluster reaches a real accuracy."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from .harness import bpslaunch

pytestmark = pytest.mark.integration

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "numpy" / "train_digits.py"


def test_digits_example_trains_to_high_accuracy():
    pytest.importorskip("sklearn")
    run = bpslaunch([str(EXAMPLE), "--epochs", "10"], workers=2, servers=2, timeout=180)
    assert run.rc == 0, run.log
    m = re.search(r"\[worker 0\] final test accuracy: ([0-9.]+) \(2 workers", run.out)
    assert m, run.log
    assert float(m.group(1)) >= 0.9, run.log
    assert "epoch  10/10" in run.out, run.log
