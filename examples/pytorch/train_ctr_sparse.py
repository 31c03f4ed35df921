"""A click-through model with server-held embedding tables (docs/sparse.md).

The data is synthetic, drawn from a known logistic model. Each sample has three categorical
features with Zipf-distributed ids (vocabularies of 100,000, 10,000 and 1,000) and four dense
features; its click probability is sigmoid(the true weights of its ids + a linear term of the
dense features). The model learns an 8-wide embedding per id (byteps_like.torch.SparseEmbedding,
Adagrad on the servers) and a linear head (DistributedOptimizer). Each step's global batch is
split between the workers, so any number of workers trains the same model as one process.
Rank 0 prints the test AUC, and that of the true model for reference.

    python examples/pytorch/train_ctr_sparse.py                          # one process
    bpslaunch --local --workers 2 --servers 2 -- python examples/pytorch/train_ctr_sparse.py
"""
import argparse

import numpy as np
import torch

import byteps_like.torch as bps

VOCAB = (100_000, 10_000, 1_000)
DENSE = 4


def truth(seed: int):
    rng = np.random.default_rng(seed)
    return [rng.normal(0.0, 1.0, n) for n in VOCAB], rng.normal(0.0, 0.5, DENSE)


def samples(seed: int, n: int, w_ids, w_dense):
    """ids (n x 3), dense features (n x 4), labels and the true click probabilities."""
    rng = np.random.default_rng(seed)
    ids = np.stack([(rng.zipf(1.3, n) - 1) % v for v in VOCAB], axis=1)
    x = rng.normal(size=(n, DENSE)).astype(np.float32)
    logit = sum(w[ids[:, t]] for t, w in enumerate(w_ids)) + x @ w_dense - 0.5
    p = 1.0 / (1.0 + np.exp(-logit))
    return ids, x, (rng.random(n) < p).astype(np.float32), p


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """The area under the ROC curve (Mann-Whitney, ties counted half)."""
    order = np.argsort(scores, kind="stable")
    ranks = np.empty(len(scores))
    ranks[order] = np.arange(1, len(scores) + 1)
    s = scores[order]
    # average the ranks of equal scores
    edges = np.flatnonzero(np.diff(s)) + 1
    for a, b in zip(np.r_[0, edges], np.r_[edges, len(s)]):
        if b - a > 1:
            ranks[order[a:b]] = (a + 1 + b) / 2
    pos = labels > 0.5
    npos, nneg = pos.sum(), (~pos).sum()
    return float((ranks[pos].sum() - npos * (npos + 1) / 2) / (npos * nneg))


class CTR(torch.nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.embs = torch.nn.ModuleList(
            bps.SparseEmbedding(v, dim, name=f"feature{t}", init="normal",
                                init_args={"mean": 0.0, "std": 0.01}, seed=t,
                                optimizer="adagrad", lr=0.1)
            for t, v in enumerate(VOCAB))
        self.head = torch.nn.Linear(len(VOCAB) * dim + DENSE, 1)

    def forward(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        parts = [e(ids[:, t]) for t, e in enumerate(self.embs)] + [x]
        return self.head(torch.cat(parts, dim=1)).squeeze(1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=1024, help="global batch (all workers)")
    p.add_argument("--dim", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    torch.manual_seed(a.seed)
    torch.set_num_threads(1)
    bps.init()
    rank, size = bps.rank(), bps.size()
    if a.batch % size:
        raise SystemExit(f"--batch {a.batch} does not split over {size} workers")
    w_ids, w_dense = truth(a.seed)
    model = CTR(a.dim)
    opt = bps.DistributedOptimizer(torch.optim.Adagrad(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    bps.broadcast_parameters(model.state_dict(), root_rank=0)
    mine = slice(rank * a.batch // size, (rank + 1) * a.batch // size)
    for step in range(a.steps):
        ids, x, y, _p = samples(a.seed * 100_003 + step + 1, a.batch, w_ids, w_dense)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(
            model(torch.from_numpy(ids[mine]), torch.from_numpy(x[mine])),
            torch.from_numpy(y[mine]))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0 and (step + 1) % 100 == 0:
            print(f"step {step + 1:4d}/{a.steps}: loss {loss.item():.4f}", flush=True)
    if rank == 0:
        model.eval()
        ids, x, y, p_true = samples(a.seed * 100_003, 20_000, w_ids, w_dense)
        with torch.no_grad():
            scores = model(torch.from_numpy(ids), torch.from_numpy(x)).numpy()
        print(f"final test AUC: {auc(scores, y):.4f} ({size} workers; the true model's "
              f"{auc(p_true, y):.4f})", flush=True)
    bps.shutdown()


if __name__ == "__main__":
    main()
