"""Server-held tables losing servers, for tests/faults/test_lose_server.py. Usage:
lose_server_tables.py OUT STEPS [KILLS [OPTIMIZER]]

Each step every worker pulls the rows of a batch (ids from its rank and the step, overlapping
between the workers), makes gradients from them, pushes them, and push_pulls one dense tensor.
KILLS is a comma-separated list of STEP:SERVER:PHASE: worker rank 0 SIGKILLs server rank SERVER
at that step, before the step's pull (PHASE pull) or right before its push (PHASE push).
OPTIMIZER: sgd (the default), adagrad or adam. At the end every rank pulls every row and writes
them and the dense tensor to OUT.<rank>.npz, with every row as each step began (``trace``, by
the table's round ``trace_rounds``: a rollback repeats rounds); rank 0 prints ``STEP_TIMES``
and each rank ``ROLLED_BACK`` with the steps lost servers rolled the table back.
LOAD_SNAPSHOTS=FOLDER[@ROUND] in the environment: first restore the table from another job's
snapshots (table.load_snapshots) and start at the step after the round it returns
(``LOADED``)."""
import os
import signal
import sys
import time

import numpy as np

import byteps_like as bps
from byteps_like.worker.runtime import default_runtime

out, steps = sys.argv[1], int(sys.argv[2])
kills: dict = {}
for item in filter(None, (sys.argv[3] if len(sys.argv) > 3 else "").split(",")):
    step, server, phase = item.split(":")
    kills.setdefault((int(step), phase), []).append(int(server))
optimizer = sys.argv[4] if len(sys.argv) > 4 else "sgd"

ROWS, DIM = 500, 8
bps.init()
rank = bps.rank()
table = bps.embedding_table("emb", ROWS, DIM, optimizer=optimizer, lr=0.05, seed=7)
dense = np.linspace(-1, 1, 5000, dtype=np.float32)


def kill(step: int, phase: str) -> None:
    for server in kills.get((step, phase), []) if rank == 0 else []:
        peers = default_runtime().members.controller.peers
        pid = [p.pid for p in peers if p.role == "server" and p.rank == server][0]
        os.kill(pid, signal.SIGKILL)
        print(f"KILLED server {server} pid {pid} at step {step} before its {phase}", flush=True)


times, trace, trace_rounds = [], [], []
first = 0
if os.environ.get("LOAD_SNAPSHOTS"):
    folder, _, at = os.environ["LOAD_SNAPSHOTS"].partition("@")
    first = table.load_snapshots(folder, int(at) if at else None)
    print(f"LOADED round {first}", flush=True)
for step in range(first, steps):
    t0 = time.monotonic()
    kill(step, "pull")
    trace.append(table.pull(np.arange(ROWS)))
    trace_rounds.append(table.step)   # after the pull: a rollback may have moved it
    ids = np.unique((np.arange(40) * (7 + rank) + 13 * step) % ROWS)
    rows = table.pull(ids)
    grads = (np.sin(rows * (1.0 + 0.1 * rank)) + 0.01 * step).astype(np.float32)
    kill(step, "push")
    table.push(ids, grads, average=True)
    dense -= np.float32(0.1) * bps.push_pull(np.cos(dense + step + rank), name="dense",
                                             average=True)
    times.append(time.monotonic() - t0)
# a rollback (snapshots) can leave the ranks one round apart: join() as for uneven inputs
if bps.local_size() == 1:   # join() needs one process per machine
    bps.join()
final = table.pull(np.arange(ROWS))
np.savez(f"{out}.{rank}.npz", rows=final, dense=dense, trace=np.stack(trace) if trace else np.zeros((0, ROWS, DIM)),
         trace_rounds=np.array(trace_rounds))
print(f"ROLLED_BACK {table.stats.rolled_back}", flush=True)
if rank == 0:
    print("STEP_TIMES " + " ".join(f"{t:.4f}" for t in times), flush=True)
bps.shutdown()
