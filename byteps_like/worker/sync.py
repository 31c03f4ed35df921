"""Gradient bookkeeping, written once for every framework plugin.

A :class:`GradientSynchronizer` knows the model's parameters by name, in the order the forward
pass needs them. A plugin tells it when a parameter's gradient has been accumulated (a backward
hook); after ``backward_passes_per_step`` accumulations it starts that gradient's push_pull at
once, so communication overlaps the rest of the backward pass. ``synchronize()`` starts what has
not started (parameters without gradients this step), waits for everything and writes the
averaged gradients back.

Priorities: the first parameter the forward pass uses gets the highest priority, so its gradient,
produced last by backward, overtakes the bulk still queued and the next forward can start early.

The plugin supplies one function, ``grad_buffer(index) -> GradBuffer``: a numpy view of the
gradient (zero-copy where the framework allows), its wire dtype, and a write-back for
frameworks that had to stage a copy.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..compression import Compression, Compressor, resolve, split
from ..errors import BytePSError
from .runtime import Runtime


@dataclass
class GradBuffer:
    array: np.ndarray                     # the gradient as numpy (a view when possible)
    dtype: str | None = None              # wire dtype override (e.g. "bfloat16")
    writeback: Callable[[], None] | None = None   # after the sum landed in ``array``
    device: Any = None   # a runtime.DeviceCopier: ``array`` is its host staging buffer
    start: Callable[[int], Any] | None = None   # starts the push_pull itself, given its
                                                # priority (e.g. after an NCCL reduce-scatter);
                                                # writeback finishes it


@dataclass
class _Pending:
    handle: Any
    buf: GradBuffer
    wire: np.ndarray
    ctx: Any
    dtype: str


def check_names(names: Sequence[str], what: str = "named_parameters") -> None:
    """Duplicate or empty names would make two tensors share a key: refuse them clearly."""
    seen: dict[str, int] = {}
    dups = []
    for i, n in enumerate(names):
        if not isinstance(n, str) or not n:
            raise ValueError(f"{what}: parameter #{i} has no usable name ({n!r})")
        if n in seen:
            dups.append(n)
        seen[n] = i
    if dups:
        raise ValueError(f"{what} has duplicate names: {sorted(set(dups))}; every parameter "
                         "needs its own name (they name the tensors on the wire)")


class GradientSynchronizer:
    def __init__(self, rt: Runtime, names: Sequence[str],
                 grad_buffer: Callable[[int], GradBuffer], *, backward_passes_per_step: int = 1,
                 compression: Compressor = Compression.none, average: bool = True,
                 prefix: str = "Gradient."):
        check_names(names)
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step={backward_passes_per_step}: must be >= 1")
        self.rt = rt
        self.names = list(names)
        self.tensor_names = [prefix + n for n in self.names]
        self.grad_buffer = grad_buffer
        self.bpps = backward_passes_per_step
        # BYTEPS_COMPRESSOR* applies where the code left the default; a cast compressor (fp16)
        # changes the wire dtype here, a codec (onebit, top-k, ...) runs in the runtime's
        # pipeline per partition
        self.compression = resolve(compression, rt.cfg)
        self._cast, self._codec = split(self.compression)
        self.average = average
        # the first parameter of the forward pass goes first
        self.priorities = [-i for i in range(len(self.names))]
        self.counts = [0] * len(self.names)
        self.pending: dict[int, _Pending] = {}
        self.enabled = True
        self._lock = threading.Lock()
        for n in self.tensor_names:
            rt.declare(n)

    # -- backward side -----------------------------------------------------------------------
    def ready(self, index: int) -> None:
        """A backward pass has accumulated parameter ``index``'s gradient."""
        if not self.enabled:
            return
        with self._lock:
            self.counts[index] += 1
            if self.counts[index] > self.bpps:
                raise BytePSError(
                    f"gradient of {self.names[index]!r} was accumulated "
                    f"{self.counts[index]} times, more than backward_passes_per_step="
                    f"{self.bpps}, before the step synchronised it: call optimizer.step() "
                    "(or synchronize()) after every backward_passes_per_step backward passes")
            start = self.counts[index] == self.bpps and index not in self.pending
        if start:
            self._launch(index)

    def _launch(self, index: int) -> None:
        buf = self.grad_buffer(index)
        dtype = buf.dtype or _wire_dtype(buf.array)
        if buf.start is not None:  # the plugin runs the whole operation (NCCL local reduction)
            h = buf.start(self.priorities[index])
            with self._lock:
                self.pending[index] = _Pending(h, buf, buf.array, None, dtype)
            return
        if buf.device is not None:  # staged partition by partition by the pipeline
            wire, wdtype, ctx = buf.array, dtype, None
        else:
            wire, wdtype, ctx = self._cast.compress(buf.array, dtype)
        h = self.rt.push_pull_async(wire, name=self.tensor_names[index], average=self.average,
                                    priority=self.priorities[index], out=wire, dtype=wdtype,
                                    device=buf.device, compression=self._codec)
        with self._lock:
            self.pending[index] = _Pending(h, buf, wire, ctx, dtype)

    # -- step side ---------------------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        return len(self.pending)

    def synchronize(self, timeout: float | None = None) -> None:
        """Start every gradient not yet started, wait for all, write the sums back. Each call
        that succeeds is one training step for traces, metrics and the status view
        (``Runtime.note_step``, keyed by the group's first tensor)."""
        for i in range(len(self.names)):
            if i not in self.pending:
                self._launch(i)
        errors = []
        for i in sorted(self.pending):
            p = self.pending[i]
            try:
                p.handle.wait(timeout)
            except Exception as exc:  # noqa: BLE001 - first one raised after cleanup
                errors.append(exc)
                continue
            if p.wire is not p.buf.array:
                self._cast.decompress(p.wire, p.ctx, p.buf.array, p.dtype)
            if p.buf.writeback is not None:
                p.buf.writeback()
        self.pending.clear()
        self.counts = [0] * len(self.names)
        if errors:
            raise errors[0]
        self.rt.note_step(self.tensor_names[0] if self.names else "")

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """Backward passes inside do not start any push_pull (gradient accumulation)."""
        prev, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = prev


def _wire_dtype(arr: np.ndarray) -> str:
    from ..wire import dtype_name
    return dtype_name(arr.dtype)


def model_signature_check(rt: Runtime, entries: Sequence[tuple[str, tuple, str]],
                          what: str = "model") -> None:
    """Raise MismatchError on every worker when the workers' parameter lists differ.

    Every rank writes a 48-bit digest of its (name, shape, dtype) list into its own slot of a
    vector; after the sum every rank sees every digest and names the ranks that differ."""
    import hashlib

    from ..errors import MismatchError
    digest = hashlib.sha256(repr(list(entries)).encode()).digest()
    mine = int.from_bytes(digest[:6], "little")
    slots = np.zeros(rt.size(), np.int64)
    slots[rt.rank()] = mine
    rt.push_pull_async(slots, name=f"Signature.{what}.{rt.size()}", average=False,
                       out=slots).wait()
    if len(set(slots.tolist())) > 1:
        groups: dict[int, list[int]] = {}
        for r, d in enumerate(slots.tolist()):
            groups.setdefault(d, []).append(r)
        desc = "; ".join(f"ranks {rs}" for rs in groups.values())
        raise MismatchError(
            f"the {what} differs between workers (parameter names, shapes or dtypes): {desc} "
            f"hold different versions; this rank ({rt.rank()}) has {len(entries)} parameters, "
            f"first {entries[:3]}")
