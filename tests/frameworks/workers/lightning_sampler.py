"""Worker: which indices Lightning's training loop takes on each rank under BytePSStrategy
(tests/frameworks/test_lightning.py::test_the_training_sampler_with_and_without_backup_workers).

Usage: lightning_sampler.py (under bpslaunch; BYTEPS_BACKUP_WORKERS as the test sets it)

A tiny model fits 3 epochs of a 203-sample dataset whose features are the sample's index, with
``shuffle=True`` (Lightning adds its distributed sampler) and a second loader of the user's own
sampler (Lightning wraps it in ``DistributedSamplerWrapper``), through CombinedLoader. Each
training step records the indices of its batch. Every rank prints, per loader, ``SAMPLER
<loader> rank <r> type <sampler class> len <len(sampler)> batches <batches an epoch> epochs
<json: the indices of each epoch>`` and ``EXPECT <loader> rank <r> len <n> epochs <json>``:
what ``bps.DistributedSampler`` (b > 0) or torch's ``DistributedSampler`` (b = 0) with the same
seed gives for those epochs. A validation loader's sampler is printed too (``VAL``): it is
Lightning's with any ``b``. A second fit with ``use_distributed_sampler=False`` keeps the script's
own sampler (``UNSWAPPED``).
"""
from __future__ import annotations

import json
import warnings

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Sampler, TensorDataset
from torch.utils.data.distributed import DistributedSampler as TorchSampler

import byteps_like.torch as bps
from byteps_like.lightning import BytePSStrategy

warnings.filterwarnings("ignore", ".*does not have many workers.*")
N, BATCH, EPOCHS = 203, 8, 3


class Reversed(Sampler):
    """A user's own sampler: the dataset backwards."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(range(self.n - 1, -1, -1))

    def __len__(self) -> int:
        return self.n


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(1, 1)
        self.seen: dict[str, list[list[int]]] = {"shuffled": [], "own": []}
        self.val_sampler = None

    def on_train_epoch_start(self):
        for v in self.seen.values():
            v.append([])

    def training_step(self, batch, _idx):
        loss = 0.0
        for name, (x, y) in batch.items():
            self.seen[name][-1] += x[:, 0].long().tolist()
            loss = loss + torch.nn.functional.mse_loss(self.lin(x), y)
        return loss

    def validation_step(self, batch, _idx):
        self.val_sampler = self.trainer.val_dataloaders.sampler
        return None

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-6)


def kind(obj) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def main() -> None:
    strategy = BytePSStrategy()
    rank, size = bps.rank(), bps.size()
    pl.seed_everything(5, workers=False)
    data = TensorDataset(torch.arange(N, dtype=torch.float32)[:, None], torch.zeros(N, 1))
    train = {"shuffled": DataLoader(data, batch_size=BATCH, shuffle=True),
             "own": DataLoader(data, batch_size=BATCH, sampler=Reversed(N))}
    val = DataLoader(data, batch_size=64)
    model = Net()
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_epochs=EPOCHS,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(model, train_dataloaders=train, val_dataloaders=val)
    loaders = trainer.train_dataloader
    for name in ("shuffled", "own"):
        sampler = loaders[name].sampler
        print(f"SAMPLER {name} rank {rank} type {kind(sampler)} len {len(sampler)} "
              f"batches {len(loaders[name])} epochs {json.dumps(model.seen[name])}", flush=True)
    b = bps.DistributedSampler(data, shuffle=True, seed=5).backup_workers
    want: dict[str, list[list[int]]] = {"shuffled": [], "own": []}
    for epoch in range(EPOCHS):
        for name in ("shuffled", "own"):   # Lightning shuffles a training loader's deal
            kw = {"num_replicas": size, "rank": rank, "shuffle": True, "seed": 5}
            s = bps.DistributedSampler(data, **kw) if b else TorchSampler(data, **kw)
            s.set_epoch(epoch)
            order = list(s)
            if name == "own":   # positions in the user sampler's order (N-1 .. 0)
                order = [N - 1 - i for i in order]
            want[name].append(order)
    for name in ("shuffled", "own"):
        print(f"EXPECT {name} rank {rank} len {len(want[name][0])} backup {b} "
              f"epochs {json.dumps(want[name])}", flush=True)
    print(f"VAL rank {rank} type {kind(model.val_sampler)} "
          f"len {len(model.val_sampler)}", flush=True)
    # Trainer(use_distributed_sampler=False): the script's own sampler stays, whatever b
    mine = TorchSampler(data, num_replicas=size, rank=rank, shuffle=True, seed=5)
    trainer = pl.Trainer(strategy=BytePSStrategy(), accelerator="cpu", devices=1, max_epochs=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=False)
    trainer.fit(Net(), train_dataloaders={"shuffled": DataLoader(data, BATCH, sampler=mine),
                                          "own": DataLoader(data, BATCH)})
    kept = trainer.train_dataloader["shuffled"].sampler
    print(f"UNSWAPPED rank {rank} type {kind(kept)} same {kept is mine}", flush=True)


if __name__ == "__main__":
    main()
