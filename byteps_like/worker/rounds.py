"""The rounds of push_pulls: how a bound tensor's push_pull starts, one at a time per name.

:meth:`Rounds.enqueue` takes a new round of a tensor (the runtime's lock held): it starts at
once when the name is idle, else it waits behind the round in flight (one round of a key at a
time), and the next starts when a handle completes (:meth:`Rounds.done`). Rounds is the host
side's executor of the route plan (:mod:`.route`; :meth:`Rounds.plan` asks for it):
:meth:`Rounds.push_pull` converts a whole fp16/bf16 cast, :meth:`Rounds.start` does what
:meth:`RoutePlan.submit <.route.RoutePlan.submit>` names: one native operation on the native
data plane (plain, cast or coded: :mod:`.dataplane`), or one :class:`~.pipeline.Task` per
partition carrying the plan's itinerary into the :class:`~.pipeline.Pipeline`.

Who calls it: :meth:`Runtime.push_pull_async <byteps_like.worker.runtime.Runtime.
push_pull_async>` (``host_arrays`` checks its arguments, ``enqueue`` and the first ``start``),
``Runtime.join`` (:meth:`Rounds.join`), and the handles' completion callbacks.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import CommunicationError
from ..wire import ITEMSIZE, SUMMABLE, dtype_name, first_round
from .handle import Handle
from .pipeline import Phase, Task
from .route import (
    NATIVE_CAST,
    NATIVE_CODED,
    NATIVE_WHOLE,
    WHOLE,
    JobFacts,
    RoutePlan,
    TensorFacts,
    plan_route,
)
from .tensors import DeviceCopier, TensorState, backs_up, declaration

if TYPE_CHECKING:
    from .dataplane import NativeDataPlane
    from .inflight import InFlight
    from .local_reduce import LocalReduction
    from .membership import Membership
    from .tensors import TensorRegistry


#: the most route plans :meth:`Rounds.plan` keeps (one a tensor, as a rule)
_PLANS = 4096
#: the most threads one whole-tensor cast takes (the kernel also keeps >= 256 KiB each)
MAX_CAST_THREADS = 8


def cast_threads() -> int:
    """Threads of a whole-tensor cast: the usable CPUs, at most :data:`MAX_CAST_THREADS`."""
    from ..transport.native import usable_cpus
    return max(1, min(MAX_CAST_THREADS, usable_cpus()))


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
        self._plans: dict[tuple, tuple[Any, JobFacts, RoutePlan]] = {}
        self._job: tuple[tuple, JobFacts, Any] = ((), JobFacts(), None)

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

    def job(self) -> JobFacts:
        """The job as the route planner sees it (:func:`~.route.plan_route`), made again
        when what it is made of changes (a connection, an elastic epoch)."""
        m = self.members
        cfg = m.config
        now = (m.control is not None, m.single_machine, m.local_size, m.is_local_root,
               self.plane.client is not None, id(cfg))
        if now != self._job[0] or self._job[2] is not cfg:
            self._job = (now, JobFacts(
                distributed=now[0], single_machine=now[1], local_size=now[2],
                local_root=now[3], native=now[4],
                partition_bytes=cfg.partition.partition_bytes,
                fusion_bytes=cfg.partition.fusion_bytes,
                min_compress_bytes=cfg.compression.min_compress_bytes), cfg)
        return self._job[1]

    def plan(self, tensor: TensorFacts, compression: Any = None, *,
             bucket: bool = False) -> RoutePlan:
        """``Runtime.plan``: the route of a push_pull of ``tensor`` in this job. Plans are
        kept (a pure function of hashable facts: a tensor's every round asks the same), at
        most :data:`_PLANS` of them."""
        job = self.job()
        key = (tensor, id(job), id(compression), bucket)
        kept = self._plans.get(key)
        if kept is not None and kept[0] is compression and kept[1] is job:
            return kept[2]
        plan = plan_route(tensor, job, compression, bucket=bucket)
        if len(self._plans) >= _PLANS:
            self._plans.clear()
        self._plans[key] = (compression, job, plan)
        return plan

    def push_pull(self, arr: np.ndarray, out: np.ndarray, name: str | None, dtype: str,
                  average: bool, priority: int, device: DeviceCopier | None, prereduced: bool,
                  compression: Any) -> Handle:
        """``Runtime.push_pull_async`` once its arguments are checked (:func:`host_arrays`):
        plan the route (:mod:`.route`), then bind the name, make the handle and start the
        round, or queue it behind the name's round in flight.

        A cast ``compression`` (fp16, bf16) of a float tensor: the name is bound and travels
        in the narrow dtype, converted where the plan says (:class:`~.route.Cast`): partition
        by partition on the native client, or (:data:`~.route.WHOLE`) here, narrowed whole
        with :func:`cast_threads` threads before the push and widened into ``out`` in the
        handle's first ``wait()`` (``Handle.convert``)."""
        plan = self.plan(TensorFacts(dtype, arr.size, name=name,
                                     staged=device is not None, prereduced=prereduced),
                         compression)
        cast = plan.cast
        if cast is not None and cast.where == WHOLE:  # the host side's one Python cast
            comp, nthreads = cast.compressor, cast_threads()
            wire, _wdt, ctx = comp.compress(arr, dtype, nthreads=nthreads)
            h = self.run(plan, wire, wire, name, average, priority, None, False, compression)
            h.input, h.output = arr, out
            h.convert = lambda: comp.decompress(wire, ctx, out, dtype, nthreads=nthreads)
            return h
        return self.run(plan, arr, out, name, average, priority, device, prereduced,
                        compression)

    def run(self, plan: RoutePlan, arr: np.ndarray, out: np.ndarray, name: str | None,
            average: bool, priority: int, device: DeviceCopier | None, prereduced: bool,
            compression: Any) -> Handle:
        """Run ``plan`` for host arrays ``arr`` -> ``out`` (with a :data:`~.route.WHOLE` cast,
        already the wire arrays)."""
        m, cfg = self.members, self.members.config
        distributed = m.control is not None
        wdtype = plan.wire_dtype
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
            nparts = len(st.parts) if plan.servers else 0
            h = Handle(name, arr, out, nparts, default_timeout=cfg.timeouts.op_timeout,
                       describe_pending=self.describe_pending)
            if not plan.servers:  # the sum over one worker is the input
                if out is not arr:
                    np.copyto(out, arr)
                return h
            start = self.enqueue(st, h, plan, arr, out, average, priority, device, prereduced)
        if start is not None:
            try:
                start(True)  # outside the lock: may block on a full queue (back-pressure)
            except BaseException as exc:  # failed before it started: shutdown must not wait
                h.fail(exc)
                raise
        return h

    def enqueue(self, st: TensorState, h: Handle, plan: RoutePlan, arr: np.ndarray,
                out: np.ndarray, average: bool, priority: int,
                device: DeviceCopier | None, prereduced: bool) -> Callable[[bool], None] | None:
        """Take a new round of ``st`` (lock held). Returns its start (call it outside the lock)
        when the name is idle; None when it waits behind the round in flight."""
        self.flight.handles.add(h)

        def start(block: bool) -> None:
            self.start(st, h, plan, arr, out, average, priority, block, device, prereduced)
        idle = st.busy is None
        if idle:
            st.busy = h
        else:
            st.waiting.append((h, start))  # one round of a key in flight at a time
        # registered last: a handle of no partitions is already done and frees the name now
        h.add_done_callback(lambda hh: self.done(st, hh))
        return start if idle else None

    def start(self, st: TensorState, h: Handle, plan: RoutePlan, arr: np.ndarray,
              out: np.ndarray, average: bool, priority: int, block: bool,
              device: DeviceCopier | None = None, prereduced: bool = False) -> None:
        """Start the next round of ``st`` as ``plan`` says (:meth:`RoutePlan.submit
        <.route.RoutePlan.submit>`): one native operation, or one pipeline task per
        partition. ``arr`` and ``out`` are in the caller's dtype; a :data:`~.route.NATIVE`
        cast narrows them to the plan's wire dtype on the native client."""
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
        wdt = plan.wire_dtype  # what the servers sum
        cli = self.plane.client
        src = arr.reshape(-1).view(np.uint8)
        dst = out.reshape(-1).view(np.uint8)
        how = plan.submit(compiled=st.compiled is not None, native=cli is not None)
        if how in (NATIVE_WHOLE, NATIVE_CAST, NATIVE_CODED):
            # a host tensor as one native operation (a task's PUSH stage submits the others):
            # plain, cast (a float32 tensor the client narrows and widens partition by
            # partition) or coded (a float32 tensor whose compiled codec the client runs), the
            # cast and the codec on the client's codec threads
            if cli is None:  # a cast is planned before the client is known
                h.fail(CommunicationError(f"push_pull of {st.name!r}: the native data plane "
                                          "closed before the round started"))
                return
            self.plane.submit_tensor(cli, st, h, rnd, src, dst, wdt, average, priority,
                                     coded=how == NATIVE_CODED, cast=how == NATIVE_CAST)
            return
        pipeline = self.flight.active_pipeline
        phase = Phase.SUM_SLICE if prereduced else Phase.COPY_IN
        route = plan.itinerary
        for part, (off, n, key, server) in enumerate(st.parts):
            # the declared fields one by one, as cheap as it gets (a keyword per field to the
            # dataclass costs about a microsecond more per partition)
            task = Task(h, key, part, off, n, priority, server, rnd, route)
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
            task.codec = st.codecs[part] if st.codecs else None
            task.decl = (declaration(st, wdt, part, backs_up(m.config, average, m.size),
                                     coded=task.codec is not None)
                         if first_round(rnd) else None)
            if task.codec is not None:
                task.scratch = st.scratch[part]
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
