"""Train a small MLP on the handwritten-digits dataset that ships inside scikit-learn, data-parallel
over every worker of a byteps_like job, with gradients summed by the parameter servers.

    bpslaunch --local --workers 2 --servers 2 -- python examples/numpy/train_digits.py

Each worker trains on its own shard of the training set; after every step the gradients are
averaged across workers with ``push_pull`` (asynchronously, so the tensors overlap on the wire),
and every worker applies the same update. The script prints progress and, at the end, a line
``final test accuracy: 0.xxxx`` that the test suite checks.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

import byteps_like as bps

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # examples/: digits_data
from digits_data import load_data, parser, print_final  # noqa: E402


def init_params(seed: int, hidden: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"w1": (rng.standard_normal((64, hidden)) * np.sqrt(2 / 64)).astype(np.float32),
            "b1": np.zeros(hidden, np.float32),
            "w2": (rng.standard_normal((hidden, 10)) * np.sqrt(2 / hidden)).astype(np.float32),
            "b2": np.zeros(10, np.float32)}


def forward_backward(p, x, y):
    h = np.maximum(x @ p["w1"] + p["b1"], 0)
    logits = h @ p["w2"] + p["b2"]
    logits -= logits.max(axis=1, keepdims=True)
    prob = np.exp(logits)
    prob /= prob.sum(axis=1, keepdims=True)
    loss = -np.log(prob[np.arange(len(y)), y] + 1e-12).mean()
    d = prob
    d[np.arange(len(y)), y] -= 1
    d /= len(y)
    grads = {"w2": h.T @ d, "b2": d.sum(0)}
    dh = (d @ p["w2"].T) * (h > 0)
    grads["w1"] = x.T @ dh
    grads["b1"] = dh.sum(0)
    return float(loss), grads


def accuracy(p, x, y) -> float:
    h = np.maximum(x @ p["w1"] + p["b1"], 0)
    return float(((h @ p["w2"] + p["b2"]).argmax(1) == y).mean())


def main() -> None:
    ap = parser(__doc__, epochs=30, lr=0.1, lr_help=None)
    ap.add_argument("--hidden", type=int, default=64)
    args = ap.parse_args()

    bps.init()
    rank, size = bps.rank(), bps.size()
    xtr, ytr, xte, yte = load_data(seed=0)
    # a fixed shard: right while every push makes every round; with backup workers
    # (BYTEPS_BACKUP_WORKERS) deal the whole set anew each epoch instead: docs/reliability.md
    shard = slice(rank, None, size)                      # this worker's part of the data
    xs, ys = xtr[shard], ytr[shard]
    params = init_params(seed=1, hidden=args.hidden)     # same start on every worker
    names = list(params)
    for name in names:
        bps.declare(name)
    steps = len(xs) // args.batch_size
    t0 = time.perf_counter()
    for epoch in range(args.epochs):
        order = np.random.default_rng(100 + epoch * size + rank).permutation(len(xs))
        losses = []
        for s in range(steps):
            idx = order[s * args.batch_size:(s + 1) * args.batch_size]
            loss, grads = forward_backward(params, xs[idx], ys[idx])
            # first layer first: it is what the next forward pass needs first
            handles = {n: bps.push_pull_async(grads[n], name=n, average=True,
                                              priority=-i) for i, n in enumerate(names)}
            for n, h in handles.items():
                params[n] -= args.lr * h.wait()
            losses.append(loss)
        if rank == 0 and (epoch % 5 == 4 or epoch == args.epochs - 1):
            print(f"epoch {epoch + 1:3d}/{args.epochs}  loss {np.mean(losses):.4f}  "
                  f"test accuracy {accuracy(params, xte, yte):.4f}  "
                  f"({time.perf_counter() - t0:.1f} s)", flush=True)
    # every worker holds identical parameters: check it, then report
    check = bps.push_pull(params["w1"], name="check.w1", average=True)
    assert np.allclose(check, params["w1"], atol=1e-6), "workers diverged"
    if rank == 0:
        print_final(accuracy(params, xte, yte), size, steps * args.epochs, wire_report=False)
    bps.shutdown()


if __name__ == "__main__":
    main()
