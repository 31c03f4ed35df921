"""The worker runtime: the facade a training process talks to.

The framework-neutral API in :mod:`byteps_like` delegates to a default :class:`Runtime`, created
lazily and re-created after ``fork``; framework plugins build on the same object.

The walk of one gradient, top to bottom: a plugin's optimizer (e.g. ``byteps_like.torch.
DistributedOptimizer.step``) hands each gradient to a :class:`~.sync.GradientSynchronizer`,
which calls :meth:`Runtime.push_pull_async`. That binds the tensor's name in the registry
(:mod:`.tensors`: its key, partitions and servers, its compressor) and starts a round
(:mod:`.rounds`): a host tensor on the native data plane goes to C++ whole
(:mod:`.dataplane`); otherwise each partition becomes a :class:`~.pipeline.Task` whose
itinerary the :class:`~.pipeline.Pipeline` walks through the stage executors
(:mod:`.stages`, and :mod:`.local_reduce` with several ranks per machine), whose PUSH stage
submits the partition to the same native data plane. Its server's I/O threads sum every
worker's push of the round (csrc/dataplane_server.cc) and answer with the sum, which the
client receives into the output (averaged there) and reports as a completion; when the
operation (or every partition) is done the :class:`~.handle.Handle` completes and
``synchronize()`` writes the gradient back.

The parts, each with one job:

* :class:`~.membership.Membership` (``members``): rendezvous with the scheduler, identity,
  connections to servers and local peers, the job's topology; ``join``, ``barrier``;
* :class:`~.tensors.TensorRegistry` (``registry``): declared tensors, partitions, compressors;
* :class:`~.stages.StageExecutors` (``stages``) and :class:`~.local_reduce.LocalReduction`
  (``local``): what each pipeline stage does;
* :class:`~.dataplane.NativeDataPlane` (``plane``): the native data plane's submit, wait and
  completion;
* :class:`~.dispatch.Dispatcher` (``dispatch``): the endpoint's incoming messages (control,
  the local reduction, the server-held tables' answers);
* :class:`~.rounds.Rounds` (``rounds``): a push_pull's rounds, one at a time per name, cut
  into one native operation or one pipeline task per partition; ``join``'s rounds.

The parts never see the runtime: each takes the :class:`~.inflight.InFlight` object (the lock,
the handles and pushes in flight, task failure, the fatal error, the byte counters) and the
other parts it uses, so none imports this module back.

This module keeps the lifecycle (``init``, ``shutdown``, teardown), the fatal-error path and
the public methods; it re-exports :class:`~.tensors.TensorState` and
:class:`~.tensors.DeviceCopier`, which plugins and tests import from here.
"""
from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import numpy as np

from ..config import Config, load
from ..errors import (
    BytePSError,
    CommunicationError,
    ConfigError,
    NotInitializedError,
)
from ..transport.base import Drops, Endpoint
from .autocompress import auto_choice
from .dataplane import NativeDataPlane
from .dispatch import Dispatcher
from .elastic_membership import ElasticMembership
from .failover import ServerFailover
from .handle import Handle
from .inflight import InFlight
from .local_reduce import LocalReduction
from .membership import Membership
from .pipeline import Pipeline
from .rounds import Rounds, host_arrays
from .route import RoutePlan, TensorFacts
from .sparse import SparseTables
from .stages import StageExecutors
from .tensors import COMPRESSIBLE, DeviceCopier, TensorRegistry, TensorState

if TYPE_CHECKING:
    from ..control import ControlClient
    from .telemetry import Telemetry

__all__ = ["COMPRESSIBLE", "DeviceCopier", "Runtime", "TensorState", "default_runtime",
           "reset_default_runtime"]

log = logging.getLogger("byteps_like.worker")
T = TypeVar("T")


def _may_join(rank: int, local_size: int, cfg: Config) -> None:
    """join() refuses what it cannot serve, saying what to do instead."""
    if local_size > 1:
        raise BytePSError(
            f"join() on worker rank {rank}: not supported with several worker "
            f"processes per machine (BYTEPS_LOCAL_SIZE={local_size}) yet; give "
            "every rank the same number of steps (e.g. drop the last uneven batches)")
    if cfg.server.backup_workers:  # a joined rank and a late rank would be told apart wrongly
        raise BytePSError(
            f"join() on worker rank {rank}: not supported with backup workers "
            f"(BYTEPS_BACKUP_WORKERS={cfg.server.backup_workers}); give every rank the same "
            "number of steps or run without BYTEPS_BACKUP_WORKERS")


