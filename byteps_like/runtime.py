"""The worker runtime: owns the connection to the job and the pipeline.

The framework-neutral API in :mod:`byteps_like` delegates to a default :class:`Runtime`, created
lazily and re-created after ``fork``. Framework plugins build on the same object.
"""
from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import _core
from .config import Config, load
from .control import ControlClient
from .errors import (CommunicationError, MismatchError, NotInitializedError, ProtocolError,
                     RemoteError)
from .handle import Handle
from .partition import ServerAssigner, make_key, partition_bounds
from .pipeline import PULL, PUSH, Pipeline, Task, plan
from .transport import Route, make_endpoint
from .wire import (ERR_MISMATCH, FLAG_DECLARE, FLAG_PULL, ITEMSIZE, NUMPY_DTYPE, SUMMABLE, Header, MsgType,
                   Role, decode, dtype_name, encode, job_hash)

log = logging.getLogger("byteps_like.worker")


@dataclass
class TensorState:
    """What a worker knows of one declared tensor."""
    decl_id: int
    name: str
    shape: tuple | None = None
    dtype: str | None = None
    nbytes: int = 0
    parts: list = field(default_factory=list)     # (offset, nbytes, key, server)
    round: int = 0
    busy: Handle | None = None
    waiting: list = field(default_factory=list)   # closures that start queued push_pulls


