"""Worker for the refused-registration test: the worker with DMLC_WORKER_ID=1 was told another
job size (DMLC_NUM_WORKER=3) than the rest of the job, as a hand-written launch script might.
Prints ``STARTED T`` (time.time()) before init and ``INIT OK`` after."""
import os
import time

import byteps_like as bps

if os.environ.get("DMLC_WORKER_ID") == "1":
    os.environ["DMLC_NUM_WORKER"] = "3"
print(f"STARTED {time.time():.3f}", flush=True)
bps.init()
print("INIT OK", flush=True)
bps.shutdown()
