"""Worker: the framework conformance suite (tests/frameworks/test_conformance.py).

Usage: conformance.py FRAMEWORK[,FRAMEWORK...] [CASE ...]
FRAMEWORK: numpy, torch, tensorflow, keras, mxnet, lightning (fw_<name>.py is its adapter).
Without CASEs every case runs: the common ones below, written once over the adapter, then the adapter's own
(``EXTRAS``). Each case prints ``CASE <framework> <case> OK rank <r>``; a case whose feature the
framework lacks (the adapter raises NotImplementedError before any communication, or names
the case in its ``LACKS``) prints ``CASE <framework> <case> MISSING rank <r>: <why>`` and the
run goes on; any other failure
prints ``CASE <framework> <case> FAIL rank <r>: <error>`` with its traceback and ends the process
(bpslaunch then stops the job), so later cases read as not reached.

Common cases (``size`` workers, ``s`` = the sum of the ranks):
  not_initialized  an operation before init() raises NotInitializedError naming init()
  average          push_pull sums (average=False) and averages (the default)
  dtypes           every dtype the framework supports sums exactly and keeps its dtype
  broadcast        from root rank 1: every rank gets the root's values, exactly
  allgather        rank r gives r + 1 rows; rows arrive in rank order; a trailing dimension
                   that differs between ranks raises MismatchError naming the other ranks
  compression      fp16 compression: values exact in half precision come back exact
  wire_order       gradients go on the wire first layer first (backward produces them last
                   layer first): the push credit is held until every gradient is queued
  mismatch         a name differing between ranks under one key: every rank gets a
                   MismatchError naming both sides; a name reused with another shape in one
                   process raises too
Cases run only when named, each in a launch of its own (the job is of no use after them):
  mismatch_shape, mismatch_dtype   as mismatch, for a shape / a dtype differing between ranks
  join             uneven steps: rank r runs size - r push_pulls, then join(); averages divide
                   by the ranks still in; join() returns 0 (rank 0 joins last)
"""
from __future__ import annotations

import importlib
import os
import sys
import threading
from pathlib import Path

