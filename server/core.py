"""The summation server.

A store per key, allocated on the first push. Engine threads own disjoint keys (assigned on first
sight to the engine with the fewest bytes) so no store is ever touched by two threads. The I/O
thread only decodes headers and routes; summation runs in ``_core`` kernels that release the GIL.

Synchronous mode: round r of a key sums one push from each of the job's workers into buffer
``r % 2``; pulls of round r are answered once the round completes. A worker pushes round r+1 of a
key only after it has pulled round r, so when the first push of round r+2 arrives every worker has
received round r: the buffer can be reused without copying the result out for each pull.

Asynchronous mode (``BYTEPS_ENABLE_ASYNC=1``): one buffer holds the value; every push is a delta
added at once; a pull returns a snapshot of the current value.
"""
from __future__ import annotations

import json
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from .. import _core
from ..compression import CompressionError, from_spec
from ..config import Config
from ..control import ControlClient
from ..errors import EXIT_PEER_FAILED, PeerLostError, ProtocolError
from ..transport import Route, data_scheme, make_endpoint, native
from ..wire import (ERR_INTERNAL, ERR_MISMATCH, ERR_PEER_LEFT, ERR_PROTOCOL, FLAG_COMPRESSED,
                    FLAG_DECLARE, FLAG_PULL, SUMMABLE, Header, as_buffer, contrib_flags,
                    Message, MsgType, Role, decode, decode_header, encode, job_hash)

log = logging.getLogger("byteps_like.server")


@dataclass
class KeyStore:
    key: int
    dtype: str
    nbytes: int
    count: int
    decl: dict
    decl_rank: int
    bufs: list
    round: int = 0                 # the round being accumulated
    completed: int = -1            # last completed round
    pushed: set = field(default_factory=set)
    pending: list = field(default_factory=list)   # (route, rank, round) waiting for a round
    failed: str | None = None
    failed_kind: str = ERR_MISMATCH
    failed_extra: dict = field(default_factory=dict)  # more error meta (peer_left: rank, round)
    contrib: list = field(default_factory=lambda: [0, 0])  # pushes summed per buffer's round
    pushes: int = 0
    round_started: float | None = None   # monotonic time of the open round's first push
    codec: object = None           # compressed key: the server Codec (decode pushes, encode sum)
    step: int = -1                 # compressed key: the step of the open round's pushes

    @property
    def compressed(self) -> bool:
        return self.codec is not None

    def describe_decl(self, decl: dict) -> str:
        comp = decl.get("compressor")
        how = f" compressed with {_spec_text(comp)}" if comp is not None else " uncompressed"
        return (f"{decl.get('name')!r} shape {tuple(decl.get('shape', ()))} "
                f"{decl.get('dtype')}{how}")


def _spec_text(spec) -> str:
    """A compressor spec as a short readable text: name(k=v, ..., inner=...)."""
    if not isinstance(spec, dict):
        return repr(spec)
    args = ", ".join(f"{k}={_spec_text(v) if isinstance(v, dict) else v!r}"
                     for k, v in spec.items() if k != "name")
    return f"{spec.get('name')}({args})"


