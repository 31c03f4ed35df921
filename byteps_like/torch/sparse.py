"""Embedding tables held and updated on the servers (docs/sparse.md), as torch modules.

``SparseEmbedding`` stands in for ``nn.Embedding`` and ``SparseEmbeddingBag`` for
``nn.EmbeddingBag``: the table lives on the servers (``byteps_like.worker.sparse``), a forward
pass pulls the rows of the batch's unique ids, and the backward pass pushes each unique row's
summed gradient; the servers apply the table's optimizer. The modules hold no ``nn.Parameter``,
so ``DistributedOptimizer`` and the user's optimizer see only the dense parameters.

One training forward (``module.training`` with gradients enabled) is one step of the table:
its backward must run before the next training forward, on every worker. Forwards without
gradients (evaluation) only read the rows.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..errors import BytePSError
from ..worker.runtime import default_runtime
from ..worker.sparse import EmbeddingTable


class _TableModule(torch.nn.Module):
    """What both modules share: the table, the pull of a batch and the push of its rows."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, name: str | None,
                 init: str, init_args: dict | None, seed: int, optimizer: str, average: bool,
                 optimizer_args: dict[str, Any]):
        super().__init__()
        rt = default_runtime()
        rt.check()
        if name is None:
            name = f"SparseEmbedding.{len(rt.sparse.tables)}"
        self.table: EmbeddingTable = rt.sparse.create(
            name, num_embeddings, embedding_dim, init=init, init_args=init_args, seed=seed,
            optimizer=optimizer, **optimizer_args)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        # gradients are averaged over the workers, like DistributedOptimizer's dense ones: the
        # servers divide each round's sum by the workers that pushed it
        self.average = average
        self._unpushed: int | None = None   # the step of a training forward not pushed yet
        self._prefetched: tuple | None = None   # prefetch(): (ids, uniq, inv, pending rows)

    def prefetch(self, ids: torch.Tensor) -> None:
        """Start pulling the rows of ``ids`` now; the next forward with equal ids takes them.
        Call it for every table of a model before the first table's forward: their pulls
        travel together and are answered in one wait, not one after another (docs/sparse.md).
        A forward with other ids pulls them itself; the prefetched rows are dropped."""
        self._check_forward(ids)
        self._drop_prefetched()
        uniq, inv = torch.unique(ids.reshape(-1), return_inverse=True)
        uniq_np = uniq.detach().cpu().numpy()
        self._prefetched = (ids.detach().cpu().clone(), uniq_np, inv,
                            self.table.pull_async(uniq_np))

    def _drop_prefetched(self) -> None:
        got, self._prefetched = self._prefetched, None
        if got is not None:
            got[3].wait()   # one pull of a table in flight at a time: it must be answered

    def _check_forward(self, ids: torch.Tensor) -> None:
        if ids.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"table {self.table.name!r}: ids must be int32 or int64, not "
                            f"{ids.dtype}")
        # (a new elastic epoch moved the table's step on: that forward is void)
        if (self.training and torch.is_grad_enabled() and self._unpushed is not None
                and self._unpushed == self.table.step):
            raise BytePSError(f"table {self.table.name!r}: a training forward before the "
                              "previous one's backward pushed its gradients; run backward "
                              "once after each training forward (or use eval/no_grad)")

    def _rows(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the rows of the unique ids, the index of each id among them); in a training forward
        the rows' gradient is pushed when backward reaches them."""
        self._check_forward(ids)
        got = self._prefetched
        if got is not None and got[0].shape == ids.shape and torch.equal(got[0], ids.cpu()):
            self._prefetched = None
            _, uniq_np, inv, pending = got
            rows_np = pending.wait()
        else:
            self._drop_prefetched()
            uniq, inv = torch.unique(ids.reshape(-1), return_inverse=True)
            uniq_np = uniq.detach().cpu().numpy()
            rows_np = self.table.pull(uniq_np)
        rows = torch.from_numpy(rows_np).to(ids.device)
        if self.training and torch.is_grad_enabled():
            self._unpushed = self.table.step
            rows.requires_grad_(True)
            rows.register_hook(lambda g: self._push(uniq_np, g))
        return rows, inv.reshape(ids.shape)

    def _push(self, uniq, grad: torch.Tensor) -> None:
        g = grad.detach().to("cpu", torch.float32)
        try:
            self.table.push(uniq, g.numpy(), average=self.average)
        finally:
            self._unpushed = None

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, table={self.table.name!r}, "
                f"optimizer={self.table.spec.optimizer}")


class SparseEmbedding(_TableModule):
    """``nn.Embedding(num_embeddings, embedding_dim)`` whose table is held and updated on the
    servers. ``init``: zeros, uniform (``init_args`` low, high) or normal (mean, std) from
    ``seed``; ``optimizer``: sgd, adagrad or adam, with its parameters by keyword (``lr=...``),
    applied to the rows a step touched. Every worker creates the same modules in the same
    order; ``name`` defaults to ``SparseEmbedding.<n>``."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, name: str | None = None,
                 init: str = "normal", init_args: dict | None = None, seed: int = 0,
                 optimizer: str = "sgd", average: bool = True, **optimizer_args: Any):
        super().__init__(num_embeddings, embedding_dim, name=name, init=init,
                         init_args=init_args, seed=seed, optimizer=optimizer, average=average,
                         optimizer_args=optimizer_args)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows, inv = self._rows(ids)
        return F.embedding(inv, rows)


class SparseEmbeddingBag(_TableModule):
    """``nn.EmbeddingBag(num_embeddings, embedding_dim, mode=...)`` whose table is held and
    updated on the servers (arguments as :class:`SparseEmbedding`; ``mode`` sum, mean or
    max). ``forward(ids, offsets=None, per_sample_weights=None)`` as ``nn.EmbeddingBag``."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, mode: str = "mean",
                 name: str | None = None, init: str = "normal", init_args: dict | None = None,
                 seed: int = 0, optimizer: str = "sgd", average: bool = True,
                 **optimizer_args: Any):
        if mode not in ("sum", "mean", "max"):
            raise ValueError(f"mode must be sum, mean or max, not {mode!r}")
        super().__init__(num_embeddings, embedding_dim, name=name, init=init,
                         init_args=init_args, seed=seed, optimizer=optimizer, average=average,
                         optimizer_args=optimizer_args)
        self.mode = mode

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        rows, inv = self._rows(ids)
        return F.embedding_bag(inv, rows, offsets, mode=self.mode,
                               per_sample_weights=per_sample_weights)
