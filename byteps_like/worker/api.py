"""The framework-neutral worker API on numpy arrays (``import byteps_like as bps``)."""
from __future__ import annotations

from typing import Any

import numpy as np

from .handle import Handle
from .runtime import Runtime, default_runtime
from .sparse import EmbeddingTable


def init(**overrides: Any) -> None:
    """Join the job described by the environment (BytePS's DMLC_*/BYTEPS_* contract).

    Keyword overrides take precedence over the environment, e.g.
    ``init(**{"partition.partition_bytes": 1 << 20})``. With no environment at all this is a
    one-process job where push_pull returns its input."""
    default_runtime().init(**overrides)


def plugin_init(lazy: bool = True, **overrides: Any) -> None:
    """A framework plugin's ``init``: join the job (``lazy`` is accepted for BytePS
    compatibility)."""
    init(**overrides)


def shutdown() -> None:
    """Finish in-flight operations, leave the job and release every resource."""
    default_runtime().shutdown()


def rank() -> int:
    return default_runtime().rank()


def size() -> int:
    return default_runtime().size()


def local_rank() -> int:
    return default_runtime().local_rank()


def local_size() -> int:
    return default_runtime().local_size()


def cross_rank() -> int:
    """This worker's machine index among the worker machines (Horovod's ``cross_rank``): the
    local ranks of one machine share it."""
    return default_runtime().cross_rank()


def cross_size() -> int:
    """The number of worker machines (Horovod's ``cross_size``; ``size() // local_size()``)."""
    return default_runtime().cross_size()


def declare(name: str) -> None:
    """Declare a tensor name; every worker must declare the same names in the same order."""
    default_runtime().declare(name)


def barrier(timeout: float | None = None) -> None:
    """Block until every worker has reached this barrier."""
    default_runtime().barrier(timeout)


def allgather(array: Any, name: str | None = None) -> np.ndarray:
    """Every worker's ``array`` concatenated along the first axis, in rank order (Horovod's
    ``allgather``); the first dimension may differ between workers, the rest may not. Goes
    through the servers as a sum of zero-padded buffers (exact). Unnamed calls are numbered in
    call order, the same on every worker."""
    from .broadcast import allgather_array
    return allgather_array(default_runtime(), np.asarray(array), name)


def join(device: Any = None) -> int:
    """This rank has run out of data (Horovod's ``hvd.join()``): finish what is in flight and
    block until every worker has joined; returns the rank that joined last. Meanwhile the other
    ranks keep training: their rounds complete without this rank and averages divide by the
    ranks still in. ``device`` is accepted for Horovod compatibility and ignored. A rank that
    ends without calling join() while others still push_pull makes their push_pull (and join)
    raise :class:`~byteps_like.errors.PeerLeftError` naming it."""
    del device
    return default_runtime().join()


def push_pull_async(array: Any, name: str | None = None, average: bool = True, priority: int = 0,
                    out: Any = None, dtype: str | None = None,
                    compression: Any = None) -> Handle:
    """Start summing ``array`` over all workers; returns a :class:`Handle`.

    Larger ``priority`` values go out first. The input must not change until the handle is done.
    ``compression``: a compressor of :class:`byteps_like.compression.Compression` (fp16, bf16,
    onebit, top-k, ...; docs/compression.md); the sum is then approximate.
    """
    _check_name(name)
    return default_runtime().push_pull_async(array, name, average, priority, out, dtype,
                                             compression=compression)


def _check_name(name: Any) -> None:
    """Refuse a name that is not a str: ``push_pull(arr, False)`` is BytePS's
    ``push_pull(tensor, average)`` habit, and here would name the tensor False and average it."""
    if name is not None and not isinstance(name, str):
        raise TypeError(f"push_pull: name must be a str, got {name!r}; the positional "
                        "arguments are push_pull(array, name=None, average=True, priority=0), "
                        "not BytePS's push_pull(tensor, average, name): pass average=... and "
                        "name=... by keyword")


def push_pull(array: Any, name: str | None = None, average: bool = True, priority: int = 0,
              out: Any = None, timeout: float | None = None, compression: Any = None) -> Any:
    """Sum (or average) ``array`` over all workers and return the result."""
    return push_pull_async(array, name, average, priority, out,
                           compression=compression).wait(timeout)


def poll(handle: Handle) -> bool:
    """True once ``handle`` has finished (successfully or not)."""
    return handle.done()


def synchronize(handle: Handle, timeout: float | None = None) -> Any:
    """Wait for ``handle`` and return its output (raises its error, if any)."""
    return handle.wait(timeout)


def get_pushpull_speed() -> tuple[int, float]:
    """(timestamp in ms, MB/s this worker pushed plus pulled over the last few seconds)."""
    return default_runtime().get_pushpull_speed()


def set_progress(step: int, total_steps: int = 0, samples_per_step: int = 0) -> None:
    """Declare this worker's progress for the live job page (docs/observability.md): the step
    it is at, the steps the job will run (0: unknown; with it, the page shows an ETA) and the
    samples one step of this worker takes (0: unknown; with it, the job's samples/s). Cheap:
    call it every step. Sent with the next report to the scheduler."""
    rt = default_runtime()
    tel = rt.telemetry
    if tel is None:
        from ..errors import NotInitializedError
        raise NotInitializedError("set_progress() needs init() first")
    tel.set_progress(step, total_steps, samples_per_step)


def embedding_table(name: str, rows: int, dim: int, **kw: Any) -> EmbeddingTable:
    """A server-held embedding table (docs/sparse.md): ``rows x dim`` float32, sharded by row
    over the servers, updated there by its optimizer. ``table.pull(ids)`` gives the rows,
    ``table.push(ids, grads)`` one step's gradients. Keywords: ``init`` (zeros, uniform, normal),
    ``init_args``, ``seed``, ``optimizer`` (sgd, adagrad, adam) and its parameters (``lr``, ...).
    Every worker creates the same tables in the same order."""
    return default_runtime().sparse.create(name, rows, dim, **kw)


__all__ = ["Runtime", "Handle", "init", "shutdown", "rank", "size", "local_rank", "local_size",
           "declare", "barrier", "push_pull", "push_pull_async", "poll", "synchronize",
           "get_pushpull_speed", "embedding_table", "set_progress"]