class _Of(Generic[T]):
    """A read-only attribute of the :class:`Runtime` that one of its parts holds
    (``Runtime.rank_`` is ``members.rank``): the facade publishes what the parts keep."""

    def __init__(self, part: str, name: str, doc: str = "") -> None:
        self.part, self.name, self.attr = part, name, name
        self.__doc__ = doc or f"The runtime's ``{part}.{name}``."

    def __set_name__(self, owner: type, attr: str) -> None:
        self.attr = attr

    def __get__(self, rt: Any, owner: Any = None) -> T:
        if rt is None:  # looked up on the class (documentation, introspection)
            return self  # type: ignore[return-value]
        return getattr(getattr(rt, self.part), self.name)

    def __set__(self, rt: Any, value: Any) -> None:
        raise AttributeError(f"Runtime.{self.attr} is read-only (it reads "
                             f"Runtime.{self.part}.{self.name})")


class Runtime:
    """One worker process's membership in a job and everything it push_pulls (the facade over
    the parts listed in the module docstring). ``init()`` joins the job, ``shutdown()`` leaves
    it; ``cfg`` (or keyword overrides of the environment) configures it."""

    def __init__(self, cfg: Config | None = None, **overrides: Any):
        self._cfg_arg = cfg
        self._overrides = overrides
        self.cfg: Config | None = None
        self.initialized = False
        # what the parts share of the operations in flight (inflight.py): the lock, the
        # handles, the pushes awaiting their answer, the fatal error, the pipeline, the bytes
        self.flight = InFlight(lambda: f"worker rank {self.members.rank}")
        self._lock = self.flight.lock
        self._handles = self.flight.handles
        self.telemetry: Telemetry | None = None  # once connected (trace, metrics, summary)
        self.steps: dict[str, int] = {}  # training steps a plugin noted, per gradient group
        # the parts
        self.members = m = Membership()
        self.registry = TensorRegistry()
        self._tensors = self.registry.tensors   # name -> TensorState (tests read it)
        self.local = LocalReduction(m, self.flight)
        self.plane = NativeDataPlane(m, self.flight)
        self.stages = StageExecutors(m, self.flight, self.plane, self.local)
        self.dispatch = Dispatcher(m, self.flight, self.local)
        self.rounds = Rounds(m, self.flight, self.registry, self.local, self.plane)
        self.elastic_m: ElasticMembership | None = None  # elastic jobs (elastic_membership.py)
        self.failover: ServerFailover | None = None  # losing a server (failover.py)
        self.sparse = SparseTables(self)  # server-held embedding tables (sparse.py)

    # -- the parts' state, as the rest of the code reads it ----------------------------------------
    @property
    def pipeline(self) -> Pipeline | None:
        """The pipeline while connected (None before ``init()`` and after ``shutdown()``)."""
        return self.flight.pipeline

    @pipeline.setter
    def pipeline(self, pipeline: Pipeline | None) -> None:
        self.flight.pipeline = pipeline

    # what the parts hold, read here under the runtime's name (_Of)
    config: _Of[Config] = _Of("members", "config", "The configuration of an initialised "
                              "runtime (NotInitializedError before ``init()``).")
    bytes_pushed: _Of[int] = _Of("flight", "bytes_pushed", "Payload bytes pushed so far (the "
                                 "compressed size for compressed partitions).")
    bytes_pulled: _Of[int] = _Of("flight", "bytes_pulled", "Payload bytes pulled so far (the "
                                 "compressed size for compressed partitions).")
    rank_: _Of[int] = _Of("members", "rank")
    size_: _Of[int] = _Of("members", "size")
    local_rank_: _Of[int] = _Of("members", "local_rank")
    local_size_: _Of[int] = _Of("members", "local_size")
    machine: _Of[int] = _Of("members", "machine")
    single_machine: _Of[bool] = _Of("members", "single_machine",
                                    "One worker machine: push_pull never leaves it.")
    control: _Of[ControlClient | None] = _Of(
        "members", "control", "The :class:`~byteps_like.control.ControlClient` (None: "
        "standalone, not connected).")
    ep: _Of[Endpoint | None] = _Of("members", "ep")
    dropped: _Of[Drops] = _Of("members", "dropped", "Messages dropped because no peer "
                              "entitled to send them did (by reason).")
    native: _Of[Any] = _Of("plane", "client", "The native data plane's :class:`byteps_like."
                           "_core.DataClient`, or None.")

    # -- lifecycle ----------------------------------------------------------------------------
    def init(self, **overrides: Any) -> None:
        """Join the job. ``overrides`` (keyword overrides of the environment, e.g.
        ``**{"partition.partition_bytes": 1 << 20}``) replace the constructor's; an initialised
        runtime ignores them."""
        with self._lock:
            if self.initialized:
                return
            if overrides:
                self._overrides = overrides
            cfg = self._cfg_arg or load(overrides=self._overrides)
            if cfg.cluster.role != "worker":
                raise ConfigError(f"DMLC_ROLE={cfg.cluster.role!r}: init() is for workers; run "
                                  f"servers and the scheduler with bpslaunch or python -m "
                                  f"byteps_like.{cfg.cluster.role}")
            self.cfg = cfg
            from ..log import setup_logging
            setup_logging(cfg.log.level, f"worker {cfg.cluster.worker_id or 0}."
                                         f"{cfg.cluster.local_rank}")
            c = cfg.cluster
            self.members.configure(cfg)
            if cfg.elastic.enabled and not c.is_standalone:  # worker/elastic_membership.py
                self.elastic_m = self.stages.elastic = ElasticMembership(
                    self.members, self.flight, self.registry, self.plane)
                self.elastic_m.on_new_epoch.append(self.sparse.new_epoch)
            if c.is_standalone:
                self.members.rank = 0
            else:
                if c.num_server < 1 and not c.single_machine:
                    raise ConfigError(f"DMLC_NUM_SERVER=0 with {self.size_} workers: a "
                                      "distributed job needs at least one server")
                self._connect(cfg)
            self.initialized = True
            atexit.register(self._atexit)
            log.info("worker rank %d of %d initialised (%s)", self.rank_, self.size_,
                     "standalone" if c.is_standalone else f"{c.num_server} servers")

    def _connect(self, cfg: Config) -> None:
        """Join the job: rendezvous, then the pipeline, telemetry and the native data plane."""
        m = self.members
        c = cfg.cluster
        self.local.reset(c.local_size)
        m.open(cfg, on_message=self.dispatch.on_message, on_fatal=self._on_fatal)
        if self.elastic_m is not None:
            self.elastic_m.attach_control(m.controller)
        self.failover = ServerFailover.attach(m, self.plane, self.sparse, cfg)
        try:
            m.register()
        except BaseException:
            self._teardown()
            raise
        m.meet_peers(cfg)
        # a local rank's LOCAL_READY may have come before this rank's own node table: the
        # endpoint's thread replays what the dispatcher held (it checks every 50 ms)
        m.endpoint.add_timer(0.05, self.dispatch.replay_early)
        if self.elastic_m is not None:
            self.elastic_m.adopt_table()
        credit = cfg.scheduling.credit * cfg.partition.partition_bytes
        self.pipeline = Pipeline(self.stages.handlers(c.local_size),
                                 queue_depth=cfg.scheduling.queue_depth,
                                 on_error=self.flight.fail_task,
                                 codec_threads_setting=cfg.scheduling.codec_threads)
        self.pipeline.on_complete = lambda task: task.handle.part_done(task.part)
        from .telemetry import attach  # observers: trace, metrics, summary line
        self.telemetry = attach(self)
        self.pipeline.start()
        if self.plane.serves(cfg):
            try:
                self.plane.connect(cfg, m.servers, credit)
            except CommunicationError:
                self._teardown()
                raise
        m.install_excepthook(lambda: self.initialized and self.flight.fatal is None)

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
            control = self.members.control
            if control is not None and self.flight.fatal is None and control.fatal is None:
                self.sparse.finish()   # table pushes in flight (worker/sparse.py)
                self.flight.wait(handles)
                timeout = self.config.timeouts.shutdown_timeout
                if not control.finish(timeout):
                    log.warning("worker %d: no shutdown confirmation from the scheduler "
                                "within %g s", self.rank_, timeout)
        finally:
            self._teardown()

    def _teardown(self) -> None:
        auto = getattr(self, "_auto_controller", None)
        if auto is not None:   # its measuring thread stops before the interpreter does
            auto.close()
        if self.telemetry is not None:  # writes the trace file
            self.telemetry.close()
            self.telemetry = None
        self.plane.close()  # fails what is still in flight, with the reason (and failover's)
        self.sparse.close()   # the table streams
        if self.pipeline is not None:
            self.pipeline.close()
            self.pipeline = None
        self.local.close()
        self.members.close()

    # -- errors -----------------------------------------------------------------------------------
    def _on_fatal(self, exc: BaseException) -> None:
        if self.flight.fatal is None:
            self.flight.fatal = exc
        self.flight.fail_handles(exc)
        self.plane.interrupt()  # wakes waiters blocked in the data plane: the job is over

    def check(self) -> None:
        """Raise what stops this runtime from working: NotInitializedError before ``init()``
        (or after ``shutdown()``), the job's fatal error once there is one. Plugins call it
        before they touch a tensor, so a misuse fails at its own line."""
        if not self.initialized:
            raise NotInitializedError("byteps_like is not initialised: call init() first")
        if self.flight.fatal is not None:
            raise self.flight.fatal

    # -- identity ---------------------------------------------------------------------------------
    def rank(self) -> int:
        self.check()
        return self.rank_

    def size(self) -> int:
        self.check()
        return self.size_

    def local_rank(self) -> int:
        self.check()
        return self.local_rank_

    def local_size(self) -> int:
        self.check()
        return self.local_size_

    def cross_rank(self) -> int:
        """This worker's machine among the job's worker machines (Horovod's ``cross_rank``):
        ``rank() // local_size()``, the index the servers count its machine's pushes by."""
        self.check()
        return self.members.machine

    def cross_size(self) -> int:
        """The number of worker machines (Horovod's ``cross_size``, ``DMLC_NUM_WORKER``)."""
        self.check()
        return self.size_ // self.local_size_

    def wire_report(self) -> str:
        """One line of the payload bytes this worker pushed and pulled so far (compressed size
        for compressed partitions): ``bytes on the wire: P pushed, Q pulled``."""
        return f"bytes on the wire: {self.bytes_pushed} pushed, {self.bytes_pulled} pulled"

    def get_pushpull_speed(self) -> tuple[int, float]:
        """(timestamp in ms, MB/s pushed plus pulled over the last few seconds), as in BytePS."""
        self.check()
        if self.telemetry is None:  # standalone: nothing travels
            return int(time.time() * 1000), 0.0
        return self.telemetry.speed()

    def barrier(self, timeout: float | None = None) -> None:
        self.check()
        if self.elastic_m is not None:
            self.elastic_m.check_collective()
        if self.members.control is not None:
            self.members.control.barrier("worker", timeout)

    # -- elastic jobs (BYTEPS_ELASTIC; the protocol in elastic_membership.py) -----------------
    @property
    def elastic(self) -> bool:
        """Whether this is an elastic job's worker."""
        return self.elastic_m is not None

    @property
    def epoch(self) -> int:
        """The membership epoch this worker is in (0: none yet, or not elastic)."""
        return self.elastic_m.epoch if self.elastic_m is not None else 0

    def check_membership(self) -> None:
        """Elastic jobs: raise MembershipChangedError when workers wait to join or a newer
        epoch was announced (cheap, non-blocking; ``State.commit()`` calls it)."""
        self.check()
        if self.elastic_m is not None:
            self.elastic_m.check_membership()

    def rejoin(self, timeout: float | None = None) -> None:
        """Elastic jobs, after a MembershipChangedError: abandon the old epoch, block until the
        next one is formed and take its rank and size (TooFewWorkersError below the minimum)."""
        self.check()
        if self.elastic_m is None:
            raise BytePSError("rejoin() is for elastic jobs (BYTEPS_ELASTIC=1, bpslaunch "
                              "--elastic)")
        self.elastic_m.rejoin(timeout)

    def join(self) -> int:
        """This rank is out of data (Horovod's ``hvd.join()``): finish what is in flight, then
        block until every worker has joined. Meanwhile the other ranks' rounds complete without
        this one and their averages divide by the ranks still in. Returns the rank that joined
        last. A rank that finished without joining makes this raise PeerLeftError."""
        self.check()
        _may_join(self.rank_, self.local_size_, self.members.config)
        return self.rounds.join(self.sparse)

    # -- declaration -------------------------------------------------------------------------------
    def auto_name(self) -> str:
        """The next BytePS-style name for an unnamed tensor (same sequence on every worker)."""
        with self._lock:
            return self.registry.auto_name()

    def local_out(self, name: str, shape: tuple, dtype: str) -> np.ndarray:
        """This machine's shared reduction buffer for tensor ``name`` (several local ranks): a
        uint8 array of the tensor's bytes in shared memory, the same memory on every local rank.
        Binds the name like a first push_pull would."""
        self.check()
        if self.members.control is None or self.local_size_ < 2:
            raise ValueError("local_out needs a distributed job with several local ranks")
        return self.rounds.local_out(name, tuple(shape), dtype)

    def declare(self, name: str) -> int:
        """Reserve the next key for ``name``. Every worker must declare in the same order."""
        self.check()
        with self._lock:
            return self.registry.declare(name).decl_id

    # -- push_pull ---------------------------------------------------------------------------------
    def push_pull_async(self, array: Any, name: str | None = None, average: bool = True,
                        priority: int = 0, out: Any = None, dtype: str | None = None,
                        device: DeviceCopier | None = None,
                        prereduced: bool = False, compression: Any = None) -> Handle:
        """Start summing ``array`` across all workers; returns a :class:`Handle`.

        ``out`` receives the result (default: a new array; ``out=array``: in place). ``dtype``
        names the element type numpy cannot (``"bfloat16"`` held as uint16). Integers floor.

        ``device`` (framework plugins): ``array``/``out`` are host staging buffers of an
        accelerator's tensor; the pipeline copies each partition in (``device.d2h(offset,
        nbytes)``) just before its push and out (``h2d``) once pulled: copies and network overlap.

        ``prereduced`` (several local ranks): the local ranks summed the tensor into this
        machine's shared reduction buffer (:meth:`local_out`, e.g. each its slice after an NCCL
        reduce-scatter); pass it as ``array`` and ``out``. The sum of all workers lands in it;
        ``average`` must be False (the buffer is shared: the caller scales its own copy).

        ``compression``: a codec :class:`~byteps_like.compression.Compressor` (onebit, top-k,
        ...) compresses each partition before its push and decompresses it after its pull; the
        servers decompress, sum and compress the result. Tensors below
        BYTEPS_MIN_COMPRESS_BYTES, integer tensors and standalone jobs are not compressed. A name
        keeps its first compressor. A cast compressor (fp16, bf16) converts float tensors to the
        dtype they travel and are summed in (:mod:`.cast`); ``auto``: :mod:`.autocompress`."""
        self.check()
        if self.elastic_m is not None:  # an epoch that is over: raise at once
            self.elastic_m.check_collective()
        if device is not None and not self.rounds.job().device_pipeline:
            raise ValueError("device staging through the pipeline needs a distributed job "
                             "with one local rank; stage the tensor on the host instead")
        arr, out, wire_dtype = host_arrays(array, out, name, dtype)
        if getattr(compression, "kind", None) == "auto":  # a candidate (and name) per tensor
            name, compression = auto_choice(self, compression, name, arr,
                                            device is not None or prereduced)
        return self.rounds.push_pull(arr, out, name, wire_dtype, average, priority, device,
                                     prereduced, compression)

    def plan(self, tensor: TensorFacts, compression: Any = None, *,
             bucket: bool = False) -> RoutePlan:
        """The route of a push_pull of ``tensor`` in this job (:func:`.route.plan_route`)."""
        return self.rounds.plan(tensor, compression, bucket=bucket)

    @property
    def alone(self) -> bool:
        """One process on one machine and no forced servers: a push_pull is the identity."""
        return self.single_machine and self.local_size_ == 1

    # -- telemetry --------------------------------------------------------------------------------
    def tensors(self) -> dict[str, TensorState]:
        return dict(self._tensors)

    def note_step(self, group: str) -> None:
        """A framework plugin averaged the gradients of ``group`` (one training step): the
        step of traces, metrics and the status view counts these (telemetry.Telemetry.step)."""
        self.steps[group] = self.steps.get(group, 0) + 1


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
