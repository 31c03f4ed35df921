"""Elastic training with PyTorch (docs/elastic.md), named as in Horovod's ``hvd.elastic``.

    import byteps_like.torch as bps
    bps.init()
    model, optimizer = ..., bps.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    sampler = bps.elastic.ElasticSampler(dataset, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(dataset, batch_size=32, sampler=sampler)
    state = bps.elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler,
                                   epoch=0, batch=0)

    @bps.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            for state.batch, (x, y) in enumerate(loader, start=state.batch):  # see the docs
                ...
                state.sampler.record_batch(i, 32)
                state.commit()
            state.batch = 0
            state.sampler.set_epoch(state.epoch + 1)

    train(state)
"""
from __future__ import annotations

import math
from collections.abc import Iterator, Sized
from typing import Any

import numpy as np
import torch

from ..errors import MembershipChangedError, TooFewWorkersError
from ..worker import elastic as core
from ..worker.elastic import ObjectState, State, StateHandler, reset_synchronizer
from ..worker.runtime import Runtime
from ..worker.sync import model_signature_check
from .broadcast import _from_array, _to_array, broadcast_optimizer_state, broadcast_parameters
from .optimizer import DistributedOptimizer

run = core.run


class ModelStateHandler(StateHandler):
    """A ``torch.nn.Module``: its ``state_dict()`` (parameters and buffers)."""

    def save(self) -> None:
        self._saved = {k: v.detach().clone() for k, v in self.value.state_dict().items()}

    def restore(self) -> None:
        self.value.load_state_dict(self._saved)

    def sync(self, rt: Runtime, name: str) -> None:
        if rt.size() > 1:
            broadcast_parameters(self.value.state_dict(), root_rank=0, prefix=f"{name}.")


