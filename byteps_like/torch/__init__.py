"""byteps_like.torch: drop-in for ``byteps.torch``.

    import byteps_like.torch as bps
    bps.init()
    optimizer = bps.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    bps.broadcast_parameters(model.state_dict(), root_rank=0)
    bps.broadcast_optimizer_state(optimizer, root_rank=0)
"""
from __future__ import annotations

from typing import Any

try:
    import torch as _torch  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without torch
    raise ImportError("byteps_like.torch needs PyTorch: pip install 'byteps_like[torch]' "
                      "(or torch itself)") from exc

from ..compression import Compression
from ..reduce_op import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from ..worker.api import (  # core
    barrier,
    cross_rank,
    cross_size,
    declare,
    get_pushpull_speed,
    join,
    local_rank,
    local_size,
    rank,
    set_progress,
    size,
)
from ..worker.api import plugin_init as init
from ..worker.runtime import default_runtime

# the functions shadow the submodule of the same name on purpose: bps.broadcast(t, 0) is a call
from .broadcast import (
    broadcast,
    broadcast_,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from .ops import (
    TorchHandle,
    poll,
    push_pull,
    push_pull_async,
    push_pull_async_inplace,
    push_pull_inplace,
    synchronize,
)
from .optimizer import DistributedOptimizer
from .parallel import DistributedDataParallel
from .sampler import DistributedSampler
from .sparse import SparseEmbedding, SparseEmbeddingBag
from .sync_batch_norm import SyncBatchNorm


def shutdown() -> None:
    from .nccl import close_groups
    close_groups()
    default_runtime().shutdown()


def is_initialized() -> bool:
    """Whether this process has joined a job (Horovod's ``is_initialized``)."""
    return default_runtime().initialized


# Horovod's names for the same operations, so scripts written for Horovod run with a changed
# import; the argument order is Horovod's (tensor, average, name, ..., op). ``op`` (Average or
# Sum) supersedes ``average``: pass one of them; neither averages.
def allreduce(tensor, average: bool | None = None, name: str | None = None,
              compression=Compression.none, op=None):
    """Horovod's ``allreduce``: :func:`push_pull` (differentiable)."""
    return push_pull(tensor, average=average, name=name, compression=compression, op=op)


def allreduce_(tensor, average: bool | None = None, name: str | None = None, op=None):
    """Horovod's in-place ``allreduce_``: :func:`push_pull_inplace`."""
    return push_pull_inplace(tensor, average=average, name=name, op=op)


def allreduce_async(tensor, average: bool | None = None, name: str | None = None, op=None):
    """Horovod's ``allreduce_async``: :func:`push_pull_async`; wait with ``synchronize``."""
    return push_pull_async(tensor, average=average, name=name, op=op)


def allreduce_async_(tensor, average: bool | None = None, name: str | None = None, op=None):
    """Horovod's ``allreduce_async_``: :func:`push_pull_async_inplace`."""
    return push_pull_async_inplace(tensor, average=average, name=name, op=op)


def allgather(tensor, name: str | None = None):
    """Horovod's ``allgather``: every rank's ``tensor`` concatenated along the first axis in rank
    order, on ``tensor``'s device. The first dimension may differ between ranks. Not
    differentiable (use push_pull for gradients)."""
    from ..worker.broadcast import allgather_array
    if not isinstance(tensor, _torch.Tensor):
        raise TypeError(f"allgather: expected a tensor, got {type(tensor).__name__}")
    t = tensor.detach().cpu()
    if t.dtype == _torch.bfloat16:  # numpy has no bfloat16: gather its float32 values (exact)
        return allgather(t.float(), name).to(_torch.bfloat16).to(tensor.device)
    out = allgather_array(default_runtime(), t.numpy(), name)
    return _torch.from_numpy(out).to(tensor.device)


def suspend() -> None:
    """Leave the job, keeping nothing in flight (BytePS's elastic-training hook). ``resume``
    joins again."""
    shutdown()


def resume(num_workers: int | None = None, num_servers: int | None = None,
           global_rank: int | None = None, context=None) -> None:
    """Join a (possibly resized) job after ``suspend()``. Counts not given are read from the
    environment again."""
    from ..worker.runtime import reset_default_runtime
    overrides: dict[str, Any] = {}
    if num_workers is not None:
        overrides["cluster.num_worker"] = num_workers
    if num_servers is not None:
        overrides["cluster.num_server"] = num_servers
    if global_rank is not None:
        overrides["cluster.worker_id"] = global_rank
    reset_default_runtime()  # a fresh runtime: the old one is shut down
    init(**overrides)


__all__ = ["init", "shutdown", "suspend", "resume", "rank", "size", "local_rank", "local_size",
           "declare", "push_pull", "push_pull_async", "push_pull_inplace",
           "push_pull_async_inplace", "poll", "synchronize", "Compression",
           "DistributedOptimizer", "DistributedDataParallel", "DistributedSampler",
           "broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "TorchHandle",
           "get_pushpull_speed", "set_progress",
           "broadcast", "broadcast_", "barrier", "join", "allgather", "is_initialized",
           "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "Average", "Sum",
           "Adasum", "Min", "Max", "Product",
           "ReduceOp", "SyncBatchNorm", "cross_rank", "cross_size", "SparseEmbedding",
           "SparseEmbeddingBag"]


def __getattr__(name: str):  # bps.elastic loads on first use (docs/elastic.md)
    if name == "elastic":
        import importlib
        return importlib.import_module(f"{__name__}.elastic")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
