"""Runs an example script with a worker loss injected, for test_elastic_frameworks.py.

Usage: elastic_example.py STEP@RANK SCRIPT [ARGS...]

The worker of rank RANK in the job's first epoch SIGKILLs itself at its STEP-th
``DistributedOptimizer.step()``, after the backward pass started the gradients' push_pulls of
that step and before it waits for them: the other workers wait in that step when it dies. The
script itself is run unchanged (``runpy``), as ``python SCRIPT ARGS...`` would.
"""
import os
import runpy
import signal
import sys

from byteps_like.torch.optimizer import DistributedOptimizer
from byteps_like.worker.runtime import default_runtime

kill_step, _, kill_rank = sys.argv[1].partition("@")
kill_step, kill_rank = int(kill_step), int(kill_rank)
script, args = sys.argv[2], sys.argv[3:]

rt = default_runtime()

calls = 0
orig_step = DistributedOptimizer.step


def step(self, closure=None):
    global calls
    calls += 1
    if calls == kill_step and rt.rank() == kill_rank and rt.epoch <= 1:
        print(f"elastic_example: worker rank {kill_rank} SIGKILLs itself in step {calls}",
              flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    return orig_step(self, closure)


DistributedOptimizer.step = step  # type: ignore[method-assign]
sys.argv = [script, *args]
runpy.run_path(script, run_name="__main__")
