"""The framework-neutral worker API on numpy arrays (``import byteps_like as bps``)."""
from __future__ import annotations

from typing import Any

from .handle import Handle
from .runtime import Runtime, default_runtime


def init(**overrides: Any) -> None:
    """Join the job described by the environment (BytePS's DMLC_*/BYTEPS_* contract).

    Keyword overrides take precedence over the environment, e.g.
    ``init(**{"partition.partition_bytes": 1 << 20})``. With no environment at all this is a
    one-process job where push_pull returns its input."""
    rt = default_runtime()
    if overrides and not rt.initialized:
        rt._overrides = overrides
    rt.init()


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


def declare(name: str) -> None:
    """Declare a tensor name; every worker must declare the same names in the same order."""
    default_runtime().declare(name)


def barrier(timeout: float | None = None) -> None:
    """Block until every worker has reached this barrier."""
    default_runtime().barrier(timeout)


def push_pull_async(array: Any, name: str | None = None, average: bool = True, priority: int = 0,
                    out: Any = None, dtype: str | None = None) -> Handle:
    """Start summing ``array`` over all workers; returns a :class:`Handle`.

    Larger ``priority`` values go out first. The input must not change until the handle is done.
    """
    return default_runtime().push_pull_async(array, name, average, priority, out, dtype)


def push_pull(array: Any, name: str | None = None, average: bool = True, priority: int = 0,
              out: Any = None, timeout: float | None = None) -> Any:
    """Sum (or average) ``array`` over all workers and return the result."""
    return push_pull_async(array, name, average, priority, out).wait(timeout)


def poll(handle: Handle) -> bool:
    """True once ``handle`` has finished (successfully or not)."""
    return handle.done()


def synchronize(handle: Handle, timeout: float | None = None) -> Any:
    """Wait for ``handle`` and return its output (raises its error, if any)."""
    return handle.wait(timeout)


def get_pushpull_speed() -> tuple[int, float]:
    """(timestamp in ms, MB/s this worker pushed plus pulled over the last few seconds)."""
    return default_runtime().get_pushpull_speed()


__all__ = ["Runtime", "Handle", "init", "shutdown", "rank", "size", "local_rank", "local_size",
           "declare", "barrier", "push_pull", "push_pull_async", "poll", "synchronize", "get_pushpull_speed"]