class Runtime:
    def __init__(self, cfg: Config | None = None, **overrides: Any):
        self._cfg_arg = cfg
        self._overrides = overrides
        self.cfg: Config | None = None
        self.initialized = False
        self._lock = threading.RLock()
        self._tensors: dict[str, TensorState] = {}
        self._inflight: dict[int, Task] = {}      # key -> task in flight
        self._handles: set[Handle] = set()
        self._noname = 0
        self._fatal: BaseException | None = None
        self.rank_ = 0
        self.size_ = 1
        self._ctx = None
        self.ep = None
        self.control: ControlClient | None = None
        self.pipeline: Pipeline | None = None
        self.bytes_pushed = 0
        self.bytes_pulled = 0

    # -- lifecycle ----------------------------------------------------------------------------
    def init(self) -> None:
        with self._lock:
            if self.initialized:
                return
            cfg = self._cfg_arg or load(overrides=self._overrides)
            if cfg.cluster.role != "worker":
                from .errors import ConfigError
                raise ConfigError(f"DMLC_ROLE={cfg.cluster.role!r}: init() is for workers; run "
                                  f"servers and the scheduler with bpslaunch or python -m "
                                  f"byteps_like.{cfg.cluster.role}")
            self.cfg = cfg
            from .log import setup_logging
            setup_logging(cfg.log.level, f"worker {cfg.cluster.worker_id or 0}."
                                         f"{cfg.cluster.local_rank}")
            c = cfg.cluster
            self.local_rank_, self.local_size_ = c.local_rank, c.local_size
            self.size_ = c.num_worker * c.local_size
            if c.is_standalone:
                self.rank_ = 0
            else:
                if c.num_server < 1:
                    from .errors import ConfigError
                    raise ConfigError(f"DMLC_NUM_SERVER=0 with {self.size_} workers: a "
                                      "distributed job needs at least one server")
                self._connect()
            self.initialized = True
            atexit.register(self._atexit)
            log.info("worker rank %d of %d initialised (%s)", self.rank_, self.size_,
                     "standalone" if c.is_standalone else f"{c.num_server} servers")

    def _connect(self) -> None:
        import zmq
        cfg = self.cfg
        self._ctx = zmq.Context()
        self.ep = make_endpoint("worker", cfg, context=self._ctx)
        self.control = ControlClient(cfg, self.ep, Role.WORKER, on_fatal=self._on_fatal)
        self.ep.on_message = self._on_message
        self.ep.on_error = self._on_fatal
        self.ep.start()
        try:
            self.control.connect_and_register()
        except BaseException:
            self._teardown()
            raise
        self.rank_ = self.control.rank
        servers = sorted((p for p in self.control.peers if p.role == "server"),
                         key=lambda p: p.rank)
        self.num_servers = len(servers)
        self.conns = cfg.transport.tcp_connections
        for p in servers:
            self.ep.connect(f"server-{p.rank}", f"tcp://{p.host}:{p.port}", self.conns)
        self._routes = [[Route(peer=f"server-{p.rank}", conn=i) for i in range(self.conns)]
                        for p in servers]
        self.assigner = ServerAssigner(self.num_servers)
        self.job = job_hash(cfg.cluster.job_id)
        credit = cfg.scheduling.credit * cfg.partition.partition_bytes
        self.pipeline = Pipeline({PUSH: self._stage_push, PULL: self._stage_pull},
                                 queue_depth=cfg.scheduling.queue_depth, credit_bytes=credit,
                                 on_error=lambda task, exc: self._fail_task(task, exc))
        self.pipeline.on_complete = lambda task: task.handle.part_done(task.part)
        self.pipeline.start()
        self._install_excepthook()

    def _install_excepthook(self) -> None:
        prev = sys.excepthook

        def hook(tp, val, tb):
            if self.control is not None and self.initialized and self._fatal is None:
                reason = "".join(traceback.format_exception_only(tp, val)).strip()
                self.control.abort(f"unhandled {reason}")
                time.sleep(0.2)  # let the I/O thread flush the abort before exit
            prev(tp, val, tb)
        sys.excepthook = hook

    def _atexit(self) -> None:
        try:
            self.shutdown()
        except Exception as exc:  # noqa: BLE001 - at exit, report and go
            log.warning("shutdown at exit: %s", exc)

    def shutdown(self) -> None:
        """Finish every in-flight push_pull, tell the scheduler, and close all connections."""
        with self._lock:
            if not self.initialized:
                return
            self.initialized = False
            handles = list(self._handles)
        # no lock held from here on: the I/O thread needs it to complete the handles
        try:
            if self.control is not None and self._fatal is None:
                for h in handles:
                    try:
                        h.wait()
                    except Exception:  # noqa: BLE001 - reported by whoever waits for it
                        pass
                if not self.control.finish(self.cfg.timeouts.shutdown_timeout):
                    log.warning("worker %d: no shutdown confirmation from the scheduler "
                                "within %g s", self.rank_, self.cfg.timeouts.shutdown_timeout)
        finally:
            self._teardown()

    def _teardown(self) -> None:
        if self.pipeline is not None:
            self.pipeline.close()
            self.pipeline = None
        stopped = True
        if self.ep is not None:
            stopped = self.ep.close(linger=0.5)
            self.ep = None
        if self._ctx is not None:
            if stopped:
                self._ctx.term()
            else:  # never hang in shutdown: leave the context to the process exit
                log.warning("worker %d: I/O thread did not stop; skipping context teardown",
                            self.rank_)
            self._ctx = None

    # -- errors -----------------------------------------------------------------------------------
    def _on_fatal(self, exc: BaseException) -> None:
        if self._fatal is None:
            self._fatal = exc
        for h in list(self._handles):
            h.fail(exc)

    def _fail_task(self, task: Task, exc: BaseException) -> None:
        if self.pipeline is not None:
            self._release(task)  # a failed push must not keep its credit
        task.handle.fail(exc)

    def _check(self) -> None:
        if not self.initialized:
            raise NotInitializedError("byteps_like is not initialised: call init() first")
        if self._fatal is not None:
            raise self._fatal

    # -- identity ---------------------------------------------------------------------------------
    def rank(self) -> int:
        self._check()
        return self.rank_

    def size(self) -> int:
        self._check()
        return self.size_

    def local_rank(self) -> int:
        self._check()
        return self.local_rank_

    def local_size(self) -> int:
        self._check()
        return self.local_size_

    def barrier(self, timeout: float | None = None) -> None:
        self._check()
        if self.control is not None:
            self.control.barrier("worker", timeout)

    # -- declaration --------------------------------------------------------------------------------
    def declare(self, name: str) -> int:
        """Reserve the next key for ``name``. Every worker must declare in the same order."""
        self._check()
        with self._lock:
            st = self._tensors.get(name)
            if st is None:
                st = self._tensors[name] = TensorState(len(self._tensors), name)
            return st.decl_id

    def _bind(self, st: TensorState, shape: tuple, dtype: str, nbytes: int) -> None:
        if st.dtype is None:
            st.shape, st.dtype, st.nbytes = shape, dtype, nbytes
            if self.control is None:
                return
            bounds = partition_bounds(nbytes, ITEMSIZE[dtype], self.cfg.partition.partition_bytes)
            for part, (off, n) in enumerate(bounds):
                key = make_key(st.decl_id, part)
                st.parts.append((off, n, key, self.assigner.assign(key, n)))
        elif (st.shape, st.dtype) != (shape, dtype):
            raise MismatchError(f"worker rank {self.rank_}: tensor {st.name!r} was first used "
                                f"with shape {st.shape} {st.dtype}, now {shape} {dtype}; use a "
                                "different name for a different tensor")

    # -- push_pull ----------------------------------------------------------------------------------
    def push_pull_async(self, array: Any, name: str | None = None, average: bool = True,
                        priority: int = 0, out: Any = None, dtype: str | None = None) -> Handle:
        """Start summing ``array`` across all workers; returns a :class:`Handle`.

        ``out`` receives the result (default: a new array; pass ``out=array`` for in place).
        ``dtype`` overrides the element type for buffers numpy cannot name (``"bfloat16"`` held
        as uint16). Integer averages round down (floor division)."""
        self._check()
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
        with self._lock:
            if name is None:
                name = f"PushPull.noname.{self._noname}"
                self._noname += 1
            st = self._tensors.get(name)
            if st is None:
                st = self._tensors[name] = TensorState(len(self._tensors), name)
            self._bind(st, tuple(arr.shape), wire_dtype, arr.nbytes)
            nparts = len(st.parts) if self.control is not None else 0
            h = Handle(name, arr, out, nparts, default_timeout=self.cfg.timeouts.op_timeout,
                       describe_pending=self._describe_pending)
            if self.control is None:  # standalone: the sum over one worker is the input
                if out is not arr:
                    np.copyto(out, arr)
                return h
            self._handles.add(h)
            start = lambda block: self._start(st, h, arr, out, wire_dtype, average,  # noqa: E731
                                              priority, block)
            idle = st.busy is None
            if idle:
                st.busy = h
            else:
                st.waiting.append((h, start))  # one round of a key in flight at a time
            # registered last: a handle of no partitions is already done and frees the name now
            h.add_done_callback(lambda hh, st=st: self._on_handle_done(st, hh))
        if idle:
            start(True)  # outside the lock: may block on a full queue (back-pressure)
        return h

    def _start(self, st: TensorState, h: Handle, arr, out, dtype: str, average: bool,
               priority: int, block: bool) -> None:
        if self._fatal is not None:
            h.fail(self._fatal)
            return
        rnd = st.round
        st.round += 1
        src = arr.reshape(-1).view(np.uint8)
        dst = out.reshape(-1).view(np.uint8)
        itinerary = plan(distributed=True)
        for part, (off, n, key, server) in enumerate(st.parts):
            task = Task(h, key, part, off, n, priority, server, key % self.conns, rnd, itinerary)
            task.src = src[off:off + n]
            task.dst = dst[off:off + n]
            task.dtype = dtype
            task.average = average
            task.decl = ({"name": st.name, "shape": list(st.shape), "dtype": dtype, "part": part,
                          "nparts": len(st.parts)} if rnd == 0 else None)
            self.pipeline.submit(task, block=block)

    def _on_handle_done(self, st: TensorState, h: Handle) -> None:
        with self._lock:
            self._handles.discard(h)
            for t in [t for t in self._inflight.values() if t.handle is h]:
                self._inflight.pop(t.key, None)
            nxt = st.waiting.pop(0) if st.waiting else None
            st.busy = nxt[0] if nxt else None
        if nxt is not None:
            nxt[1](False)  # on a pipeline thread: must not block

    def _describe_pending(self, h: Handle) -> str:
        st = self._tensors.get(h.name)
        if st is None or not st.parts:
            return ""
        servers = sorted({st.parts[p][3] for p in h.pending_parts})
        return (f" (waiting on server(s) {servers}; a worker that has not pushed this tensor, "
                f"or a slow or stuck peer, holds the round open)")

    # -- stages (pipeline threads) ---------------------------------------------------------------
    def _stage_push(self, task: Task) -> bool:
        # one message pushes the partition and asks for the round's sum (FLAG_PULL)
        hdr = Header(MsgType.PUSH, task.dtype, Role.WORKER, self.rank_,
                     FLAG_PULL | (FLAG_DECLARE if task.decl else 0), self.job, task.key,
                     task.round, task.nbytes // ITEMSIZE[task.dtype], task.nbytes)
        with self._lock:
            self._inflight[task.key] = task
        self.ep.send(self._routes[task.server][task.conn], encode(hdr, task.src, task.decl))
        self.bytes_pushed += task.nbytes
        return False  # the pull response advances the task

    def _stage_pull(self, task: Task) -> bool:
        payload = task.payload
        task.payload = None
        _core.copy_into(task.dst, payload.buffer if hasattr(payload, "buffer") else payload)
        if task.average and self.size_ > 1:
            _core.scale_into(task.dst, task.dtype, self.size_)
        self.bytes_pulled += task.nbytes
        return True

    # -- network replies (I/O thread) -----------------------------------------------------------------
    def _release(self, task: Task) -> None:
        if not task.acked:
            task.acked = True
            self.pipeline.queues[PUSH].release(task.nbytes)

    def _on_message(self, route: Route, frames: list) -> None:
        try:
            msg = decode(frames, self.cfg.transport.max_message_bytes)
        except ProtocolError as exc:
            log.warning("worker %d: rejected a message from %s: %s", self.rank_, route, exc)
            return
        if route.peer == "scheduler":
            self.control.handle(msg)
            return
        h = msg.header
        with self._lock:
            task = self._inflight.get(h.key)
        if task is None or task.round != h.round:
            log.warning("worker %d: %s for key %d round %d matches no push in flight",
                        self.rank_, h.type.name, h.key, h.round)
            return
        if h.type is MsgType.PUSH_ACK:
            self._release(task)
        elif h.type is MsgType.PULL_RESP:
            self._release(task)
            if h.nbytes != task.nbytes or h.dtype != task.dtype:
                self._fail_task(task, ProtocolError(
                    f"server {h.rank} answered key {h.key} with {h.count} x {h.dtype}, "
                    f"expected {task.nbytes} bytes of {task.dtype}"))
                return
            with self._lock:
                self._inflight.pop(h.key, None)
            task.payload = msg.payload
            self.pipeline.advance(task)
        elif h.type is MsgType.ERROR:
            self._release(task)
            meta = msg.meta or {}
            text = str(meta.get("message", "error"))
            cls = MismatchError if meta.get("kind") == ERR_MISMATCH else RemoteError
            exc = cls(f"push_pull of {task.handle.name!r} (key {h.key}): {text}")
            if cls is RemoteError:
                exc = RemoteError(str(exc), role="server", rank=h.rank)
            self._fail_task(task, exc)
        else:
            log.warning("worker %d: unexpected %s from server %d", self.rank_, h.type.name,
                        h.rank)

    # -- telemetry --------------------------------------------------------------------------------
    def tensors(self) -> dict[str, TensorState]:
        return dict(self._tensors)


_default: Runtime | None = None
_default_lock = threading.Lock()


def default_runtime() -> Runtime:
    global _default
    with _default_lock:
        if _default is None:
            _default = Runtime()
        return _default


def reset_default_runtime() -> None:
    """Forget the default runtime (after fork, or to join a new job after shutdown)."""
    global _default, _default_lock
    _default = None
    _default_lock = threading.Lock()


os.register_at_fork(after_in_child=reset_default_runtime)
