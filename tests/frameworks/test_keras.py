"""byteps_like.keras beyond the conformance suite (tests/frameworks/workers/keras_cases.py):

- a model compiled with DistributedOptimizer and saved under bpslaunch loads in a plain process
  with ``keras.models.load_model`` (byteps_like not imported, and imported), with the plain
  optimizer and its state; ``byteps_like.keras.load_model`` loads it, and a file written before
  the fix, with the optimizer distributed again, and fits on 2 workers;
- ``fit`` on uneven shards (33 / 32 batches) completes on both ranks, with JoinCallback and
  MetricAverageCallback, with MetricAverageCallback alone, and a custom loop with join();
- on Keras's PyTorch backend (byteps_like.keras's eager numpy path): uneven ``fit`` (with the
  broadcast callback, whose scalar variables once came back 1-d), the collectives and the
  round trip through load_model.

Real processes on loopback, each under the watchdog (tests/support.py).
"""
from __future__ import annotations

import json
import textwrap
import zipfile
from pathlib import Path

import pytest

from tests.frameworks.envs import TF_ENV, importable
from tests.integration.harness import Run, bpslaunch
from tests.support import clean_env, python

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(bool(importable("tensorflow") or importable("keras")),
                                 reason=str(importable("tensorflow") or importable("keras")))]

WORKER = Path(__file__).parent / "workers" / "keras_cases.py"
TIMEOUT = 300   # 2 TensorFlow processes on a busy 2-core machine: a hang, not slowness


def launch(d: Path, *cases: str) -> Run:
    return bpslaunch([str(WORKER), str(d), *cases], workers=2, servers=1, env=TF_ENV,
                     timeout=TIMEOUT)


def check(run: Run, case: str) -> None:
    ok = run.lines(f"CASE keras {case} OK ")
    if len(ok) != 2:
        said = run.lines(f"CASE keras {case} FAIL") or ["not reached"]
        pytest.fail(f"{case}: {said[0]}\n{run.log}", pytrace=False)


PLAIN = textwrap.dedent("""
    import sys
    from pathlib import Path
    import keras, numpy as np
    d = Path(sys.argv[1])
    saved = np.load(d / "weights.npz")

    def same(model):
        assert type(model.optimizer) is keras.optimizers.SGD, type(model.optimizer)
        w = np.concatenate([np.asarray(v, np.float64).reshape(-1) for v in model.get_weights()])
        assert np.array_equal(w, saved["w"])
        s = np.concatenate([np.asarray(v).reshape(-1) for v in model.optimizer.variables])
        assert np.array_equal(s, saved["slots"]), "optimizer state"

    same(keras.models.load_model(d / "m.keras"))
    assert not any(m.startswith("byteps_like") for m in sys.modules), "byteps_like imported"
    print("PLAIN without byteps_like OK", flush=True)
    import byteps_like.keras as bps
    same(keras.models.load_model(d / "m.keras"))
    print("PLAIN after import OK", flush=True)

    # a file written before the fix names the class by the module byteps_like._keras
    legacy = bps.load_model(d / "legacy.keras")
    assert hasattr(type(legacy.optimizer), "_bps_ops"), type(legacy.optimizer)
    assert int(legacy.optimizer.iterations.numpy()) == 2
    print("PLAIN legacy OK", flush=True)

    # an optimizer class registered as serializable keeps its registered name
    @keras.saving.register_keras_serializable(package="mine")
    class MySGD(keras.optimizers.SGD):
        pass

    bps.init()   # a one-process job
    m = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    m.compile(optimizer=bps.DistributedOptimizer(MySGD(0.1)), loss="mse")
    m.fit(np.ones((4, 2)), np.ones((4, 1)), verbose=0)
    m.save(d / "mine.keras")
    back = keras.models.load_model(d / "mine.keras")
    assert type(back.optimizer) is MySGD, type(back.optimizer)
    again = bps.load_model(d / "mine.keras")
    assert isinstance(again.optimizer, MySGD) and hasattr(type(again.optimizer), "_bps_ops")
    again.fit(np.ones((4, 2)), np.ones((4, 1)), verbose=0)
    assert int(again.optimizer.iterations.numpy()) == 2
    print("PLAIN registered OK", flush=True)
""")


