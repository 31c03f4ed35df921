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

import math
from collections.abc import Iterator, Sized
from typing import Any, cast

import torch
from torch.utils.data.distributed import DistributedSampler as _TorchSampler

from ..worker.runtime import default_runtime


def _job_backup_workers() -> int:
    """The job's ``BYTEPS_BACKUP_WORKERS`` (0 in a job of one worker: nothing is dropped)."""
    rt = default_runtime()
    return rt.config.server.backup_workers if rt.size() > 1 else 0


class DistributedSampler(_TorchSampler):
    """``DistributedSampler(dataset, num_replicas=None, rank=None, shuffle=True, seed=0,
    drop_last=False, *, backup_workers=None, local_size=None)``.

    ``num_replicas``, ``rank``, ``backup_workers`` and ``local_size`` default to the job's
    (``bps.size()``, ``bps.rank()``, ``BYTEPS_BACKUP_WORKERS``, ``bps.local_size()``; call
    ``bps.init()`` first). Outside a job pass ``num_replicas`` and ``rank``; ``backup_workers``
    is then 0 and ``local_size`` 1 unless given. Call ``set_epoch(e)``
    at the start of every epoch, as with PyTorch's. ``aggregated`` is the number of ranks whose
    gradients a round averages, ``num_replicas - backup_workers * local_size``."""

    def __init__(self, dataset: Any, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False, *,
                 backup_workers: int | None = None, local_size: int | None = None) -> None:
        rt = default_runtime()
        if num_replicas is None:
            num_replicas = rt.size()
        if rank is None:
            rank = rt.rank()
        # given num_replicas and rank, a sampler made outside a job has no backup workers
        if backup_workers is None:
            backup_workers = (_job_backup_workers() if num_replicas > 1 and rt.initialized
                              else 0)
        if local_size is None:
            local_size = rt.local_size() if backup_workers and rt.initialized else 1
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle,
                         seed=seed, drop_last=drop_last)
        b, ls = int(backup_workers), int(local_size)
        if b < 0 or ls < 1 or num_replicas % ls:
            raise ValueError(f"DistributedSampler on rank {rank}: backup_workers={b} must be >= 0 "
                             f"and local_size={ls} >= 1 and divide num_replicas={num_replicas}")
        if b and b * ls >= num_replicas:
            raise ValueError(f"DistributedSampler on rank {rank}: backup_workers={b} leaves no "
                             f"rank to average ({num_replicas} ranks, {ls} per machine); "
                             "BYTEPS_BACKUP_WORKERS must be below the number of worker machines")
        self.backup_workers = b
        self.aggregated = num_replicas - b * ls
        if b:
            n = len(cast(Sized, self.dataset))
            self.num_samples = (n // self.aggregated if drop_last
                                else math.ceil(n / self.aggregated))
            self.total_size = self.num_samples * self.num_replicas

    def __iter__(self) -> Iterator[int]:
        if not self.backup_workers:
            return super().__iter__()
        n = len(cast(Sized, self.dataset))
        if n == 0:
            return iter([])
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        passes, have = [], 0
        while have < self.total_size:   # whole permutations, each a fresh one
            passes.append(torch.randperm(n, generator=g) if self.shuffle else torch.arange(n))
            have += n
        order = torch.cat(passes)[:self.total_size]
        start = self.rank if self.shuffle else (self.rank + self.epoch) % self.num_replicas
        return iter(order[start::self.num_replicas].tolist())


__all__ = ["DistributedSampler"]
