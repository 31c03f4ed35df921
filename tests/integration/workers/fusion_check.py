"""Trains small models of many mixed-size gradients through DistributedOptimizer, one after the
other in one job, and writes each one's final parameters to OUT_DIR/MODE.rank{r}.npz, so a test
can compare runs with tensor fusion on and off bit for bit (BYTEPS_FUSION_BYTES decides).

Modes (argv[1], comma-separated): ``plain`` (3 steps), ``bpps2`` (backward_passes_per_step=2),
``fp16`` (the fp16 cast compressor), ``cross`` (plain through CrossBarrier: updates applied
during the next forward pass), ``unused`` (a parameter that gets no gradient: its bucket
starts in step()), ``ddp`` (byteps_like's DistributedDataParallel), ``join`` (rank 1 runs one
step fewer, then both join; put it last). Prints ``BUCKETS mode n fused`` on rank 0."""
import os
import sys

# FUSION_DEVICE=cuda (on a GPU machine): the models and data on cuda:<local rank>; cuBLAS
# deterministic as torch.use_deterministic_algorithms asks
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import byteps_like.torch as bps  # noqa: E402
from byteps_like.torch.cross_barrier import CrossBarrier  # noqa: E402

modes, out_dir = sys.argv[1].split(","), sys.argv[2]
bps.init()
r = bps.rank()
dev = torch.device("cpu")
if os.environ.get("FUSION_DEVICE") == "cuda":
    dev = torch.device("cuda", bps.local_rank() % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    torch.backends.cudnn.benchmark = False
# the same kernels every run: a convolution's weight gradient reduced over another number of
# threads differs in the last bits, and the runs compared must differ only in fusion
torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)


class Net(torch.nn.Module):
    """ResNet-like: convolutions with batch norms (many small weights and biases), a linear
    head, and with ``spare`` a parameter that never gets a gradient."""

    def __init__(self, spare: bool) -> None:
        super().__init__()
        layers: list[torch.nn.Module] = []
        ch = 3
        for width in (8, 16, 16, 32, 32, 64):
            layers += [torch.nn.Conv2d(ch, width, 3, padding=1), torch.nn.BatchNorm2d(width),
                       torch.nn.ReLU()]
            ch = width
        self.body = torch.nn.Sequential(*layers)
        self.head = torch.nn.Linear(ch, 10)
        self.spare = torch.nn.Parameter(torch.ones(7)) if spare else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).mean(dim=(2, 3)))


def train(mode: str) -> None:
    torch.manual_seed(0)
    model: torch.nn.Module = Net(spare=mode == "unused").to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    bpps = 2 if mode == "bpps2" else 1
    if mode == "ddp":
        model = bps.DistributedDataParallel(model, broadcast=False)
        sync = model._sync
    else:
        named = [(f"{mode}.{n}", p) for n, p in model.named_parameters()]
        opt = bps.DistributedOptimizer(
            opt, named_parameters=named, backward_passes_per_step=bpps,
            compression=bps.Compression.fp16 if mode == "fp16" else bps.Compression.none)
        sync = opt._sync
        if mode == "cross":
            opt = CrossBarrier(model, opt)
    if r == 0:
        print(f"BUCKETS {mode} {len(sync.buckets)} {sum(b.fused for b in sync.buckets)}",
              flush=True)
    gen = torch.Generator().manual_seed(1000 + r)
    for _step in range(3 - (1 if mode == "join" and r == 1 else 0)):
        opt.zero_grad()
        for _ in range(bpps):
            x = torch.randn(4, 3, 8, 8, generator=gen).to(dev)
            y = torch.randint(0, 10, (4,), generator=gen).to(dev)
            torch.nn.functional.cross_entropy(model(x), y).backward()
        before = [p.detach().clone() for p in model.parameters()]
        opt.step()
        if mode == "cross":  # step() returned without updating: the next forward does
            assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    if mode == "join":
        bps.join()
    if mode == "cross":
        model.state_dict()  # applies the last step's updates, still waiting for a forward
    params = {n: p.detach().cpu().numpy().copy() for n, p in model.named_parameters()}
    np.savez(os.path.join(out_dir, f"{mode}.rank{r}.npz"), **params)


for m in modes:
    train(m)
bps.shutdown()
