"""byteps_like.data.EpochDealer: the framework-neutral deal of a dataset's indices over the ranks
that every framework's data helper uses (bps.DistributedSampler for PyTorch, Lightning and
MXNet, bps.epoch_indices / epoch_dataset for TensorFlow, bps.DistributedPyDataset for Keras;
docs/reliability.md, "Backup workers"). No framework is imported here."""
from __future__ import annotations

import math
import subprocess
import sys
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest

from byteps_like.data import EpochDealer, job_dealer, numpy_permutations

SHAPES = [(1437, 4, 1, 1), (1437, 4, 0, 1), (240, 3, 1, 1), (7, 4, 1, 1), (1000, 6, 1, 2),
          (1000, 6, 0, 2), (5, 8, 0, 1), (101, 8, 3, 2), (64, 4, 2, 1)]


def parts(n, size, b, ls, epoch, **kw) -> list[list[int]]:
    return [EpochDealer(n, size, r, backup_workers=b, local_size=ls, **kw).indices(epoch)
            for r in range(size)]


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("n, size, b, ls", SHAPES)
def test_the_ranks_of_an_epoch_cover_the_dataset_with_the_right_counts(n, size, b, ls, shuffle):
    """Every rank's part has ceil(n / (size - b * ls)) indices; together they hold every index
    of the dataset, each at most twice (b = 0: padding from the permutation's start; b > 0:
    a fresh permutation's first indices), and the parts differ per epoch."""
    want = math.ceil(n / (size - b * ls))
    for epoch in (0, 1, 5):
        ps = parts(n, size, b, ls, epoch, shuffle=shuffle, seed=3)
        assert [len(p) for p in ps] == [want] * size
        counts = Counter(i for p in ps for i in p)
        assert set(counts) == set(range(n)), (n, size, b, epoch)
        assert sum(counts.values()) == size * want
        assert max(counts.values()) <= math.ceil(size * want / n)
    assert parts(n, size, b, ls, 0, shuffle=shuffle, seed=3) != \
        parts(n, size, b, ls, 1, shuffle=shuffle, seed=3) or (not shuffle and not b) or n < 2


@pytest.mark.parametrize("n, size, b, ls", SHAPES)
def test_drop_last_counts_whole_rounds_and_repeats_nothing_within_a_permutation(n, size, b, ls):
    want = n // (size - b * ls)
    ps = parts(n, size, b, ls, 2, drop_last=True, seed=1)
    assert [len(p) for p in ps] == [want] * size
    flat = [i for p in ps for i in p]
    if size * want <= n:   # one permutation's worth: no index twice
        assert len(set(flat)) == len(flat)


def test_without_backup_workers_it_is_pytorchs_deal():
    """b = 0, shuffle=False: rank r takes r, r + size, ... of the range padded with its start
    (what torch.utils.data.DistributedSampler gives; tests/unit/test_sampler.py compares the
    shuffled deal with PyTorch's own, through the PyTorch sampler)."""
    assert EpochDealer(10, 4, 1, shuffle=False).indices(0) == [1, 5, 9]
    assert EpochDealer(10, 4, 3, shuffle=False).indices(7) == [3, 7, 1]   # padded, no rotation
    assert EpochDealer(10, 4, 3, shuffle=False, drop_last=True).indices(0) == [3, 7]
    # shuffled: the permutation of seed + epoch, padded from its own start
    perm = np.random.Generator(np.random.PCG64(9 + 2)).permutation(10).tolist()
    assert EpochDealer(10, 4, 2, seed=9).indices(2) == (perm + perm[:2])[2::4]


def test_with_backup_workers_a_fresh_permutation_follows_and_shuffle_false_rotates():
    draw = numpy_permutations(9 + 2)
    order = draw(10).tolist() + draw(10).tolist()
    assert EpochDealer(10, 3, 1, seed=9, backup_workers=1).indices(2) == order[1:15:3]
    # shuffle=False: the deal rotates by one rank per epoch
    assert EpochDealer(10, 3, 0, shuffle=False, backup_workers=1).indices(0) == \
        [0, 3, 6, 9, 2]
    assert EpochDealer(10, 3, 0, shuffle=False, backup_workers=1).indices(1) == \
        [1, 4, 7, 0, 3]


def test_a_rank_always_dropped_loses_no_sample_for_good():
    """Rank 3 of 4 is late in every round (b = 1): over 10 epochs every sample is in another
    rank's part, about 10 times each; with a fixed shard a quarter would never be."""
    n, seen = 1437, Counter()
    for epoch in range(10):
        ps = parts(n, 4, 1, 1, epoch, seed=2)
        seen.update(i for p in ps[:3] for i in p)
    assert set(seen) == set(range(n))
    assert abs(sum(seen.values()) / n - 10) < 0.1


def test_every_rank_computes_the_same_deal_in_its_own_process():
    """The deal depends only on its arguments: another interpreter (another hash seed) gives
    the same parts as this one."""
    code = ("from byteps_like.data import EpochDealer; "
            "print([EpochDealer(1437, 4, r, seed=7, backup_workers=1).indices(3) "
            "for r in range(4)])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env={"PYTHONHASHSEED": "123", "PATH": "/usr/bin:/bin"},
                         check=True).stdout
    assert out.strip() == str(parts(1437, 4, 1, 1, 3, seed=7))


def job(size=4, rank=2, local_size=1, b=1, initialized=True):
    return SimpleNamespace(initialized=initialized, rank=lambda: rank, size=lambda: size,
                           local_size=lambda: local_size,
                           config=SimpleNamespace(server=SimpleNamespace(backup_workers=b)))


def test_job_dealer_takes_the_jobs_ranks_and_backup_workers():
    d = job_dealer(100, job(6, 5, 2, 1), seed=1)
    assert (d.num_replicas, d.rank, d.backup_workers, d.local_size) == (6, 5, 1, 2)
    assert d.aggregated == 4 and len(d) == 25
    # a job of one worker drops nothing; explicit arguments win; outside a job b is 0
    assert job_dealer(100, job(1, 0)).backup_workers == 0
    assert job_dealer(100, job(), backup_workers=0).backup_workers == 0
    outside = job_dealer(100, job(initialized=False), num_replicas=4, rank=1)
    assert (outside.backup_workers, outside.local_size) == (0, 1)


def test_bad_settings_are_refused_naming_them():
    with pytest.raises(ValueError, match="backup_workers=4 leaves no rank"):
        EpochDealer(10, 4, 0, backup_workers=4)
    with pytest.raises(ValueError, match="local_size=3 >= 1 and divide num_replicas=4"):
        EpochDealer(10, 4, 0, backup_workers=1, local_size=3)
    with pytest.raises(ValueError, match=r"rank must be in \[0, num_replicas=4\)"):
        EpochDealer(10, 4, 4)
    with pytest.raises(ValueError, match="length -1 is negative"):
        EpochDealer(-1, 4, 0)
    assert EpochDealer(0, 4, 0, backup_workers=1).indices(0) == []
