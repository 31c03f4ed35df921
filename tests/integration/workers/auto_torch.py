"""Worker: torch's DistributedOptimizer with Compression.auto. Rank 0 forces a slow link before
step SLOW (onebit wins), so the gradients switch from none to onebit at the same step on every
rank; every rank's parameters stay identical (each prints a CRC of them per step), and the
names of the onebit candidate appear in the runtime's tensors."""
import zlib

import torch

import byteps_like.torch as bps
from byteps_like.worker.autocompress import controller
from byteps_like.worker.runtime import default_runtime

STEPS, SLOW = 6, 2


def main() -> None:
    bps.init()
    rank = bps.rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 256))
    auto = bps.Compression.auto(allow=("fp16", "onebit"))
    ctl = controller(default_runtime(), auto)
    ctl.measuring = False
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters(), compression=auto)
    bps.broadcast_parameters(model.state_dict(), root_rank=0)
    gen = torch.Generator().manual_seed(rank + 1)
    for step in range(STEPS):
        if rank == 0 and step == SLOW:
            ctl.decide(1e6 / 8)
        x = torch.randn(32, 256, generator=gen)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        crc = zlib.crc32(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
        print(f"STEP {step} rank {rank} crc={crc:08x}", flush=True)
    names = sorted(n for n in default_runtime().tensors() if "#auto." in n)
    print(f"AUTO NAMES rank {rank}: {' '.join(names)}", flush=True)
    print(f"OK auto torch rank {rank}", flush=True)
    bps.shutdown()


if __name__ == "__main__":
    main()
