"""Gradient bookkeeping, written once for every framework plugin.

A :class:`GradientSynchronizer` knows the model's parameters by name, in the order the forward
pass needs them. A plugin tells it when a parameter's gradient has been accumulated (a backward
hook); after ``backward_passes_per_step`` accumulations the gradient is ready.
``synchronize()`` starts what has not started (parameters without gradients this step), waits
for everything and writes the averaged gradients back.

Tensor fusion: a real model is hundreds of gradients, most of them small, and each push_pull
costs a fixed amount of work however small it is. When the plugin describes the parameters'
sizes (``layout``), the gradients are grouped, in the order backward produces them, into
buckets of at most ``BYTEPS_FUSION_BYTES`` (:func:`plan_buckets`: the same buckets on every
worker and every step). A bucket is one tensor on the wire; its push_pull starts as soon as its
last gradient is ready, so communication overlaps the rest of the backward pass. The default
gathers the members' host arrays into a flat host buffer; a plugin may gather a bucket itself
(``fuse``: the PyTorch plugin gathers CUDA gradients into one flat device buffer, so a bucket
is one device-to-host copy each way).

Priorities: the first parameter the forward pass uses gets the highest priority (a bucket takes
its most urgent member's), so its gradient, produced last by backward, overtakes the bulk still
queued and the next forward can start early.

The plugin supplies ``grad_buffer(index) -> GradBuffer``: a numpy view of the gradient
(zero-copy where the framework allows), its wire dtype, and a write-back for frameworks that
had to stage a copy.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import _core
from ..compression import Compression, Compressor, resolve
from ..errors import BytePSError
from .route import fuses
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
    dtype: str
    members: list[tuple[GradBuffer, int, int]] | None = None  # a host-fused bucket's members:
                                                              # (buffer, byte offset, bytes)


@dataclass
class Bucket:
    """A group of gradients that travels as one tensor (tensor fusion).

    ``members`` are parameter indices in the order backward produces their gradients (the
    reverse of the forward order); ``offsets`` their byte offsets in the bucket's flat buffer.
    A bucket of one member is the gradient itself, under its own name."""
    index: int
    members: list[int]
    offsets: list[int]
    nbytes: int
    name: str
    priority: int

    @property
    def fused(self) -> bool:
        return len(self.members) > 1


def dtype_layout(entries: Sequence[tuple[int, str]], compression: Compressor | None,
                 cfg: Any) -> list[tuple[int, Hashable, int]]:
    """The synchronizer's ``layout`` from each gradient's ``(bytes, dtype name)``: grouped by
    dtype, each with its bytes on the wire under ``compression`` (resolved with ``cfg``'s
    ``BYTEPS_COMPRESSOR`` as the synchronizer resolves it): a cast compressor halves float32,
    so a bucket holds ``BYTEPS_FUSION_BYTES`` of wire bytes whatever the compressor."""
    from ..wire import ITEMSIZE
    comp = resolve(compression, cfg) if cfg is not None else (compression or Compression.none)
    out: list[tuple[int, Hashable, int]] = []
    for nbytes, dtype in entries:
        wire = nbytes
        if comp.kind == "cast" and dtype in ITEMSIZE:
            wire = nbytes // ITEMSIZE[dtype] * ITEMSIZE[comp.wire_dtype(dtype)]
        out.append((nbytes, dtype, wire))
    return out


def plan_buckets(sizes: Sequence[int], groups: Sequence[Hashable],
                 fusion_bytes: int) -> list[list[int]]:
    """Group parameters ``0..n-1`` (forward order) into buckets, in the order backward produces
    their gradients (last parameter first).

    Gradients that cannot share a flat buffer (another dtype or device: ``groups`` differ) go
    to different buckets; each group fills one open bucket up to ``fusion_bytes``, and a
    gradient of at least ``fusion_bytes`` (or any, with ``fusion_bytes`` 0) goes alone. Pure
    and deterministic: every worker computes the same buckets from the same parameter list.
    The buckets come out in the order they become ready (their first member first)."""
    if len(sizes) != len(groups):
        raise ValueError(f"{len(sizes)} sizes for {len(groups)} groups")
    buckets: list[list[int]] = []
    open_: dict[Hashable, tuple[list[int], int]] = {}
    for i in reversed(range(len(sizes))):
        n = sizes[i]
        if fusion_bytes <= 0 or n >= fusion_bytes:
            buckets.append([i])
            continue
        cur = open_.get(groups[i])
        if cur is not None and cur[1] + n > fusion_bytes:
            cur = None
        if cur is None:
            members: list[int] = []
            buckets.append(members)
            cur = (members, 0)
        cur[0].append(i)
        open_[groups[i]] = (cur[0], cur[1] + n)
    return buckets


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


#: how a plugin carries a bucket itself (e.g. as one flat device buffer; called for buckets of
#: one gradient too): given the bucket, a GradBuffer whose ``start`` (or ``array``) carries
#: the whole bucket, or None for the synchronizer's own way (host fusion, or the gradient's
#: ``grad_buffer``)
FuseFn = Callable[[Bucket], "GradBuffer | None"]


class GradientSynchronizer:
    """The gradient bookkeeping of one model (or gradient list), shared by every plugin.

    ``layout`` (optional): per parameter, ``(nbytes, group)`` or ``(nbytes, group, wire
    bytes)`` (what counts against a bucket's cap; default ``nbytes``); it turns tensor fusion
    on (``BYTEPS_FUSION_BYTES``, or ``fusion_bytes``): gradients of the same ``group`` (dtype and
    device) are fused, in backward order, into buckets (:func:`plan_buckets`), and a bucket's
    push_pull starts as soon as its last gradient is ready. Without a layout, or with codec
    compression (onebit, top-k, ...: their state and scale are per tensor), each gradient
    travels alone. ``fuse`` lets a plugin gather a bucket itself (a flat device buffer); the
    default gathers the members' host arrays into a flat host buffer."""

    def __init__(self, rt: Runtime, names: Sequence[str],
                 grad_buffer: Callable[[int], GradBuffer], *, backward_passes_per_step: int = 1,
                 compression: Compressor = Compression.none, average: bool = True,
                 prefix: str = "Gradient.",
                 layout: Sequence[tuple[int, Hashable] | tuple[int, Hashable, int]]
                 | None = None,
                 fuse: FuseFn | None = None, fusion_bytes: int | None = None):
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
        self.average = average
        self.fuse = fuse
        # the first parameter of the forward pass goes first
        self.priorities = [-i for i in range(len(self.names))]
        if fusion_bytes is None:
            fusion_bytes = rt.cfg.partition.fusion_bytes if rt.cfg is not None else 0
        if layout is not None and len(layout) != len(self.names):
            raise ValueError(f"layout has {len(layout)} entries for {len(self.names)} names")
        if layout is None or not fuses(self.compression):
            fusion_bytes = 0
            layout = [(0, None)] * len(self.names)
        self.buckets = self._make_buckets(prefix, layout, fusion_bytes)
        self.bucket_of = [0] * len(self.names)
        for b in self.buckets:
            for i in b.members:
                self.bucket_of[i] = b.index
        self.counts = [0] * len(self.names)
        self._left = [len(b.members) for b in self.buckets]  # members not ready this step
        self.pending: dict[int, _Pending] = {}                # bucket index -> its push_pull
        self._flat: dict[int, np.ndarray] = {}                # host-fused buckets' buffers
        self.enabled = True
        self._lock = threading.Lock()
        for b in self.buckets:
            rt.declare(b.name)

    def _make_buckets(self, prefix: str,
                      layout: Sequence[tuple[int, Hashable] | tuple[int, Hashable, int]],
                      fusion_bytes: int) -> list[Bucket]:
        sizes = [int(e[0]) for e in layout]
        groups = [e[1] for e in layout]
        # a bucket's cap counts wire bytes where the plugin gives them (a cast compressor
        # halves float32): the same operations on the wire, whatever the compressor
        wire = [int(e[2]) if len(e) > 2 else n
                for e, n in zip(layout, sizes)]
        out = []
        # declared and started first layer first (the order of the unfused gradients): the
        # keys, and the order of the pushes of a step's leftovers, are those of the forward pass
        planned = sorted(plan_buckets(wire, groups, fusion_bytes), key=min)
        for k, members in enumerate(planned):
            offsets, off = [], 0
            for i in members:
                offsets.append(off)
                off += sizes[i]
            if len(members) == 1:
                name = self.tensor_names[members[0]]
            else:  # unique per model and stable across workers and steps
                name = (f"{prefix}Fused.{self.names[members[0]]}"
                        f"+{len(members) - 1}")
            out.append(Bucket(k, members, offsets, off, name,
                              max(self.priorities[i] for i in members)))
        return out

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
            if self.counts[index] != self.bpps:
                return
            b = self.bucket_of[index]
            self._left[b] -= 1
            start = self._left[b] == 0 and b not in self.pending
        if start:
            self._launch(self.buckets[b])

    def _launch(self, b: Bucket) -> None:
        buf = self.fuse(b) if self.fuse is not None else None
        if buf is None:
            if b.fused:
                self._launch_host_fused(b)
                return
            buf = self.grad_buffer(b.members[0])
        dtype = buf.dtype or _wire_dtype(buf.array)
        if buf.start is not None:  # the plugin runs the whole operation (NCCL, a device bucket)
            h = buf.start(b.priority)
            with self._lock:
                self.pending[b.index] = _Pending(h, buf, dtype)
            return
        # in place; a cast compressor (fp16) converts where the route plan says (worker/route.py;
        # a device tensor the pipeline stages never has one: the plan casts on the device)
        h = self.rt.push_pull_async(buf.array, name=b.name, average=self.average,
                                    priority=b.priority, out=buf.array, dtype=dtype,
                                    device=buf.device, compression=self.compression)
        with self._lock:
            self.pending[b.index] = _Pending(h, buf, dtype)

    def _launch_host_fused(self, b: Bucket) -> None:
        """Gather the members' host arrays into the bucket's flat buffer and push_pull it."""
        members = []
        for i, off in zip(b.members, b.offsets):
            mb = self.grad_buffer(i)
            if mb.start is not None:
                raise BytePSError(f"gradient {self.names[i]!r} is reduced by its plugin "
                                  "(start=) and cannot be fused on the host: the plugin must "
                                  "fuse its buckets itself")
            if mb.device is not None:  # a device tensor staged through host memory
                mb.device.d2h(0, mb.array.nbytes)
            members.append((mb, off, mb.array.nbytes))
        first = members[0][0]
        dtype = first.dtype or _wire_dtype(first.array)
        flat = self._flat.get(b.index)
        if flat is None:
            flat = self._flat[b.index] = np.empty(b.nbytes // first.array.itemsize,
                                                  first.array.dtype)
        for mb, off, n in members:
            _copy_bytes(flat, off, n, mb.array, into_flat=True)
        h = self.rt.push_pull_async(flat, name=b.name, average=self.average,
                                    priority=b.priority, out=flat, dtype=dtype,
                                    compression=self.compression)  # never a codec: fuses()
        with self._lock:
            self.pending[b.index] = _Pending(h, GradBuffer(flat, dtype), dtype, members)

    # -- step side ---------------------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        return len(self.pending)

    def synchronize(self, timeout: float | None = None) -> None:
        """Start every gradient not yet started, wait for all, write the sums back. Each call
        that succeeds is one training step for traces, metrics and the status view
        (``Runtime.note_step``, keyed by the group's first tensor)."""
        self.launch_rest()
        errors = []
        for k in sorted(self.pending):
            try:
                self.finish_bucket(k, timeout, forget=False)
            except Exception as exc:  # noqa: BLE001 - first one raised after cleanup
                errors.append(exc)
        self.reset()
        if errors:
            raise errors[0]
        self.end_step()

    def launch_rest(self) -> None:
        """Start every bucket of this step not started yet (gradients that backward did not
        produce count as zeros)."""
        for b in self.buckets:
            if b.index not in self.pending:
                self._launch(b)

    def finish_bucket(self, index: int, timeout: float | None = None, *,
                      forget: bool = True) -> None:
        """Wait for bucket ``index``'s push_pull and write its sums back into the gradients
        (``forget``: and drop it from the step's pending buckets)."""
        p = self.pending[index]
        try:
            p.handle.wait(timeout)
        finally:
            if forget:
                with self._lock:
                    self.pending.pop(index, None)
        if p.members is not None:  # a host-fused bucket: the sums back to each gradient
            for mb, off, n in p.members:
                _copy_bytes(p.buf.array, off, n, mb.array, into_flat=False)
                if mb.device is not None:
                    mb.device.h2d(0, n)
                if mb.writeback is not None:
                    mb.writeback()
        if p.buf.writeback is not None:
            p.buf.writeback()

    def end_step(self) -> None:
        """One training step is over (for traces, metrics and the status view)."""
        self.rt.note_step(self.tensor_names[0] if self.names else "")

    def restart_counts(self) -> None:
        """Let the next backward pass count its gradients afresh while this step's buckets
        are still in flight (cross-barrier: they finish during the next forward pass)."""
        with self._lock:
            self.counts = [0] * len(self.names)
            self._left = [len(b.members) for b in self.buckets]

    def reset(self) -> None:
        """Forget the step in progress (its handles too): the next backward starts afresh."""
        with self._lock:
            self.pending.clear()
        self.restart_counts()

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """Backward passes inside do not start any push_pull (gradient accumulation)."""
        prev, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = prev


def _copy_bytes(flat: np.ndarray, off: int, n: int, arr: np.ndarray, *, into_flat: bool) -> None:
    """Copy gradient ``arr`` into (or out of) bytes ``off .. off+n`` of a bucket's ``flat``
    buffer: in C++ for contiguous arrays, through numpy for strided ones."""
    if arr.flags.c_contiguous:
        raw, mine = flat.view(np.uint8)[off:off + n], arr.reshape(-1).view(np.uint8)
        if into_flat:
            _core.copy_into(raw, mine)
        else:
            _core.copy_into(mine, raw)
        return
    part = flat[off // flat.itemsize:(off + n) // flat.itemsize].reshape(arr.shape)
    if into_flat:
        np.copyto(part, arr)
    else:
        np.copyto(arr, part)


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
