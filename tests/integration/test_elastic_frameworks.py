"""Elastic training through the user API (issue 22): ``bps.elastic.run`` with a ``TorchState``
or a ``KerasState`` under ``bpslaunch --local --elastic``.

* a 3-worker PyTorch job loses a worker (SIGKILL mid-step): the two survivors resume within the
  heartbeat timeout + 5 s, hold identical parameters after every step, and run exactly the steps
  the plan says (from the last commit on);
* a worker added mid-training joins at the next commit and holds the others' parameters from
  its first step;
* the elastic digits example still reaches test accuracy >= 0.95 after a loss;
* a Keras ``fit`` job (compiled steps) loses a worker and finishes on the survivors;
* the same loss for the numpy API (``byteps_like.elastic.ObjectState`` of a numpy array).

The protocol side (epochs, servers, the launcher's supervision) is tests/integration/
test_elastic.py's; the API without a cluster is tests/unit/test_elastic_state.py's.
"""
from __future__ import annotations

import importlib.util
import json
import re
import uuid
from pathlib import Path

import pytest

from .harness import FAST_ENV, bpslaunch, worker

pytestmark = [pytest.mark.integration, pytest.mark.slow]

HEARTBEAT_TIMEOUT = float(FAST_ENV["BYTEPS_HEARTBEAT_TIMEOUT_SECONDS"])
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pytorch" / "train_digits_elastic.py"


def records(out: str) -> list[dict]:
    recs = []
    for ln in out.splitlines():
        if ln.startswith("[worker") and "] {" in ln:
            rec = json.loads(ln[ln.index("] {") + 2:])
            rec["who"] = ln[1:ln.index("]")]   # bpslaunch's name of the process
            recs.append(rec)
    return recs


def same_parameters_after_every_step(recs: list[dict], log: str) -> dict:
    """{(step, size): crc}: every worker that ran a step in a job of a size holds the same
    parameters after it."""
    seen: dict = {}
    for r in recs:
        if "crc" in r and "done" not in r:
            got = seen.setdefault((r["step"], r["size"]), {})
            got[r["who"]] = r["crc"]
    for key, crcs in seen.items():
        assert len(set(crcs.values())) == 1, (f"step {key[0]} with {key[1]} workers: the "
                                              f"parameters differ {crcs}", log)
    return {k: next(iter(v.values())) for k, v in seen.items()}


def lost_one(run) -> tuple[list[dict], dict, list[dict]]:
    """A run of three workers that lost one and finished on the other two, checked: it
    succeeded, the workers held the same parameters after every step, the two survivors (not
    the killed one) finished with the same parameters. Its records, the killed worker's
    record and the survivors' last records."""
    log = run.log
    assert run.rc == 0, log
    recs = records(run.out)
    same_parameters_after_every_step(recs, log)
    killed = next(r for r in recs if "killing" in r)
    done = [r for r in recs if r.get("done")]
    assert len(done) == 2 and killed["who"] not in {r["who"] for r in done}, log
    assert len({r["crc"] for r in done}) == 1, log
    return recs, killed, done


def launch(args: list, workers: int, extra: list[str], timeout: float = 150):
    # three framework processes import slowly on a busy 2-core machine: registration may take
    # longer than the fast default
    env = {"BYTEPS_JOB_ID": f"elastic-api-{uuid.uuid4().hex[:12]}",
           "BYTEPS_REGISTER_TIMEOUT_SECONDS": "150"}
    return bpslaunch(args, workers=workers, servers=1, env=env, timeout=timeout,
                     extra=["--elastic", *extra])


def test_torch_worker_lost_mid_step_survivors_resume_in_step():
    pytest.importorskip("torch")
    steps, kill_at, every = 12, 7, 3
    run = launch(worker("elastic_torch.py", steps, f"kill={kill_at}@2", f"commit={every}",
                        "slow=0.05"), 3, ["--min-workers", "2", "--max-restarts", "0"])
    log = run.log
    recs, killed, done = lost_one(run)
    assert sorted(r["rank"] for r in done) == [0, 1], log       # dense ranks
    last_commit = kill_at // every * every
    for who in {r["who"] for r in done}:
        mine = [r for r in recs if r["who"] == who]
        before = [r["step"] for r in mine if "crc" in r and r["size"] == 3]
        after = [r for r in mine if "crc" in r and r["size"] == 2 and "done" not in r]
        # the plan: every step up to the loss once; after it, from the last commit on
        assert before == list(range(1, kill_at + 1)), (who, before, log)
        assert [r["step"] for r in after] == list(range(last_commit + 1, steps + 1)), (who, log)
        resets = [r for r in mine if r.get("reset")]
        assert len(resets) == 1 and resets[0]["size"] == 2, (who, log)
        # resumed: the first step of the new epoch within the heartbeat timeout + 5 s
        assert after[0]["t"] - killed["t"] <= HEARTBEAT_TIMEOUT + 5, (after[0], killed, log)


