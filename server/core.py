"""The summation server.

A store per key, allocated on the first push, which declares it; its memory is charged to the
server's budget (BYTEPS_SERVER_MAX_BYTES, shared with the native data plane) first. Engine threads
own disjoint keys (assigned at a key's first declaring push to the engine with the fewest bytes)
so no store is ever touched by two threads. The I/O thread only decodes headers and routes;
summation runs in ``_core`` kernels that release the GIL. Rejected messages leave no state, are
answered with an ERROR, counted by reason and logged at a bounded rate.

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
from typing import TYPE_CHECKING

import numpy as np

from .. import _core
from ..compression import Codec, CompressionError, check_declared_count, codec_bytes, from_spec
from ..config import Config
from ..control import ControlClient
from ..errors import EXIT_PEER_FAILED, PeerLostError, ProtocolError
from ..transport import Route, data_scheme, make_endpoint, native
from .codecs import make_server_codec
from .sparse import SparseService
from .stalls import fail_if_left, stalled_rounds

if TYPE_CHECKING:
    from ..metrics import RoleMetrics
from ..wire import (
    ERR_EPOCH,
    ERR_INTERNAL,
    ERR_MISMATCH,
    ERR_PEER_LEFT,
    ERR_PROTOCOL,
    FLAG_COMPRESSED,
    FLAG_DECLARE,
    FLAG_PULL,
    SPARSE_REQUESTS,
    SUMMABLE,
    Header,
    Message,
    MsgType,
    Role,
    as_buffer,
    contrib_flags,
    decode,
    decode_header,
    encode,
    epoch_round_base,
    job_hash,
)

log = logging.getLogger("byteps_like.server")

#: a store's own memory beyond its buffers (the KeyStore, its sets and dicts, its routing
#: entry), charged to the memory budget (BYTEPS_SERVER_MAX_BYTES) with them
STORE_OVERHEAD = 4096
#: rejections logged one by one for each reason; later ones are counted and summarised
REJECT_LOG_FIRST = 3
#: seconds between two summary lines of the rejections (none when there were none)
REJECT_SUMMARY_INTERVAL_S = 60.0
#: the declaration fields a store keeps (and compares between workers)
DECL_FIELDS = ("name", "shape", "dtype", "part", "nparts", "compressor", "count")


def _trim_decl(meta: dict) -> dict:
    """The declaration fields a store keeps, type-checked: a declaration is untrusted, and up
    to 1 MiB of JSON must not become megabytes of Python objects per key. Raises ValueError."""
    decl = {f: meta[f] for f in DECL_FIELDS if f in meta}

    def is_int(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)
    if not isinstance(decl.get("name", ""), str):
        raise ValueError("the name is not a string")
    shape = decl.get("shape", [])
    if not (isinstance(shape, list) and len(shape) <= 64
            and all(is_int(d) and d >= 0 for d in shape)):
        raise ValueError("the shape is not a list of at most 64 sizes")
    if not (isinstance(decl.get("dtype", ""), str) and len(decl.get("dtype", "")) <= 16):
        raise ValueError("the dtype is not a dtype name")
    if not all(is_int(decl.get(f, 0)) for f in ("part", "nparts", "count")):
        raise ValueError("part, nparts and count must be integers")
    if not isinstance(decl.get("compressor", {}), (dict, type(None))):
        raise ValueError("the compressor is not a spec (a JSON object)")
    return decl


def _decl_bytes(decl: dict) -> int:
    """What a kept declaration costs, for the memory budget (its JSON length, a fair bound on
    its strings; the rest is in STORE_OVERHEAD)."""
    return len(json.dumps(decl))


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
    codec: Codec | None = None     # compressed key: the server Codec (decode pushes, encode sum)
    acc: np.ndarray | None = None  # compressed key: the float32 sum of the open round
    charged: int = 0               # its bytes of the memory budget (BYTEPS_SERVER_MAX_BYTES)
    step: int = -1                 # compressed key: the step of the open round's pushes

    @property
    def compressed(self) -> bool:
        return self.codec is not None

    def describe_decl(self, decl: dict) -> str:
        comp = decl.get("compressor")
        how = f" compressed with {_spec_text(comp)}" if comp is not None else " uncompressed"
        text = (f"{decl.get('name')!r} shape {tuple(decl.get('shape', ()))} "
                f"{decl.get('dtype')}{how}")
        return text if len(text) <= 500 else text[:500] + "..."  # a peer's text, in our log


def _spec_text(spec) -> str:
    """A compressor spec as a short readable text: name(k=v, ..., inner=...)."""
    if not isinstance(spec, dict):
        return repr(spec)
    args = ", ".join(f"{k}={_spec_text(v) if isinstance(v, dict) else v!r}"
                     for k, v in spec.items() if k != "name")
    return f"{spec.get('name')}({args})"


class Engine(threading.Thread):
    def __init__(self, server: Server, idx: int):
        super().__init__(name=f"bpsl-engine-{idx}", daemon=True)
        self.server = server
        self.idx = idx
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.stores: dict[int, KeyStore] = {}
        self.bytes = 0
        # membership as this engine's queue orders it (join()): joined and left machines
        self.joined: frozenset = frozenset()
        self.left: dict[int, str] = {}
        self.required = server.required  # pushes that complete a round (elastic: the epoch's)
        self.round_base = 0   # elastic: the epoch's first round, where a new key starts

    def run(self) -> None:
        while True:
            item = self.q.get()
            if item is None:
                return
            route, msg = item
            if route is None:  # a membership change (Server.on_members), in queue order
                if msg[0] == "epoch":
                    self.apply_epoch(*msg[1:])
                else:
                    self.apply_members(*msg)
                continue
            try:
                self.process(route, msg)
            except Exception as exc:  # noqa: BLE001 - a bug must not kill the engine silently
                if self.server._reject("internal error") <= REJECT_LOG_FIRST:
                    log.exception("server %d: engine %d failed on key %d", self.server.rank,
                                  self.idx, msg.header.key)
                self.server.reply_error(route, msg.header, ERR_INTERNAL,
                                        f"server {self.server.rank} internal error: {exc!r}")
            finally:
                self.server._settle(self, msg.header.key)

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
            if store is None:  # a pull queued behind a declaration that was refused
                self.server.refuse(route, h, "pull of an undeclared key", ERR_PROTOCOL,
                                   f"pull of key {h.key} before any push")
                return
            self._pull(store, route, h)

    def _create(self, route: Route, msg: Message) -> KeyStore | None:
        """A store for a declared key, its memory charged to the server's budget first (the
        native plane's too: BYTEPS_SERVER_MAX_BYTES bounds both paths together)."""
        h, srv = msg.header, self.server
        if srv.elastic and h.round < self.round_base:
            srv.refuse(route, h, "push of a superseded epoch", ERR_EPOCH, f"key {h.key}: push "
                       f"from worker rank {h.rank} belongs to a membership epoch that has ended")
            return None
        if not (h.flags & FLAG_DECLARE) or not msg.meta:
            srv.refuse(route, h, "push of an undeclared key", ERR_PROTOCOL, f"first push of key "
                       f"{h.key} from {h.sender} carries no declaration")
            return None
        try:
            decl = _trim_decl(msg.meta)
        except ValueError as exc:
            srv.refuse(route, h, "malformed declaration", ERR_PROTOCOL, f"server {srv.rank}: "
                       f"declaration of key {h.key} from worker rank {h.rank}: {exc}")
            return None
        if h.flags & FLAG_COMPRESSED:
            return self._create_compressed(route, msg, decl)
        if h.dtype not in SUMMABLE:
            srv.refuse(route, h, "dtype that cannot be summed", ERR_PROTOCOL,
                       f"dtype {h.dtype} cannot be summed")
            return None
        nbuf = 1 if srv.async_mode else 2
        need = nbuf * h.nbytes + STORE_OVERHEAD + _decl_bytes(decl)
        if not srv.take_memory(route, h, need):
            return None
        if not srv.claim_zmq_key(route, h):
            srv.give_memory(need)
            return None
        bufs = [np.zeros(h.nbytes, dtype=np.uint8) for _ in range(nbuf)]
        store = KeyStore(h.key, h.dtype, h.nbytes, h.count, decl, h.rank, bufs,
                         round=self.round_base, charged=need)
        self.stores[h.key] = store
        return store

    def _create_compressed(self, route: Route, msg: Message, decl: dict) -> KeyStore | None:
        """A key whose pushes are compressed: the declaration carries the compressor's spec
        (JSON, validated field by field) and the partition's element count, at most one
        partition of the declared dtype. The store keeps a float32 accumulator and the server's
        codec; the accumulator is charged to the budget before the codec is made, the codec's
        buffers after."""
        h, srv = msg.header, self.server
        what = f"key {h.key} from worker rank {h.rank}"

        def bad(exc: Exception) -> None:
            srv.refuse(route, h, "bad compressor declaration", ERR_PROTOCOL,
                       f"server {srv.rank}: compressed push of {what}: {exc}")
        try:
            if srv.async_mode:
                raise CompressionError("compression needs synchronous mode; unset "
                                       "BYTEPS_ENABLE_ASYNC or push without a compressor")
            count = check_declared_count(decl.get("count"), decl.get("dtype"),
                                         srv.cfg.partition.partition_bytes)
            spec = decl.get("compressor")
            if not isinstance(spec, dict):
                raise CompressionError("the declaration carries no compressor spec")
            comp = from_spec(spec)
        except CompressionError as exc:
            bad(exc)
            return None
        need = 4 * count + STORE_OVERHEAD + _decl_bytes(decl)   # the accumulator
        if not srv.take_memory(route, h, need):
            return None
        try:
            codec = comp.make_codec(count, role="server", key=h.key)
        except CompressionError as exc:
            srv.give_memory(need)
            bad(exc)
            return None
        more = 2 * codec.max_bytes + codec_bytes(codec)  # the codec, the encoded sums
        if not srv.take_memory(route, h, more, need):
            srv.give_memory(need)
            return None
        if not srv.claim_zmq_key(route, h):
            srv.give_memory(need + more)
            return None
        store = KeyStore(h.key, "uint8", 0, count, decl, h.rank, [None, None],
                         round=self.round_base, charged=need + more)
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

    def apply_epoch(self, base: int, size: int, applied) -> None:
        """Elastic jobs: a new membership epoch. Every open round is dropped (waiting pulls get
        an epoch error) and every key forgotten, its memory given back: the new epoch declares
        its tensors afresh, at round ``base`` (the epoch in its high bits: a push or pull of an
        older epoch is out of round, and makes no new key); a round needs ``size`` pushes."""
        self.joined, self.left, self.required = frozenset(), {}, size
        self.round_base = base
        srv = self.server
        for store in self.stores.values():
            for route, _rank, rnd in store.pending:
                srv.reply_error(route, Header(MsgType.PULL, key=store.key, round=rnd), ERR_EPOCH,
                                f"key {store.key}: the membership epoch of round {rnd} ended "
                                "(a worker left or joined); the round was dropped")
            store.pending = []
            srv.give_memory(store.charged)
        srv.forget_keys(self, list(self.stores))
        self.stores.clear()
        applied()

    def _doom_if_left(self, store: KeyStore) -> bool:
        """A round that a machine which left the job has not pushed can never complete: fail
        the key with a peer_left error naming it."""
        return fail_if_left(self.left, store.pushed, bool(store.pending), store.round,
                            f"key {store.key} ({store.describe_decl(store.decl)})",
                            lambda text, meta: self._fail_key(store, text, ERR_PEER_LEFT, meta))

    def _complete_if_ready(self, store: KeyStore) -> None:
        """Close the open round once every machine that has not joined has pushed it."""
        if not store.pushed or len(store.pushed) < self.required - len(self.joined):
            return
        if store.codec is not None:  # the pull is compressed too: encode the merged sum
            assert store.acc is not None  # made with the codec
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
        """A push to an existing store, checked in this order (as on the native plane): its
        dtype and size (rejected alone, unless it declares another tensor: then a worker
        disagrees), its round (a push for another round is rejected alone, whatever it
        declares), its declaration (a real mismatch fails the key, naming both sides)."""
        h = msg.header
        srv = self.server
        decl = msg.meta if (h.flags & FLAG_DECLARE) else None
        mismatch = decl is not None and any(decl.get(f) != store.decl.get(f)
                                            for f in ("name", "shape", "dtype", "part",
                                                      "nparts", "compressor"))
        # a push declaring another tensor is a worker disagreeing: its size may differ too
        if not mismatch and store.codec is not None and (not h.flags & FLAG_COMPRESSED
                                                         or h.dtype != "uint8"
                                                         or h.nbytes > store.codec.max_bytes):
            srv.refuse(route, h, "wrong payload for a compressed key", ERR_PROTOCOL, (
                f"push to compressed key {h.key} ({store.decl.get('name')!r}) from worker rank "
                f"{h.rank}: {h.nbytes} bytes of {h.dtype}, expected a compressed payload of at "
                f"most {store.codec.max_bytes} bytes"))
            return False
        elif not mismatch and not store.compressed and (h.dtype != store.dtype
                                                        or h.nbytes != store.nbytes
                                                        or h.flags & FLAG_COMPRESSED):
            # Without a declaration this push is not a worker disagreeing about the tensor (that
            # shows in the round-0 declarations): reject it alone, the key keeps serving.
            comp = " compressed payload" if h.flags & FLAG_COMPRESSED else ""
            srv.refuse(route, h, "wrong dtype or size for a declared key", ERR_PROTOCOL, (
                f"push to key {h.key} ({store.decl.get('name')!r}) from worker rank {h.rank}: "
                f"{h.count} x {h.dtype}{comp}, but the key holds {store.count} x {store.dtype}"
                f"{' uncompressed' if comp else ''}"))
            return False
        if not srv.async_mode and (h.round != store.round or h.rank in store.pushed):
            # one text for both causes and no round but the peer's own: the reply tells
            # nobody which round is open
            srv.refuse(route, h, "push out of round", ERR_PROTOCOL, (
                f"key {h.key}: push from worker rank {h.rank} for round {h.round}, a round that "
                "is not open or that this rank has pushed already"))
            return False
        if mismatch and decl is not None and store.failed is None:
            self._fail_key(store, (
                f"tensor mismatch on key {h.key}: worker rank {store.decl_rank} declared "
                f"{store.describe_decl(store.decl)} but worker rank {h.rank} declared "
                f"{store.describe_decl(decl)}; every worker must declare the same tensors, "
                "in the same order, with the same shape, dtype and compressor"))
        if store.failed is not None:
            self._reply_failed(store, route, h)
            return False
        if h.rank in self.joined and not srv.async_mode:
            srv.refuse(route, h, "push after join()", ERR_PROTOCOL, (
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
        codec, acc = store.codec, store.acc
        assert codec is not None and acc is not None  # only compressed keys come here
        try:
            if not store.pushed:
                step = codec.decode(payload, acc)
            else:
                step = codec.decode_add(payload, acc)
                if step != store.step:  # decoded already: the round is now inconsistent
                    self._fail_key(store, (
                        f"compressed key {h.key} ({store.decl.get('name')!r}): worker rank "
                        f"{h.rank} pushed step {step} while the round holds step {store.step}; "
                        "every worker must push the tensor the same number of times"))
                    self._reply_failed(store, route, h)
                    return False
        except CompressionError as exc:
            self.server._reject("malformed compressed payload", f"key {h.key}: {exc}")
            if store.pushed:  # the round cannot complete without it: tell everyone waiting
                self._fail_key(store, f"compressed key {h.key}: worker rank {h.rank} sent a "
                               f"malformed payload ({exc})")
                self.server.reply_error(route, h, ERR_PROTOCOL, store.failed or str(exc))
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
        srv = self.server
        if store.failed is not None:
            self._reply_failed(store, route, h)
        elif srv.async_mode or (h.round == store.completed and h.round >= 0):
            self._answer_pull(store, route, h.round)
        elif h.round == store.round and len(store.pending) < 4 * srv.num_workers:
            store.pending.append((route, h.rank, h.round))
        elif h.round == store.round:  # each worker waits once: a flood must not grow the list
            srv.refuse(route, h, "too many pulls waiting", ERR_PROTOCOL, (
                f"key {h.key}: pull of round {h.round} from worker rank {h.rank}: too many "
                "pulls already wait for this round"))
        else:  # no round but the peer's own: the reply tells nobody which round is open
            srv.refuse(route, h, "pull out of round", ERR_PROTOCOL, (
                f"key {h.key}: pull of round {h.round} from worker rank {h.rank}, which is "
                "neither the open round nor the last completed one"))


class Server:
    def __init__(self, cfg: Config, *, context=None, address: str | None = None,
                 scheduler_address: str | None = None):
        self.cfg = cfg
        self.async_mode = cfg.server.enable_async
        self.sum_threads = cfg.server.sum_threads
        # one push per worker machine: the local ranks of a machine reduce before pushing;
        # elastic: up to the most workers at once, a round needs the epoch's (on_epoch)
        self.elastic = cfg.elastic.enabled and not cfg.server.enable_async
        self.num_workers = (cfg.elastic.capacity(cfg.cluster.num_worker) if self.elastic
                            else cfg.cluster.num_worker)
        self.required = cfg.cluster.num_worker
        self.epoch = 0
        self.joined: frozenset = frozenset()   # machines in join() (stall reports skip them)
        self.job = job_hash(cfg.cluster.job_id)
        self.ep = make_endpoint("server", cfg, context=context)
        from ..control import node_host
        host = node_host(cfg)
        self.address = self.ep.bind(
            address or f"{data_scheme(cfg)}://{host}:{cfg.cluster.server_port}")
        port = (int(self.address.rsplit(":", 1)[1])
                if self.address.startswith(("tcp", "ucx")) else 0)
        # the native data plane (csrc/dataplane.cc); its port travels in the node table
        self.native = None
        data_port_ = 0
        if native.native_enabled(cfg) and self.address.startswith(("tcp", "ucx")):
            key = native.auth_key(cfg)
            self.native = _core.DataServer(
                self.num_workers, -1, self.job, native.io_threads(cfg),
                cfg.transport.max_message_bytes, native.store_budget(cfg),
                native.max_connections(), **({"auth_key": key} if key else {}),
                async_mode=self.async_mode)
            # a compressed key: at most a partition; a registered one's codec: server/codecs.py
            self.native.set_partition_bytes(cfg.partition.partition_bytes)
            self.native.set_codec_factory(make_server_codec, CompressionError)
            listen = self.native.listen_ucx if native.uses_ucx(cfg) else self.native.listen
            data_port_ = listen(host, native.data_port(cfg))
        self.control = ControlClient(cfg, self.ep, Role.SERVER, port=port, data_port=data_port_,
                                     on_fatal=lambda exc: self._done.set(),
                                     on_shutdown=lambda: self._done.set(),
                                     on_members=self.on_members,
                                     on_epoch=self.on_epoch if self.elastic else None)
        self._scheduler_address = scheduler_address
        self.engines = [Engine(self, i) for i in range(cfg.server.engine_threads)]
        self.sparse = SparseService(self)  # server-held embedding tables (server/sparse.py)
        # key -> engine, only for keys that have a store or a declaration on its way to one
        self.key_engine: dict[int, Engine] = {}
        # keys routed to an engine whose store is not made yet: [messages queued, bytes]
        self._unsettled: dict[int, list] = {}
        self._route_lock = threading.Lock()
        # the memory budget of the stores (BYTEPS_SERVER_MAX_BYTES): the native plane's, which
        # the ZeroMQ path charges too, or the ZeroMQ path's alone without a native plane
        self.budget = native.store_budget(cfg)
        self._store_bytes = 0
        self._budget_lock = threading.Lock()
        self.rejected = 0
        self.rejected_by_reason: dict[str, int] = {}
        self._reject_lock = threading.Lock()
        self._summary_lock = threading.Lock()
        self._summarised: dict[str, int] = {}
        self._summary_at = time.monotonic()
        self.stall_reports = 0
        self._done = threading.Event()
        # -- metrics (byteps_like/metrics.py, docs/observability.md) --
        from byteps_like.metrics import SumMeter
        self.sum_meter = SumMeter()
        self.metrics: RoleMetrics | None = None
        # -- end metrics --
        self.ep.on_message = self._on_message
        self.ep.on_error = self._io_failed

    def _io_failed(self, exc: BaseException) -> None:
        """The I/O thread died (a bug): exit non-zero instead of hanging; the scheduler sees the
        heartbeats stop and tells every other node which server was lost."""
        self.control.fail(RuntimeError(f"server {self.rank} internal error: {exc!r}"))
        self._done.set()

    @property
    def rank(self) -> int:
        return self.control.rank

    def reply(self, route: Route, mtype: MsgType, h: Header, meta: dict | None = None,
              job: int | None = None) -> None:
        """Answer a peer; ``job``: the tag to answer with when the peer's is not known to be
        this job's (its own, so an outsider learns nothing)."""
        hdr = Header(mtype, role=Role.SERVER, rank=self.rank,
                     job=self.job if job is None else job, key=h.key, round=h.round)
        self.ep.send(route, encode(hdr, meta=meta))

    def reply_error(self, route: Route, h: Header, kind: str, text: str,
                    extra: dict | None = None, job: int | None = None) -> None:
        self.reply(route, MsgType.ERROR, h, {"kind": kind, "message": text,
                                              "type": h.type.name, **(extra or {})}, job)

    def refuse(self, route: Route, h: Header, reason: str, kind: str, text: str,
               extra: dict | None = None, job: int | None = None) -> None:
        """Reject a message: count it by ``reason`` (logged at a bounded rate) and answer with
        an ERROR saying why."""
        self._reject(reason, text)
        self.reply_error(route, h, kind, text, extra, job)

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
        self.sparse.members(joined, left)

    def on_epoch(self, epoch: int, meta: dict) -> None:
        """Elastic jobs: reset to membership epoch ``epoch`` of ``meta["size"]`` workers, on the
        native plane at once and in every engine's queue order (after the pushes that came
        before it); the last engine to apply it acknowledges it to the scheduler, which starts
        the workers of the epoch only then."""
        size = meta.get("size")
        if type(size) is not int or not 1 <= size <= self.num_workers or epoch <= self.epoch:
            log.warning("server %d: ignored a malformed epoch notice (epoch %d, size %r)",
                        self.rank, epoch, size)
            return
        base = epoch_round_base(epoch)
        self.epoch, self.required = epoch, size
        if self.native is not None:
            self.native.reset_epoch(base, size)
        left = [len(self.engines) + 1]   # the engines and the tables' thread
        lock = threading.Lock()

        def applied() -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                log.info("server %d: membership epoch %d, %d worker(s)", self.rank, epoch, size)
                self.control.ack_epoch(epoch)
        for e in self.engines:
            e.q.put((None, ("epoch", base, size, applied)))
        self.sparse.epoch(base, size, applied)

    def _on_message(self, route: Route, frames: list) -> None:
        try:
            msg = decode(frames, self.cfg.transport.max_message_bytes)
        except ProtocolError as exc:
            self._reject("malformed", f"from {route}: {exc}")
            if route.ident is not None:
                try:
                    h = decode_header(frames[0])
                except ProtocolError:
                    h = Header(MsgType.ERROR)
                # answered with the peer's own tag (or none): the job's is not handed out
                self.reply_error(route, h, ERR_PROTOCOL, f"server {self.rank}: {exc}",
                                 job=h.job)
            return
        if route.peer == "scheduler":
            self.control.handle(msg)
            return
        h = msg.header
        if h.job != self.job:  # neither the job's id nor its tag goes to another job's peer
            self.refuse(route, h, "wrong job", ERR_PROTOCOL, f"server {self.rank}: this peer "
                        "belongs to another job (check BYTEPS_JOB_ID)", job=h.job)
            return
        if h.type in SPARSE_REQUESTS and 0 <= h.rank < self.num_workers:
            self.sparse.submit(route, msg)
            return
        if h.type not in (MsgType.PUSH, MsgType.PULL) or not 0 <= h.rank < self.num_workers:
            self.refuse(route, h, "unexpected type or rank", ERR_PROTOCOL, f"server "
                        f"{self.rank}: unexpected {h.type.name} from {h.sender}")
            return
        self._route(route, msg)

    def _route(self, route: Route, msg: Message) -> None:
        """Hand a message to the engine that owns its key. A key gets an engine (the one with
        the fewest bytes) only with a declaring push; pulls and undeclared pushes of unknown
        keys are refused here, so they leave no state. A key whose declaration the engine
        refuses loses its engine again once no message for it is queued (Engine.run settles)."""
        h = msg.header
        with self._route_lock:
            eng = self.key_engine.get(h.key)
            if eng is None and h.type is MsgType.PUSH and h.flags & FLAG_DECLARE and msg.meta:
                eng = min(self.engines, key=lambda e: (e.bytes, e.idx))
                eng.bytes += h.nbytes
                self.key_engine[h.key] = eng
                self._unsettled[h.key] = [0, h.nbytes]
            if eng is not None and h.key in self._unsettled:
                self._unsettled[h.key][0] += 1
        if eng is not None:
            eng.q.put((route, msg))
        elif h.type is MsgType.PULL:
            self.refuse(route, h, "pull of an undeclared key", ERR_PROTOCOL,
                        f"pull of key {h.key} before any push")
        else:
            self.refuse(route, h, "push of an undeclared key", ERR_PROTOCOL, f"first push of "
                        f"key {h.key} from {h.sender} carries no declaration")

    def forget_keys(self, eng: Engine, keys: list[int]) -> None:
        """Elastic epochs: ``eng`` dropped these keys' stores; the next declaring push of one
        picks an engine again."""
        with self._route_lock:
            for key in keys:
                if self.key_engine.get(key) is eng:
                    del self.key_engine[key]
                self._unsettled.pop(key, None)
            eng.bytes = sum(st.nbytes for st in eng.stores.values() if st.key not in keys)

    def _settle(self, eng: Engine, key: int) -> None:
        """``eng`` is done with a message for ``key``: once the key has a store it stays; a key
        without one and with nothing more queued is forgotten."""
        with self._route_lock:
            u = self._unsettled.get(key)
            if u is None:
                return
            if key in eng.stores:
                del self._unsettled[key]
                return
            u[0] -= 1
            if u[0] <= 0:
                del self._unsettled[key]
                if self.key_engine.get(key) is eng:
                    del self.key_engine[key]
                eng.bytes -= u[1]

    # -- the memory budget ------------------------------------------------------------------
    def charge(self, nbytes: int) -> bool:
        """Take ``nbytes`` of the stores' budget (negative: give back); False, taking nothing,
        when they do not fit."""
        if self.native is not None:
            return self.native.reserve(nbytes)
        with self._budget_lock:
            if nbytes > 0 and self._store_bytes + nbytes > self.budget:
                return False
            self._store_bytes = max(0, self._store_bytes + nbytes)
            return True

    def store_bytes(self) -> int:
        """Bytes the stores of both paths hold (as charged)."""
        if self.native is not None:
            return self.native.stats()["store_bytes"]
        with self._budget_lock:
            return self._store_bytes

    def take_memory(self, route: Route, h: Header, nbytes: int, held: int = 0) -> bool:
        """Charge a new store's ``nbytes`` (``held``: what it took already), or refuse the push
        that declares it with an error naming BYTEPS_SERVER_MAX_BYTES."""
        if self.charge(nbytes):
            return True
        self.refuse(route, h, "server memory budget exhausted", ERR_PROTOCOL, (
            f"server {self.rank}: key {h.key} needs {nbytes + held} bytes, over the budget of "
            f"{self.budget} (BYTEPS_SERVER_MAX_BYTES); {self.store_bytes()} bytes are held"))
        return False

    def give_memory(self, nbytes: int) -> None:
        self.charge(-nbytes)

    def claim_zmq_key(self, route: Route, h: Header) -> bool:
        """A key the ZeroMQ path is about to serve (compressed, or pushed from device memory):
        refused with a mismatch when other workers already push it over the native plane."""
        if self.native is None or self.native.claim_zmq_key(h.key):
            return True
        self.refuse(route, h, "key served over the native data plane", ERR_MISMATCH, (
            f"server {self.rank}: key {h.key} from worker rank {h.rank} came over ZeroMQ, but "
            "other workers push it over the native data plane; every worker must use the same "
            "BYTEPS_DATA_PLANE, compressor and transport settings"))
        return False

    # -- rejections: counted by reason, logged at a bounded rate ------------------------------
    def _reject(self, reason: str, detail: str | None = None) -> int:
        """Count a rejected message; returns how many of ``reason`` so far. The first
        REJECT_LOG_FIRST of each reason are logged with ``detail``; the rest only in the summary
        line log_rejections writes at most every REJECT_SUMMARY_INTERVAL_S."""
        with self._reject_lock:
            self.rejected += 1
            n = self.rejected_by_reason[reason] = self.rejected_by_reason.get(reason, 0) + 1
        if detail is not None and n <= REJECT_LOG_FIRST:
            log.warning("server %d: rejected a message (%s): %s%s", self.rank, reason,
                        detail[:2000], "" if n < REJECT_LOG_FIRST else
                        f" [more of '{reason}' are counted, and summed up every "
                        f"{REJECT_SUMMARY_INTERVAL_S:.0f} s]")
        return n

    def log_rejections(self) -> None:
        """One line with the messages rejected since the last such line, by reason, both data
        paths (nothing when there were none). The I/O thread calls it every
        REJECT_SUMMARY_INTERVAL_S, so a flood of garbage costs the log one line per interval."""
        with self._summary_lock:
            now, totals = time.monotonic(), self.rejections()
            new = {r: n - self._summarised.get(r, 0) for r, n in totals.items()
                   if n > self._summarised.get(r, 0)}
            span, self._summarised, self._summary_at = now - self._summary_at, totals, now
        if new:
            log.warning("server %d: %d messages rejected in the %.0f s since the last summary: "
                        "%s", self.rank, sum(new.values()), span,
                        ", ".join(f"{r}: {n}" for r, n in sorted(new.items())))

    # -- the stall inspector ----------------------------------------------------------------
    def stalled_rounds(self, now: float | None = None) -> list[dict]:
        """Synchronous rounds open longer than BYTEPS_STALL_CHECK_TIME_SECONDS: some workers
        have pushed, others have not (stalls.py)."""
        if self.async_mode:
            return []
        now = time.monotonic() if now is None else now
        limit = self.cfg.timeouts.stall_check_time
        return stalled_rounds(self.engines, self.native, now, limit, self.required,
                              self.joined, list(self.sparse.tables.values()))

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
        self.sparse.start()
        if self.native is not None:
            self.native.start()
        self.ep.start()
        self.control.connect_and_register(self._scheduler_address)
        if self.native is not None:
            self.native.set_rank(self.rank)
        if not self.async_mode:
            check = self.cfg.timeouts.stall_check_time
            self.ep.add_timer(max(0.05, min(check / 2, 5.0)), self._stall_tick)
        self.ep.add_timer(REJECT_SUMMARY_INTERVAL_S, self.log_rejections)
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
               "byteps_server_pushes": m.pushes, "byteps_server_rounds": rounds,
               "byteps_server_table_rounds": self.sparse.rounds_applied,
               "byteps_server_table_rows_updated": self.sparse.rows_updated,
               "byteps_server_table_bytes": self.sparse.held_bytes()}
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
        self.sparse.close()
        self.closed_cleanly = self.ep.close(linger=1.0)
        self.log_rejections()  # the last window's rejections, which no timer will write

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
