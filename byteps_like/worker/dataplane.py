"""The native data plane's worker side: push_pulls that C++ carries (csrc/dataplane.cc).

Every push and pull between workers and servers goes through it: the local root of a machine
opens ``streams`` TCP (or UCX) connections to each server's data port (:mod:`byteps_like.
transport.native`) through a :class:`byteps_like._core.DataClient`. Two kinds of operation:

* a host tensor whose itinerary is only PUSH, PULL (no device copy, no compression, one local
  rank) is submitted whole, all partitions in one call (:meth:`NativeDataPlane.submit_tensor`);
  C++ pushes each, receives the sum in place and divides it, and reports one completion;
* any other partition reaches the PUSH stage as a pipeline task and is submitted alone
  (:meth:`NativeDataPlane.submit_task`); its completion advances the task to its next stage.

Completions come back on the completion thread (:class:`byteps_like.transport.native.
Completions`), or on the thread that waits for a handle (``Handle.fast_wait``, which waits in
C++ without the GIL and then finishes the handle itself).

Who calls it: ``Runtime._connect`` (:meth:`NativeDataPlane.connect`), ``Rounds.start`` (a
whole tensor), the PUSH stage (:mod:`.stages`), and the runtime's teardown and fatal errors
(:meth:`NativeDataPlane.close`).
"""
from __future__ import annotations

import itertools
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import _core
from ..config import Config
from ..errors import CommunicationError, FellBehindError, PeerLostError, ProtocolError
from ..transport import native
from ..wire import DTYPE_CODE, ERR_BEHIND, ITEMSIZE, first_round
from .dispatch import server_error
from .handle import Handle
from .pipeline import PULL, PUSH, Task, native_codec_threads
from .tensors import NativePart, TensorState, backs_up, decl_bytes, declaration

if TYPE_CHECKING:
    from ..control import PeerInfo
    from .inflight import InFlight
    from .membership import Membership

log = logging.getLogger("byteps_like.worker")
_PY_SWITCH_INTERVAL = 0.005  # the interpreter's default thread switch interval

#: a whole-tensor operation in flight: (handle, tensor, round, priority, submitted at)
_TensorOp = tuple[Handle, TensorState, int, int, float]


@dataclass(eq=False)
class NativeSpan:
    """What observers see of a native operation (they read a Task's fields)."""
    handle: Any
    key: int
    part: int
    nbytes: int
    priority: int
    round: int
    enqueued_at: float


