"""byteps_like.torch on real local clusters: equivalence with single-process training, the API,
errors, broadcasts and the priority order on the wire."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.harness import bpslaunch

pytest.importorskip("torch")
pytestmark = pytest.mark.integration

WORKERS = Path(__file__).parent / "workers"


def run(script: str, *args: object, workers: int = 2, timeout: float = 120):
    return bpslaunch([str(WORKERS / script), *map(str, args)], workers=workers, servers=1,
                     timeout=timeout)


@pytest.mark.parametrize("workers", [2, 4])
@pytest.mark.parametrize("mode", ["sgd", "adam"])
def test_equivalence_with_one_process_on_the_whole_batch(mode, workers):
    r = run("torch_equivalence.py", mode, 6, workers=workers)
    assert r.rc == 0, r.log
    assert len(r.lines(f"EQUIV OK {mode}")) == workers, r.log


@pytest.mark.parametrize("mode", ["bpps2", "skipsync", "ddp", "fp16"])
def test_equivalence_variants(mode):
    r = run("torch_equivalence.py", mode, 4)
    assert r.rc == 0, r.log
    assert len(r.lines(f"EQUIV OK {mode}")) == 2, r.log


@pytest.mark.parametrize("mode", ["errors", "broadcast", "ops", "join"])
def test_api(mode):
    n = 3 if mode in ("errors", "join") else 2
    r = run("torch_api.py", mode, workers=n)
    assert r.rc == 0, r.log
    assert len(r.lines(f"API OK {mode}")) == n, r.log


def test_gradients_go_on_the_wire_first_layer_first():
    r = run("torch_api.py", "priority")
    assert r.rc == 0, r.log
    wire = r.lines("PRIORITY wire order")[0].split(":", 2)[-1].split()
    backward = r.lines("PRIORITY backward order")[0].split(":", 2)[-1].split()
    assert wire == backward[::-1] and wire[0] == "0.weight", r.log