class Engine(threading.Thread):
    def __init__(self, server: "Server", idx: int):
        super().__init__(name=f"bpsl-engine-{idx}", daemon=True)
        self.server = server
        self.idx = idx
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.stores: dict[int, KeyStore] = {}
        self.bytes = 0
        # membership as this engine's queue orders it (join()): joined and left machines
        self.joined: frozenset = frozenset()
        self.left: dict[int, str] = {}

    def run(self) -> None:
        while True:
            item = self.q.get()
            if item is None:
                return
            route, msg = item
            if route is None:  # a membership change (Server.on_members), in queue order
                self.apply_members(*msg)
                continue
            try:
                self.process(route, msg)
            except Exception as exc:  # noqa: BLE001 - a bug must not kill the engine silently
                log.exception("server %d: engine %d failed on key %d", self.server.rank,
                              self.idx, msg.header.key)
                self.server.reply_error(route, msg.header, ERR_INTERNAL,
                                        f"server {self.server.rank} internal error: {exc!r}")

    # -- processing -------------------------------------------------------------------------
    def process(self, route: Route, msg: Message) -> None:
        h = msg.header
        store = self.stores.get(h.key)
        if h.type is MsgType.PUSH:
            if store is None:
                store = self._create(route, msg)
                if store is None:
                    return
            self._push(store, route, msg)
        elif h.type is MsgType.PULL:
            if store is None:
                self.server._reject("pull of an undeclared key")
                self.server.reply_error(route, h, ERR_PROTOCOL,
                                        f"pull of key {h.key} before any push")
                return
            self._pull(store, route, h)

    def _create(self, route: Route, msg: Message) -> KeyStore | None:
        h = msg.header
        if not (h.flags & FLAG_DECLARE) or not msg.meta:
            self.server._reject("push of an undeclared key")
            self.server.reply_error(route, h, ERR_PROTOCOL, f"first push of key {h.key} from "
                                    f"{h.sender} carries no declaration")
            return None
        if h.flags & FLAG_COMPRESSED:
            return self._create_compressed(route, msg)
        if h.dtype not in SUMMABLE:
            self.server._reject("dtype that cannot be summed")
            self.server.reply_error(route, h, ERR_PROTOCOL, f"dtype {h.dtype} cannot be summed")
            return None
        if not self.server.claim_zmq_key(route, h):
            return None
        nbuf = 1 if self.server.async_mode else 2
        bufs = [np.zeros(h.nbytes, dtype=np.uint8) for _ in range(nbuf)]
        store = KeyStore(h.key, h.dtype, h.nbytes, h.count, dict(msg.meta), h.rank, bufs)
        self.stores[h.key] = store
        return store

    def _create_compressed(self, route: Route, msg: Message) -> KeyStore | None:
        """A key whose pushes are compressed: the declaration carries the compressor's spec
        (JSON, validated field by field) and the partition's element count. The store keeps a
        float32 accumulator and the server's codec."""
        h, decl, srv = msg.header, msg.meta, self.server
        what = f"key {h.key} ({decl.get('name')!r}) from worker rank {h.rank}"
        count = decl.get("count")
        # an uncompressed partition fits in a message and compressible dtypes have >= 2 bytes
        limit = srv.cfg.transport.max_message_bytes // 2
        try:
            if srv.async_mode:
                raise CompressionError("compression needs synchronous mode; unset "
                                       "BYTEPS_ENABLE_ASYNC or push without a compressor")
            if type(count) is not int or not 0 < count <= limit:
                raise CompressionError(f"element count {count!r} is not an integer in "
                                       f"1..{limit}")
            spec = decl.get("compressor")
            if not isinstance(spec, dict):
                raise CompressionError("the declaration carries no compressor spec")
            codec = from_spec(spec).make_codec(count, role="server", key=h.key)
        except CompressionError as exc:
            srv._reject("bad compressor declaration")
            srv.reply_error(route, h, ERR_PROTOCOL, f"server {srv.rank}: compressed push of "
                            f"{what}: {exc}")
            return None
        if not srv.claim_zmq_key(route, h):
            return None
        store = KeyStore(h.key, "uint8", 0, count, dict(decl), h.rank, [None, None])
        store.codec = codec
        store.acc = np.zeros(count, np.float32)
        self.stores[h.key] = store
        return store

    def _fail_key(self, store: KeyStore, text: str, kind: str = ERR_MISMATCH,
                  extra: dict | None = None) -> None:
        store.failed, store.failed_kind, store.failed_extra = text, kind, extra or {}
        log.error("server %d: %s", self.server.rank, text)
        for route, _rank, rnd in store.pending:
            self._reply_failed(store, route, Header(MsgType.PULL, key=store.key, round=rnd))
        store.pending.clear()

    def _reply_failed(self, store: KeyStore, route: Route, h: Header) -> None:
        self.server.reply_error(route, h, store.failed_kind, store.failed or "",
                                store.failed_extra)

    # -- membership (join()) ----------------------------------------------------------------
    def apply_members(self, joined: frozenset, left: dict[int, str]) -> None:
        self.joined, self.left = joined, left
        for store in self.stores.values():
            if store.failed is None and not self.server.async_mode:
                if not self._doom_if_left(store):
                    self._complete_if_ready(store)

    def _doom_if_left(self, store: KeyStore) -> bool:
        """A round that a machine which left the job has not pushed can never complete: fail
        the key with a peer_left error naming it."""
        if not self.left or (not store.pushed and not store.pending):
            return False
        for machine, why in sorted(self.left.items()):
            if machine in store.pushed:
                continue
            last = store.round - 1
            self._fail_key(store, (
                f"{why}; round {store.round} of key {store.key} "
                f"({store.describe_decl(store.decl)}) can never complete (the last round it pushed was "
                f"{last}). Ranks that run fewer steps must call join() when they are done"),
                ERR_PEER_LEFT, {"rank": machine, "last_round": last})
            return True
        return False

    def _complete_if_ready(self, store: KeyStore) -> None:
        """Close the open round once every machine that has not joined has pushed it."""
        srv = self.server
        if not store.pushed or len(store.pushed) < srv.num_workers - len(self.joined):
            return
        if store.compressed:  # the pull is compressed too: encode the merged sum
            wire = store.codec.encode(store.acc, store.step)
            store.bufs[store.round % 2] = np.array(wire, dtype=np.uint8, copy=True)
            store.step = -1
        store.contrib[store.round % 2] = len(store.pushed)
        store.completed = store.round
        store.round += 1
        store.round_started = None
        store.pushed = set()
        waiting, store.pending = store.pending, []
        for proute, _rank, rnd in waiting:
            self._answer_pull(store, proute, rnd)

    def _check(self, store: KeyStore, route: Route, msg: Message) -> bool:
        h = msg.header
        decl = msg.meta if (h.flags & FLAG_DECLARE) else None
        text = None
        if decl is not None and any(decl.get(f) != store.decl.get(f)
                                    for f in ("name", "shape", "dtype", "part", "nparts",
                                              "compressor")):
            text = (f"tensor mismatch on key {h.key}: worker rank {store.decl_rank} declared "
                    f"{store.describe_decl(store.decl)} but worker rank {h.rank} declared "
                    f"{store.describe_decl(decl)}; every worker must declare the same tensors, "
                    "in the same order, with the same shape, dtype and compressor")
        elif store.compressed and (not h.flags & FLAG_COMPRESSED or h.dtype != "uint8"
                                   or h.nbytes > store.codec.max_bytes):
            self.server._reject("wrong payload for a compressed key")
            self.server.reply_error(route, h, ERR_PROTOCOL, (
                f"push to compressed key {h.key} ({store.decl.get('name')!r}) from worker rank "
                f"{h.rank}: {h.nbytes} bytes of {h.dtype}, expected a compressed payload of at "
                f"most {store.codec.max_bytes} bytes"))
            return False
        elif not store.compressed and (h.dtype != store.dtype or h.nbytes != store.nbytes
                                       or h.flags & FLAG_COMPRESSED):
            # Without a declaration this push is not a worker disagreeing about the tensor (that
            # shows in the round-0 declarations): reject it alone, the key keeps serving.
            self.server._reject("wrong dtype or size for a declared key")
            comp = " compressed payload" if h.flags & FLAG_COMPRESSED else ""
            self.server.reply_error(route, h, ERR_PROTOCOL, (
                f"push to key {h.key} ({store.decl.get('name')!r}) from worker rank {h.rank}: "
                f"{h.count} x {h.dtype}{comp}, but the key holds {store.count} x {store.dtype}"
                f"{' uncompressed' if comp else ''}"))
            return False
        if text is not None:
            self._fail_key(store, text)
        if store.failed is not None:
            self._reply_failed(store, route, h)
            return False
        if h.rank in self.joined and not self.server.async_mode:
            self.server._reject("push after join()")
            self.server.reply_error(route, h, ERR_PROTOCOL, (
                f"key {h.key}: push from worker rank {h.rank}, which has called join(); a "
                "joined rank pushes again only after every rank has joined"))
            return False
        return True

    def _push(self, store: KeyStore, route: Route, msg: Message) -> None:
        h = msg.header
        if not self._check(store, route, msg):
            return
        srv = self.server
        if srv.async_mode:
            t_sum = time.perf_counter()
            _core.add_into(store.bufs[0], msg.payload, store.dtype, srv.sum_threads)
            srv.sum_meter.add(h.nbytes, time.perf_counter() - t_sum)  # metrics
            store.pushes += 1
            srv.reply(route, MsgType.PUSH_ACK, h)
            if h.flags & FLAG_PULL:
                self._pull(store, route, h)
            return
        if h.round != store.round or h.rank in store.pushed:
            why = ("twice in one round" if h.rank in store.pushed and h.round == store.round
                   else f"for round {h.round} while round {store.round} is open")
            srv._reject("push out of round")
            srv.reply_error(route, h, ERR_PROTOCOL, f"key {h.key}: push from worker rank "
                            f"{h.rank} {why}")
            return
        t_sum = time.perf_counter()
        if store.compressed:
            if not self._push_compressed(store, route, msg):
                return
        else:
            buf = store.bufs[h.round % 2]
            if not store.pushed:
                store.round_started = time.monotonic()
                _core.copy_into(buf, msg.payload, srv.sum_threads)
            else:
                _core.add_into(buf, msg.payload, store.dtype, srv.sum_threads)
        srv.sum_meter.add(h.nbytes, time.perf_counter() - t_sum)  # metrics
        store.pushed.add(h.rank)
        store.pushes += 1
        if self.left and self._doom_if_left(store):
            self._reply_failed(store, route, h)
            return
        srv.reply(route, MsgType.PUSH_ACK, h)
        if h.flags & FLAG_PULL:
            store.pending.append((route, h.rank, h.round))
        self._complete_if_ready(store)

    def _push_compressed(self, store: KeyStore, route: Route, msg: Message) -> bool:
        """Decode one worker's compressed push into the round's float32 accumulator (the first
        push overwrites it). Every push of a round must carry the same step."""
        h = msg.header
        payload = as_buffer(msg.payload)
        try:
            if not store.pushed:
                step = store.codec.decode(payload, store.acc)
            else:
                step = store.codec.decode_add(payload, store.acc)
                if step != store.step:  # decoded already: the round is now inconsistent
                    self._fail_key(store, (
                        f"compressed key {h.key} ({store.decl.get('name')!r}): worker rank "
                        f"{h.rank} pushed step {step} while the round holds step {store.step}; "
                        "every worker must push the tensor the same number of times"))
                    self._reply_failed(store, route, h)
                    return False
        except CompressionError as exc:
            self.server._reject("malformed compressed payload")
            if store.pushed:  # the round cannot complete without it: tell everyone waiting
                self._fail_key(store, f"compressed key {h.key}: worker rank {h.rank} sent a "
                               f"malformed payload ({exc})")
                self.server.reply_error(route, h, ERR_PROTOCOL, store.failed)
            else:
                self.server.reply_error(route, h, ERR_PROTOCOL, f"compressed push to key "
                                        f"{h.key} from worker rank {h.rank}: {exc}")
            return False
        if not store.pushed:
            store.round_started = time.monotonic()
            store.step = step
        return True

    def _answer_pull(self, store: KeyStore, route: Route, rnd: int) -> None:
        contrib = (0 if self.server.async_mode
                   else contrib_flags(store.contrib[rnd % 2], self.server.num_workers))
        if store.compressed:
            payload = store.bufs[rnd % 2]
            hdr = Header(MsgType.PULL_RESP, "uint8", Role.SERVER, self.server.rank,
                         FLAG_COMPRESSED | contrib, self.server.job, store.key, rnd,
                         payload.nbytes, payload.nbytes)
            self.server.ep.send(route, encode(hdr, payload))
            return
        hdr = Header(MsgType.PULL_RESP, store.dtype, Role.SERVER, self.server.rank, contrib,
                     self.server.job, store.key, rnd, store.count, store.nbytes)
        if self.server.async_mode:
            payload = store.bufs[0].tobytes()  # a snapshot: later pushes must not tear it
        else:
            payload = store.bufs[rnd % 2]
        self.server.ep.send(route, encode(hdr, payload))

    def _pull(self, store: KeyStore, route: Route, h: Header) -> None:
        if store.failed is not None:
            self._reply_failed(store, route, h)
        elif self.server.async_mode or h.round == store.completed:
            self._answer_pull(store, route, h.round)
        elif h.round == store.round:
            store.pending.append((route, h.rank, h.round))
        else:
            self.server.reply_error(route, h, ERR_PROTOCOL, f"key {h.key}: pull of round "
                                    f"{h.round} from worker rank {h.rank}, but round "
                                    f"{store.completed} is the last completed")