def cast_coders(st: TensorState, wire_dtype: str) -> list[Any]:
    """The ``_core.NativeCast`` of each partition of a cast tensor (bound in ``wire_dtype``),
    made at its first round and kept: their buffers hold the partitions on the wire."""
    coders = st.cast_coders
    if coders is None:
        size = ITEMSIZE[wire_dtype]
        coders = st.cast_coders = [_core.NativeCast(n // size, wire_dtype)
                                   for _off, n, _key, _server in st.parts]
    return coders


class NativeDataPlane:
    """The native data plane of one runtime; ``client`` is None when it is not in use."""

    def __init__(self, members: Membership, flight: InFlight):
        self.members = members
        self.flight = flight
        self.client: _core.DataClient | None = None
        self.streams = 1                   # connections to each server
        self._ops: dict[int, Task | _TensorOp] = {}   # op id -> what it completes
        self._ids = itertools.count(1)
        self._completions: native.Completions | None = None
        self._switch_interval: float | None = None  # what we set sys.setswitchinterval to
        # losing a server (worker/failover.py): whether a lost server's parts wait for its
        # keys' new servers, the server indices lost for good, and who hears of a lost stream
        self.failover_on = False
        self.gone: list[int] = []
        self.on_server_lost: Callable[[int, str], None] | None = None
        self.on_close: Callable[[], None] | None = None
        self.cfg: Config | None = None     # the job's, once connected

    def serves(self, cfg: Config) -> bool:
        """Whether this worker talks to the servers: a local root of a job of several
        machines (every push and pull goes through the native data plane). Raises ConfigError
        where the plane cannot serve the job (native.check)."""
        m = self.members
        if not (m.is_local_root and bool(m.servers) and not m.single_machine):
            return False
        native.check(cfg)
        return True

    def connect(self, cfg: Config, servers: list[PeerInfo], credit: int) -> None:
        """Open the native data plane's streams to every server. A failure closes what was
        opened and raises CommunicationError (the caller tears the runtime down)."""
        m = self.members
        key = native.auth_key(cfg)
        cli = _core.DataClient(m.push_rank, m.job, native.io_threads(cfg), credit,
                               cfg.transport.max_message_bytes,
                               **({"auth_key": key} if key else {}),
                               codec_threads=native_codec_threads(cfg.scheduling.codec_threads))
        self.streams = native.streams(cfg)
        self.cfg = cfg
        if self.failover_on:  # before any submit: answers land in the keys' shadows
            cli.set_failover(True)
        try:
            for idx, p in enumerate(servers):
                if idx not in self.gone:  # not lost before this client (an elastic epoch's)
                    self._open(cli, cfg, idx, p)
            if self.gone:
                cli.failover(self.gone, False)
        except RuntimeError as exc:
            cli.close()
            raise CommunicationError(f"worker rank {m.rank}: {exc}") from None
        self.client = cli
        self._completions = native.Completions(cli, self.done)
        self._completions.start()
        want = cfg.scheduling.switch_interval
        if want and sys.getswitchinterval() == _PY_SWITCH_INTERVAL:
            sys.setswitchinterval(want)
            self._switch_interval = want
        log.info("worker %d: native data plane, %d %s stream(s) to each of %d server(s), %d "
                 "I/O threads%s", m.rank, self.streams,
                 "UCX" if native.uses_ucx(cfg) else "TCP", len(servers),
                 cli.stats()["io_threads"], ", authenticated streams" if key else "")

    def reconnect(self, idx: int, peer: PeerInfo) -> None:
        """Open the streams to server index ``idx`` again: a replacement of a lost server
        (worker/failover.py); raises RuntimeError when it cannot be reached."""
        if self.client is not None and self.cfg is not None:
            self._open(self.client, self.cfg, idx, peer)

    def _open(self, cli: _core.DataClient, cfg: Config, idx: int, peer: PeerInfo) -> None:
        """Open ``self.streams`` streams to server index ``idx`` (RuntimeError: unreachable)."""
        cli.connect(idx, peer.host, peer.data_port, self.streams,
                    min(60.0, cfg.timeouts.register_timeout), ucx=native.uses_ucx(cfg))

    @property
    def active_client(self) -> _core.DataClient:
        """The client, while the data plane is open."""
        if self.client is None:
            raise CommunicationError(f"worker rank {self.members.rank}: the native data "
                                     "plane is closed")
        return self.client

    # -- submitting --------------------------------------------------------------------------------
    def _lane(self, key: int) -> int:
        """The stream to its server that carries ``key`` (``Assigner.lane``)."""
        a = self.members.assigner
        return a.lane(key, self.streams) if a is not None else key % self.streams

    def submit_tensor(self, cli: _core.DataClient, st: TensorState, h: Handle, rnd: int,
                      src: np.ndarray, dst: np.ndarray, dtype: str, average: bool,
                      priority: int, coded: bool = False, cast: bool = False) -> None:
        """All partitions of a host tensor as one native operation: one call in, one
        completion out, whatever the number of partitions. ``coded``: a float32 tensor whose
        partitions the client encodes and decodes with ``st.compiled`` (its codec threads).
        ``cast``: a float32 tensor that travels as ``dtype`` (float16, bfloat16; ``st`` is
        bound in it): the client narrows each partition before its push and widens the
        averaged answer into ``dst`` on its codec threads (``st.cast_coders``)."""
        flight = self.flight
        lane = self._lane
        # a cast's parts are in wire bytes (``dtype``'s); its src and dst are float32
        grow = ITEMSIZE["float32"] // ITEMSIZE[dtype] if cast else 1
        parts: list[NativePart] | None
        if first_round(rnd):  # the declarations travel once per key (and epoch)
            backup = backs_up(self.cfg, average, self.members.size)
            parts = [(key, server, lane(key), grow * off, grow * n,
                      decl_bytes(declaration(st, dtype, part, backup, coded)))
                     for part, (off, n, key, server) in enumerate(st.parts)]
        else:
            parts = st.native_parts
            if parts is None:
                parts = st.native_parts = [(key, server, lane(key), grow * off, grow * n, None)
                                           for off, n, key, server in st.parts]
        op = next(self._ids)
        size = self.members.size
        divisor = size if average and size > 1 else 1
        with flight.lock:
            self._ops[op] = (h, st, rnd, priority, time.monotonic())
        h.fast_wait = lambda timeout, op=op: self._wait(op, timeout)
        extra: dict[str, Any] = ({"compressed": True, "codecs": st.compiled} if coded else
                                 {"codecs": cast_coders(st, dtype)} if cast else {})
        try:
            cli.submit(op, priority, src, dst, native.WIRE_CODE[dtype], divisor, rnd, parts,
                       **extra)
        except (RuntimeError, ValueError) as exc:
            with flight.lock:
                self._ops.pop(op, None)
            h.fail(CommunicationError(f"push_pull of {st.name!r}: {exc}"))
            return
        flight.bytes_pushed += st.compiled_bytes if coded and st.compiled else st.nbytes

    def submit_task(self, cli: _core.DataClient, task: Task) -> None:
        """One partition that reached the PUSH stage (its push credit already returned: the
        native data plane applies its own); its completion advances the task."""
        flight = self.flight
        op = next(self._ids)
        size = self.members.size
        divisor = size if task.average and size > 1 and task.seg is None else 1
        decl = decl_bytes(task.decl) if task.decl else None
        with flight.lock:
            self._ops[op] = task
        if task.codec is not None:  # the codec's payload; the server's encoded sum comes back
            wire = task.wire  # the codec's buffer (valid until its next encode) or its own
            assert wire is not None  # array: the task holds it until the completion (done())
            # DECOMPRESS decodes the answer; room for the largest (a registered compressor's
            # payloads vary in size: done() keeps the bytes that came)
            task.payload = np.empty(max(wire.nbytes, task.codec.max_bytes), np.uint8)
            cli.submit(op, task.priority, wire, task.payload, DTYPE_CODE["uint8"], 1,
                       task.round, [(task.key, task.server, self._lane(task.key), 0,
                                     wire.nbytes, decl)], compressed=True)
            flight.bytes_pushed += wire.nbytes
            return
        cli.submit(op, task.priority, task.push_src, task.pull_dst,
                   native.WIRE_CODE[task.dtype], divisor, task.round,
                   [(task.key, task.server, self._lane(task.key), 0, task.nbytes, decl)])
        flight.bytes_pushed += task.nbytes

    # -- completing --------------------------------------------------------------------------------
    def _wait(self, op: int, timeout: float) -> None:
        """Handle.wait of a native operation: wait in C++ without the GIL, then finish the
        handle on this thread."""
        cli = self.client
        if cli is None:
            return
        if cli.wait(op, timeout):
            comp = cli.take(op)
            if comp is not None:
                self.done(comp)

    def _error(self, name: str, kind: str, server: int, message: bytes) -> Exception:
        text = message.decode("utf-8", "replace")
        where = f"push_pull of {name!r} on worker rank {self.members.rank}"
        if kind == "remote":
            meta = native.decode_error_meta(message)
            if meta["kind"] == ERR_BEHIND:
                return self._behind(name, meta["message"], meta.get("behind"))
            return server_error(f"push_pull of {name!r}", meta["kind"], meta["message"],
                                server, meta)
        if kind == "peer_lost":
            control = self.members.control
            cause = control.scheduler_lost() if control is not None else None
            if isinstance(cause, Exception):  # the server stopped because the scheduler
                return cause                  # was lost (issue 40): this worker reports that
            return PeerLostError(f"{where}: {text}", role="server", rank=server)
        if kind == "protocol":
            return ProtocolError(f"{where}: {text}")
        if kind == "closed":
            return CommunicationError(f"{where}: the runtime was shut down before it completed")
        return CommunicationError(f"{where}: {text}")

    def _behind(self, name: str, text: str, behind: Any) -> Exception:
        """Backup workers: this worker fell further behind than the servers keep rounds for
        (csrc/dataplane_server_backup.cc); the error names it, its host and how far behind."""
        from ..control import node_host
        m = self.members
        host = node_host(m.config) if m.cfg is not None else "?"
        return FellBehindError(f"push_pull of {name!r} on worker rank {m.rank} (host {host}): "
                               f"{text}", rank=m.rank, host=host,
                               behind=behind if isinstance(behind, int) else None)

    def done(self, comp: _core.Completion) -> None:
        """One completed native operation (the completion thread, or a waiter)."""
        flight = self.flight
        op, ok, kind, server, message, _t0, _t1, nbytes, times, contrib = comp
        if kind == "server_lost":  # a notice, no operation: its parts wait (failover.py)
            if self.on_server_lost is not None:
                self.on_server_lost(server, message.decode("utf-8", "replace"))
            return
        with flight.lock:
            entry = self._ops.pop(op, None)
        if entry is None:
            return
        if isinstance(entry, Task):
            task = entry
            task.wire = None  # sent: the client holds it no more
            if ok:
                task.contrib = contrib  # a compressed sum is averaged after DECOMPRESS
                if task.codec is not None and task.payload is not None:
                    task.payload = task.payload[:nbytes]  # the encoded sum, as long as it came
                flight.active_pipeline.advance(task)
            else:
                flight.fail_task(task, self._error(task.handle.name, kind, server, message))
            return
        h, st, rnd, priority, t_sub = entry
        if not ok:
            h.fail(self._error(h.name, kind, server, message))
            return
        flight.bytes_pulled += nbytes
        observers = flight.pipeline.observers if flight.pipeline is not None else ()
        if observers:  # each partition's push (sent..acknowledged) and pull (..received)
            for part, ((_off, n, key, _srv), (ts, ta, td)) in enumerate(zip(st.parts, times)):
                span = NativeSpan(h, key, part, n, priority, rnd, t_sub)
                for stage, a, b in ((PUSH, ts, ta), (PULL, ta, td)):
                    for obs in observers:
                        obs(span, stage, "start", a)
                    for obs in observers:
                        obs(span, stage, "end", b)
        h.complete()

    # -- teardown ----------------------------------------------------------------------------------
    def forget(self) -> None:
        """Forget every operation in flight: what the client still completes is ignored (an
        elastic epoch that ended). Called with the in-flight lock held."""
        self._ops.clear()

    def interrupt(self) -> None:
        """Close the client so that nobody stays blocked in C++ (a fatal error, an epoch that
        ended): what is in flight fails, and its completions still arrive."""
        cli = self.client
        if cli is not None:
            cli.close()

    def close(self) -> None:
        """Close the client, which fails what is still in flight with the reason; finish
        those operations; give the interpreter's switch interval back if we changed it."""
        if self.on_close is not None:
            self.on_close()
        cli = self.client
        if cli is None:
            return
        cli.close()
        if self._completions is not None:
            self._completions.stop()
            self._completions = None
        for comp in cli.completions(0.0):
            self.done(comp)
        self.client = None
        if self._switch_interval == sys.getswitchinterval():
            sys.setswitchinterval(_PY_SWITCH_INTERVAL)  # ours: give the default back
        self._switch_interval = None
