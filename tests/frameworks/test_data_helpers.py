"""Issue 38: each framework's data helper deals byteps_like.data.EpochDealer's indices (the deal
bps.DistributedSampler makes for PyTorch): TensorFlow's ``bps.epoch_indices`` and
``bps.epoch_dataset`` (tuples and dicts of arrays and tensors, x and y kept paired), Keras's
``bps.DistributedPyDataset`` through ``model.fit`` (the epochs Keras begins advance the deal;
``set_epoch`` moves it) and MXNet's ``bps.DistributedSampler`` through Gluon's DataLoader. As a
rank of 3 workers with b = 1 (passed explicitly, in one process: workers/data_helpers.py), each
rank's epoch holds ceil(50 / 2) = 25 samples and the ranks of an epoch cover the dataset. The
examples that use them run under bpslaunch in test_examples.py."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from byteps_like.data import EpochDealer
from tests.frameworks.envs import TF_ENV, importable
from tests.support import clean_env, run

WORKER = str(Path(__file__).parent / "workers" / "data_helpers.py")
N, SIZE, B, SEED, BATCH, EPOCHS = 50, 3, 1, 4, 8, 3


def needs(*modules: str):
    whys = [w for w in map(importable, modules) if w]
    return pytest.mark.skipif(bool(whys), reason="; ".join(whys))


def results(framework: str) -> dict:
    r = run([sys.executable, WORKER, framework], 240, clean_env(**TF_ENV), merge=True)
    assert r.rc == 0, r.out
    (line,) = [ln for ln in r.out.splitlines() if ln.startswith("RESULT ")]
    return json.loads(line.removeprefix("RESULT "))


def want(rank: int, epoch: int) -> list[int]:
    return EpochDealer(N, SIZE, rank, seed=SEED, backup_workers=B).indices(epoch)


def check_deal(per_rank: dict, what: str) -> None:
    assert sorted(per_rank) == [str(r) for r in range(SIZE)], what
    for rank, epochs in per_rank.items():
        assert epochs == [want(int(rank), e) for e in range(EPOCHS)], (what, rank)
        assert {len(e) for e in epochs} == {math.ceil(N / (SIZE - B))}, what
    for e in range(EPOCHS):
        assert set().union(*(set(per_rank[str(r)][e]) for r in range(SIZE))) == set(range(N))


@pytest.mark.timeout(300)
@needs("tensorflow", "keras")
def test_tensorflow_and_keras_helpers_deal_the_epoch_dealers_indices():
    out = results("tensorflow")
    for what in ("epoch_indices", "epoch_dataset", "epoch_dataset_dict", "keras_fit"):
        check_deal(out[what], what)
    per_rank = math.ceil(N / (SIZE - B))
    assert out["keras_len"] == {str(r): [math.ceil(per_rank / BATCH), per_rank]
                                for r in range(SIZE)}
    assert out["keras_set_epoch"] == {str(r): want(r, 7) for r in range(SIZE)}
    assert "first dimensions differ ([3, 50])" in out["error"], out["error"]


@pytest.mark.timeout(300)
@needs("mxnet")
def test_mxnet_sampler_deals_the_epoch_dealers_indices_through_gluons_dataloader():
    out = results("mxnet")
    check_deal(out["mxnet_loader"], "mxnet_loader")
    per_rank = math.ceil(N / (SIZE - B))
    assert out["mxnet_len"] == {str(r): [math.ceil(per_rank / BATCH), per_rank]
                                for r in range(SIZE)}
