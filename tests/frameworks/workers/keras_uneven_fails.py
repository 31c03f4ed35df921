"""Worker: Keras ``fit`` on uneven shards (33 / 32 batches) with only the broadcast callback,
no JoinCallback: the rank with more batches fails with PeerLeftError (its peer ended without
join()); tests/frameworks/test_keras.py checks the report the failing job prints."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import byteps_like.keras as bps  # noqa: E402

bps.init()
rank = bps.rank()
n = 1025 if rank == 0 else 1024   # 33 and 32 batches of 32
rng = np.random.default_rng(rank)
x = rng.normal(size=(n, 4)).astype("float32")
y = rng.normal(size=(n, 2)).astype("float32")
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(2)])
model.compile(optimizer=bps.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss="mse")
model.fit(x, y, batch_size=32, epochs=2, verbose=0,
          callbacks=[bps.callbacks.BroadcastGlobalVariablesCallback(0)])
print(f"FIT DONE rank {rank}", flush=True)
