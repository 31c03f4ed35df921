"""BytePSStrategy: a Lightning ``ParallelStrategy`` over byteps_like.torch.

One process per device, started by ``bpslaunch`` (or torchrun); Lightning starts nothing.
Training goes through :class:`byteps_like.torch.DistributedOptimizer`, which wraps each
optimizer ``configure_optimizers`` returns: every gradient starts its push_pull as soon as
backward has accumulated it, and the optimizer step waits for the averages. The strategy's
collectives (``reduce`` for ``self.log(..., sync_dist=True)``, ``all_gather``, ``broadcast``,
``barrier``) go through the same job.

With backup workers (``BYTEPS_BACKUP_WORKERS=b > 0``) the training dataloader's sampler is
``bps.DistributedSampler`` (``process_dataloader``): the distributed sampler Lightning adds
deals a fixed share per rank and an epoch of ``len / size`` samples, which loses the slow
machine's share; this one deals the whole dataset anew every epoch and counts an epoch in the
samples the rounds average (docs/reliability.md, "Backup workers"). With ``b = 0`` Lightning's
own sampler stays.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper, _DatasetSamplerWrapper
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.data import _update_dataloader
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch.distributed import ReduceOp
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler as TorchDistributedSampler

import byteps_like.torch as bps

_OPS = {"sum": "sum", "mean": "mean", "avg": "mean", "max": "max", "min": "min"}


def _op_name(reduce_op: Any) -> str:
    """Lightning's reduce_op (None, a string or torch.distributed.ReduceOp) as sum, mean, max
    or min."""
    if reduce_op is None:
        return "mean"
    if isinstance(reduce_op, str):
        op = _OPS.get(reduce_op.lower())
        if op is not None:
            return op
    else:
        for dist_op, op in ((ReduceOp.SUM, "sum"), (ReduceOp.AVG, "mean"),
                            (ReduceOp.MAX, "max"), (ReduceOp.MIN, "min")):
            with contextlib.suppress(TypeError, ValueError, RuntimeError):
                if reduce_op == dist_op:
                    return op
    raise ValueError(f"BytePSStrategy.reduce: reduce_op={reduce_op!r} is not supported; use "
                     "'sum', 'mean' (or 'avg'), 'max' or 'min'")


def _key(prefix: str, t: torch.Tensor) -> str:
    """A tensor name that is the same on every rank for the same call, reused across calls of
    the same dtype and shape (a new round of one key, not a new key per call)."""
    shape = "x".join(map(str, t.shape)) or "scalar"
    return f"lightning.{prefix}.{str(t.dtype).removeprefix('torch.')}.{shape}"


class _GatherWithGrad(torch.autograd.Function):
    """all_gather(sync_grads=True): the gradient of rank r's slice comes back to rank r,
    summed over the ranks that used it (torch.distributed.nn's all_gather does the same)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        ctx.rank = bps.rank()
        return _gather(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        total = bps.push_pull(grad.contiguous(), average=False, name=_key("gather_grad", grad))
        return total[ctx.rank]


def _gather(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's ``tensor`` stacked along a new first dimension, in rank order."""
    t = tensor.detach().contiguous()
    return bps.allgather(t.reshape(1, *t.shape), name=_key("all_gather", t))


class _BackupSamplerWrapper(bps.DistributedSampler):
    """Lightning's ``DistributedSamplerWrapper`` (the user's own sampler, dealt over the ranks)
    with ``bps.DistributedSampler``'s deal: positions in the user sampler's order of an
    epoch."""

    def __init__(self, sampler: Any, **kwargs: Any) -> None:
        super().__init__(_DatasetSamplerWrapper(sampler), **kwargs)

    def __iter__(self):
        self.dataset.reset()
        return (self.dataset[index] for index in super().__iter__())

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        set_original = getattr(getattr(self.dataset, "_sampler", None), "set_epoch", None)
        if set_original is not None:   # as Lightning's wrapper: the user's sampler follows
            set_original(epoch)


def backup_aware_sampler(sampler: Any) -> bps.DistributedSampler | None:
    """The backup-aware replacement of the distributed sampler Lightning put into a training
    dataloader (``torch``'s ``DistributedSampler``, or ``DistributedSamplerWrapper`` over the
    user's sampler): ``bps.DistributedSampler`` with the same ranks, ``shuffle``, ``seed`` and
    ``drop_last``; None when the job has no backup workers (nothing to change) or the sampler
    is of another class (a ``bps.DistributedSampler`` or any other subclass stays). A
    ``DistributedSampler`` of torch's own class that the script set itself cannot be told from
    Lightning's and is replaced too."""
    if type(sampler) not in (TorchDistributedSampler, DistributedSamplerWrapper):
        return None
    kwargs = {"num_replicas": sampler.num_replicas, "rank": sampler.rank,
              "shuffle": sampler.shuffle, "seed": sampler.seed, "drop_last": sampler.drop_last}
    if type(sampler) is DistributedSamplerWrapper:
        user_sampler = getattr(sampler.dataset, "_sampler")  # noqa: B009 - Lightning's wrapper
        new: bps.DistributedSampler = _BackupSamplerWrapper(user_sampler, **kwargs)
    else:
        new = bps.DistributedSampler(sampler.dataset, **kwargs)
    return new if new.backup_workers else None


class BytePSStrategy(ParallelStrategy):
    """Lightning strategy for byteps_like (the shape of Lightning's former HorovodStrategy).

    Args:
        compression: ``byteps_like.torch.Compression.*`` for the gradients (default none).
        backward_passes_per_step: manual optimization only: backward passes accumulated
            locally before ``optimizer.step()`` (automatic optimization takes the Trainer's
            ``accumulate_grad_batches``).
        init_options: passed to ``byteps_like.torch.init()`` (configuration overrides such as
            ``{"cluster.num_worker": 2}``), when this process has not joined the job yet.
        backup_sampler: with backup workers, put ``bps.DistributedSampler`` into the training
            dataloader in place of the sampler Lightning adds (default True; see
            :meth:`process_dataloader`). Pass False where rounds wait for every machine
            anyway (CUDA tensors of machines with several local ranks: docs/reliability.md).

    Unlike the Horovod strategy, the learning rate is not multiplied by the number of workers:
    the gradients are averaged, as with Lightning's DDP strategy, so the same hyperparameters
    give the same training.
    """

    strategy_name = "byteps"

    def __init__(self, accelerator: pl.accelerators.Accelerator | None = None,
                 parallel_devices: list[torch.device] | None = None,
                 checkpoint_io=None, precision_plugin=None,
                 compression: Any = bps.Compression.none, backward_passes_per_step: int = 1,
                 init_options: dict[str, Any] | None = None, backup_sampler: bool = True):
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step={backward_passes_per_step}: must be "
                             ">= 1")
        if not bps.is_initialized():
            bps.init(**(init_options or {}))
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=None, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self._compression = compression
        self._manual_bpps = backward_passes_per_step
        self._backup_sampler = backup_sampler
        self._exit_stack: contextlib.ExitStack | None = None
        self._failed = False
        rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    # -- who is who -------------------------------------------------------------------------
    @property
    def global_rank(self) -> int:
        return bps.rank()

    @property
    def local_rank(self) -> int:
        return bps.local_rank()

    @property
    def node_rank(self) -> int:
        return bps.cross_rank()

    @property
    def world_size(self) -> int:
        return bps.size()

    @property
    def is_distributed(self) -> bool:  # Lightning then adds a DistributedSampler
        return True

    @property
    def root_device(self) -> torch.device:
        devices = self.parallel_devices or [torch.device("cpu")]
        if devices[0].type == "cuda":
            return torch.device("cuda", self.local_rank)
        return devices[0]

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def process_dataloader(self, dataloader: object) -> object:
        """The training dataloader's sampler, with backup workers (``BYTEPS_BACKUP_WORKERS >
        0``): ``bps.DistributedSampler`` in place of the one Lightning added (see
        :func:`backup_aware_sampler`), so each epoch deals the whole dataset anew and holds as many
        samples as the rounds average; every rank then has ``ceil(len / (size - b *
        local_size))`` samples an epoch. Validation, test and prediction loaders, every loader
        with ``b = 0`` and every loader of ``Trainer(use_distributed_sampler=False)`` are left
        as they are."""
        dataloader = super().process_dataloader(dataloader)
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None) if module is not None else None
        if (not self._backup_sampler or trainer is None
                or trainer.state.stage != RunningStage.TRAINING
                or not isinstance(dataloader, DataLoader)):
            return dataloader
        # Trainer(use_distributed_sampler=False): the script deals its data itself
        connector = getattr(trainer, "_accelerator_connector", None)
        if not getattr(connector, "use_distributed_sampler", True):
            return dataloader
        sampler = backup_aware_sampler(dataloader.sampler)
        if sampler is None:
            return dataloader
        return _update_dataloader(dataloader, sampler, mode=RunningStage.TRAINING)

    def model_to_device(self) -> None:
        if self.root_device.type == "cuda":
            torch.cuda.set_device(self.root_device)
        assert self.model is not None
        self.model.to(self.root_device)

    # -- training ---------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        self._exit_stack = contextlib.ExitStack()
        if trainer.state.fn != TrainerFn.FITTING:
            return
        module = self.lightning_module
        assert module is not None
        optimizers = [o._optimizer if isinstance(o, LightningOptimizer) else o
                      for o in self.optimizers]
        # every rank starts from rank 0's weights and optimizer state (as DDP does)
        bps.broadcast_parameters(module.state_dict(), root_rank=0)
        for opt in optimizers:
            if not isinstance(opt, bps.DistributedOptimizer):
                bps.broadcast_optimizer_state(opt, root_rank=0)
        bpps = trainer.accumulate_grad_batches if module.automatic_optimization \
            else self._manual_bpps
        wrapped: list[torch.optim.Optimizer] = []
        for opt in optimizers:
            if not isinstance(opt, bps.DistributedOptimizer):
                opt = bps.DistributedOptimizer(
                    opt, named_parameters=self._named_parameters(module, opt),
                    compression=self._compression, backward_passes_per_step=bpps)
            # the step is synchronised by the closure (optimizer_step below), after backward
            self._exit_stack.enter_context(opt.skip_synchronize())
            wrapped.append(opt)
        self.optimizers = wrapped

    @staticmethod
    def _named_parameters(module: torch.nn.Module, optimizer) -> list[tuple[str, Any]]:
        ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
        return [(n, p) for n, p in module.named_parameters() if id(p) in ids]

    def optimizer_step(self, optimizer, closure: Callable[[], Any], model=None,
                       **kwargs: Any) -> Any:
        """The closure runs forward and backward (push_pulls start during backward); the
        averages are waited for right after it, before gradient clipping and the update."""
        inner = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        if isinstance(inner, bps.DistributedOptimizer):
            user_closure = closure

            def closure() -> Any:
                result = user_closure()
                inner.synchronize()
                return result
        return super().optimizer_step(optimizer, closure, model, **kwargs)

    # -- collectives ------------------------------------------------------------------------
    def reduce(self, tensor: Any, group: Any | None = None,
               reduce_op: Any | None = "mean") -> Any:
        """``tensor`` reduced over every worker (sum, mean, max or min); anything but a tensor
        comes back unchanged, as with Lightning's DDP strategy."""
        if not isinstance(tensor, torch.Tensor):
            return tensor
        self._check_group(group, "reduce")
        op = _op_name(reduce_op)
        t = tensor.detach()
        if op in ("max", "min"):
            gathered = _gather(t)
            return gathered.amax(0) if op == "max" else gathered.amin(0)
        if t.dtype == torch.bool:
            t = t.to(torch.int32)
        if op == "mean" and not t.is_floating_point():
            # as Lightning's DDP: the sum divided by the world size, a float (not floored)
            total = bps.push_pull(t.contiguous(), average=False, name=_key("sum", t))
            return total / self.world_size
        return bps.push_pull(t.contiguous(), average=op == "mean", name=_key(op, t))

    def all_gather(self, tensor: torch.Tensor, group: Any | None = None,
                   sync_grads: bool = False) -> torch.Tensor:
        """Every worker's ``tensor`` stacked along a new first dimension, in rank order
        (Lightning's contract); ``sync_grads``: differentiable."""
        self._check_group(group, "all_gather")
        if sync_grads:
            return _GatherWithGrad.apply(tensor)
        return _gather(tensor)

    def barrier(self, name: str | None = None) -> None:
        bps.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank. It travels through byteps_like's restricted
        codec (no pickle): None, bool, int, float, str, bytes, lists, tuples, dicts, tensors,
        arrays, and paths (as Lightning broadcasts checkpoint directories)."""
        if isinstance(obj, os.PathLike):
            packed: Any = ("path", os.fspath(obj))
        else:
            packed = ("value", obj)
        kind, value = bps.broadcast_object(packed, root_rank=src, name="lightning.broadcast")
        if kind == "path":
            from pathlib import Path
            return Path(value)
        return value

    @staticmethod
    def _check_group(group: Any, what: str) -> None:
        if group is None:
            return
        world = getattr(getattr(torch.distributed, "group", None), "WORLD", None)
        if group is not world:
            raise ValueError(f"BytePSStrategy.{what}: process groups are not supported "
                             f"(got group={group!r}); every byteps_like collective spans "
                             "the whole job: leave group unset")

    def on_exception(self, exception: BaseException) -> None:
        self._failed = True
        super().on_exception(exception)

    def teardown(self) -> None:
        """Every rank leaves ``fit`` (or validate, test, predict) together, as Horovod's
        strategy made them (a rank that returned first could end its process while a peer
        still waits for the last round's result); not after an exception, which the job's
        failure handling reports instead."""
        if not self._failed:
            bps.barrier()
        self._failed = False
        if self._exit_stack is not None:
            self._exit_stack.close()
            self._exit_stack = None
        # the gradient hooks go with the fit: a later fit of the same model wraps it anew
        for opt in self.optimizers:
            if isinstance(opt, bps.DistributedOptimizer):
                opt.close()
        super().teardown()

    def __repr__(self) -> str:
        return f"BytePSStrategy(rank={bps.rank()}, size={bps.size()})"

