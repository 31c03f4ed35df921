"""Worker: each framework's data helper deals what byteps_like.data.EpochDealer deals
(tests/frameworks/test_data_helpers.py). One process, no job: the ranks, backup workers and
machines are passed explicitly, as a rank of a job of 3 workers with b = 1 would have them.

Usage: data_helpers.py tensorflow|mxnet
Prints one ``RESULT <json>`` line: {what: {rank: [indices of epoch 0, 1, 2]}} for every helper,
as the framework delivered the samples (the samples' features are their indices).
"""
from __future__ import annotations

import json
import os
import sys
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
N, SIZE, B, SEED, BATCH, EPOCHS = 50, 3, 1, 4, 8, 3
JOB = {"num_replicas": SIZE, "backup_workers": B, "local_size": 1}


def tensorflow() -> dict:
    import keras
    import numpy as np
    import tensorflow as tf

    import byteps_like.keras as bps_keras
    import byteps_like.tensorflow as bps
    x = np.arange(N, dtype=np.float32)[:, None]
    y = np.arange(N, dtype=np.int64) * 10
    out: dict = {"epoch_indices": {}, "epoch_dataset": {}, "epoch_dataset_dict": {},
                 "keras_fit": {}, "keras_len": {}, "keras_set_epoch": {}}
    for rank in range(SIZE):
        out["epoch_indices"][rank] = [bps.epoch_indices(N, e, seed=SEED, rank=rank, **JOB)
                                      .tolist() for e in range(EPOCHS)]
        got, got_dict = [], []
        for e in range(EPOCHS):
            ds = bps.epoch_dataset((x, tf.constant(y)), e, seed=SEED, rank=rank, **JOB)
            rows = [(int(a[0]), int(b)) for a, b in ds.as_numpy_iterator()]
            assert all(b == 10 * a for a, b in rows), rows   # x and y stay paired
            got.append([a for a, _ in rows])
            ds = bps.epoch_dataset({"x": x, "y": y}, e, seed=SEED, rank=rank, **JOB).batch(BATCH)
            got_dict.append([int(v) for d in ds.as_numpy_iterator() for v in d["x"][:, 0]])
        out["epoch_dataset"][rank], out["epoch_dataset_dict"][rank] = got, got_dict

        calls: dict[int, dict[int, list[int]]] = {}

        class Recording(bps_keras.DistributedPyDataset):
            def __getitem__(self, i):
                batch = super().__getitem__(i)
                calls.setdefault(self.epoch, {})[i] = batch[0][:, 0].astype(int).tolist()
                return batch

        data = Recording(x, y % 10, BATCH, seed=SEED, rank=rank, **JOB)
        model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(10)])
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(data, epochs=EPOCHS, verbose=0)
        out["keras_fit"][rank] = [[i for b in sorted(calls[e]) for i in calls[e][b]]
                                  for e in range(EPOCHS)]
        out["keras_len"][rank] = [len(data), len(data.dealer)]
        calls.clear()
        data.set_epoch(7)
        model.fit(data, epochs=1, verbose=0)
        out["keras_set_epoch"][rank] = [i for b in sorted(calls[7]) for i in calls[7][b]]
    try:
        bps.epoch_dataset((x, y[:3]), 0, rank=0, **JOB)
    except ValueError as exc:
        out["error"] = str(exc)
    return out


def mxnet() -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import numpy as np
        from mxnet import gluon

        import byteps_like.mxnet as bps
    data = gluon.data.ArrayDataset(np.arange(N, dtype=np.float32), np.zeros(N, np.float32))
    out: dict = {"mxnet_loader": {}, "mxnet_len": {}}
    for rank in range(SIZE):
        sampler = bps.DistributedSampler(N, shuffle=True, seed=SEED, rank=rank, **JOB)
        assert isinstance(sampler, gluon.data.Sampler)
        loader = gluon.data.DataLoader(data, batch_size=BATCH, sampler=sampler)
        epochs = []
        for e in range(EPOCHS):
            sampler.set_epoch(e)
            epochs.append([int(v) for x, _ in loader for v in x.asnumpy()])
        out["mxnet_loader"][rank] = epochs
        out["mxnet_len"][rank] = [len(loader), len(sampler)]
    return out


if __name__ == "__main__":
    print("RESULT " + json.dumps({"tensorflow": tensorflow, "mxnet": mxnet}[sys.argv[1]]()),
          flush=True)
