"""Tensor fusion changes how gradients travel, not what they average to: training through
DistributedOptimizer with fusion off, with many small buckets and with one bucket gives the same
parameters bit for bit (float32, 2 workers, so every sum has one order)."""
from __future__ import annotations

import re

import numpy as np
import pytest

from .harness import bpslaunch, worker

pytestmark = pytest.mark.integration

#: BYTEPS_FUSION_BYTES: off, small buckets (several fused buckets and some gradients alone), the
#: default (everything of these models in one bucket)
FUSION = {"off": "0", "small": "3000", "default": None}
MODES = ["plain", "bpps2", "unused", "fp16", "ddp", "cross", "join"]


def train(tmp_path, modes: list[str], fusion: str):
    """{mode: {rank:name: parameters}}, {mode: (buckets, fused buckets)} of one job."""
    out = tmp_path / fusion
    out.mkdir()
    env: dict[str, str] = {}
    if FUSION[fusion] is not None:
        env["BYTEPS_FUSION_BYTES"] = FUSION[fusion]
    run = bpslaunch(worker("fusion_check.py", ",".join(modes), out), workers=2, servers=1,
                    env=env, timeout=150)
    assert run.rc == 0, run.log
    params, buckets = {}, {}
    for mode in modes:
        ranks = [dict(np.load(out / f"{mode}.rank{r}.npz")) for r in range(2)]
        if mode != "join":  # every rank ends with the same model (join: rank 1 stepped less)
            for name in ranks[0]:
                assert np.array_equal(ranks[0][name], ranks[1][name]), (mode, name, run.log)
        params[mode] = {f"{r}:{n}": a for r, d in enumerate(ranks) for n, a in d.items()}
        m = re.search(rf"BUCKETS {mode} (\d+) (\d+)", run.out)
        assert m, run.log
        buckets[mode] = (int(m.group(1)), int(m.group(2)))
    return params, buckets


def assert_identical(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == np.float32
        assert np.array_equal(a[name], b[name]), (
            f"{what} {name}: max difference {np.abs(a[name] - b[name]).max()}")


def test_fused_training_equals_unfused_bit_for_bit(tmp_path):
    """plain, backward_passes_per_step, a parameter without gradient, fp16 compression (each
    element rounds as it does alone), DistributedDataParallel, CrossBarrier, join."""
    off, off_b = train(tmp_path, MODES, "off")
    small, small_b = train(tmp_path, MODES, "small")
    one, one_b = train(tmp_path, MODES, "default")
    for mode in MODES:
        # the three runs really travelled differently: (buckets, fused buckets)
        assert off_b[mode][1] == 0, off_b
        assert small_b[mode][1] >= 2, small_b
        assert off_b[mode][0] > small_b[mode][0] > one_b[mode][0], (off_b, small_b, one_b)
        assert_identical(off[mode], small[mode], mode)
        assert_identical(off[mode], one[mode], mode)
    # CrossBarrier applies the same updates, one bucket at a time during the next forward
    for run in (off, small, one):
        assert_identical(run["plain"], run["cross"], "cross")


