"""The deal of a dataset's indices over the ranks, epoch by epoch, for every framework: what
``bps.DistributedSampler`` (PyTorch, Lightning), ``bps.epoch_indices`` / ``bps.epoch_dataset``
(TensorFlow), ``bps.DistributedPyDataset`` (Keras) and ``bps.DistributedSampler`` (MXNet Gluon)
hand each rank (docs/reliability.md, "Backup workers").

    dealer = EpochDealer(len(data), num_replicas=size, rank=rank, seed=0,
                         backup_workers=b, local_size=local_size)
    for epoch in range(epochs):
        mine = dealer.indices(epoch)        # this rank's indices, the same deal on every rank

With ``backup_workers=0`` it is PyTorch's ``DistributedSampler``'s deal: a permutation of the
dataset (``shuffle=False``: the identity), padded with its own first indices to a multiple of
the ranks (or cut to one, ``drop_last``), each rank taking every ``num_replicas``-th index from
its own. With ``backup_workers=b > 0`` every round averages the gradients of only
``aggregated = num_replicas - b * local_size`` ranks (the slowest machines' pushes are dropped),
so the deal changes in two ways:

* an epoch is counted in the samples the rounds average (Chen et al. 2016): each rank gets
  ``ceil(n / aggregated)`` indices (``drop_last``: ``n // aggregated``), taken from the epoch's
  permutation followed by a fresh permutation's first indices (never the first again, which
  could hand a repeated sample to the same rank);
* with ``shuffle=False`` the deal rotates by one rank each epoch, so a rank that is always the
  slow one does not lose the same samples every epoch (with ``shuffle=True`` every epoch is a
  new permutation anyway).

The deal depends only on the arguments and the epoch: every rank computes its part alone, with
no communication, and the parts of one epoch together hold the whole dataset. The permutations
come from ``permutations(seed + epoch)``: by default numpy's PCG64 (the same on every platform);
the PyTorch sampler passes ``torch.randperm`` with a ``torch.Generator``, so its indices are
PyTorch's. This module imports numpy and the standard library only.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

#: ``permutations(seed)`` returns a function that gives a fresh permutation of ``range(n)`` on
#: each call (all of them drawn from the one generator seeded with ``seed``).
Permutations = Callable[[int], Callable[[int], Sequence[int] | np.ndarray]]


def numpy_permutations(seed: int) -> Callable[[int], np.ndarray]:
    """Permutations from numpy's PCG64 generator seeded with ``seed``: the same on every rank,
    machine and platform."""
    rng = np.random.Generator(np.random.PCG64(seed))
    return rng.permutation


class EpochDealer:
    """``EpochDealer(length, num_replicas, rank, *, shuffle=True, seed=0, drop_last=False,
    backup_workers=0, local_size=1, permutations=numpy_permutations)``: rank ``rank``'s indices
    of each epoch of a dataset of ``length`` samples, dealt over ``num_replicas`` ranks
    (module docstring). ``num_samples`` is the length of every rank's part, ``aggregated`` the
    number of ranks a round averages."""

    def __init__(self, length: int, num_replicas: int, rank: int, *, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False, backup_workers: int = 0,
                 local_size: int = 1, permutations: Permutations = numpy_permutations) -> None:
        length, num_replicas, rank = int(length), int(num_replicas), int(rank)
        b, ls = int(backup_workers), int(local_size)
        where = f"the data deal of rank {rank}"
        if length < 0:
            raise ValueError(f"{where}: the dataset's length {length} is negative")
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"{where}: rank must be in [0, num_replicas={num_replicas}) "
                             "and num_replicas >= 1")
        if b < 0 or ls < 1 or num_replicas % ls:
            raise ValueError(f"{where}: backup_workers={b} must be >= 0 and local_size={ls} "
                             f">= 1 and divide num_replicas={num_replicas}")
        if b and b * ls >= num_replicas:
            raise ValueError(f"{where}: backup_workers={b} leaves no rank to average "
                             f"({num_replicas} ranks, {ls} per machine); "
                             "BYTEPS_BACKUP_WORKERS must be below the number of worker machines")
        self.length, self.num_replicas, self.rank = length, num_replicas, rank
        self.shuffle, self.seed, self.drop_last = bool(shuffle), int(seed), bool(drop_last)
        self.backup_workers, self.local_size = b, ls
        self.aggregated = num_replicas - b * ls
        self.permutations = permutations
        self.num_samples = (length // self.aggregated if drop_last
                            else math.ceil(length / self.aggregated))
        self.total_size = self.num_samples * num_replicas

    def __len__(self) -> int:
        return self.num_samples

    def indices(self, epoch: int) -> list[int]:
        """This rank's indices of ``epoch``, in the order to visit them."""
        n, total, size = self.length, self.total_size, self.num_replicas
        if n == 0 or total == 0:
            return []
        draw = self.permutations(self.seed + int(epoch)) if self.shuffle else None

        def one() -> list[int]:
            return list(range(n)) if draw is None else np.asarray(draw(n)).tolist()

        order = one()
        if not self.backup_workers:
            # PyTorch's DistributedSampler: pad with the permutation's own first indices
            if len(order) < total:
                order = (order * math.ceil(total / n))[:total]
            return order[self.rank:total:size]
        while len(order) < total:   # whole permutations, each a fresh one
            order += one()
        start = self.rank if self.shuffle else (self.rank + int(epoch)) % size
        return order[start:total:size]

    def __repr__(self) -> str:
        return (f"EpochDealer(length={self.length}, num_replicas={self.num_replicas}, "
                f"rank={self.rank}, shuffle={self.shuffle}, seed={self.seed}, "
                f"drop_last={self.drop_last}, backup_workers={self.backup_workers}, "
                f"local_size={self.local_size})")


class _Job(Protocol):
    """What :func:`job_dealer` reads of a worker's runtime (byteps_like.worker.runtime)."""

    initialized: bool

    @property
    def config(self) -> Any: ...

    def rank(self) -> int: ...
    def size(self) -> int: ...
    def local_size(self) -> int: ...


def job_dealer(length: int, job: _Job, *, num_replicas: int | None = None,
               rank: int | None = None, backup_workers: int | None = None,
               local_size: int | None = None, **kwargs: Any) -> EpochDealer:
    """An :class:`EpochDealer` whose unset ``num_replicas``, ``rank``, ``backup_workers`` and
    ``local_size`` are the job's (``size()``, ``rank()``, ``BYTEPS_BACKUP_WORKERS``,
    ``local_size()``; the plugins pass their runtime as ``job``). Given ``num_replicas`` and
    ``rank``, a dealer made outside a job (before ``init()``) has no backup workers and one rank
    per machine unless told. ``kwargs``: ``shuffle``, ``seed``, ``drop_last``,
    ``permutations``."""
    if num_replicas is None:
        num_replicas = job.size()
    if rank is None:
        rank = job.rank()
    if backup_workers is None:
        # a job of one worker drops nothing, whatever its setting
        backup_workers = (job.config.server.backup_workers
                          if num_replicas > 1 and job.initialized and job.size() > 1 else 0)
    if local_size is None:
        local_size = job.local_size() if backup_workers and job.initialized else 1
    return EpochDealer(length, num_replicas, rank, backup_workers=backup_workers,
                       local_size=local_size, **kwargs)


__all__ = ["EpochDealer", "job_dealer", "numpy_permutations"]
