"""``bps.DistributedSampler`` for Gluon's ``DataLoader``: each rank's indices of an epoch, dealt
from the whole dataset anew every epoch (byteps_like.data.EpochDealer; docs/frameworks/mxnet.md).

    sampler = bps.DistributedSampler(len(train), shuffle=True, seed=0)
    loader = gluon.data.DataLoader(train, batch_size=32, sampler=sampler)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)          # a new deal of the whole dataset, the same on every rank
        for x, y in loader: ...

in place of Gluon's ``SplitSampler`` or a fixed shard per rank. With backup workers
(``BYTEPS_BACKUP_WORKERS=b``) a fixed shard is lost for good when its rank is the slow one, and
an epoch of ``len / size`` samples a rank puts only ``(size - b) / size`` of the data into the
model; here every epoch deals a new permutation of the whole set over the ranks and, with ``b >
0``, each rank's epoch holds ``ceil(len / (size - b * local_size))`` samples (docs/reliability.md,
"Backup workers"). Importing this module imports MXNet (the package loads it on first use).
"""
from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

from ..data import EpochDealer, job_dealer
from ..worker.runtime import default_runtime
from ._mx import mx

_mx: Any = mx()  # MXNet is untyped


class DistributedSampler(_mx.gluon.data.Sampler):
    """``DistributedSampler(length, shuffle=True, seed=0, drop_last=False, *,
    num_replicas=None, rank=None, backup_workers=None, local_size=None)``: a Gluon sampler of
    this rank's indices of the current epoch (``set_epoch(e)`` at the start of each). ``length``
    is the dataset's number of samples (or the dataset itself), as Gluon's samplers take it.
    ``num_replicas``, ``rank``, ``backup_workers`` and ``local_size`` default to the job's
    (``size()``, ``rank()``, ``BYTEPS_BACKUP_WORKERS``, ``local_size()``; call ``init()``
    first). Every rank's ``len(sampler)`` is the same."""

    def __init__(self, length: int | Sized, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, *, num_replicas: int | None = None,
                 rank: int | None = None, backup_workers: int | None = None,
                 local_size: int | None = None) -> None:
        n = length if isinstance(length, int) else len(length)
        self.dealer: EpochDealer = job_dealer(
            n, default_runtime(), num_replicas=num_replicas, rank=rank,
            backup_workers=backup_workers, local_size=local_size, shuffle=shuffle, seed=seed,
            drop_last=drop_last)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next iteration deals (the same on every rank)."""
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[int]:
        return iter(self.dealer.indices(self.epoch))

    def __len__(self) -> int:
        return len(self.dealer)


__all__ = ["DistributedSampler"]