def test_numpy_object_state_loses_a_worker():
    steps, kill_at, every = 10, 5, 2
    run = launch(worker("elastic_objectstate.py", steps, f"kill={kill_at}@1", f"commit={every}"),
                 3, ["--min-workers", "2", "--max-restarts", "0"])
    log = run.log
    recs, killed, done = lost_one(run)
    last_commit = kill_at // every * every
    for who in {r["who"] for r in done}:
        after = [r["step"] for r in recs if r["who"] == who and r.get("size") == 2
                 and "crc" in r and "done" not in r]
        assert after == list(range(last_commit + 1, steps + 1)), (who, after, log)


def test_torch_worker_added_joins_at_a_commit_with_the_same_parameters():
    pytest.importorskip("torch")
    steps, every = 8, 2
    run = launch(worker("elastic_torch.py", steps, f"commit={every}", "slow=0.1", "join=3"), 2,
                 ["--max-workers", "3", "--add-workers", "1", "--add-after", "1"])
    log = run.log
    assert run.rc == 0, log
    recs = records(run.out)
    by_step = same_parameters_after_every_step(recs, log)
    done = [r for r in recs if r.get("done")]
    assert len(done) == 3 and {r["size"] for r in done} == {3}, log
    assert len({r["crc"] for r in done}) == 1, log
    # the joiner: the process that started into the second epoch (bpslaunch's process names
    # follow the start order, ranks the order of registration)
    starts = {r["who"]: r for r in recs if "started" in r}
    joined = [who for who, r in starts.items() if r["epoch"] > 1]
    assert len(joined) == 1 and starts[joined[0]]["size"] == 3, log
    first = next(r for r in recs if r["who"] == joined[0] and "crc" in r)
    assert first["size"] == 3 and first["rank"] == 2, log
    stayed = sorted(set(starts) - set(joined))
    olds = [r for r in recs if r["who"] in stayed and "crc" in r and "done" not in r]
    # its first step is a step the others ran with it: same parameters (checked above)
    assert (first["step"], 3) in by_step and sum(
        1 for r in olds if (r["step"], r["size"]) == (first["step"], 3)) == 2, log
    # admitted at a commit: the others lost and repeated nothing
    for who in stayed:
        mine = [r["step"] for r in olds if r["who"] == who]
        assert mine == list(range(1, len(mine) + 1)), (who, mine, log)
        assert (first["step"] - 1) % every == 0, (first, log)


def test_elastic_digits_example_reaches_its_accuracy_after_a_loss():
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    run = launch(worker("elastic_example.py", "40@2", EXAMPLE, "--epochs", "10"), 3, ["--min-workers", "2", "--max-restarts", "0"],
                 timeout=240)
    log = run.log
    assert run.rc == 0, log
    assert "SIGKILLs itself in step 40" in run.out, log
    assert re.search(r"membership changed: 2 workers now", run.out), log
    m = re.search(r"final test accuracy: ([0-9.]+) \(2 workers at the end, (\d+) steps, "
                  r"1 resets\)", run.out)
    assert m, log
    assert float(m.group(1)) >= 0.95, log


def test_keras_fit_loses_a_worker_and_finishes_on_the_survivors():
    if importlib.util.find_spec("tensorflow") is None or importlib.util.find_spec(
            "keras") is None:
        pytest.skip("needs TensorFlow and Keras")
    epochs, kill_at, every = 3, 7, 2
    run = launch(worker("elastic_keras.py", epochs, f"kill={kill_at}@2", f"commit={every}"), 3,
                 ["--min-workers", "2", "--max-restarts", "0"], timeout=240)
    log = run.log
    recs, killed, done = lost_one(run)
    assert {r["epoch"] for r in done} == {epochs}, log
    last_commit = kill_at // every * every
    for who in {r["who"] for r in done}:
        mine = [r for r in recs if r["who"] == who and "crc" in r and "done" not in r]
        after = [r["step"] for r in mine if r["size"] == 2]
        # fit starts the interrupted epoch again; the steps count on from the last commit
        assert after and after == list(range(last_commit + 1, last_commit + 1 + len(after))), (
            who, after, log)
        first_after = next(r for r in mine if r["size"] == 2)
        assert first_after["t"] - killed["t"] <= HEARTBEAT_TIMEOUT + 5, (first_after, log)
