"""``bps.DistributedSampler``: PyTorch's ``DistributedSampler`` for a byteps_like job, and one that
keeps every sample in the model when rounds complete without some workers (backup workers,
``BYTEPS_BACKUP_WORKERS``; docs/reliability.md, "Backup workers").

    sampler = bps.DistributedSampler(dataset, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(dataset, batch_size=32, sampler=sampler)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)          # a new order of the whole dataset, the same on every rank
        for x, y in loader: ...

With ``b = 0`` it is ``torch.utils.data.distributed.DistributedSampler`` with ``num_replicas``
and ``rank`` taken from the job: the same indices, bit for bit.

With ``b > 0`` backup workers, every round averages the gradients of only ``size() - b *
local_size()`` ranks (the slowest machines' pushes are dropped). Two things then go wrong with
the usual split, and this sampler fixes both:

* a **fixed shard per rank** (``data[rank::size]``, or ``shuffle=False``) loses the slow rank's
  shard for good: its pushes are the ones dropped, round after round. Here every epoch deals a
  new permutation of the whole dataset over the ranks (with ``shuffle=False``, the deal rotates
  by one rank each epoch), so a sample dropped in one epoch is another rank's in the next;
* an epoch of ``len(dataset) / size()`` samples per rank puts only ``(size - b) / size`` of
  the dataset into the model. Here an epoch is counted in the samples the rounds average, as
  Chen et al. (2016) count it: each rank gets ``ceil(len(dataset) / (size - b *
  local_size))`` samples, the first permutation followed by a fresh one's first samples (not
  the first permutation again, which would hand a repeated sample to the same rank).

Rounds that still wait for every machine with ``b > 0`` (PyTorch CUDA tensors that machines of
several local ranks reduce through NCCL: docs/reliability.md) drop nothing; there pass
``backup_workers=0``, or an epoch holds ``size / (size - b)`` epochs' worth of samples.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sized
from typing import Any, cast

import torch
from torch.utils.data.distributed import DistributedSampler as _TorchSampler

from ..data import EpochDealer, job_dealer
from ..worker.runtime import default_runtime


def torch_permutations(seed: int) -> Callable[[int], torch.Tensor]:
    """Permutations from a ``torch.Generator`` seeded with ``seed`` (``torch.randperm``), as
    PyTorch's ``DistributedSampler`` draws them: the same on every rank."""
    g = torch.Generator()
    g.manual_seed(seed)
    return lambda n: torch.randperm(n, generator=g)


class DistributedSampler(_TorchSampler):
    """``DistributedSampler(dataset, num_replicas=None, rank=None, shuffle=True, seed=0,
    drop_last=False, *, backup_workers=None, local_size=None)``.

    ``num_replicas``, ``rank``, ``backup_workers`` and ``local_size`` default to the job's
    (``bps.size()``, ``bps.rank()``, ``BYTEPS_BACKUP_WORKERS``, ``bps.local_size()``; call
    ``bps.init()`` first). Outside a job pass ``num_replicas`` and ``rank``; ``backup_workers``
    is then 0 and ``local_size`` 1 unless given. Call ``set_epoch(e)``
    at the start of every epoch, as with PyTorch's. ``aggregated`` is the number of ranks whose
    gradients a round averages, ``num_replicas - backup_workers * local_size``. The deal itself
    is :class:`byteps_like.data.EpochDealer`'s (``dealer``), the one every framework's data
    helper uses, with PyTorch's permutations."""

    def __init__(self, dataset: Any, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False, *,
                 backup_workers: int | None = None, local_size: int | None = None) -> None:
        rt = default_runtime()
        if num_replicas is None:
            num_replicas = rt.size()
        if rank is None:
            rank = rt.rank()
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle,
                         seed=seed, drop_last=drop_last)
        try:
            self.dealer: EpochDealer = job_dealer(
                len(cast(Sized, dataset)), rt, num_replicas=num_replicas, rank=rank,
                backup_workers=backup_workers, local_size=local_size, shuffle=shuffle,
                seed=seed, drop_last=drop_last, permutations=torch_permutations)
        except ValueError as exc:
            raise ValueError(f"DistributedSampler: {exc}") from None
        self.backup_workers = self.dealer.backup_workers
        self.aggregated = self.dealer.aggregated
        self.num_samples = self.dealer.num_samples
        self.total_size = self.dealer.total_size

    def __iter__(self) -> Iterator[int]:
        return iter(self.dealer.indices(self.epoch))


__all__ = ["DistributedSampler"]
