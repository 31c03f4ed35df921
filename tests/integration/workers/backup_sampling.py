"""Which samples reach the model when backup workers drop the slow rank's pushes
(tests/integration/test_backup_sampling.py).

argv: MODE EPOCHS SLOW GATE_DIR. MODE ``sampler``: each rank's batches come from
``bps.DistributedSampler`` (the job's rank, size and BYTEPS_BACKUP_WORKERS); ``shards``: from a
fixed shard ``range(rank, N, size)``, shuffled per epoch (the old digits example). Each step
every rank push_pulls (averages) a vector of N + size floats: a count of each sample in its
batch, and a 1 at N + rank. The average of the rank part is 1/k at each of the k ranks whose
pushes the round summed, so every rank recovers from it which ranks made the round and, times
k, how often each sample did. Rank SLOW first waits until every other rank has completed all
its steps (each writes GATE_DIR/rank<r>.<step> after it; a bounded wait), so its pushes are the
dropped ones in every round, by construction rather than by timing.

Every rank prints ``REPORT rank r: <json>``: the samples that never reached the model, the
samples each epoch's rounds summed, the ranks that made any round, and whether every average
divided the sum by the count of pushes summed.
"""
import json
import os
import sys
import time

import numpy as np
import torch

import byteps_like as bps
import byteps_like.torch as bpt

N, BATCH = 240, 8
mode, epochs, slow, gate_dir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
bps.init()
rank, size = bps.rank(), bps.size()
if mode == "sampler":
    sampler = bpt.DistributedSampler(range(N), shuffle=True, seed=5)
    steps = len(sampler) // BATCH
else:
    sampler = None
    shard = torch.arange(rank, N, size)
    steps = (N // size) // BATCH
g = torch.Generator().manual_seed(100 + rank)
total_steps = epochs * steps


def wait_for_the_others() -> None:
    deadline = time.monotonic() + 120
    others = [r for r in range(size) if r != slow]
    while not all(os.path.exists(os.path.join(gate_dir, f"rank{r}.{total_steps}"))
                  for r in others):
        if time.monotonic() > deadline:
            print(f"GATE TIMEOUT rank {rank}: the others never completed {total_steps} steps "
                  "without this rank", flush=True)
            sys.exit(3)
        time.sleep(0.01)


if rank == slow:
    wait_for_the_others()
seen = np.zeros(N, np.int64)
per_epoch, made_it, exact = [], set(), True
done = 0
for epoch in range(epochs):
    if sampler is not None:
        sampler.set_epoch(epoch)
        order = torch.tensor(list(sampler))
    else:
        order = shard[torch.randperm(len(shard), generator=g)]
    summed = 0
    for s in range(steps):
        v = np.zeros(N + size, np.float32)
        np.add.at(v, order[s * BATCH:(s + 1) * BATCH].numpy(), 1.0)
        v[N + rank] = 1.0
        avg = bps.push_pull(v, name="seen", average=True)
        ranks = np.flatnonzero(avg[N:])
        k = len(ranks)
        exact &= bool(np.all(avg[N:][ranks] == np.float32(1.0 / k)))
        counts = np.rint(avg[:N].astype(np.float64) * k).astype(np.int64)
        exact &= int(counts.sum()) == k * BATCH
        seen += counts
        summed += int(counts.sum())
        made_it.update(int(r) for r in ranks)
        done += 1
        if rank != slow:  # (after the step: the slow rank waits for the file of the last one)
            open(os.path.join(gate_dir, f"rank{rank}.{done}"), "w").close()
    per_epoch.append(summed)
report = {"never": int((seen == 0).sum()), "never_ids": np.flatnonzero(seen == 0).tolist(),
          "per_epoch": per_epoch, "ranks": sorted(made_it), "exact": exact,
          "steps": total_steps, "mean_seen": float(seen.mean())}
print(f"REPORT rank {rank}: {json.dumps(report, sort_keys=True)}", flush=True)
bps.shutdown()
