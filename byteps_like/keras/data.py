"""``bps.DistributedPyDataset``: ``model.fit`` data for a byteps_like job, dealt from the whole
dataset anew every epoch (byteps_like.data.EpochDealer; docs/frameworks/keras.md).

    model.fit(bps.DistributedPyDataset(x_train, y_train, batch_size=32, seed=1), epochs=10)

in place of each rank fitting its own fixed shard (``model.fit(x[rank::size], ...)``). With backup
workers (``BYTEPS_BACKUP_WORKERS=b``) a fixed shard is lost for good when its rank is the slow
one, and an epoch of ``len / size`` samples a rank puts only ``(size - b) / size`` of the data into
the model; here every epoch deals a new permutation of the whole set over the ranks and, with
``b > 0``, each rank's epoch holds ``ceil(len / (size - b * local_size))`` samples
(docs/reliability.md, "Backup workers"). Every rank has the same number of batches.
"""
from __future__ import annotations

import math
from typing import Any

import keras
import numpy as np

from ..data import EpochDealer, job_dealer
from ..worker.runtime import default_runtime


def _length(x: Any) -> int:
    lengths = {len(a) for a in keras.tree.flatten(x)}
    if len(lengths) != 1:
        raise ValueError(f"DistributedPyDataset: the arrays' first dimensions differ "
                         f"({sorted(lengths)}); they must all be the number of samples")
    return lengths.pop()


class DistributedPyDataset(keras.utils.PyDataset):
    """``DistributedPyDataset(x, y=None, batch_size=32, *, shuffle=True, seed=0,
    drop_last=False, sample_weight=None, num_replicas=None, rank=None, backup_workers=None,
    local_size=None, **kwargs)``: a ``keras.utils.PyDataset`` of this rank's batches of each
    epoch. ``x`` (and ``y``, ``sample_weight``) are numpy arrays, or lists, tuples or dicts of
    them, indexed by sample. Its first epoch is 0 (or ``set_epoch(e)``'s, for
    ``fit(initial_epoch=e)``), and every later epoch Keras begins over it
    (``on_epoch_begin``) is the next one: give ``fit`` its own dataset. ``num_replicas``, ``rank``,
    ``backup_workers`` and ``local_size`` default to the job's; ``kwargs`` go to ``PyDataset``
    (``workers``, ``use_multiprocessing``, ``max_queue_size``)."""

    def __init__(self, x: Any, y: Any = None, batch_size: int = 32, *, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False, sample_weight: Any = None,
                 num_replicas: int | None = None, rank: int | None = None,
                 backup_workers: int | None = None, local_size: int | None = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if batch_size < 1:
            raise ValueError(f"DistributedPyDataset: batch_size={batch_size} must be >= 1")
        arrays = tuple(a for a in (x, y, sample_weight) if a is not None)
        self._data = keras.tree.map_structure(np.asarray, arrays)
        self.batch_size = int(batch_size)
        self.dealer: EpochDealer = job_dealer(
            _length(self._data), default_runtime(), num_replicas=num_replicas, rank=rank,
            backup_workers=backup_workers, local_size=local_size, shuffle=shuffle, seed=seed,
            drop_last=drop_last)
        self.epoch = 0
        self._begun = False   # whether Keras began an epoch since set_epoch
        self._order: tuple[int, np.ndarray] | None = None

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose deal the next batches come from (the next one Keras begins)."""
        self.epoch = int(epoch)
        self._begun = False

    def indices(self) -> np.ndarray:
        """This rank's indices of the current epoch."""
        if self._order is None or self._order[0] != self.epoch:
            self._order = (self.epoch, np.asarray(self.dealer.indices(self.epoch),
                                                  dtype=np.int64))
        return self._order[1]

    def __len__(self) -> int:
        return math.ceil(len(self.dealer) / self.batch_size)

    def __getitem__(self, index: int) -> Any:
        if not 0 <= index < len(self):
            raise IndexError(f"DistributedPyDataset: batch {index} of {len(self)}")
        idx = self.indices()[index * self.batch_size:(index + 1) * self.batch_size]
        batch = keras.tree.map_structure(lambda a: a[idx], self._data)
        return batch if len(batch) > 1 else batch[0]

    def on_epoch_begin(self) -> None:
        # Keras also calls on_epoch_end when it sets up (and after a short epoch), so the
        # epochs are counted where they begin
        if self._begun:
            self.epoch += 1
        self._begun = True


__all__ = ["DistributedPyDataset"]
