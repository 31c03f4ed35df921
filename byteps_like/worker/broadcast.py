"""Broadcast and allgather through the parameter servers, for every framework.

A broadcast is a push_pull in which every rank but the root contributes zeros: the sum is the
root's value. Objects travel through :mod:`byteps_like.worker.objcodec` (no pickle) as int64 words,
whose sums with zeros are exact. An allgather is the same idea with every rank the root of its
own rows: each rank writes its rows at its offset of a zero buffer holding all ranks' rows.
"""
from __future__ import annotations

import itertools
import zlib
from typing import Any, Protocol

import numpy as np

from ..errors import BytePSError, MismatchError
from . import objcodec
from .handle import Handle


class Runtime(Protocol):
    """What a broadcast needs of the worker runtime (:class:`~.runtime.Runtime` is one); a
    protocol, so this module does not import the runtime (whose elastic membership resets
    the names below)."""

    def rank(self) -> int: ...

    def size(self) -> int: ...

    def push_pull_async(self, array: Any, name: str | None = None, average: bool = True,
                        priority: int = 0, out: Any = None,
                        dtype: str | None = None) -> Handle: ...


# the sequences that name unnamed broadcasts and allgathers: the same on every worker
_counter = itertools.count()
_gather_counter = itertools.count()


def reset_names() -> None:
    """Restart the names of unnamed broadcasts and allgathers (an elastic job's new epoch,
    in which every name is declared afresh, so that a joiner's names are the survivors')."""
    global _counter, _gather_counter
    _counter = itertools.count()
    _gather_counter = itertools.count()


def broadcast_array(rt: Runtime, arr: np.ndarray, root_rank: int, name: str) -> None:
    """Overwrite ``arr`` in place with the root rank's values."""
    _check_root(rt, root_rank)
    if rt.rank() != root_rank:
        arr[...] = 0
    rt.push_pull_async(arr, name=name, average=False, out=arr).wait()


_FAILED = -1  # the root could not produce its data: every rank raises instead of waiting


def broadcast_bytes(rt: Runtime, data: bytes | None, root_rank: int, name: str,
                    root_failed: bool = False) -> bytes:
    """The root's ``data`` on every rank (others pass None)."""
    _check_root(rt, root_rank)
    root = rt.rank() == root_rank
    if root and data is None and not root_failed:
        raise BytePSError(f"broadcast {name!r}: the root rank {root_rank} passed no data")
    payload = data or b""
    size = np.array([(_FAILED if root_failed else len(payload)) if root else 0], np.int64)
    rt.push_pull_async(size, name=f"{name}.size", average=False, out=size).wait()
    n = int(size[0])
    if n == _FAILED:
        if root_failed:
            return b""  # the root raises its own error
        raise BytePSError(f"broadcast {name!r}: root rank {root_rank} could not serialise its "
                          "object (its own error says why)")
    words = np.zeros((n + 7) // 8, np.int64)
    if root:
        words.view(np.uint8)[:n] = np.frombuffer(payload, np.uint8)
    rt.push_pull_async(words, name=f"{name}.data.{words.size}", average=False, out=words).wait()
    return words.view(np.uint8)[:n].tobytes()


def broadcast_object(rt: Runtime, obj: Any, root_rank: int, name: str | None = None,
                     to_array: objcodec.ToArray | None = None,
                     from_array: objcodec.FromArray | None = None) -> Any:
    """The root rank's ``obj`` on every rank. Trusts only what the root of this job sent, and
    even that is decoded by the restricted codec: no code can travel."""
    name = name or f"BroadcastObject.{next(_counter)}"
    data = None
    if rt.rank() == root_rank:
        try:
            data = objcodec.encode(obj, to_array)
        except TypeError:
            # tell the other ranks, so they raise too instead of waiting for the data
            broadcast_bytes(rt, None, root_rank, name, root_failed=True)
            raise
    return objcodec.decode(broadcast_bytes(rt, data, root_rank, name), from_array)


def _check_root(rt: Runtime, root_rank: int) -> None:
    size = rt.size()
    if not 0 <= root_rank < size:
        raise ValueError(f"root_rank={root_rank} is out of range for a job of {size} workers")


def allgather_array(rt: Runtime, arr: np.ndarray, name: str | None = None,
                    dtype: str | None = None, *, max_rows: int | None = None,
                    bound: str = "") -> np.ndarray:
    """Every rank's ``arr`` concatenated along the first axis in rank order (Horovod's
    ``allgather``). Ranks may differ in their first dimension; the other dimensions and the
    dtype must agree (a MismatchError names the ranks that differ). Values travel exactly
    (x + 0 == x), except that -0.0 arrives as 0.0. Each distinct total size is its own key on
    the servers, so gathering many different sizes under one name holds a buffer for each.
    ``max_rows``: every rank raises ValueError (naming the ranks over it and ``bound``, the
    setting) when a rank brings more rows, before the result is allocated: every rank sees every
    count, so they all stop, none waits."""
    arr = np.ascontiguousarray(arr)
    if arr.ndim == 0:
        raise ValueError("allgather needs an array with at least one dimension, got a scalar")
    name = name or f"allgather.noname.{next(_gather_counter)}"
    r, n = rt.rank(), rt.size()
    # every rank's row count and a fingerprint of its row shape and dtype, in one push_pull
    sig = zlib.crc32(f"{arr.shape[1:]}/{dtype or arr.dtype.name}".encode())
    info = np.zeros((n, 2), np.int64)
    info[r] = (arr.shape[0], sig)
    rt.push_pull_async(info, name=f"{name}.rows", average=False, out=info).wait()
    differ = sorted(q for q in range(n) if info[q, 1] != sig)
    if differ:
        raise MismatchError(
            f"allgather {name!r} on worker rank {r}: rows of shape {arr.shape[1:]} "
            f"{dtype or arr.dtype.name} here, but worker ranks {differ} have a different row "
            "shape or dtype; only the first dimension may differ between ranks")
    rows = info[:, 0]
    over = [q for q in range(n) if max_rows is not None and rows[q] > max_rows]
    if over:
        raise ValueError(
            f"allgather {name!r} on worker rank {r}: worker rank(s) {over} bring "
            f"{[int(rows[q]) for q in over]} rows, more than {max_rows}"
            + (f" ({bound})" if bound else "") + "; nothing was gathered")
    total, offset = int(rows.sum()), int(rows[:r].sum())
    out = np.zeros((total,) + arr.shape[1:], arr.dtype)
    if total == 0:
        return out
    out[offset:offset + arr.shape[0]] = arr
    rt.push_pull_async(out, name=f"{name}.data.{total}", average=False, out=out,
                       dtype=dtype).wait()
    return out
