"""Worker: rank 0 shuts down while its auto controller's thread is measuring the codec speeds
(the measurement is wrapped to say it began and to hold there until shutdown is under way).
shutdown() must return only once the thread stopped: a thread still inside a codec when the
interpreter finalizes is ended by Python 3.12 with a forced unwind that aborts the process."""
import threading

import numpy as np

import byteps_like as bps
import byteps_like.worker.autocompress as ac
from byteps_like.compression import Compression
from byteps_like.worker.runtime import default_runtime

began = threading.Event()
real = ac.measure_speeds


def measuring(*args, **kwargs):
    began.set()
    stop = kwargs["stop"]
    while not stop():   # held in the measurement until the runtime shuts down...
        threading.Event().wait(0.01)
    return real(*args, **kwargs)   # ...whose first timed call then stops it


def main() -> None:
    ac.measure_speeds = measuring
    bps.init()
    rank = bps.rank()
    auto = Compression.auto(allow=("onebit",))
    x = np.ones(1 << 16, np.float32)
    bps.push_pull(x, name="x", average=False, compression=auto)
    ctl = ac.controller(default_runtime(), auto)
    if rank == 0:
        assert began.wait(60), "rank 0's measuring thread never began"
    bps.shutdown()
    alive = ctl._thread is not None and ctl._thread.is_alive()
    print(f"AUTO SHUTDOWN rank {rank} thread_alive={alive} speeds={ctl.speeds}", flush=True)


if __name__ == "__main__":
    main()