# the repository root, for tests.* (appended: an installed byteps_like keeps precedence over the
# source tree, whose _core may not be built, as on the device), and this folder (case_common)
# where the interpreter leaves it out (PYTHONSAFEPATH)
sys.path.append(str(Path(__file__).resolve().parents[3]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
from case_common import run_reported  # noqa: E402

from byteps_like.errors import MismatchError, NotInitializedError  # noqa: E402
from tests.support import expect  # noqa: E402

FIRST = ["not_initialized"]
MIDDLE = ["average", "dtypes", "broadcast", "allgather", "compression", "wire_order"]
LAST = ["mismatch", "join"]
COMMON = FIRST + MIDDLE + LAST


def ranks_sum(size: int) -> int:
    return size * (size - 1) // 2


# -- the common cases ---------------------------------------------------------------------------
def not_initialized(fw, rank, size):
    expect(NotInitializedError, lambda: fw.push_pull(fw.tensor(np.ones(2), "float32"), "pre",
                                                     True), "init()")
    if hasattr(fw, "before_init"):   # the framework's own checks
        fw.before_init()


def average(fw, rank, size):
    s = ranks_sum(size)
    x = fw.tensor(np.array([rank, 10.0 * rank, -rank]), "float32")
    y = fw.push_pull(x, "avg.sum", False)
    assert np.array_equal(fw.numpy(y), [s, 10.0 * s, -s]), fw.numpy(y)
    y = fw.push_pull(fw.tensor(np.full((3, 4), size * (rank + 1.0)), "float32"), "avg.avg",
                     True)
    want = np.full((3, 4), float(s + size))
    assert np.array_equal(fw.numpy(y), want), fw.numpy(y)
    if fw.default_average:   # the default is average
        y = fw.push_pull(fw.tensor(np.full(5, size * (rank + 1.0)), "float32"), "avg.default",
                         None)
        assert np.array_equal(fw.numpy(y), np.full(5, float(s + size))), fw.numpy(y)
    # a repeated push_pull of one name: same key, new round
    for step in range(3):
        y = fw.push_pull(fw.tensor(np.full(4, rank + step), "float32"), "avg.again", False)
        assert np.array_equal(fw.numpy(y), np.full(4, float(s + size * step))), (step, y)


def dtypes(fw, rank, size):
    s = ranks_sum(size)
    for dt in fw.dtypes:
        x = fw.tensor(np.full(1000, rank), dt)
        y = fw.push_pull(x, f"sum.{dt}", False)
        assert fw.dtype_name(y) == dt, (dt, fw.dtype_name(y))
        assert np.array_equal(fw.numpy(y), np.full(1000, float(s))), (dt, fw.numpy(y)[:3])
        if not fw.in_place:
            assert np.array_equal(fw.numpy(x), np.full(1000, float(rank))), "input changed"
        # average of rank * size: exactly s, also for integers
        a = fw.push_pull(fw.tensor(np.full((3, 4), rank * size), dt), f"avg.{dt}", True)
        assert fw.dtype_name(a) == dt and np.array_equal(fw.numpy(a), np.full((3, 4), float(s)))


def broadcast(fw, rank, size):
    root = 1
    for dt in fw.broadcast_dtypes:
        x = fw.tensor(np.full((3, 2), rank + 5), dt)
        y = fw.broadcast(x, root, f"bcast.{dt}")
        assert fw.dtype_name(y) == dt, (dt, fw.dtype_name(y))
        assert np.array_equal(fw.numpy(y), np.full((3, 2), root + 5.0)), (dt, fw.numpy(y))


def allgather(fw, rank, size):
    for dt in fw.gather_dtypes:
        mine = fw.tensor(np.full((rank + 1, 3), rank + 1), dt)
        got = fw.allgather(mine, f"gather.{dt}")
        want = np.concatenate([np.full((q + 1, 3), q + 1.0) for q in range(size)])
        assert fw.dtype_name(got) == dt and np.array_equal(fw.numpy(got), want), (dt, got)
    others = [q for q in range(size) if q != rank]
    expect(MismatchError, lambda: fw.allgather(fw.tensor(np.zeros((2, 3 + rank)), "float32"),
                                               "gather.bad"),
           "only the first dimension may differ", f"worker ranks {others}")


def compression(fw, rank, size):
    s = ranks_sum(size)
    z = fw.push_pull_fp16(fw.tensor(np.full(100, rank + 0.5), "float32"), "fp16")
    assert fw.dtype_name(z) == "float32", fw.dtype_name(z)
    assert np.array_equal(fw.numpy(z), np.full(100, s + 0.5 * size)), fw.numpy(z)[:3]


def wire_order(fw, rank, size):
    """The adapter's gradients(): (their tensor names, first layer first; ``start`` which
    queues every gradient's push_pull; ``finish`` which waits, or None when start itself
    waits). With the credit held, only the priorities decide the order on the wire."""
    import dataclasses

    from byteps_like.worker.runtime import default_runtime

    rt = default_runtime()
    # one push_pull per gradient (tensor fusion off) so that the order of the gradients
    # themselves is seen; a fused bucket takes its most urgent member's priority
    # (tests/unit/test_fusion.py)
    assert rt.cfg is not None
    cfg = rt.cfg
    rt.cfg = dataclasses.replace(cfg, partition=dataclasses.replace(cfg.partition,
                                                                    fusion_bytes=0))
    try:
        _wire_order(fw, rt, rank)
    finally:
        rt.cfg = cfg


def _wire_order(fw, rt, rank):
    from byteps_like.worker.pipeline import PUSH

    names, start, finish = fw.gradients()
    seen: list[str] = []
    rt.pipeline.observers.append(
        lambda task, stage, ev, t: stage == PUSH and ev == "start" and seen.append(
            task.handle.name))
    if rt.native is not None:   # the native data plane schedules partitions in C++
        rt.native.take_dispatch_log()
        hold, release = (lambda: rt.native.set_paused(True)), (lambda: rt.native.set_paused(False))
    else:
        q = rt.pipeline.queues[PUSH]

        def hold():
            q.inflight += 1 << 40

        def release():
            q.release(1 << 40)
    hold()
    if finish is None:   # start() waits for the results: release from another thread
        timer = threading.Timer(1.0, release)
        timer.start()
        start()
        timer.join()
    else:
        start()
        release()
        finish()
    if rt.native is not None:
        by_key = {st.parts[0][2]: name for name, st in rt.tensors().items() if st.parts}
        seen = [by_key[k] for k in rt.native.take_dispatch_log() if k in by_key]
    wire = [n for n in seen if n in names]
    assert wire == names, f"wire order {wire}, want {names} (all seen: {seen})"
    if rank == 0:
        print(f"WIRE {fw.name}: {' '.join(wire)}", flush=True)


def mismatch(fw, rank, size):
    """Rank 0 pushes another name than the others under one key (the next declared): every
    rank gets a MismatchError naming both sides. A name reused with another shape in one
    process raises too."""
    name = "mm.name.a" if rank == 0 else "mm.name.b"
    msg = expect(MismatchError, lambda: fw.push_pull(fw.tensor(np.ones(3), "float32"), name,
                                                     False), "mismatch")
    assert "worker rank 0" in msg and "mm.name.a'" in msg and "mm.name.b'" in msg, msg
    fw.push_pull(fw.tensor(np.ones(3), "float32"), "mm.local", False)
    expect(MismatchError, lambda: fw.push_pull(fw.tensor(np.ones(4), "float32"), "mm.local",
                                               False), "shape")


def mismatch_shape(fw, rank, size):
    """Rank 0 pushes shape (3,), the others (4,), under one name: every rank gets a
    MismatchError naming both sides. Ends the job's usefulness: run it alone."""
    msg = expect(MismatchError, lambda: fw.push_pull(
        fw.tensor(np.ones((3,) if rank == 0 else (4,)), "float32"), "mm.shape", False),
        "mismatch")
    assert "worker rank 0" in msg and "(3,)" in msg and "(4,)" in msg, msg


def mismatch_dtype(fw, rank, size):
    """Rank 0 pushes float32, the others float64, under one name (as mismatch_shape)."""
    msg = expect(MismatchError, lambda: fw.push_pull(
        fw.tensor(np.ones(3), "float32" if rank == 0 else "float64"), "mm.dtype", False),
        "mismatch")
    assert "worker rank 0" in msg and "float32" in msg and "float64" in msg, msg


def join(fw, rank, size):
    for step in range(size - rank):
        y = fw.push_pull(fw.tensor(np.full(100, rank + 1.0), "float32"), "join.grad", True)
        still_in = [q for q in range(size) if size - q > step]
        want = sum(q + 1 for q in still_in) / len(still_in)
        assert np.allclose(fw.numpy(y), want), (step, fw.numpy(y)[:3], want)
    assert fw.bps.join() == 0
    # everyone is back in after the join: a full average again
    y = fw.push_pull(fw.tensor(np.full(3, float(rank)), "float32"), "after.join", True)
    assert np.allclose(fw.numpy(y), (size - 1) / 2), fw.numpy(y)


ALONE = ["mismatch_shape", "mismatch_dtype"]   # each in a launch of its own
CASES = {name: globals()[name] for name in COMMON + ALONE}


# -- the runner ---------------------------------------------------------------------------------
def run_case(fw, case: str, fn, rank: int, size: int) -> None:
    lacks = getattr(fw, "LACKS", {}).get(case)   # a common case the framework has no API for

    def call():
        if lacks:
            raise NotImplementedError(lacks)
        return fn(fw, rank, size) if case in CASES else fn(rank, size)
    run_reported(fw.name, case, rank, call, missing_ok=True)


def main() -> None:
    names = sys.argv[1].split(",")
    only = set(sys.argv[2:])
    fws = [importlib.import_module(f"fw_{n}").Adapter() for n in names]

    def cases(fw, group):
        table = {c: CASES[c] for c in group}
        if group is MIDDLE:
            table.update(fw.EXTRAS)
        return [(c, f) for c, f in table.items()
                if (c in only if only else group is not ALONE)]

    for fw in fws:
        for case, fn in cases(fw, FIRST):
            run_case(fw, case, fn, -1, 0)
    fws[0].bps.init()
    rank, size = fws[0].bps.rank(), fws[0].bps.size()
    for group in (MIDDLE, LAST, ALONE):
        for fw in fws:
            for case, fn in cases(fw, group):
                run_case(fw, case, fn, rank, size)
    print(f"CONFORMANCE DONE rank {rank}", flush=True)
    fws[0].bps.shutdown()


if __name__ == "__main__":
    main()
