"""push_pull on real local clusters: every dtype, sizes from 1 element to 64 MiB, 1/2/4 workers
with 1/2 servers, asynchronous mode and declaration mismatches."""
from __future__ import annotations

import pytest

from .harness import bpslaunch, worker

pytestmark = pytest.mark.integration

SMALL = [1, 7, 1000, 70001]  # 70001 elements cross several 64 KiB partitions


@pytest.mark.parametrize("workers,servers", [(1, 1), (1, 2), (2, 1), (2, 2), (4, 1), (4, 2)])
def test_every_dtype_exact(workers, servers):
    run = bpslaunch(worker("pushpull_check.py", *SMALL), workers=workers, servers=servers,
                    env={"BYTEPS_PARTITION_BYTES": "64K", "BYTEPS_SCHEDULING_CREDIT": "2"})
    assert run.rc == 0, run.log
    ok = run.lines("OK rank")
    assert len(ok) == workers, run.log
    assert all(f"of {workers}: {2 * 6 * len(SMALL)} tensors checked" in ln for ln in ok), run.log


def test_two_local_ranks_per_machine():
    run = bpslaunch(worker("pushpull_check.py", 5, 5000), workers=2, servers=1, local_size=2,
                    env={"ROUNDS": "1"})
    assert run.rc == 0, run.log
    assert len(run.lines("of 4: 12 tensors checked")) == 4, run.log


def test_64mib_tensor_two_servers():
    n = (64 << 20) // 4  # 64 MiB of float32 (and the other dtypes at the same element count)
    run = bpslaunch(worker("pushpull_check.py", n), workers=2, servers=2,
                    env={"ROUNDS": "1"}, timeout=240)
    assert run.rc == 0, run.log
    assert len(run.lines("OK rank")) == 2, run.log


def test_one_machine_of_four_local_ranks():
    run = bpslaunch(worker("pushpull_check.py", *SMALL), workers=1, servers=1, local_size=4,
                    env={"ROUNDS": "1", "BYTEPS_PARTITION_BYTES": "64K"})
    assert run.rc == 0, run.log
    assert len(run.lines(f"of 4: {6 * len(SMALL)} tensors checked")) == 4, run.log
