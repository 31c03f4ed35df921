"""Feeding ``tf.data`` in a byteps_like job: each rank's indices of an epoch, dealt from the whole
dataset anew every epoch (byteps_like.data.EpochDealer; docs/frameworks/tensorflow.md).

    for epoch in range(epochs):
        data = bps.epoch_dataset((x_train, y_train), epoch, seed=1).batch(32)
        for x, y in data: ...

With backup workers (``BYTEPS_BACKUP_WORKERS=b``) a fixed shard per rank
(``dataset.shard(size, rank)``) loses the slow machine's shard for good, and an epoch of
``len / size`` samples a rank puts only ``(size - b) / size`` of the data into the model. These
helpers deal a new permutation of the whole dataset over the ranks each epoch and, with ``b >
0``, give each rank ``ceil(len / (size - b * local_size))`` samples (docs/reliability.md,
"Backup workers"). With ``b = 0`` the deal is PyTorch's ``DistributedSampler``'s (with numpy's
permutations).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from ..data import EpochDealer, job_dealer
from ..worker.runtime import default_runtime


def dealer(length: int, *, shuffle: bool = True, seed: int = 0, drop_last: bool = False,
           num_replicas: int | None = None, rank: int | None = None,
           backup_workers: int | None = None, local_size: int | None = None) -> EpochDealer:
    """The job's :class:`byteps_like.data.EpochDealer` for a dataset of ``length`` samples:
    ``num_replicas``, ``rank``, ``backup_workers`` and ``local_size`` default to the job's
    (``size()``, ``rank()``, ``BYTEPS_BACKUP_WORKERS``, ``local_size()``; call ``init()``
    first). ``len(dealer)`` is every rank's number of samples an epoch."""
    return job_dealer(length, default_runtime(), num_replicas=num_replicas, rank=rank,
                      backup_workers=backup_workers, local_size=local_size, shuffle=shuffle,
                      seed=seed, drop_last=drop_last)


def epoch_indices(length: int, epoch: int, *, shuffle: bool = True, seed: int = 0,
                  drop_last: bool = False, **job: Any) -> np.ndarray:
    """This rank's indices (int64) of ``epoch`` for a dataset of ``length`` samples: the same
    deal, computed alone, on every rank (pass the same ``seed``). ``job``: ``num_replicas``,
    ``rank``, ``backup_workers``, ``local_size`` to override the job's (see :func:`dealer`)."""
    d = dealer(length, shuffle=shuffle, seed=seed, drop_last=drop_last, **job)
    return np.asarray(d.indices(epoch), dtype=np.int64)


def _take(value: Any, idx: np.ndarray) -> Any:
    if isinstance(value, np.ndarray):
        return value[idx]
    return tf.gather(value, idx)


def epoch_dataset(tensors: Any, epoch: int, *, shuffle: bool = True, seed: int = 0,
                  drop_last: bool = False, **job: Any) -> tf.data.Dataset:
    """``tf.data.Dataset.from_tensor_slices`` of this rank's samples of ``epoch``, in the order
    of the deal (no further shuffle needed): ``tensors`` is an array or tensor, or a tuple,
    list or dict of them, sharing their first dimension (as ``from_tensor_slices`` takes).
    Batch it as usual; every rank gets the same number of samples."""
    flat = tf.nest.flatten(tensors)
    if not flat:
        raise ValueError("epoch_dataset: tensors holds no array")
    lengths = {int(len(t)) if isinstance(t, np.ndarray) else int(tf.shape(t)[0]) for t in flat}
    if len(lengths) != 1:
        raise ValueError(f"epoch_dataset: the arrays' first dimensions differ "
                         f"({sorted(lengths)}); they must all be the number of samples")
    idx = epoch_indices(lengths.pop(), epoch, shuffle=shuffle, seed=seed, drop_last=drop_last,
                        **job)
    return tf.data.Dataset.from_tensor_slices(
        tf.nest.map_structure(lambda t: _take(t, idx), tensors))


__all__ = ["dealer", "epoch_indices", "epoch_dataset"]
