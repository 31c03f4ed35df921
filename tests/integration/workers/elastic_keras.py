"""An elastic Keras (TensorFlow backend) worker for tests/integration/test_elastic_frameworks.py.

Usage: elastic_keras.py EPOCHS [kill=STEP@RANK] [commit=EVERY]

``model.fit`` (compiled steps: a membership change reaches Python as a TensorFlow error) inside
``@bps.elastic.run`` on a ``KerasState(model, epoch=0, batch=0, step=0)`` with Horovod's
callbacks (UpdateBatchState, UpdateEpochState, CommitState every EVERY batches) and
``initial_epoch=state.epoch``. Each worker trains on its shard of a fixed regression set (rank
and size of the current epoch). After every batch it prints one JSON line: rank, size, step
(batches done by the job), a CRC of the weights. ``kill=STEP@RANK``: the worker of that rank in
the first epoch SIGKILLs itself at the start of the batch after STEP batches are done.
"""
import json
import os
import signal
import sys
import time
import zlib

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import byteps_like.keras as bps  # noqa: E402
from byteps_like.worker.runtime import default_runtime  # noqa: E402

epochs = int(sys.argv[1])
opts = dict(a.split("=", 1) for a in sys.argv[2:])
kill_at, _, kill_rank = opts.get("kill", "-1@-1").partition("@")
kill_at, kill_rank = int(kill_at), int(kill_rank or 0)
every = int(opts.get("commit", 2))

rt = default_runtime()
bps.init()
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)


def say(**kw):
    print(json.dumps({**kw, "t": time.time()}), flush=True)


def epoch_no():
    return rt.epoch


say(started=bps.rank(), size=bps.size(), pid=os.getpid())
keras.utils.set_random_seed(1000 + os.getpid() % 1000)   # different: the sync must fix it
rng = np.random.default_rng(7)
X = rng.normal(size=(96, 8)).astype(np.float32)
Y = (X @ rng.normal(size=(8, 2))).astype(np.float32)
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh",
                                                                name="hidden"),
                          keras.layers.Dense(2, name="out")])
model.compile(optimizer=bps.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9)),
              loss="mse")
state = bps.elastic.KerasState(model, epoch=0, batch=0, step=0)


def crc() -> int:
    return zlib.crc32(b"".join(np.ascontiguousarray(w).tobytes() for w in model.get_weights()))


class Report(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        if state.step == kill_at and bps.rank() == kill_rank and epoch_no() <= 1:
            say(killing=state.step, rank=bps.rank())
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_end(self, batch, logs=None):
        state.step += 1
        say(rank=bps.rank(), size=bps.size(), step=state.step, crc=crc())


state.register_reset_callbacks([lambda: say(reset=True, rank=bps.rank(), size=bps.size())])
callbacks = [Report(), bps.elastic.UpdateBatchStateCallback(state),
             bps.elastic.UpdateEpochStateCallback(state),
             bps.elastic.CommitStateCallback(state, batches_per_commit=every)]


@bps.elastic.run
def train(state):
    if state.last_reset is not None:
        say(resumed=round(state.last_reset[0], 3), rank=bps.rank(), size=bps.size())
    r, n = bps.rank(), bps.size()
    model.fit(X[r::n], Y[r::n], batch_size=8, epochs=epochs, initial_epoch=state.epoch,
              shuffle=False, verbose=0, callbacks=callbacks)


train(state)
say(done=True, rank=bps.rank(), size=bps.size(), step=state.step, epoch=state.epoch, crc=crc())
bps.shutdown()
