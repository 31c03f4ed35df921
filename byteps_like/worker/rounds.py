"""The rounds of push_pulls: how a bound tensor's push_pull starts, one at a time per name.

:meth:`Rounds.enqueue` takes a new round of a tensor (the runtime's lock held): it starts at
once when the name is idle, else it waits behind the round in flight (one round of a key at a
time), and the next starts when a handle completes (:meth:`Rounds.done`). :meth:`Rounds.start`
starts a round: a host tensor on the native data plane goes to C++ whole (:mod:`.dataplane`);
otherwise each partition becomes a :class:`~.pipeline.Task` carrying its itinerary
(:func:`~.pipeline.itinerary`) into the :class:`~.pipeline.Pipeline`.

Who calls it: :meth:`Runtime.push_pull_async <byteps_like.worker.runtime.Runtime.
push_pull_async>` (``host_arrays`` checks its arguments, ``enqueue`` and the first ``start``),
``Runtime.join`` (:meth:`Rounds.join`), and the handles' completion callbacks.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ..wire import ITEMSIZE, SUMMABLE, dtype_name, first_round
from .cast import (
    cast_of,
    check_host,
    element_slice,
    push_pull_whole,
    spans_partitions,
    wire_buffer,
)
from .handle import Handle
from .pipeline import COMPRESS, DECOMPRESS, PULL, PUSH, Phase, Task, itinerary
from .tensors import DeviceCopier, TensorState, backs_up, declaration

if TYPE_CHECKING:
    from ..compression import _CastCompressor
    from .dataplane import NativeDataPlane
    from .inflight import InFlight
    from .local_reduce import LocalReduction
    from .membership import Membership
    from .tensors import TensorRegistry

#: the itinerary of a compressed host partition of a machine's only rank
_CODED = (COMPRESS, PUSH, PULL, DECOMPRESS)


def host_arrays(array: Any, out: Any, name: str | None,
                dtype: str | None) -> tuple[np.ndarray, np.ndarray, str]:
    """push_pull's input and output as C-contiguous arrays, and the element type on the wire
    (TypeError / ValueError naming what is wrong)."""
    arr = np.asarray(array)
    wire_dtype = dtype or dtype_name(arr.dtype)
    if wire_dtype not in SUMMABLE:
        raise TypeError(f"push_pull of {name or 'a tensor'}: dtype {wire_dtype} cannot be "
                        f"summed; use one of {', '.join(sorted(SUMMABLE))}")
    if ITEMSIZE[wire_dtype] != arr.dtype.itemsize:
        raise TypeError(f"dtype={wire_dtype!r} needs {ITEMSIZE[wire_dtype]}-byte elements, "
                        f"the array has {arr.dtype.itemsize}-byte {arr.dtype}")
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    if out is None:
        out = np.empty_like(arr)
    elif out.shape != arr.shape or out.dtype != arr.dtype or not out.flags.c_contiguous:
        raise ValueError(f"push_pull of {name!r}: out must be a C-contiguous {arr.dtype} "
                         f"array of shape {arr.shape}")
    return arr, out, wire_dtype


class Rounds:
    """Starts the push_pull rounds of one runtime."""

    def __init__(self, members: Membership, flight: InFlight, registry: TensorRegistry,
                 local: LocalReduction, plane: NativeDataPlane):
        self.members = members
        self.flight = flight
        self.registry = registry
        self.local = local
        self.plane = plane

    def bind(self, st: TensorState, shape: tuple, dtype: str, nbytes: int) -> None:
        """Bind ``st`` at its use (lock held): partitions only in a distributed job."""
        m = self.members
        self.registry.bind(st, shape, dtype, nbytes, rank=m.rank,
                           partition_bytes=m.config.partition.partition_bytes,
                           assigner=m.assigner if m.control is not None else None)

    def local_out(self, name: str, shape: tuple, dtype: str) -> np.ndarray:
        """``Runtime.local_out``: bind ``name`` like a first push_pull would and return its
        shared segment's output region."""
        nbytes = int(np.prod(shape, dtype=np.int64)) * ITEMSIZE[dtype]
        with self.flight.lock:
            st = self.registry.declare(name)
            self.bind(st, shape, dtype, nbytes)
            return self.local.segment(st).out

    def push_pull(self, arr: np.ndarray, out: np.ndarray, name: str | None, dtype: str,
                  average: bool, priority: int, device: DeviceCopier | None, prereduced: bool,
                  compression: Any, *, alone: bool) -> Handle:
        """``Runtime.push_pull_async`` once its arguments are checked (:func:`host_arrays`):
        bind the name, make the handle and start the round, or queue it behind the name's
        round in flight. ``alone``: a push_pull is the identity.

        A cast ``compression`` (fp16, bf16; :mod:`.cast`) of a float tensor: the name is bound
        and travels in the narrow dtype. In a distributed job of one local rank the pipeline
        converts each partition of a tensor of several as it goes; otherwise the tensor is
        converted whole, and back
        in ``wait()`` (``Handle.convert``). Not with ``device`` or ``prereduced``
        (ValueError): a plugin casts a device tensor itself."""
        m, cfg = self.members, self.members.config
        distributed = m.control is not None
        cast = cast_of(compression, dtype)
        if cast is not None:
            check_host(cast, name, device, prereduced)
            if (not distributed or alone or m.local_size > 1 or not spans_partitions(
                    cast, dtype, arr.size, cfg.partition.partition_bytes)):
                return push_pull_whole(
                    lambda wire, wdt: self.push_pull(wire, wire, name, wdt, average, priority,
                                                     None, False, compression, alone=alone),
                    cast, arr, out, dtype)
        wdtype = dtype if cast is None else cast.wire_dtype(dtype)
        with self.flight.lock:
            if name is None:
                name = self.registry.auto_name()
            st = self.registry.declare(name)
            self.bind(st, tuple(arr.shape), wdtype, arr.size * ITEMSIZE[wdtype])
            if distributed:
                self.registry.bind_compressor(
                    st, compression, rank=m.rank,
                    min_bytes=cfg.compression.min_compress_bytes,
                    makes_codecs=m.is_local_root)  # only the local root pushes
            nparts = len(st.parts) if distributed and not alone else 0
            h = Handle(name, arr, out, nparts, default_timeout=cfg.timeouts.op_timeout,
                       describe_pending=self.describe_pending)
            if not distributed or alone:  # the sum over one worker is the input
                if out is not arr:
                    np.copyto(out, arr)
                return h
            start = self.enqueue(st, h, arr, out, dtype, average, priority, device, prereduced,
                                 cast)
        if start is not None:
            try:
                start(True)  # outside the lock: may block on a full queue (back-pressure)
            except BaseException as exc:  # failed before it started: shutdown must not wait
                h.fail(exc)
                raise
        return h

    def enqueue(self, st: TensorState, h: Handle, arr: np.ndarray, out: np.ndarray,
                dtype: str, average: bool, priority: int, device: DeviceCopier | None,
                prereduced: bool,
                cast: _CastCompressor | None = None) -> Callable[[bool], None] | None:
        """Take a new round of ``st`` (lock held). Returns its start (call it outside the lock)
        when the name is idle; None when it waits behind the round in flight."""
        self.flight.handles.add(h)

        def start(block: bool) -> None:
            self.start(st, h, arr, out, dtype, average, priority, block, device, prereduced,
                       cast)
        idle = st.busy is None
        if idle:
            st.busy = h
        else:
            st.waiting.append((h, start))  # one round of a key in flight at a time
        # registered last: a handle of no partitions is already done and frees the name now
        h.add_done_callback(lambda hh: self.done(st, hh))
        return start if idle else None

    def start(self, st: TensorState, h: Handle, arr: np.ndarray, out: np.ndarray, dtype: str,
              average: bool, priority: int, block: bool, device: DeviceCopier | None = None,
              prereduced: bool = False, cast: _CastCompressor | None = None) -> None:
        """Start the next round of ``st``: one native operation for a host tensor on the
        native data plane, else one pipeline task per partition. ``dtype`` is the caller's;
        with a ``cast`` compressor the tasks carry the tensor's wire bytes and convert."""
        fatal = self.flight.fatal
        if fatal is not None:
            h.fail(fatal)
            return
        m = self.members
        try:
            seg = self.local.segment(st) if m.local_size > 1 else None
        except BaseException as exc:  # failed before it started: nobody (shutdown) waits on it
            h.fail(exc)
            if block:
                raise
            return
        rnd = st.round
        st.round += 1
        wdt = dtype if cast is None else cast.wire_dtype(dtype)  # what the servers sum
        cli = self.plane.client
        route = itinerary(distributed=not m.single_machine, local_size=m.local_size,
                          local_root=m.is_local_root, on_device=device is not None,
                          compressed=bool(st.codecs) or cast is not None)
        if (cast is not None and cli is not None and dtype == "float32" and not prereduced
                and route == _CODED):
            # a host float32 tensor cast on the native data plane: one native operation, the
            # client narrowing and widening its partitions on its codec threads
            self.plane.submit_tensor(cli, st, h, rnd, arr.reshape(-1).view(np.uint8),
                                     out.reshape(-1).view(np.uint8), wdt, average, priority,
                                     cast=True)
            return
        if cast is None:
            src = arr.reshape(-1).view(np.uint8)
            dst = out.reshape(-1).view(np.uint8)
        else:  # what travels: the wire bytes; COMPRESS and DECOMPRESS convert each partition
            src = dst = wire_buffer(st)
            flat_in, flat_out = arr.reshape(-1), out.reshape(-1)
        if cli is not None and route == (PUSH, PULL):
            # a host tensor: one native operation (a task's PUSH stage submits the others; a
            # compressed partition too: the compiled server runs a built-in codec itself and a
            # registered compressor's, whose math is Python, through its codec factory)
            self.plane.submit_tensor(cli, st, h, rnd, src, dst, wdt, average, priority)
            return
        if cli is not None and st.compiled and route == _CODED:
            # a host float32 tensor with a compiled codec: one native operation too, its
            # partitions encoded and decoded on the client's codec threads
            self.plane.submit_tensor(cli, st, h, rnd, src, dst, dtype, average, priority,
                                     coded=True)
            return
        pipeline = self.flight.active_pipeline
        phase = Phase.SUM_SLICE if prereduced else Phase.COPY_IN
        for part, (off, n, key, server) in enumerate(st.parts):
            # the declared fields one by one, as cheap as it gets (a keyword per field to the
            # dataclass costs about a microsecond more per partition)
            task = Task(h, key, part, off, n, priority, server, key % m.conns, rnd, route)
            task.src = src[off:off + n]
            task.dst = dst[off:off + n]
            # what goes to the servers and where their sum lands: the machine's reduced
            # partition in shared memory with local ranks, the caller's arrays otherwise
            task.seg = seg
            task.push_src = seg.out[off:off + n] if seg is not None else task.src
            task.pull_dst = seg.out[off:off + n] if seg is not None else task.dst
            task.phase = phase
            task.prereduced = prereduced
            task.device = device
            task.dtype = wdt
            task.average = average
            if cast is not None:
                task.cast, task.cast_dtype = cast, dtype
                task.cast_src = element_slice(flat_in, ITEMSIZE[wdt], off, n)
                task.cast_dst = element_slice(flat_out, ITEMSIZE[wdt], off, n)
            task.decl = (declaration(st, wdt, part, backs_up(m.config, average, m.size))
                         if first_round(rnd) else None)
            task.codec = st.codecs[part] if st.codecs else None
            if task.codec is not None:
                task.scratch = st.scratch[part]
                if task.decl is not None:  # the compressor travels once per key
                    if st.native_codec is not None:  # a built-in codec's (native_params)
                        task.decl["native_codec"] = st.native_codec[part]
                    task.decl["compressor"] = st.spec
            pipeline.submit(task, block=block)

    def done(self, st: TensorState, h: Handle) -> None:
        """A round of ``st`` completed (or failed): the name's next round starts."""
        flight = self.flight
        with flight.lock:
            flight.handles.discard(h)
            nxt = st.waiting.pop(0) if st.waiting else None
            st.busy = nxt[0] if nxt else None
        if nxt is not None:
            nxt[1](False)  # on a pipeline thread: must not block

    def describe_pending(self, h: Handle) -> str:
        """What a handle that timed out waits for (its servers), for its error."""
        st = self.registry.tensors.get(h.name)
        if st is None or not st.parts:
            return ""
        servers = sorted({st.parts[p][3] for p in h.pending_parts})
        return (f" (waiting on server(s) {servers}; a worker that has not pushed this tensor, "
                f"or a slow or stuck peer, holds the round open)")

    def join(self, tables: Any = None) -> int:
        """``Runtime.join``'s rounds: finish what is in flight, tell the scheduler the round
        each tensor reached, wait until every worker has joined, and continue each tensor at
        the round the job is at (the ranks that ran more steps pushed more rounds). Returns
        the rank that joined last. ``tables`` (the server-held tables, worker/sparse.py)
        reports and catches up its own rounds the same way."""
        m, flight = self.members, self.flight
        for h in list(flight.handles):
            h.wait()
        control = m.control
        if control is None or m.size == 1:
            return m.rank
        with flight.lock:
            rounds = self.registry.rounds()
        own = tables.rounds() if tables is not None else {}
        last, rounds = control.join({**rounds, **own})
        if tables is not None:
            tables.catch_up(rounds)
        with flight.lock:
            self.registry.catch_up({n: r for n, r in rounds.items() if n not in own})
        return last