def legacy_copy(d: Path) -> None:
    """d/legacy.keras: d/m.keras as the code before the fix wrote it (the optimizer's module
    byteps_like._keras, its registered name its class name)."""
    with zipfile.ZipFile(d / "m.keras") as src, \
            zipfile.ZipFile(d / "legacy.keras", "w") as dst:
        for item in src.infolist():
            data = src.read(item.filename)
            if item.filename == "config.json":
                cfg = json.loads(data)
                opt = cfg["compile_config"]["optimizer"]
                opt.update(module="byteps_like._keras", registered_name=opt["class_name"])
                data = json.dumps(cfg).encode()
            dst.writestr(item, data)


@pytest.mark.timeout(3 * TIMEOUT)
def test_a_saved_model_loads_in_plain_keras_and_distributed_again_with_load_model(tmp_path):
    check(launch(tmp_path, "save"), "save")
    legacy_copy(tmp_path)
    plain = python(["-c", PLAIN, str(tmp_path)], TIMEOUT, clean_env(**TF_ENV))
    assert plain.rc == 0, plain.log
    for what in ("without byteps_like", "after import", "legacy", "registered"):
        assert f"PLAIN {what} OK" in plain.out, plain.log
    check(launch(tmp_path, "load"), "load")


_runs: dict[str, Run | str] = {}


@pytest.mark.timeout(TIMEOUT + 60)
@pytest.mark.parametrize("case", ["uneven_metric", "uneven_fit", "uneven_loop"])
def test_uneven_shards_complete_with_the_same_weights_everywhere(case, tmp_path_factory):
    """One launch for the three cases; each reads its own lines."""
    if "uneven" not in _runs:
        try:
            _runs["uneven"] = launch(tmp_path_factory.mktemp("uneven"), "uneven_metric",
                                     "uneven_fit", "uneven_loop")
        except AssertionError as exc:   # the watchdog: every case says so
            _runs["uneven"] = str(exc)
    run = _runs["uneven"]
    if isinstance(run, str):
        pytest.fail(run, pytrace=False)
    check(run, case)


@pytest.mark.timeout(TIMEOUT + 60)
@pytest.mark.skipif(bool(importable("torch")), reason=str(importable("torch")))
def test_the_torch_backend_collectives_uneven_fit_and_round_trip(tmp_path):
    cases = ["uneven_metric", "collectives", "save", "load"]
    run = bpslaunch([str(WORKER), str(tmp_path), *cases], workers=2, servers=1,
                    env={**TF_ENV, "KERAS_BACKEND": "torch"}, timeout=TIMEOUT)
    assert "backend torch" in run.out, run.log
    for case in cases:
        check(run, case)


def test_uneven_fit_without_join_fails_with_one_short_report_ending_in_the_advice():
    """Issue 40: fit on uneven shards without JoinCallback fails (the rank with fewer batches
    ends, the other can never complete its round), and the job prints one report: at most 40
    lines in all (254 before: TensorFlow's traceback three times), the root cause last and whole,
    its advice (join()) included."""
    run = bpslaunch([str(Path(__file__).parent / "workers" / "keras_uneven_fails.py")],
                    workers=2, servers=1, env=TF_ENV, timeout=TIMEOUT)
    assert run.rc == 1, run.log
    printed = (run.out + run.err).splitlines()
    assert len(printed) <= 40, f"{len(printed)} lines\n{run.log}"
    last = run.err.splitlines()[-1]
    assert last.startswith("bpslaunch: error: worker 0 (pid "), run.log
    assert "failed first: exit status 1; last stderr: byteps_like.errors.PeerLeftError: " \
        "push_pull of 'DistributedOptimizer." in last, run.log
    assert "has finished (its script ended without join())" in last, run.log
    assert "Ranks that run fewer steps must call join() when they are done" in last, run.log
    assert run.lines("FIT DONE rank 1") and not run.lines("FIT DONE rank 0"), run.log
    # the failure is told once by the report: no process printed TensorFlow's traceback
    assert "Traceback (most recent call last)" not in "\n".join(
        ln for ln in printed if not ln.startswith("bpslaunch: |")), run.log