class Server:
    def __init__(self, cfg: Config, *, context=None, address: str | None = None,
                 scheduler_address: str | None = None):
        self.cfg = cfg
        self.async_mode = cfg.server.enable_async
        self.sum_threads = cfg.server.sum_threads
        # one push per worker machine: the local ranks of a machine reduce before pushing
        self.num_workers = cfg.cluster.num_worker
        self.joined: frozenset = frozenset()   # machines in join() (stall reports skip them)
        self.job = job_hash(cfg.cluster.job_id)
        self.ep = make_endpoint("server", cfg, context=context)
        from ..control import node_host
        host = node_host(cfg)
        self.address = self.ep.bind(
            address or f"{data_scheme(cfg)}://{host}:{cfg.cluster.server_port}")
        port = (int(self.address.rsplit(":", 1)[1])
                if self.address.startswith(("tcp", "ucx")) else 0)
        # the native data plane (csrc/dataplane.cc): uncompressed partitions, summed and
        # answered by compiled I/O threads; its port travels in the node table
        self.native = None
        data_port_ = 0
        if native.native_enabled(cfg) and self.address.startswith("tcp"):
            key = native.auth_key(cfg)
            self.native = _core.DataServer(
                self.num_workers, -1, self.job, native.io_threads(cfg),
                cfg.transport.max_message_bytes, native.store_budget(cfg),
                native.max_connections(), **({"auth_key": key} if key else {}))
            data_port_ = self.native.listen(host, native.data_port(cfg))
        self.control = ControlClient(cfg, self.ep, Role.SERVER, port=port, data_port=data_port_,
                                     on_fatal=lambda exc: self._done.set(),
                                     on_shutdown=lambda: self._done.set(),
                                     on_members=self.on_members)
        self._scheduler_address = scheduler_address
        self.engines = [Engine(self, i) for i in range(cfg.server.engine_threads)]
        self.key_engine: dict[int, Engine] = {}
        self.rejected = 0
        self.rejected_by_reason: dict[str, int] = {}
        self._reject_lock = threading.Lock()
        self.stall_reports = 0
        self._done = threading.Event()
        # -- metrics (byteps_like/metrics.py, docs/observability.md) --
        from byteps_like.metrics import SumMeter
        self.sum_meter = SumMeter()
        self.metrics = None
        # -- end metrics --
        self.ep.on_message = self._on_message
        self.ep.on_error = self._io_failed

    def _io_failed(self, exc: BaseException) -> None:
        """The I/O thread died (a bug): exit non-zero instead of hanging; the scheduler sees the
        heartbeats stop and tells every other node which server was lost."""
        self.control._fail(RuntimeError(f"server {self.rank} internal error: {exc!r}"))
        self._done.set()

    @property
    def rank(self) -> int:
        return self.control.rank

    def reply(self, route: Route, mtype: MsgType, h: Header, meta: dict | None = None) -> None:
        hdr = Header(mtype, role=Role.SERVER, rank=self.rank, job=self.job, key=h.key,
                     round=h.round)
        self.ep.send(route, encode(hdr, meta=meta))

    def reply_error(self, route: Route, h: Header, kind: str, text: str,
                    extra: dict | None = None) -> None:
        self.reply(route, MsgType.ERROR, h, {"kind": kind, "message": text,
                                              "type": h.type.name, **(extra or {})})

    def on_members(self, meta: dict) -> None:
        """The scheduler's membership (join()): machines joined and left. Applied by every
        engine in its queue order (so after the pushes that came before it) and by the native
        plane at once; the scheduler reads the acknowledgement only after this returns."""
        try:
            joined = frozenset(int(m) for m in meta.get("joined", ())
                               if 0 <= int(m) < self.num_workers)
            left = {int(m): str(why)[:1000] for m, why in dict(meta.get("left", {})).items()
                    if 0 <= int(m) < self.num_workers}
        except (TypeError, ValueError) as exc:
            log.warning("server %d: ignored a malformed membership notice: %s", self.rank, exc)
            return
        self.joined = joined
        if self.native is not None:
            self.native.set_members(sorted(joined), left)
        for e in self.engines:
            e.q.put((None, (joined, left)))

    def _on_message(self, route: Route, frames: list) -> None:
        try:
            msg = decode(frames, self.cfg.transport.max_message_bytes)
        except ProtocolError as exc:
            self._reject("malformed")
            log.warning("server %d: rejected a message from %s: %s", self.rank, route, exc)
            if route.ident is not None:
                try:
                    h = decode_header(frames[0])
                except ProtocolError:
                    h = Header(MsgType.ERROR)
                self.reply_error(route, h, ERR_PROTOCOL, f"server {self.rank}: {exc}")
            return
        if route.peer == "scheduler":
            self.control.handle(msg)
            return
        h = msg.header
        if h.job != self.job:
            self._reject("wrong job")
            self.reply_error(route, h, ERR_PROTOCOL, f"server {self.rank} serves job "
                             f"{self.cfg.cluster.job_id!r}; this peer belongs to another job")
            return
        if h.type not in (MsgType.PUSH, MsgType.PULL) or not 0 <= h.rank < self.num_workers:
            self._reject("unexpected type or rank")
            self.reply_error(route, h, ERR_PROTOCOL, f"server {self.rank}: unexpected "
                             f"{h.type.name} from {h.sender}")
            return
        eng = self.key_engine.get(h.key)
        if eng is None:
            eng = min(self.engines, key=lambda e: (e.bytes, e.idx))
            eng.bytes += h.nbytes
            self.key_engine[h.key] = eng
        eng.q.put((route, msg))

    def claim_zmq_key(self, route: Route, h: Header) -> bool:
        """A key the ZeroMQ path is about to serve (compressed, or pushed from device memory):
        refused with a mismatch when other workers already push it over the native plane."""
        if self.native is None or self.native.claim_zmq_key(h.key):
            return True
        self._reject("key served over the native data plane")
        self.reply_error(route, h, ERR_MISMATCH, (
            f"server {self.rank}: key {h.key} from worker rank {h.rank} came over ZeroMQ, but "
            "other workers push it over the native data plane; every worker must use the same "
            "BYTEPS_DATA_PLANE, compressor and transport settings"))
        return False

    def _reject(self, reason: str) -> None:
        with self._reject_lock:
            self.rejected += 1
            self.rejected_by_reason[reason] = self.rejected_by_reason.get(reason, 0) + 1

    # -- the stall inspector ----------------------------------------------------------------
    def stalled_rounds(self, now: float | None = None) -> list[dict]:
        """Synchronous rounds open longer than BYTEPS_STALL_CHECK_TIME_SECONDS: some workers
        have pushed, others have not. Read from the I/O thread while engines run, so every
        field is read once into a local (a round may complete meanwhile; then it is skipped)."""
        if self.async_mode:
            return []
        now = time.monotonic() if now is None else now
        limit = self.cfg.timeouts.stall_check_time
        out = []
        for eng in self.engines:
            for store in list(eng.stores.values()):
                started, rnd = store.round_started, store.round
                if started is None or now - started < limit or store.failed is not None:
                    continue
                try:
                    pushed = sorted(store.pushed)
                except RuntimeError:  # changed size while copying: the round is moving
                    continue
                if not pushed or store.round != rnd:
                    continue
                out.append(self._stall_entry(store.decl, store.key, rnd, now - started, pushed))
        if self.native is not None:
            for key, rnd, age, pushed, decl in self.native.stalls(limit):
                try:
                    meta = json.loads(decl.decode("utf-8"))
                except (UnicodeDecodeError, ValueError):
                    meta = {}
                out.append(self._stall_entry(meta if isinstance(meta, dict) else {}, key, rnd,
                                             age, pushed))
        return out

    def _stall_entry(self, decl: dict, key: int, rnd: int, age: float, pushed: list) -> dict:
        """One stalled round as the scheduler's stall report reads it."""
        return {"name": str(decl.get("name")), "key": key, "round": rnd,
                "part": decl.get("part"), "age": round(age, 3), "pushed": pushed,
                "missing": sorted(set(range(self.num_workers)) - set(pushed) - self.joined)}

    def _stall_tick(self) -> None:
        if self.control.rank < 0 or self.control.fatal is not None or self.control.shutting_down:
            return
        stalls = self.stalled_rounds()
        if stalls:
            self.stall_reports += 1
            self.control.send_stall(stalls[:200])

    def start(self) -> None:
        for e in self.engines:
            e.start()
        if self.native is not None:
            self.native.start()
        self.ep.start()
        self.control.connect_and_register(self._scheduler_address)
        if self.native is not None:
            self.native.set_rank(self.rank)
        if not self.async_mode:
            check = self.cfg.timeouts.stall_check_time
            self.ep.add_timer(max(0.05, min(check / 2, 5.0)), self._stall_tick)
        log.info("server %d: serving on %s (%d engine threads, %s mode)%s", self.rank,
                 self.address, len(self.engines), "async" if self.async_mode else "sync",
                 "" if self.native is None else
                 f"; native data plane on port {self.control.data_port} "
                 f"({self.native.stats()['io_threads']} I/O threads)")
        from byteps_like.metrics import serve_role  # metrics: BYTEPS_METRICS_PORT
        self.metrics = serve_role("server", self.rank, self.cfg, self._metrics_sample)

    def _metrics_sample(self) -> dict:
        """What the Prometheus endpoint reports (byteps_like/metrics.py)."""
        m = self.sum_meter
        rounds = sum(st.round for e in self.engines for st in list(e.stores.values()))
        out = {"byteps_server_bytes_summed": m.bytes, "byteps_server_sum_seconds": m.seconds,
               "byteps_server_pushes": m.pushes, "byteps_server_rounds": rounds}
        if self.native is not None:
            ns = self.native.stats()
            out["byteps_server_bytes_summed"] += ns["bytes_summed"]
            out["byteps_server_pushes"] += ns["pushes"]
            out["byteps_server_rounds"] += ns["rounds"]
        return out

    def rejections(self) -> dict[str, int]:
        """Rejected messages by reason, both data paths."""
        with self._reject_lock:
            out = dict(self.rejected_by_reason)
        if self.native is not None:
            for reason, n in self.native.rejected().items():
                out[reason] = out.get(reason, 0) + n
        return out

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        if self.native is not None:
            self.native.close()
        for e in self.engines:
            e.q.put(None)
        for e in self.engines:
            if e.is_alive():
                e.join(5.0)
        self.closed_cleanly = self.ep.close(linger=1.0)

    def run(self) -> int:
        try:
            self.start()
            self._done.wait()
        except Exception as exc:  # noqa: BLE001 - reported, exit non-zero
            log.error("server: %s", exc)
            return 1
        finally:
            self.close()
        if isinstance(self.control.fatal, PeerLostError):
            return EXIT_PEER_FAILED  # another node failed: bpslaunch blames that one
        if self.control.fatal is not None:
            return 1
        return 0


def run(cfg: Config) -> int:
    """Run a server in this process until the job ends; returns the exit status."""
    from ..roles import run_node
    return run_node(Server, cfg)
