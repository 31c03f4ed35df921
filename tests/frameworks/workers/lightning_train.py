"""Worker: a small Lightning model on scikit-learn's digits, under a strategy named on the
command line (tests/frameworks/test_lightning.py).

Usage: lightning_train.py STRATEGY OUTDIR [ACCUMULATE]
STRATEGY: ``byteps`` (byteps_like.lightning.BytePSStrategy; run under bpslaunch or torchrun) or
``ddp`` (Lightning's DDPStrategy, gloo on CPU, 2 processes that Lightning starts itself).

Every rank prints ``RESULT <strategy> rank <r> acc <accuracy on the whole test set>
val_acc <the synced metric> params <checksum>``. With byteps it also checks the strategy's
collectives (``CHECK <name> OK rank <r>``), and every rank says which checkpoint writes it made
(``SAVED rank <r> <file>``): only rank 0 must write.
"""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))  # digits_data

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from digits_data import load_data  # noqa: E402
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*sync_dist=True.*")
EPOCHS, BATCH, LR = 4, 32, 0.1


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                       torch.nn.Linear(64, 10))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, _idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, _idx):
        x, y = batch
        acc = (self(x).argmax(1) == y).float().mean()
        self.log("val_acc", acc, sync_dist=True)
        rank = torch.tensor(float(self.global_rank))
        for fx in ("mean", "sum", "max", "min"):
            self.log(f"rank_{fx}", rank, sync_dist=True, reduce_fx=fx)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)


class RecordingIO(TorchCheckpointIO):
    """Says which rank writes each checkpoint file."""

    rank = -1

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        say(f"SAVED rank {self.rank} {Path(path).name}")
        super().save_checkpoint(checkpoint, path, storage_options)



def say(text: str) -> None:
    """One write of a whole line: under plain DDP the ranks share the test's pipe, and print()
    writes a line's text and its newline apart (unbuffered), so another rank's line came
    between them once (the test read "rank_min=0RESULT ddp rank 1 ...")."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()

def loaders():
    x_train, y_train, x_test, y_test = load_data(0)
    train = TensorDataset(torch.from_numpy(x_train), torch.from_numpy(y_train))
    test = TensorDataset(torch.from_numpy(x_test), torch.from_numpy(y_test))
    return (DataLoader(train, batch_size=BATCH, shuffle=True), DataLoader(test, batch_size=64),
            (torch.from_numpy(x_test), torch.from_numpy(y_test)))


def check_collectives(strategy, rank: int, size: int, out: Path) -> None:
    got = strategy.all_gather(torch.tensor([rank, 10 * rank]))
    assert got.tolist() == [[r, 10 * r] for r in range(size)], got
    say(f"CHECK all_gather OK rank {rank}")
    x = torch.tensor([1.0 + rank, 2.0], requires_grad=True)
    g = strategy.all_gather(x, sync_grads=True)
    (g * torch.arange(1.0, size + 1).reshape(size, 1)).sum().backward()
    # every rank's loss weights slice r by r + 1: the summed gradient of my slice is
    # size * (rank + 1)
    assert x.grad.tolist() == [size * (rank + 1.0)] * 2, x.grad
    say(f"CHECK all_gather_grad OK rank {rank}")
    for op, want in (("sum", size * (size - 1) / 2), ("mean", (size - 1) / 2),
                     ("max", size - 1), ("min", 0)):
        got = strategy.reduce(torch.tensor([float(rank)]), reduce_op=op)
        assert got.tolist() == [want], (op, got)
    got = strategy.reduce(torch.tensor([rank, 1]), reduce_op="mean")   # integers: as DDP
    assert got.tolist() == [(size - 1) / 2, 1.0] and got.is_floating_point(), got
    assert strategy.reduce("not a tensor") == "not a tensor"
    assert strategy.reduce_boolean_decision(rank == 0, all=False) is True
    assert strategy.reduce_boolean_decision(rank == 0, all=True) is (size == 1)
    say(f"CHECK reduce OK rank {rank}")
    sent = strategy.broadcast(out / f"from-{rank}" if rank == 1 else None, src=1)
    assert sent == out / "from-1", sent
    assert strategy.broadcast({"epoch": rank, "name": f"r{rank}"}) == {"epoch": 0, "name": "r0"}
    strategy.barrier("check")
    say(f"CHECK broadcast OK rank {rank}")
    for call, needle in ((lambda: strategy.reduce(torch.ones(1), reduce_op="prod"), "'prod'"),
                         (lambda: strategy.all_gather(torch.ones(1), group=object()),
                          "process groups are not supported")):
        try:
            call()
        except ValueError as exc:
            assert needle in str(exc), exc
        else:
            raise AssertionError(f"no ValueError ({needle})")
    say(f"CHECK errors OK rank {rank}")


def refit(model, train, rank: int) -> None:
    """A second fit of the same model by a new Trainer (and strategy): the first fit's
    gradient hooks are gone, every rank ends with the same weights."""
    from byteps_like.lightning import BytePSStrategy
    trainer = pl.Trainer(strategy=BytePSStrategy(), accelerator="cpu", devices=1, max_epochs=1,
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False)
    trainer.fit(model, train)
    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    say(f"REFIT rank {rank} params {checksum:.9f}")


def main() -> int:
    mode, out = sys.argv[1], Path(sys.argv[2])
    accumulate = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    torch.set_num_threads(1)
    pl.seed_everything(0, workers=True)
    if mode == "byteps":
        from byteps_like.lightning import BytePSStrategy
        strategy = BytePSStrategy()
        trainer_args = {"strategy": strategy, "accelerator": "cpu", "devices": 1}
    else:
        from lightning.pytorch.strategies import DDPStrategy
        trainer_args = {"strategy": DDPStrategy(process_group_backend="gloo"),
                        "accelerator": "cpu", "devices": 2}
    io = RecordingIO()
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=out / f"ckpt-{mode}", monitor="val_acc",
                                        mode="max", save_last=True)
    trainer = pl.Trainer(max_epochs=EPOCHS, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[ckpt],
                         plugins=[io], accumulate_grad_batches=accumulate,
                         **trainer_args)
    rank, size = trainer.global_rank, trainer.world_size
    io.rank = rank
    model = Net()
    train, test, (x_test, y_test) = loaders()
    trainer.fit(model, train, test)
    with torch.no_grad():
        acc = (model(x_test).argmax(1) == y_test).float().mean().item()
    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    say(f"RESULT {mode} rank {rank} size {size} acc {acc:.6f} val_acc "
        f"{metrics['val_acc']:.6f} params {checksum:.9f}")
    say(f"METRICS {mode} rank {rank} " + " ".join(
        f"{k}={metrics[k]:g}" for k in ("rank_mean", "rank_sum", "rank_max", "rank_min")))
    if mode == "byteps":
        check_collectives(trainer.strategy, rank, size, out)
        # the best checkpoint restores on every rank to the same weights
        best = Net.load_from_checkpoint(ckpt.best_model_path)
        assert Path(ckpt.best_model_path).parent == out / "ckpt-byteps"
        with torch.no_grad():
            best_acc = (best(x_test).argmax(1) == y_test).float().mean().item()
        say(f"BEST rank {rank} {Path(ckpt.best_model_path).name} acc {best_acc:.6f}")
        refit(model, train, rank)
    return 0


if __name__ == "__main__":
    sys.exit(main())
