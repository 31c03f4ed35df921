"""The worker runtime: owns the connection to the job and the pipeline.

The framework-neutral API in :mod:`byteps_like` delegates to a default :class:`Runtime`, created
lazily and re-created after ``fork``. Framework plugins build on the same object.
"""
from __future__ import annotations

import atexit
import itertools
import json
import logging
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import _core, local
from ..config import Config, load
from ..control import ControlClient
from ..errors import (
    BytePSError,
    CommunicationError,
    MismatchError,
    NotInitializedError,
    PeerLeftError,
    PeerLostError,
    ProtocolError,
    RemoteError,
)
from ..partition import ServerAssigner, make_key, mixed_mode_weights, partition_bounds
from ..roles import exit_if_peer_failed
from ..transport import Route, data_scheme, local_peers, make_endpoint, native
from ..transport.base import Drops
from ..wire import (
    ERR_MISMATCH,
    ERR_PEER_LEFT,
    FLAG_COMPRESSED,
    FLAG_DECLARE,
    FLAG_PULL,
    ITEMSIZE,
    SUMMABLE,
    Header,
    MsgType,
    Role,
    as_buffer,
    contributors,
    decode,
    dtype_name,
    encode,
    job_hash,
)
from .handle import Handle
from .pipeline import (
    BROADCAST,
    COMPRESS,
    COPY_D2H,
    COPY_H2D,
    DECOMPRESS,
    PULL,
    PUSH,
    REDUCE,
    Pipeline,
    Task,
    plan,
)

log = logging.getLogger("byteps_like.worker")
_PY_SWITCH_INTERVAL = 0.005  # the interpreter's default thread switch interval
_LOCAL_TYPES = frozenset({MsgType.LOCAL_READY, MsgType.LOCAL_REDUCE, MsgType.LOCAL_REDUCED,
                          MsgType.LOCAL_DONE})


class DeviceCopier:
    """What a plugin implements to stage an accelerator tensor partition by partition.

    Both methods run on pipeline threads and must return once the copy is complete (d2h) or
    ordered before any later use of the output (h2d)."""

    def d2h(self, offset: int, nbytes: int) -> None:
        raise NotImplementedError

    def h2d(self, offset: int, nbytes: int) -> None:
        raise NotImplementedError

    #: Optional: ``device_slice(offset, nbytes)`` returns the partition's device memory (an
    #: object with ``__cuda_array_interface__``), ordered after the caller's work. When the
    #: transport can send device memory (BYTEPS_TRANSPORT=ucx, BYTEPS_UCX_DEVICE_MEMORY=1, a
    #: UCX with CUDA support) the push sends it directly and ``d2h`` is skipped.
    device_slice = None


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
    compressor: Any = None     # a codec-kind Compressor bound at first use, or None
    spec: dict | None = None   # its spec (what the servers get)
    comp_bound: bool = False
    codecs: list = field(default_factory=list)    # one worker Codec per partition
    scratch: list = field(default_factory=list)   # float32 staging per partition (non-float32)
    native_parts: list | None = None  # (key, server, stream, offset, nbytes, None) per partition


