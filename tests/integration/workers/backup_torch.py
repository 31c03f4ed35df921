"""Backup workers through the PyTorch plugin (tests/integration/test_backup.py):
DistributedOptimizer (fused gradients) and broadcast_parameters with BYTEPS_BACKUP_WORKERS=1.

argv: STEPS GATE_DIR. Rank 2 waits until every other rank has completed STEPS steps (files in
GATE_DIR; a bounded wait), then runs its steps: its gradients are dropped, it applies the same
averages. Every rank prints a digest of its final parameters (``PARAMS``)."""
import hashlib
import os
import sys
import time

import torch

import byteps_like.torch as bps

steps, gate_dir = int(sys.argv[1]), sys.argv[2]
bps.init()
rank, size = bps.rank(), bps.size()
torch.manual_seed(rank)  # different initial weights: the broadcast must make them the same
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters())
bps.broadcast_parameters(model.state_dict(), root_rank=0)  # a sum: waits for every rank
if rank == 2:
    deadline = time.monotonic() + 90
    while not all(os.path.exists(os.path.join(gate_dir, f"torch{r}")) for r in (0, 1)):
        if time.monotonic() > deadline:
            print(f"GATE TIMEOUT rank {rank}", flush=True)
            sys.exit(3)
        time.sleep(0.01)
g = torch.Generator().manual_seed(100 + rank)  # every rank its own data
for _step in range(steps):
    x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
if rank != 2:
    open(os.path.join(gate_dir, f"torch{rank}"), "w").close()
digest = hashlib.sha256()
for p in model.parameters():
    digest.update(p.detach().numpy().tobytes())
print(f"PARAMS rank {rank}: {digest.hexdigest()}", flush=True)
bps.shutdown()
