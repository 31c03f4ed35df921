"""What the train_digits examples share: the data and the closing report.

A script in a subfolder puts this folder on ``sys.path`` and imports it::

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # examples/: digits_data
    from digits_data import load_data, parser, print_final
"""
from __future__ import annotations

import argparse

import numpy as np


def load_data(seed: int = 0):
    """scikit-learn's handwritten digits (shipped inside scikit-learn: no download), features
    scaled to [0, 1] as float32, shuffled by ``seed``; a fifth held out for the test:
    ``x_train, y_train, x_test, y_test`` (numpy, labels int64)."""
    from sklearn.datasets import load_digits
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order].astype(np.int64)
    n_test = len(x) // 5
    return x[n_test:], y[n_test:], x[:n_test], y[:n_test]


def parser(doc: str, *, epochs: int = 10, lr: float = 0.05,
           lr_help: str | None = "per worker; scaled by size()") -> argparse.ArgumentParser:
    """The command line every digits example starts from (its description: the first paragraph
    of ``doc``): ``--epochs``, ``--batch-size`` (per worker) and ``--lr``."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=epochs)
    p.add_argument("--batch-size", type=int, default=32, help="per worker")
    p.add_argument("--lr", type=float, default=lr, help=lr_help)
    return p


def add_backup_options(p: argparse.ArgumentParser, deal: str, *, straggler: bool = True) -> None:
    """``--fixed-shards`` (each worker its own fixed shard instead of ``deal``, the per-epoch deal
    of the whole set that backup workers need) and ``--straggler RANK:FACTOR``."""
    p.add_argument("--fixed-shards", action="store_true",
                   help=f"each worker trains on its own fixed shard (data[rank::size]) instead "
                        f"of {deal}'s per-epoch deal of the whole set; with backup workers the "
                        "slow worker's shard is then lost")
    if straggler:
        p.add_argument("--straggler", metavar="RANK:FACTOR", default="",
                       help="make worker RANK FACTOR times slower: after each step it sleeps "
                            "FACTOR - 1 times the step's own time (try with "
                            "BYTEPS_BACKUP_WORKERS=1; docs/reliability.md, 'Backup workers')")


def straggler_delay(spec: str, rank: int) -> float:
    """``--straggler RANK:FACTOR``: how many times its own time this rank sleeps after each step
    (FACTOR - 1 on RANK, 0 elsewhere)."""
    slow_rank, _, factor = spec.partition(":")
    return float(factor) - 1 if spec and int(slow_rank) == rank else 0.0


def print_final(acc: float, size: int, steps: int, *, wire_report: bool = True) -> None:
    """Rank 0's last lines: ``final test accuracy: 0.XXXX (N workers, S steps)`` (the line the
    tests read) and, in a job of several workers, what its push_pulls put on the network."""
    print(f"final test accuracy: {acc:.4f} ({size} workers, {steps} steps)", flush=True)
    if wire_report and size > 1:
        from byteps_like.worker.runtime import default_runtime
        print(default_runtime().wire_report(), flush=True)