#: dtypes a codec compressor applies to (codecs work in float32; the others are converted)
COMPRESSIBLE = frozenset({"float32", "float16", "bfloat16", "float64"})


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
        self.telemetry = None  # byteps_like.worker.telemetry.Telemetry once connected
        self.steps: dict[str, int] = {}  # training steps a plugin noted, per gradient group
        self.native = None     # _core.DataClient: the native data plane (transport/native.py)
        self._native_ops: dict[int, tuple] = {}
        self._native_ids = itertools.count(1)
        self._completions = None
        self._switch_interval = None  # what the runtime set sys.setswitchinterval to, if it did
        self.single_machine = False   # one worker machine: push_pull never leaves it
        self._round_floor: dict[str, int] = {}  # after join(): rounds of tensors not declared yet
        self.dropped = Drops(log, "worker")  # messages from no peer entitled to send them
        self._local_ids: dict[int, bytes] = {}  # local root: rank -> its connection's routing id
        self._peers_token: str | None = None    # local root: the token file to remove at exit
        self._peers_ready = False  # the node table is in: peers' messages can be checked

    # -- lifecycle ----------------------------------------------------------------------------
    def init(self) -> None:
        with self._lock:
            if self.initialized:
                return
            cfg = self._cfg_arg or load(overrides=self._overrides)
            if cfg.cluster.role != "worker":
                from ..errors import ConfigError
                raise ConfigError(f"DMLC_ROLE={cfg.cluster.role!r}: init() is for workers; run "
                                  f"servers and the scheduler with bpslaunch or python -m "
                                  f"byteps_like.{cfg.cluster.role}")
            self.cfg = cfg
            from ..log import setup_logging
            setup_logging(cfg.log.level, f"worker {cfg.cluster.worker_id or 0}."
                                         f"{cfg.cluster.local_rank}")
            c = cfg.cluster
            self.local_rank_, self.local_size_ = c.local_rank, c.local_size
            self.size_ = c.num_worker * c.local_size
            if c.is_standalone:
                self.rank_ = 0
            else:
                if c.num_server < 1 and not c.single_machine:
                    from ..errors import ConfigError
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
        c = cfg.cluster
        self.local_size_, self.local_rank_ = c.local_size, c.local_rank
        self.is_local_root = c.local_rank == 0
        port = 0
        if c.local_size > 1:
            if c.worker_id is None:
                from ..errors import ConfigError
                raise ConfigError(f"BYTEPS_LOCAL_SIZE={c.local_size} needs DMLC_WORKER_ID: the "
                                  "local ranks of a machine find each other through it "
                                  "(bpslaunch sets it)")
            if self.is_local_root:  # the coordinator of this machine's local reduction
                from ..control import node_host
                local.sweep(local.segment_prefix(c.job_id, c.root_port)
                            + f"m{c.worker_id}-", c.shm_dir)
                bound = self.ep.bind(f"tcp://{node_host(cfg)}:0")
                port = int(bound.rsplit(":", 1)[1])
                # what the local ranks' connections prove they are this machine's with
                # (transport/local_peers.py), written before the node table can name the port
                self._peers_token = local_peers.token_path(c)
                token = local_peers.create_token(self._peers_token)
        self.control = ControlClient(cfg, self.ep, Role.WORKER, port=port,
                                     on_fatal=self._on_fatal)
        self.ep.on_message = self._on_message
        self.ep.on_error = self._on_fatal
        self.ep.start()
        try:
            self.control.connect_and_register()
        except BaseException:
            self._teardown()
            raise
        self.rank_ = self.control.rank
        # one worker machine: push_pull stays on it, no server is contacted
        self.single_machine = c.single_machine
        # the machine index is what servers count pushes by
        self.machine = self.rank_ // c.local_size
        self.push_rank = self.machine
        self._segments: dict[int, local.Segment] = {}
        self._local_routes: dict[int, Route] = {}
        self._gate = local.Gate(lambda task: self.pipeline.resume(task))
        self._ready = local.Counter(c.local_size)
        self._reduced = local.Counter(c.local_size)
        if c.local_size > 1 and not self.is_local_root:
            root = next(p for p in self.control.peers
                        if p.role == "worker" and p.rank == self.machine * c.local_size)
            token = local_peers.read_token(local_peers.token_path(c))
            self.ep.connect("localroot", f"tcp://{root.host}:{root.port}",
                            routing_id=local_peers.routing_id(token, c.local_rank))
        if c.local_size > 1 and self.is_local_root:  # the connection each local rank must use
            self._local_ids = {self.machine * c.local_size + lr:
                               local_peers.routing_id(token, lr) for lr in range(1, c.local_size)}
        self.dropped.who = f"worker {self.rank_}"
        self._peers_ready = True
        servers = sorted((p for p in self.control.peers if p.role == "server"),
                         key=lambda p: p.rank)
        self.num_servers = len(servers)
        self._server_ranks = [p.rank for p in servers]  # what a reply's header must say
        self.conns = cfg.transport.tcp_connections
        if self.is_local_root and not self.single_machine:  # only the root talks to servers
            scheme = data_scheme(cfg)
            for p in servers:
                self.ep.connect(f"server-{p.rank}", f"{scheme}://{p.host}:{p.port}", self.conns)
        self._routes = [[Route(peer=f"server-{p.rank}", conn=i) for i in range(self.conns)]
                        for p in servers]
        weights = None
        if cfg.partition.mixed_mode != "off" and servers:   # BytePS mixed mode
            worker_hosts = {p.host for p in self.control.peers if p.role == "worker"}
            weights = mixed_mode_weights([p.host in worker_hosts for p in servers],
                                         len(worker_hosts))
        # without servers (one machine) partitions still cut tensors for the local reduction
        self.assigner = ServerAssigner(max(1, self.num_servers), weights)
        self.job = job_hash(cfg.cluster.job_id)
        credit = cfg.scheduling.credit * cfg.partition.partition_bytes
        stages = {COMPRESS: self._stage_compress, PUSH: self._stage_push,
                  PULL: self._stage_pull, DECOMPRESS: self._stage_decompress}
        if c.local_size == 1:  # device tensors stage partition by partition (DeviceCopier)
            stages = {COPY_D2H: self._stage_d2h, **stages, COPY_H2D: self._stage_h2d}
        if c.local_size > 1:
            stages = {REDUCE: self._stage_reduce, **stages, BROADCAST: self._stage_broadcast}
        self.pipeline = Pipeline(stages,
                                 queue_depth=cfg.scheduling.queue_depth, credit_bytes=credit,
                                 on_error=lambda task, exc: self._fail_task(task, exc))
        self.pipeline.on_complete = lambda task: task.handle.part_done(task.part)
        from .telemetry import attach  # observers: trace, metrics, summary line
        self.telemetry = attach(self)
        self.pipeline.start()
        if self.is_local_root and servers and not self.single_machine \
                and all(p.data_port for p in servers) and native.native_enabled(cfg):
            self._connect_native(servers, credit)
        self._install_excepthook()

    def _connect_native(self, servers: list, credit: int) -> None:
        """Open the native data plane's streams to every server (csrc/dataplane.cc)."""
        cfg = self.cfg
        key = native.auth_key(cfg)
        cli = _core.DataClient(self.push_rank, self.job, native.io_threads(cfg), credit,
                               cfg.transport.max_message_bytes,
                               **({"auth_key": key} if key else {}))
        self.native_streams = native.streams(cfg)
        try:
            for idx, p in enumerate(servers):
                cli.connect(idx, p.host, p.data_port, self.native_streams,
                            min(60.0, cfg.timeouts.register_timeout))
        except RuntimeError as exc:
            cli.close()
            self._teardown()
            raise CommunicationError(f"worker rank {self.rank_}: {exc}") from None
        self.native = cli
        self._completions = native.Completions(cli, self._native_done)
        self._completions.start()
        want = cfg.scheduling.switch_interval
        if want and sys.getswitchinterval() == _PY_SWITCH_INTERVAL:
            sys.setswitchinterval(want)
            self._switch_interval = want
        log.info("worker %d: native data plane, %d stream(s) to each of %d server(s), %d I/O "
                 "threads%s", self.rank_, self.native_streams, len(servers),
                 cli.stats()["io_threads"], ", authenticated streams" if key else "")

    def _install_excepthook(self) -> None:
        prev = sys.excepthook

        def hook(tp, val, tb):
            if self.control is not None and self.initialized and self._fatal is None:
                reason = "".join(traceback.format_exception_only(tp, val)).strip()
                self.control.abort(f"unhandled {reason}")
                time.sleep(0.2)  # let the I/O thread flush the abort before exit
            prev(tp, val, tb)
            exit_if_peer_failed(val)  # a lost peer's fault: exit with EXIT_PEER_FAILED
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
            # the control client records a fatal error before it tells this runtime: check
            # both, or a shutdown racing that hand-over would raise the known error again
            if (self.control is not None and self._fatal is None
                    and self.control.fatal is None):
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
        if self.telemetry is not None:  # writes the trace file
            self.telemetry.close()
            self.telemetry = None
        if self.native is not None:  # fails what is still in flight, with the reason
            self.native.close()
            if self._completions is not None:
                self._completions.stop()
                self._completions = None
            for comp in self.native.completions(0.0):
                self._native_done(comp)
            self.native = None
            if self._switch_interval == sys.getswitchinterval():
                sys.setswitchinterval(_PY_SWITCH_INTERVAL)  # ours: give the default back
            self._switch_interval = None
        if self.pipeline is not None:
            self.pipeline.close()
            self.pipeline = None
        for seg in getattr(self, "_segments", {}).values():
            seg.close(unlink=True)  # every rank unlinks: whoever is last leaves nothing
        self._segments = {}
        if self._peers_token is not None:
            local_peers.remove(self._peers_token)
            self._peers_token = None
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
        if self.native is not None:  # wakes waiters blocked in the data plane: the job is over
            self.native.close()

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

    def wire_report(self) -> str:
        """One line of the payload bytes this worker pushed and pulled so far (compressed size
        for compressed partitions): ``bytes on the wire: P pushed, Q pulled``."""
        return f"bytes on the wire: {self.bytes_pushed} pushed, {self.bytes_pulled} pulled"

    def get_pushpull_speed(self) -> tuple[int, float]:
        """(timestamp in ms, MB/s pushed plus pulled over the last few seconds), as in BytePS."""
        self._check()
        if self.telemetry is None:  # standalone: nothing travels
            return int(time.time() * 1000), 0.0
        return self.telemetry.speed()

    def barrier(self, timeout: float | None = None) -> None:
        self._check()
        if self.control is not None:
            self.control.barrier("worker", timeout)

    def join(self) -> int:
        """This rank is out of data (Horovod's ``hvd.join()``): finish what is in flight, then
        block until every worker has joined. Meanwhile the other ranks' rounds complete without
        this one and their averages divide by the ranks still in. Returns the rank that joined
        last. A rank that finished without joining makes this raise PeerLeftError."""
        self._check()
        if self.local_size_ > 1:
            raise BytePSError(
                f"join() on worker rank {self.rank_}: not supported with several worker "
                f"processes per machine (BYTEPS_LOCAL_SIZE={self.local_size_}) yet; give "
                "every rank the same number of steps (e.g. drop the last uneven batches)")
        for h in list(self._handles):
            h.wait()
        if self.control is None or self.size_ == 1:
            return self.rank_
        with self._lock:
            rounds = {st.name: st.round for st in self._tensors.values()}
        last, rounds = self.control.join(rounds)
        # every rank is back in: each tensor continues at the round the job is at (the ranks
        # that ran more steps pushed more rounds)
        with self._lock:
            for name, rnd in rounds.items():
                st = self._tensors.get(name)
                if st is None:
                    self._round_floor[name] = rnd
                elif rnd > st.round:
                    st.round = rnd
        return last

    def _divisor(self, task: Task) -> int:
        """What an average of ``task``'s round divides by: every rank, or only the ranks whose
        machines pushed it when some had joined."""
        return task.contrib * self.local_size_ if task.contrib else self.size_

    # -- declaration --------------------------------------------------------------------------------
    def auto_name(self) -> str:
        """The next BytePS-style name for an unnamed tensor (same sequence on every worker)."""
        with self._lock:
            name = f"PushPull.noname.{self._noname}"
            self._noname += 1
            return name

    def local_out(self, name: str, shape: tuple, dtype: str) -> np.ndarray:
        """This machine's shared reduction buffer for tensor ``name`` (several local ranks): a
        uint8 array of the tensor's bytes in shared memory, the same memory on every local rank.
        Binds the name like a first push_pull would."""
        self._check()
        if self.control is None or self.local_size_ < 2:
            raise ValueError("local_out needs a distributed job with several local ranks")
        nbytes = int(np.prod(shape, dtype=np.int64)) * ITEMSIZE[dtype]
        with self._lock:
            st = self._tensors.get(name)
            if st is None:
                st = self._new_tensor(name)
            self._bind(st, tuple(shape), dtype, nbytes)
            return self._segment(st).out

    def declare(self, name: str) -> int:
        """Reserve the next key for ``name``. Every worker must declare in the same order."""
        self._check()
        with self._lock:
            st = self._tensors.get(name)
            if st is None:
                st = self._new_tensor(name)
            return st.decl_id

    def _new_tensor(self, name: str) -> TensorState:
        """Declare ``name`` (lock held); after a join() it starts at the round the job is at."""
        st = self._tensors[name] = TensorState(len(self._tensors), name,
                                               round=self._round_floor.pop(name, 0))
        return st

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
                        priority: int = 0, out: Any = None, dtype: str | None = None,
                        device: DeviceCopier | None = None,
                        prereduced: bool = False, compression: Any = None) -> Handle:
        """Start summing ``array`` across all workers; returns a :class:`Handle`.

        ``out`` receives the result (default: a new array; pass ``out=array`` for in place).
        ``dtype`` overrides the element type for buffers numpy cannot name (``"bfloat16"`` held
        as uint16). Integer averages round down (floor division).

        ``device`` (framework plugins): ``array``/``out`` are host staging buffers of a tensor
        that lives on an accelerator; the pipeline copies each partition in with
        ``device.d2h(offset, nbytes)`` just before pushing it and out with
        ``device.h2d(offset, nbytes)`` as soon as it is pulled, so copies and network overlap.

        ``prereduced`` (several local ranks): the local ranks have already summed the tensor
        into this machine's shared reduction buffer (:meth:`local_out`, e.g. each rank its
        slice after an NCCL reduce-scatter); pass that buffer as ``array`` and ``out``. The
        machine's sum of all workers lands in it; ``average`` must be False (the buffer is
        shared, so the caller scales its own copy).

        ``compression``: a codec :class:`~byteps_like.compression.Compressor` (onebit, top-k,
        ...). Each partition is compressed before its push and decompressed after its pull; the
        servers decompress, sum and compress the result. Tensors below
        BYTEPS_MIN_COMPRESS_BYTES, integer tensors and standalone jobs are not compressed. A name
        keeps the compressor of its first push_pull. Cast compressors (fp16, bf16) are applied
        by the plugins before this call, so they are ignored here."""
        self._check()
        if device is not None and not self.device_pipeline:
            raise ValueError("device staging through the pipeline needs a distributed job "
                             "with one local rank; stage the tensor on the host instead")
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
                name = self.auto_name()
            st = self._tensors.get(name)
            if st is None:
                st = self._new_tensor(name)
            self._bind(st, tuple(arr.shape), wire_dtype, arr.nbytes)
            if self.control is not None:
                self._bind_compressor(st, compression)
            nparts = len(st.parts) if self.control is not None and not self.alone else 0
            h = Handle(name, arr, out, nparts, default_timeout=self.cfg.timeouts.op_timeout,
                       describe_pending=self._describe_pending)
            if self.control is None or self.alone:  # the sum over one worker is the input
                if out is not arr:
                    np.copyto(out, arr)
                return h
            self._handles.add(h)
            start = lambda block: self._start(st, h, arr, out, wire_dtype, average,  # noqa: E731
                                              priority, block, device, prereduced)
            idle = st.busy is None
            if idle:
                st.busy = h
            else:
                st.waiting.append((h, start))  # one round of a key in flight at a time
            # registered last: a handle of no partitions is already done and frees the name now
            h.add_done_callback(lambda hh, st=st: self._on_handle_done(st, hh))
        if idle:
            try:
                start(True)  # outside the lock: may block on a full queue (back-pressure)
            except BaseException as exc:  # failed before it started: shutdown must not wait
                h.fail(exc)
                raise
        return h

    def _bind_compressor(self, st: TensorState, compression: Any) -> None:
        """Bind a codec compressor to a tensor at its first push_pull (every worker does the
        same, so the servers see one compressor per key); refuse a different one later."""
        is_codec = getattr(compression, "kind", "none") == "codec"
        if st.comp_bound and (compression is st.compressor
                              or (st.compressor is None and not is_codec)):
            return  # the usual case, every step: the same compressor (or none) as bound
        # too small to gain, or not a float tensor: travels as it is
        codec = (is_codec and st.dtype in COMPRESSIBLE
                 and st.nbytes >= self.cfg.compression.min_compress_bytes)
        wanted = compression.spec() if codec else None
        if not st.comp_bound:
            st.comp_bound = True
            if wanted is None:
                return
            st.compressor, st.spec = compression, wanted
            if self.is_local_root:  # only the local root pushes, so only it compresses
                for off, n, key, _server in st.parts:
                    count = n // ITEMSIZE[st.dtype]
                    st.codecs.append(compression.make_codec(count, role="worker", key=key))
                    st.scratch.append(None if st.dtype == "float32"
                                      else np.empty(count, np.float32))
            return
        if st.spec != wanted:
            raise MismatchError(f"worker rank {self.rank_}: tensor {st.name!r} was first "
                                f"pushed with compression {st.spec or 'none'}, now with "
                                f"{wanted or 'none'}; a tensor keeps its compressor (use "
                                "another name for another setting)")

    def _start(self, st: TensorState, h: Handle, arr, out, dtype: str, average: bool,
               priority: int, block: bool, device: DeviceCopier | None = None,
               prereduced: bool = False) -> None:
        if self._fatal is not None:
            h.fail(self._fatal)
            return
        try:
            seg = self._segment(st) if self.local_size_ > 1 else None
        except BaseException as exc:  # failed before it started: nobody (shutdown) waits on it
            h.fail(exc)
            if block:
                raise
            return
        rnd = st.round
        st.round += 1
        src = arr.reshape(-1).view(np.uint8)
        dst = out.reshape(-1).view(np.uint8)
        device_push = (device is not None and self.device_push
                       and getattr(device, "device_slice", None) is not None)
        itinerary = plan(distributed=not self.single_machine, local_size=self.local_size_,
                         local_root=self.is_local_root, on_device=device is not None,
                         compressed=bool(st.codecs), device_push=device_push)
        on_native = self.native is not None and not st.codecs and not device_push
        if on_native and itinerary == (PUSH, PULL):  # a host tensor: one native operation
            self._submit_native(st, h, rnd, src, dst, dtype, average, priority)
            return
        for part, (off, n, key, server) in enumerate(st.parts):
            task = Task(h, key, part, off, n, priority, server, key % self.conns, rnd, itinerary)
            task.src = src[off:off + n]
            task.dst = dst[off:off + n]
            # what goes to the servers and where their sum lands: the machine's reduced
            # partition in shared memory with local ranks, the caller's arrays otherwise
            task.seg = seg
            task.push_src = seg.out[off:off + n] if seg is not None else task.src
            task.pull_dst = seg.out[off:off + n] if seg is not None else task.dst
            task.phase = 1 if prereduced else 0
            task.prereduced = prereduced
            task.device = device
            task.device_direct = device_push and COPY_D2H not in itinerary
            task.dtype = dtype
            task.average = average
            task.decl = self._declaration(st, dtype, part) if rnd == 0 else None
            task.codec = st.codecs[part] if st.codecs else None
            task.native = on_native
            if task.codec is not None:
                task.scratch = st.scratch[part]
                task.wire = None
                if task.decl is not None:  # the compressor travels once per key, typed JSON
                    task.decl["compressor"] = st.spec
                    task.decl["count"] = n // ITEMSIZE[dtype]
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
        if task.native:  # the native data plane pushes and pulls; it applies its own credit
            self._release(task)
            op = next(self._native_ids)
            divisor = (self.size_ if task.average and self.size_ > 1 and task.seg is None
                       else 1)
            decl = self._decl_bytes(task.decl) if task.decl else None
            with self._lock:
                self._native_ops[op] = ("task", task)
            self.native.submit(op, task.priority, task.push_src, task.pull_dst,
                               native.WIRE_CODE[task.dtype], divisor, task.round,
                               [(task.key, task.server, task.key % self.native_streams, 0,
                                 task.nbytes, decl)])
            self.bytes_pushed += task.nbytes
            return False  # the completion advances the task
        # one message pushes the partition and asks for the round's sum (FLAG_PULL)
        flags = FLAG_PULL | (FLAG_DECLARE if task.decl else 0)
        if task.codec is not None:  # a compressed payload: raw bytes the server decodes
            payload = task.wire
            task.wire = None
            hdr = Header(MsgType.PUSH, "uint8", Role.WORKER, self.push_rank,
                         flags | FLAG_COMPRESSED, self.job, task.key, task.round,
                         payload.nbytes, payload.nbytes)
        else:
            # device memory straight from the accelerator when the transport sends it itself
            payload = (task.device.device_slice(task.offset, task.nbytes) if task.device_direct
                       else task.push_src)
            hdr = Header(MsgType.PUSH, task.dtype, Role.WORKER, self.push_rank, flags, self.job,
                         task.key, task.round, task.nbytes // ITEMSIZE[task.dtype], task.nbytes)
        with self._lock:
            self._inflight[task.key] = task
        self.ep.send(self._routes[task.server][task.conn], encode(hdr, payload, task.decl))
        self.bytes_pushed += hdr.nbytes
        return False  # the pull response advances the task

    @staticmethod
    def _to_float32(task: Task, buf: np.ndarray) -> np.ndarray:
        """The partition bytes ``buf`` as float32: a view, or converted into the scratch."""
        if task.scratch is None:
            return buf.view(np.float32)
        if task.dtype == "float64":
            np.copyto(task.scratch, buf.view(np.float64), casting="same_kind")
        else:
            _core.convert(task.scratch, "float32", buf, task.dtype)
        return task.scratch

    @staticmethod
    def _from_float32(task: Task, buf: np.ndarray) -> None:
        """Write the scratch's float32 values into the partition bytes ``buf`` (its dtype)."""
        if task.dtype == "float64":
            np.copyto(buf.view(np.float64), task.scratch, casting="same_kind")
        else:
            _core.convert(buf, task.dtype, task.scratch, "float32")

    def _stage_compress(self, task: Task) -> bool:
        task.wire = task.codec.encode(self._to_float32(task, task.push_src), task.round)
        return True

    def _stage_decompress(self, task: Task) -> bool:
        buf, task.payload = as_buffer(task.payload), None
        if task.scratch is None:
            step = task.codec.decode(buf, task.pull_dst.view(np.float32))
        else:
            step = task.codec.decode(buf, task.scratch)
            self._from_float32(task, task.pull_dst)
        if step != task.round:
            raise ProtocolError(f"push_pull of {task.handle.name!r} (key {task.key}): the "
                                f"server's compressed sum is of step {step}, expected "
                                f"{task.round}")
        if task.average and self.size_ > 1 and task.seg is None:
            _core.scale_into(task.dst, task.dtype, self._divisor(task))
        return True

    def _stage_pull(self, task: Task) -> bool:
        if task.native:  # received in place and averaged by the native data plane
            self.bytes_pulled += task.nbytes
            return True
        if task.codec is not None:  # the decompress stage decodes the payload
            self.bytes_pulled += memoryview(as_buffer(task.payload)).nbytes
            return True
        payload = task.payload
        task.payload = None
        _core.copy_into(task.pull_dst, as_buffer(payload))
        if task.average and self.size_ > 1 and task.seg is None:
            _core.scale_into(task.dst, task.dtype, self._divisor(task))
        self.bytes_pulled += task.nbytes
        return True

    @staticmethod
    def _stage_d2h(task: Task) -> bool:
        task.device.d2h(task.offset, task.nbytes)
        return True

    @staticmethod
    def _stage_h2d(task: Task) -> bool:
        task.device.h2d(task.offset, task.nbytes)
        return True

    @property
    def device_push(self) -> bool:
        """Whether the transport sends device memory itself (UCX with CUDA support and
        BYTEPS_UCX_DEVICE_MEMORY=1): device tensors then skip the copy to the host before the
        push (their sums still arrive in host memory and are copied back)."""
        return bool(getattr(getattr(self.ep, "ucx", None), "device_memory", False))

    @property
    def device_pipeline(self) -> bool:
        """Whether push_pull_async accepts ``device=`` (a distributed job, one local rank)."""
        return self.control is not None and self.local_size_ == 1 and not self.alone

    @property
    def alone(self) -> bool:
        """One process on one machine and no forced servers: a push_pull is the identity."""
        return self.single_machine and self.local_size_ == 1

    # -- local reduction stages (see byteps_like.local) -------------------------------------------
    def _segment(self, st: TensorState) -> local.Segment:
        seg = self._segments.get(st.decl_id)
        if seg is None:
            c = self.cfg.cluster
            name = (local.segment_prefix(c.job_id, c.root_port)
                    + f"m{self.machine}-t{st.decl_id}")
            seg = local.Segment(name, st.nbytes, self.local_size_,
                                what=f"tensor {st.name!r} on worker rank {self.rank_}",
                                shm_dir=c.shm_dir)
            self._segments[st.decl_id] = seg
        return seg

    def _local_send(self, mtype: MsgType, task: Task, route: Route) -> None:
        hdr = Header(mtype, role=Role.WORKER, rank=self.rank_, job=self.job, key=task.key,
                     round=task.round)
        self.ep.send(route, encode(hdr))

    def _stage_reduce(self, task: Task) -> bool:
        token = (task.key, task.round)
        if task.phase == 0:  # my input into my slot, then wait until every slot is filled
            _core.copy_into(task.seg.slot(self.local_rank_)[task.offset:task.offset + task.nbytes],
                            task.src)
            task.phase = 1
            if self.is_local_root:
                self._local_ready(token)
            else:
                self._local_send(MsgType.LOCAL_READY, task, Route(peer="localroot"))
            if not self._gate.park(("reduce",) + token, task):
                return False
        if task.phase == 1:  # reduce-scatter: sum my slice of the partition over all slots
            lo, hi = local.slice_of(task.offset, task.nbytes, ITEMSIZE[task.dtype],
                                    self.local_rank_, self.local_size_)
            if hi > lo and not task.prereduced:
                out = task.seg.out[lo:hi]
                _core.copy_into(out, task.seg.slot(0)[lo:hi])
                for i in range(1, self.local_size_):
                    _core.add_into(out, task.seg.slot(i)[lo:hi], task.dtype)
            task.phase = 2
            if not self.is_local_root:
                self._local_send(MsgType.LOCAL_REDUCED, task, Route(peer="localroot"))
                return True  # on to the broadcast stage, which waits for the result
            if self._reduced.arrive(token):
                return True
            return self._gate.park(("reduced",) + token, task)
        return True  # phase 2: every slice is reduced, on to the push

    def _local_ready(self, token) -> None:
        """Local root: one more rank's input is in place; when all are, reduce."""
        if self._ready.arrive(token):
            for r, route in self._local_routes.items():
                hdr = Header(MsgType.LOCAL_REDUCE, role=Role.WORKER, rank=self.rank_,
                             job=self.job, key=token[0], round=token[1])
                self.ep.send(route, encode(hdr))
            self._gate.signal(("reduce",) + token)

    def _stage_broadcast(self, task: Task) -> bool:
        token = (task.key, task.round)
        if self.is_local_root:
            for route in self._local_routes.values():
                self._local_send(MsgType.LOCAL_DONE, task, route)
        elif task.phase < 3:
            task.phase = 3
            if not self._gate.park(("done",) + token, task):
                return False
        if not task.prereduced:  # prereduced: the caller reads the shared buffer itself
            _core.copy_into(task.dst, task.seg.out[task.offset:task.offset + task.nbytes])
        if task.average and self.size_ > 1 and not task.prereduced:
            _core.scale_into(task.dst, task.dtype, self._divisor(task))
        return True

    def _local_sender_problem(self, route: Route, h: Header) -> str | None:
        """Why a local-reduction message is not this machine's (None: it is). The root takes
        LOCAL_READY and LOCAL_REDUCED from a local rank's own connection only (its routing id,
        transport/local_peers.py); a local rank takes LOCAL_REDUCE and LOCAL_DONE from its
        connection to the root only."""
        if h.job != self.control.job or h.role is not Role.WORKER:
            return "local-reduction message of another job"
        if self.is_local_root:
            if h.type not in (MsgType.LOCAL_READY, MsgType.LOCAL_REDUCED):
                return "local-reduction message a local root never takes"
            if route.ident is None or self._local_ids.get(h.rank) != route.ident:
                return "local-reduction message from no local rank's connection"
        else:
            if h.type not in (MsgType.LOCAL_REDUCE, MsgType.LOCAL_DONE):
                return "local-reduction message a local rank never takes"
            if route.peer != "localroot" or h.rank != self.machine * self.local_size_:
                return "local-reduction message from another than the local root"
        return None

    def _on_local_message(self, route: Route, h: Header) -> None:
        token = (h.key, h.round)
        if route.ident is not None:  # a local rank talking to its root: remember the way back
            self._local_routes[h.rank % self.local_size_] = route
        if h.type is MsgType.LOCAL_READY:
            self._local_ready(token)
        elif h.type is MsgType.LOCAL_REDUCED:
            if self._reduced.arrive(token):
                self._gate.signal(("reduced",) + token)
        elif h.type is MsgType.LOCAL_REDUCE:
            self._gate.signal(("reduce",) + token)
        elif h.type is MsgType.LOCAL_DONE:
            self._gate.signal(("done",) + token)

    # -- the native data plane -----------------------------------------------------------------------
    @staticmethod
    def _declaration(st: TensorState, dtype: str, part: int) -> dict:
        """What the first round of partition ``part`` declares to its server (both paths)."""
        return {"name": st.name, "shape": list(st.shape), "dtype": dtype, "part": part,
                "nparts": len(st.parts)}

    @staticmethod
    def _decl_bytes(decl: dict) -> bytes:
        """A declaration as the servers compare it: the same JSON bytes on every worker."""
        return json.dumps(decl, separators=(",", ":"), allow_nan=False).encode()

    def _submit_native(self, st: TensorState, h: Handle, rnd: int, src, dst, dtype: str,
                       average: bool, priority: int) -> None:
        """All partitions of a host tensor as one native operation: one call in, one
        completion out, whatever the number of partitions."""
        streams = self.native_streams
        if rnd == 0:  # the declarations travel once per key
            parts = [(key, server, key % streams, off, n,
                      self._decl_bytes(self._declaration(st, dtype, part)))
                     for part, (off, n, key, server) in enumerate(st.parts)]
        else:
            parts = st.native_parts
            if parts is None:
                parts = st.native_parts = [(key, server, key % streams, off, n, None)
                                           for off, n, key, server in st.parts]
        op = next(self._native_ids)
        divisor = self.size_ if average and self.size_ > 1 else 1
        with self._lock:
            self._native_ops[op] = ("op", h, st, rnd, priority, time.monotonic())
        h.fast_wait = lambda timeout, op=op: self._native_wait(op, timeout)
        try:
            self.native.submit(op, priority, src, dst, native.WIRE_CODE[dtype], divisor, rnd,
                               parts)
        except (RuntimeError, ValueError) as exc:
            with self._lock:
                self._native_ops.pop(op, None)
            h.fail(CommunicationError(f"push_pull of {st.name!r}: {exc}"))
            return
        self.bytes_pushed += st.nbytes

    def _native_wait(self, op: int, timeout: float) -> None:
        """Handle.wait of a native operation: wait in C++ without the GIL, then finish the
        handle on this thread."""
        cli = self.native
        if cli is None:
            return
        if cli.wait(op, timeout):
            comp = cli.take(op)
            if comp is not None:
                self._native_done(comp)

    @staticmethod
    def _server_error(what: str, kind: str | None, text: str, server: int,
                      meta: dict | None = None) -> Exception:
        """A server's error reply (either data path) as the exception users get."""
        if kind == ERR_MISMATCH:
            return MismatchError(f"{what}: {text}")
        if kind == ERR_PEER_LEFT:
            meta = meta or {}
            rank, last = meta.get("rank"), meta.get("last_round")
            return PeerLeftError(f"{what}: {text}",
                                 rank=rank if isinstance(rank, int) else None,
                                 last_round=last if isinstance(last, int) else None)
        return RemoteError(f"{what}: {text}", role="server", rank=server)

    def _native_error(self, name: str, kind: str, server: int, message: bytes) -> Exception:
        text = message.decode("utf-8", "replace")
        where = f"push_pull of {name!r} on worker rank {self.rank_}"
        if kind == "remote":
            meta = native.decode_error_meta(message)
            return self._server_error(f"push_pull of {name!r}", meta["kind"], meta["message"],
                                      server, meta)
        if kind == "peer_lost":
            return PeerLostError(f"{where}: {text}", role="server", rank=server)
        if kind == "protocol":
            return ProtocolError(f"{where}: {text}")
        if kind == "closed":
            return CommunicationError(f"{where}: the runtime was shut down before it completed")
        return CommunicationError(f"{where}: {text}")

    def _native_done(self, comp: tuple) -> None:
        """One completed native operation (the completion thread, or a waiter)."""
        op, ok, kind, server, message, t0, t1, nbytes, times = comp
        with self._lock:
            entry = self._native_ops.pop(op, None)
        if entry is None:
            return
        if entry[0] == "task":
            task = entry[1]
            if ok:
                self.pipeline.advance(task)
            else:
                self._fail_task(task, self._native_error(task.handle.name, kind, server,
                                                         message))
            return
        _, h, st, rnd, priority, t_sub = entry
        if not ok:
            h.fail(self._native_error(h.name, kind, server, message))
            return
        self.bytes_pulled += nbytes
        observers = self.pipeline.observers if self.pipeline is not None else ()
        if observers:  # each partition's push (sent..acknowledged) and pull (..received)
            for part, ((_off, n, key, _srv), (ts, ta, td)) in enumerate(zip(st.parts, times)):
                span = _NativeSpan(h, key, part, n, priority, rnd, t_sub)
                for stage, a, b in (("push", ts, ta), ("pull", ta, td)):
                    for obs in observers:
                        obs(span, stage, "start", a)
                    for obs in observers:
                        obs(span, stage, "end", b)
        h.complete()

    # -- network replies (I/O thread) -----------------------------------------------------------------
    def _release(self, task: Task) -> None:
        """Return a task's push credit once: only a task the push queue handed out holds any
        (one that failed in an earlier stage, e.g. a device copy, never took it)."""
        if task.credited and not task.acked:
            task.acked = True
            self.pipeline.queues[PUSH].release(task.nbytes)

    def _on_message(self, route: Route, frames: list) -> None:
        try:
            msg = decode(frames, self.cfg.transport.max_message_bytes)
        except ProtocolError as exc:
            self.dropped("malformed", f"from {route}: {exc}")
            return
        if route.peer == "scheduler":
            self.control.handle(msg)
            return
        h = msg.header
        if not self._peers_ready:  # before the node table nobody may talk to it
            self.dropped("message before the node table", f"{h.type.name} from {route}")
            return
        if h.type in _LOCAL_TYPES:
            why = self._local_sender_problem(route, h)
            if why:
                self.dropped(why, f"{h.type.name} key {h.key} round {h.round} from {route}")
                return
            self._on_local_message(route, h)
            return
        # a server's answer: only on the connection the push went out on, from that server
        with self._lock:
            task = self._inflight.get(h.key)
        if task is None or task.round != h.round:
            self.dropped("answer that matches no push in flight",
                         f"{h.type.name} key {h.key} round {h.round} from {route}")
            return
        if (route != self._routes[task.server][task.conn] or h.job != self.job
                or h.role is not Role.SERVER or h.rank != self._server_ranks[task.server]):
            self.dropped("answer from another connection or sender than the push's server",
                         f"{h.type.name} key {h.key} round {h.round} from {route} as "
                         f"{h.sender}")
            return
        if h.type is MsgType.PUSH_ACK:
            self._release(task)
        elif h.type is MsgType.PULL_RESP:
            self._release(task)
            if task.codec is not None:
                bad = (not h.flags & FLAG_COMPRESSED or h.dtype != "uint8"
                       or h.nbytes > task.codec.max_bytes)
            else:
                bad = h.nbytes != task.nbytes or h.dtype != task.dtype
            if bad:
                want = (f"a compressed payload of at most {task.codec.max_bytes} bytes"
                        if task.codec is not None else f"{task.nbytes} bytes of {task.dtype}")
                self._fail_task(task, ProtocolError(
                    f"server {h.rank} answered key {h.key} with {h.count} x {h.dtype}, "
                    f"expected {want}"))
                return
            with self._lock:
                self._inflight.pop(h.key, None)
            task.payload = msg.payload
            task.contrib = contributors(h.flags)
            self.pipeline.advance(task)
        elif h.type is MsgType.ERROR:
            self._release(task)
            meta = msg.meta if isinstance(msg.meta, dict) else {}
            self._fail_task(task, self._server_error(
                f"push_pull of {task.handle.name!r} (key {h.key})", meta.get("kind"),
                str(meta.get("message", "error")), h.rank, meta))
        else:
            log.warning("worker %d: unexpected %s from server %d", self.rank_, h.type.name,
                        h.rank)

    # -- telemetry --------------------------------------------------------------------------------
    def tensors(self) -> dict[str, TensorState]:
        return dict(self._tensors)

    def note_step(self, group: str) -> None:
        """A framework plugin averaged the gradients of ``group`` (one training step): the
        step of traces, metrics and the status view counts these (telemetry.Telemetry.step)."""
        self.steps[group] = self.steps.get(group, 0) + 1


@dataclass(eq=False)
class _NativeSpan:
    """What observers see of a native operation (they read a Task's fields)."""
    handle: Any
    key: int
    part: int
    nbytes: int
    priority: int
    round: int
    enqueued_at: float


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