class OptimizerStateHandler(StateHandler):
    """A ``torch.optim.Optimizer`` (a DistributedOptimizer or a plain one): its state_dict."""

    def save(self) -> None:
        self._saved = _clone(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(_clone(self._saved))

    def reset(self) -> None:
        reset_synchronizer(getattr(self.value, "_sync", None))

    def sync(self, rt: Runtime, name: str) -> None:
        if rt.size() > 1:
            broadcast_optimizer_state(self.value, root_rank=0)


class SamplerStateHandler(StateHandler):
    """An :class:`ElasticSampler`: its epoch and the samples processed in it."""

    def save(self) -> None:
        self._saved = self.value.state_dict()

    def restore(self) -> None:
        self.value.load_state_dict(self._saved)

    def sync(self, rt: Runtime, name: str) -> None:
        self.value.sync(rt, name)


def _clone(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone(v) for v in obj)
    return obj


class TorchState(ObjectState):
    """``TorchState(model=None, optimizer=None, **extra)``: Horovod's ``hvd.elastic.TorchState``.

    ``state.model``, ``state.optimizer`` and every extra (``epoch=0`` -> ``state.epoch``) are
    attributes. Extras that are ``torch.nn.Module``, ``torch.optim.Optimizer`` or
    :class:`ElasticSampler` objects are saved and synced like the model and optimizer; other
    extras (numbers, tensors, lists, dicts) are copied on commit and broadcast on sync."""

    _to_array = staticmethod(_to_array)
    _from_array = staticmethod(_from_array)

    def __init__(self, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, **kwargs: Any) -> None:
        handlers: dict[str, StateHandler] = {}
        extras: dict[str, Any] = {}
        for name, value in (("model", model), ("optimizer", optimizer), *kwargs.items()):
            if isinstance(value, torch.nn.Module):
                handlers[name] = ModelStateHandler(value)
            elif isinstance(value, torch.optim.Optimizer):
                handlers[name] = OptimizerStateHandler(value)
            elif isinstance(value, ElasticSampler):
                handlers[name] = SamplerStateHandler(value)
            elif name in ("model", "optimizer"):
                if value is not None:
                    raise TypeError(f"TorchState: {name}= must be a torch "
                                    f"{'nn.Module' if name == 'model' else 'optim.Optimizer'}, "
                                    f"got {type(value).__name__}")
            else:
                extras[name] = value
        super().__init__(handlers, **extras)

    def _sync_handlers(self, rt: Runtime, first: bool) -> None:
        # A worker that starts into the job checks the model signature when it creates its
        # DistributedOptimizer (a collective); the workers already in the job make the same
        # check here, at every sync but a process's first, so every worker of the new epoch
        # runs the same collectives in the same order.
        if not first and rt.size() > 1:
            for h in self._handlers.values():
                opt = h.value
                if isinstance(opt, DistributedOptimizer):
                    model_signature_check(rt, [(n, tuple(p.shape), str(p.dtype))
                                               for n, p in zip(opt._names, opt._params)],
                                          "model")
        super()._sync_handlers(rt, first)


class ElasticSampler(torch.utils.data.Sampler):
    """``ElasticSampler(dataset, shuffle=True, seed=0)``: Horovod's elastic sampler.

    Splits the samples of the current epoch that are not processed yet over the workers of the
    current epoch: worker ``r`` of ``n`` takes every ``n``-th sample (padded to a multiple of
    ``n`` with samples from the start). Call ``record_batch(i, batch_size)`` after batch ``i``
    of the current iteration: it marks that batch of *every* worker processed (they step
    together), so after a membership change the remaining samples of the epoch are split over
    the new workers and none is trained twice or skipped. ``set_epoch(e)`` starts epoch ``e``
    (a new order when ``shuffle``: the permutation of ``seed + e``, the same on every worker).
    Kept in a :class:`TorchState` (as an extra), it is committed, restored and synced with
    it."""

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.epoch = 0
        self.processed_indices: set[int] = set()
        self.num_replicas = 1
        self.rank = 0
        self.remaining_indices: list[int] = []
        self.num_samples = 0
        self.total_size = 0
        self._order: np.ndarray = np.zeros(0, np.int64)   # the padded order of all workers
        self.indices: list[int] = []                      # this worker's part of it
        self.reset()

    # -- Horovod's interface -------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: nothing of it is processed yet."""
        self.epoch = int(epoch)
        self.processed_indices = set()
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Batch ``batch_idx`` (of size ``batch_size``) of the current iteration is done on every
        worker."""
        if batch_idx < 0 or batch_size < 1:
            raise ValueError(f"record_batch({batch_idx}, {batch_size}): the batch index must be "
                             ">= 0 and the batch size >= 1")
        rows = self._order.reshape(-1, self.num_replicas) if self._order.size else self._order
        done = rows[batch_idx * batch_size:(batch_idx + 1) * batch_size]
        self.processed_indices.update(int(i) for i in done.ravel())

    def record_indices(self, indices) -> None:
        """Mark dataset indices processed (e.g. those this worker trained on); merged over the
        workers at the next sync."""
        self.processed_indices.update(int(i) for i in indices)

    def get_indices(self, batch_idx: int, batch_size: int) -> list[int]:
        """This worker's dataset indices of batch ``batch_idx`` of the current iteration."""
        return self.indices[batch_idx * batch_size:(batch_idx + 1) * batch_size]

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "processed_indices": set(self.processed_indices)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.epoch = int(state_dict["epoch"])
        self.processed_indices = {int(i) for i in state_dict["processed_indices"]}
        self.reset()

    def reset(self) -> None:
        """Re-split what is left of the epoch over the workers of the current membership."""
        rt = core.runtime()
        self.num_replicas, self.rank = max(1, rt.size()), rt.rank()
        n = len(self.dataset)
        done = np.zeros(n, bool)
        idx = self._processed_array()
        done[idx[(idx >= 0) & (idx < n)]] = True
        remaining = np.flatnonzero(~done)
        self.remaining_indices = remaining.tolist()
        self.num_samples = math.ceil(remaining.size / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas
        order = remaining
        if self.shuffle and remaining.size:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = remaining[torch.randperm(remaining.size, generator=g).numpy()]
        if order.size and order.size < self.total_size:  # pad, as DistributedSampler does
            order = np.resize(order, self.total_size)
        self._order = order.astype(np.int64)
        self.indices = self._order[self.rank::self.num_replicas].tolist()

    def _processed_array(self) -> np.ndarray:
        return np.fromiter(self.processed_indices, np.int64, len(self.processed_indices))

    def __iter__(self) -> Iterator[int]:
        return iter(list(self.indices))

    def __len__(self) -> int:
        return self.num_samples

    # -- sync ------------------------------------------------------------------------------------
    def sync(self, rt: Runtime, name: str) -> None:
        """Every worker takes rank 0's epoch and the union of the workers' processed samples
        (one push_pull of a mask of the dataset), then re-splits."""
        if rt.size() > 1:
            n = len(self.dataset)
            buf = np.zeros(n + 1, np.int32)
            done = self._processed_array()
            buf[done[(done >= 0) & (done < n)]] = 1
            if rt.rank() == 0:
                buf[n] = self.epoch
            rt.push_pull_async(buf, name=f"{name}.{n}", average=False, out=buf).wait()
            self.epoch = int(buf[n])
            self.processed_indices = set(np.flatnonzero(buf[:n]).tolist())
        self.reset()


__all__ = ["run", "TorchState", "ElasticSampler", "State", "ObjectState", "StateHandler",
           "ModelStateHandler", "OptimizerStateHandler", "SamplerStateHandler",
           "MembershipChangedError", "TooFewWorkersError"]
