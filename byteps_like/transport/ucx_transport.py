"""UCX implementation of :class:`~byteps_like.transport.base.Endpoint`, on ``ucxx``.

Addresses are ``ucx://host:port``. One I/O thread owns the UCX worker and everything made from
it; it sleeps in ``epoll`` on the worker's event fd (UCX *blocking progress mode*) and on an
``eventfd`` that other threads write to when they hand it a message, a call or a stop. Nothing
spins while idle.

The wire, per connection (one UCX endpoint):

* a handshake over the UCX stream API: each side sends ``<magic, version, conn id>`` and learns the
  id the other side receives under. Tag matching in UCX is per worker, so every tag names the
  *receiving* connection: ``tag = conn_id << 32 | kind``.
* each multipart message is one HEAD tag message (frame count, a kind and a length per frame,
  then the bytes of the small frames inline) followed by one DATA tag message per large frame,
  sent zero-copy from the caller's buffer (a reference is kept until UCX completes the send).

Receiving never trusts a length: the HEAD and every DATA message are *probed* first
(``ucp_tag_probe``), which tells their size before any memory is taken; the HEAD is bounded by
``HEAD_MAX`` and every frame by ``max_message_bytes`` and by what its HEAD declared. Large frames
land, zero-copy (UCX rendezvous), in staging buffers taken from a pool that reuses them round
after round; a buffer goes back to the pool only once nothing refers to it any more (a server
may hold a push payload until an engine thread has summed it). Malformed input closes that
connection with a logged error; the I/O thread carries on.
"""
from __future__ import annotations

import collections
import itertools
import logging
import os
import select
import struct
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..errors import CommunicationError, ConfigError
from .base import Endpoint, Route, Timers

log = logging.getLogger("byteps_like.transport")

SCHEME = "ucx://"
INSTALL_HINT = "pip install 'byteps_like[ucx]' (the ucxx-cu12 wheel; it bundles UCX)"

_HELLO = struct.Struct("<4sHHII")          # magic, version, flags, conn id, reserved
_MAGIC = b"BPSU"
_VERSION = 1
_HEAD = struct.Struct("<4sBBH")            # magic, version, flags, frame count
_HEAD_MAGIC = b"BPSH"
MAX_FRAMES = 64
INLINE_MAX = 8 * 1024                      # frames up to this size are copied into the HEAD
HEAD_MAX = _HEAD.size + MAX_FRAMES * 9 + 4 * INLINE_MAX  # largest HEAD a receiver accepts
_INLINE_TOTAL = 4 * INLINE_MAX             # inline bytes per message, beyond it frames go apart
K_INLINE, K_HOST, K_DEVICE = 0, 1, 2
KIND_HEAD, KIND_DATA = 1, 2
_KIND_MASK = 0xFFFFFFFF
_CONN_MASK = 0xFFFFFFFF00000000
_HANDSHAKE_TIMEOUT = 10.0
_CONNECT_RETRIES = 20
_CONNECT_BACKOFF = 0.25
_DEAD_TTL = 30.0                           # seconds a closed conn id is purged of leftovers


def _ucx_settings(env: dict[str, str] | None) -> str:
    env = env or {}
    tls = env.get("UCX_TLS", "") or "(unset: UCX picks, default 'all')"
    dev = env.get("UCX_NET_DEVICES", "") or "(unset: all devices)"
    return f"UCX_TLS={tls} UCX_NET_DEVICES={dev}"


def import_ucxx():
    """The low-level ucxx API, or a ConfigError that says how to install it."""
    try:
        from ucxx._lib import libucxx
        from ucxx._lib.arr import Array
    except ImportError as exc:
        raise ConfigError(f"BYTEPS_TRANSPORT=ucx (or DMLC_ENABLE_RDMA=1) needs the ucxx package, "
                          f"which cannot be imported here ({exc}); install it with "
                          f"{INSTALL_HINT}, or use BYTEPS_TRANSPORT=zmq") from None
    return libucxx, Array


# --------------------------------------------------------------------------- staging buffers
def _split_completed(items: list) -> tuple[list, list]:
    """(items whose request, item[0], has completed; the others), each in order."""
    done: list = []
    still: list = []
    for item in items:
        (done if item[0].completed else still).append(item)
    return done, still


class StagingPool:
    """Receive buffers in power-of-two size classes, reused across rounds.

    A buffer handed out is a numpy ``uint8`` array; every frame delivered from it (a memoryview)
    and everything derived from that frame (numpy views, further memoryviews) keeps a reference
    to it, so a lent buffer whose reference count is back to the pool's own is provably unused and
    is reclaimed. UCX's registration cache keeps the memory of reused buffers registered, so a
    buffer is registered with the NIC once, on first use, not once per round."""

    MIN_SIZE = 64 * 1024

    def __init__(self, max_free_bytes: int = 1 << 30):
        self.max_free_bytes = max_free_bytes
        self._free: dict[int, list[np.ndarray]] = collections.defaultdict(list)
        self._lent: list[np.ndarray] = []
        self.free_bytes = 0
        self.allocated = 0        # buffers ever allocated
        self.reused = 0           # times a buffer was handed out again
        self.lock = threading.Lock()

    @classmethod
    def size_class(cls, n: int) -> int:
        return max(cls.MIN_SIZE, 1 << max(0, n - 1).bit_length())

    def _reclaim(self) -> None:
        keep = []
        for buf in self._lent:
            # references: the list, the loop variable and getrefcount's argument
            if sys.getrefcount(buf) <= 3:
                if self.free_bytes + buf.nbytes <= self.max_free_bytes:
                    self._free[buf.nbytes].append(buf)
                    self.free_bytes += buf.nbytes
            else:
                keep.append(buf)
        self._lent = keep

    def take(self, n: int) -> np.ndarray:
        size = self.size_class(n)
        with self.lock:
            if not self._free.get(size):
                self._reclaim()
            free = self._free.get(size)
            if free:
                buf = free.pop()
                self.free_bytes -= size
                self.reused += 1
            else:
                buf = np.empty(size, dtype=np.uint8)
                self.allocated += 1
            self._lent.append(buf)
            return buf

    def stats(self) -> dict[str, int]:
        with self.lock:
            self._reclaim()
            return {"allocated": self.allocated, "reused": self.reused,
                    "lent": len(self._lent), "free": sum(map(len, self._free.values())),
                    "free_bytes": self.free_bytes}

    def clear(self) -> None:
        with self.lock:
            self._free.clear()
            self._lent.clear()
            self.free_bytes = 0


# --------------------------------------------------------------------------- connections
class _InMsg:
    __slots__ = ("frames", "missing", "head", "head_ready", "parsed")

    def __init__(self) -> None:
        self.frames: list = []
        self.missing = 0
        self.head: bytearray | None = None
        self.head_ready = False
        self.parsed = False


class _Conn:
    __slots__ = ("cid", "peer_cid", "ep", "route", "ident", "ready", "pending", "inq", "expect",
                 "closed", "address", "hello_buf", "deadline", "attempt", "label")

    def __init__(self, cid: int, route: Route, label: str, address: tuple | None = None):
        self.cid = cid
        self.peer_cid: int | None = None
        self.ep: Any = None  # the ucxx Endpoint once created
        self.route = route
        self.ident = route.ident
        self.ready = False
        self.pending: list = []            # (head, bigs) waiting for the handshake
        self.inq: collections.deque[_InMsg] = collections.deque()
        self.expect: collections.deque = collections.deque()  # (msg, index, nbytes, kind)
        self.closed = False
        self.address = address             # (host, port) on the connecting side
        self.hello_buf = bytearray(_HELLO.size)
        self.deadline = time.monotonic() + _HANDSHAKE_TIMEOUT
        self.attempt = 0
        self.label = label


class UcxEndpoint(Endpoint):
    """An :class:`Endpoint` over UCX (``ucx://host:port`` addresses)."""

    def __init__(self, name: str, *, max_message_bytes: int = 1 << 30,
                 ucx_env: dict[str, str] | None = None, device_memory: bool = False):
        self.name = name
        self.max_message_bytes = int(max_message_bytes)
        self._ucx_env = dict(ucx_env or {})
        self.L, self.Array = import_ucxx()
        L = self.L
        try:
            self._ctx = L.UCXContext(feature_flags=(L.Feature.TAG, L.Feature.WAKEUP,
                                                    L.Feature.STREAM))
            self._worker = L.UCXWorker(self._ctx)
            self._worker.init_blocking_progress_mode()
        except Exception as exc:  # noqa: BLE001 - ucxx raises its own UCXXError tree
            raise ConfigError(
                f"{name}: UCX found no usable transport ({type(exc).__name__}: {exc}) with "
                f"{_ucx_settings(self._ucx_env)}. Check that UCX_TLS names transports this "
                "machine has (`ucx_info -d` lists them; `tcp` works everywhere), that "
                "UCX_NET_DEVICES names an existing interface or HCA (e.g. `lo`, `eth0`, "
                "`mlx5_0:1`), and inside containers that the RDMA devices (/dev/infiniband) are "
                "mounted; or use BYTEPS_TRANSPORT=zmq. See docs/transports.md.") from None
        self.cuda_support = bool(self._ctx.cuda_support)
        if device_memory and not self.cuda_support:
            log.warning("%s: BYTEPS_UCX_DEVICE_MEMORY is on but this UCX has no CUDA support; "
                        "device tensors will be staged through host memory", name)
        self.device_memory = device_memory and self.cuda_support
        self.pool = StagingPool()
        self._listener: Any = None  # ucxx objects (untyped library)
        self._bound: str | None = None
        self._conns: dict[int, _Conn] = {}             # by local conn id
        self._by_route: dict[tuple[str | None, int], _Conn] = {}
        self._by_ident: dict[bytes, _Conn] = {}
        self._cids = itertools.count(1)
        self._dead: dict[int, float] = {}              # closed cid -> purge until
        self._sending: list = []                        # (request, keepalive, conn)
        self._recving: list = []                        # (request, keepalive, conn, msg, idx)
        self._handshakes: list = []                     # (request, conn, what)
        self._awaiting: set[_Conn] = set()              # conns with DATA frames to probe for
        self._retry: list = []                          # (when, conn) reconnects due
        self._inbox: collections.deque = collections.deque()
        self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._poll = select.epoll()
        self._poll.register(self._efd, select.EPOLLIN)
        self._poll.register(self._worker.epoll_file_descriptor, select.EPOLLIN)
        self._timers = Timers()
        self._thread: threading.Thread | None = None
        self._stop = False
        self._closed = False
        self._linger = 1.0
        self._lock = threading.Lock()
        self.on_message = None
        self.on_error = None
        self.stats: collections.Counter[str] = collections.Counter()

    # -- setup ---------------------------------------------------------------------------
    @staticmethod
    def parse(address: str) -> tuple[str, int]:
        if not address.startswith(SCHEME):
            raise ValueError(f"not a UCX address: {address!r} (expected ucx://host:port)")
        host, sep, port = address[len(SCHEME):].rpartition(":")
        if not sep or not port.isdigit() or not host:
            raise ValueError(f"bad UCX address {address!r} (expected ucx://host:port)")
        return host.strip("[]"), int(port)

    def bind(self, address: str) -> str:
        host, port = self.parse(address)
        result: list = []

        def do() -> None:
            try:
                if self._listener is not None:
                    raise RuntimeError(f"{self.name}: already bound")
                self._listener = self.L.UCXListener.create(self._worker, port,
                                                           self._on_conn_request)
                self._bound = f"{SCHEME}{host}:{self._listener.port}"
                result.append(self._bound)
            except Exception as exc:  # noqa: BLE001
                result.append(exc)
        self._run_sync(do)
        if isinstance(result[0], RuntimeError):
            raise result[0]
        if isinstance(result[0], BaseException):
            raise CommunicationError(
                f"{self.name}: cannot listen on {address} over UCX ({result[0]}) with "
                f"{_ucx_settings(self._ucx_env)}; the port may be taken, or UCX_TLS lacks a "
                "transport that can accept connections (it needs `tcp` or an RDMA transport "
                "with rdmacm)") from None
        return result[0]

    def connect(self, peer: str, address: str, connections: int = 1,
                routing_id: bytes | None = None) -> None:
        # UCX carries the data plane only (worker -> server); routing ids are for the local
        # root's ZeroMQ socket, which UcxZmqEndpoint hands to ZeroMQ
        host, port = self.parse(address)

        def do() -> None:
            for i in range(connections):
                route = Route(peer=peer, conn=i)
                conn = _Conn(next(self._cids), route, f"{peer} ({address}) connection {i}",
                             (host, port))
                self._conns[conn.cid] = conn
                self._by_route[(peer, i)] = conn
                self._open(conn)
        self._on_io_thread(do)

    def connections(self, peer: str) -> int:
        return sum(1 for (p, _i) in self._by_route if p == peer)

    def add_timer(self, interval: float, fn: Callable[[], None]) -> None:
        entry = self._timers.entry(interval, fn)
        self._on_io_thread(lambda: self._timers.push(entry))

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"bpsl-ucx-{self.name}",
                                        daemon=True)
        self._thread.start()

    # -- cross-thread plumbing -----------------------------------------------------------
    def _wake(self) -> None:
        try:
            os.eventfd_write(self._efd, 1)
        except (OSError, ValueError):   # closed: the endpoint is gone
            pass

    def _on_io_thread(self, fn: Callable[[], None]) -> None:
        if self._thread is None or threading.current_thread() is self._thread:
            fn()
        else:
            self.call_soon(fn)

    def _run_sync(self, fn: Callable[[], None]) -> None:
        if self._thread is None or threading.current_thread() is self._thread:
            fn()
            return
        done = threading.Event()

        def wrapped() -> None:
            try:
                fn()
            finally:
                done.set()
        self.call_soon(wrapped)
        if not done.wait(30.0):
            raise CommunicationError(f"{self.name}: the UCX I/O thread did not answer in 30 s")

    def call_soon(self, fn: Callable[[], None]) -> None:
        self._inbox.append(("F", fn))
        self._wake()

    # -- sending ---------------------------------------------------------------------------
    def _pack(self, frames: Sequence[Any]) -> tuple[bytes, list]:
        n = len(frames)
        if not 0 < n <= MAX_FRAMES:
            raise ValueError(f"{self.name}: a message has 1 to {MAX_FRAMES} frames, not {n}")
        kinds = bytearray(n)
        lengths = []
        inline: list = []
        bigs: list = []
        inline_total = 0
        for i, f in enumerate(frames):
            if hasattr(f, "__cuda_array_interface__"):
                if not self.cuda_support:
                    raise ConfigError(f"{self.name}: a CUDA buffer was given to send, but this "
                                      "UCX has no CUDA support (ucxx-cu12 with a CUDA driver "
                                      "and UCX_TLS including cuda_copy is needed); copy it to "
                                      "host memory first")
                arr = self.Array(f)
                if not arr.c_contiguous:
                    raise ValueError(f"{self.name}: frame {i} is not a contiguous buffer")
                kinds[i] = K_DEVICE
                lengths.append(arr.nbytes)
                bigs.append(arr)
                continue
            mv = f if isinstance(f, memoryview) else memoryview(f)
            nb = mv.nbytes
            if nb <= INLINE_MAX and inline_total + nb <= _INLINE_TOTAL:
                kinds[i] = K_INLINE
                inline.append(mv)
                inline_total += nb
            else:
                if not mv.c_contiguous:
                    raise ValueError(f"{self.name}: frame {i} is not a contiguous buffer")
                kinds[i] = K_HOST
                bigs.append(self.Array(mv))
            lengths.append(nb)
        head = b"".join([_HEAD.pack(_HEAD_MAGIC, _VERSION, 0, n), bytes(kinds),
                         struct.pack(f"<{n}Q", *lengths), *inline])
        return head, bigs

    def send(self, route: Route, frames: Sequence[Any]) -> None:
        if self._closed:
            log.debug("%s: send after close dropped", self.name)
            return
        head, bigs = self._pack(frames)
        if self._thread is None or threading.current_thread() is self._thread:
            self._send_now(route, head, bigs)
            return
        self._inbox.append(("S", route, head, bigs))
        self._wake()

    def _send_now(self, route: Route, head: bytes, bigs: list) -> None:
        if self._stop:
            return
        if route.ident is not None:
            conn = self._by_ident.get(route.ident)
            if conn is None or conn.closed:
                log.debug("%s: reply to vanished UCX client %r dropped", self.name, route.ident)
                return
        else:
            conn = self._by_route.get((route.peer, route.conn))
            if conn is None:
                log.error("%s: no connection %d to peer %r; message dropped", self.name,
                          route.conn, route.peer)
                return
            if conn.closed:
                log.warning("%s: connection to %s is closed; message dropped", self.name,
                            conn.label)
                return
        if not conn.ready:
            conn.pending.append((head, bigs))
            return
        self._post_send(conn, head, bigs)

    def _post_send(self, conn: _Conn, head: bytes, bigs: list) -> None:
        L = self.L
        assert conn.peer_cid is not None, "sent on a connection before its handshake"
        base = conn.peer_cid << 32
        harr = self.Array(head)
        self._sending.append((conn.ep.tag_send(harr, L.UCXXTag(base | KIND_HEAD)), harr, conn))
        for arr in bigs:
            self._sending.append((conn.ep.tag_send(arr, L.UCXXTag(base | KIND_DATA)), arr, conn))
        self.stats["sent"] += 1

    # -- connections -----------------------------------------------------------------------
    def _open(self, conn: _Conn) -> None:
        """Create (or re-create) the UCX endpoint of a connecting-side conn and say hello."""
        assert conn.address is not None, "only connecting-side conns are (re)opened"
        host, port = conn.address
        conn.attempt += 1
        conn.deadline = time.monotonic() + _HANDSHAKE_TIMEOUT
        try:
            conn.ep = self.L.UCXEndpoint.create(self._worker, host, port, True)
        except Exception as exc:  # noqa: BLE001
            self._connect_failed(conn, exc)
            return
        conn.ep.set_close_callback(self._on_ep_closed, cb_args=(conn.cid, conn.attempt))
        hello = _HELLO.pack(_MAGIC, _VERSION, 0, conn.cid, 0)
        harr = self.Array(hello)
        self._handshakes.append((conn.ep.stream_send(harr), conn, "hello-out", harr,
                                 conn.attempt))
        rarr = self.Array(conn.hello_buf)
        self._handshakes.append((conn.ep.stream_recv(rarr), conn, "hello-in", rarr,
                                 conn.attempt))

    def _connect_failed(self, conn: _Conn, exc: BaseException | str) -> None:
        if conn.closed or self._stop:
            return
        if conn.address is not None and conn.attempt < _CONNECT_RETRIES and not conn.ready:
            log.debug("%s: connecting to %s failed (%s); retrying", self.name, conn.label, exc)
            self._drop_ep(conn)
            self._retry.append((time.monotonic() + _CONNECT_BACKOFF, conn))
            return
        msg = (f"{self.name}: cannot connect to {conn.label} over UCX after {conn.attempt} "
               f"attempts ({exc}) with {_ucx_settings(self._ucx_env)}; check that the peer is "
               "up, that a firewall lets the port through, and that UCX_NET_DEVICES names an "
               "interface that reaches it")
        log.error("%s", msg)
        self._close_conn(conn, None)
        if self.on_error is not None:
            self.on_error(CommunicationError(msg))

    def _drop_ep(self, conn: _Conn) -> None:
        ep, conn.ep = conn.ep, None
        if ep is not None:
            try:
                ep.remove_close_callback()
                if ep.alive:   # closing an endpoint UCX already failed crashes ucxx
                    ep.close()
            except Exception:  # noqa: BLE001 - already gone
                pass

    def _on_conn_request(self, conn_request) -> None:
        cid = next(self._cids)
        ident = b"U" + struct.pack("<I", cid)
        conn = _Conn(cid, Route(ident=ident), f"UCX client {cid}")
        try:
            conn.ep = self._listener.create_endpoint_from_conn_request(conn_request, True)
        except Exception as exc:  # noqa: BLE001
            log.warning("%s: could not accept a UCX connection: %s", self.name, exc)
            return
        self._conns[cid] = conn
        self._by_ident[ident] = conn
        conn.ep.set_close_callback(self._on_ep_closed, cb_args=(cid, 0))
        rarr = self.Array(conn.hello_buf)
        self._handshakes.append((conn.ep.stream_recv(rarr), conn, "hello-in", rarr, 0))

    def _on_ep_closed(self, cid: int, attempt: int, *args) -> None:
        # runs inside UCX progress: closing the endpoint here would deadlock, so defer
        self._inbox.append(("F", lambda: self._ep_closed(cid, attempt)))

    def _ep_closed(self, cid: int, attempt: int) -> None:
        conn = self._conns.get(cid)
        if conn is None or conn.closed or attempt != conn.attempt or conn.ep is None:
            return
        if not conn.ready and conn.address is not None:
            self._connect_failed(conn, "endpoint closed during connection setup")
            return
        level = logging.INFO if self._stop or conn.ident is not None else logging.WARNING
        log.log(level, "%s: UCX connection to %s closed by the peer", self.name, conn.label)
        self._close_conn(conn, None)

    def _close_conn(self, conn: _Conn, error: str | None) -> None:
        if conn.closed:
            return
        if error:
            self.stats["rejected"] += 1
            log.error("%s: closing UCX connection %s: %s", self.name, conn.label, error)
        conn.closed = True
        conn.ready = False
        conn.pending.clear()
        conn.inq.clear()
        conn.expect.clear()
        self._awaiting.discard(conn)
        self._drop_ep(conn)
        self._conns.pop(conn.cid, None)
        if conn.ident is not None:
            self._by_ident.pop(conn.ident, None)
        self._dead[conn.cid] = time.monotonic() + _DEAD_TTL

    def _handshake_done(self, req, conn: _Conn, what: str) -> None:
        if conn.closed:
            return
        try:
            req.check_error()
        except Exception as exc:  # noqa: BLE001
            if conn.address is not None:
                self._connect_failed(conn, exc)
            else:
                log.debug("%s: handshake with %s failed: %s", self.name, conn.label, exc)
                self._close_conn(conn, None)
            return
        if what != "hello-in":
            return
        try:
            magic, version, _flags, peer_cid, _r = _HELLO.unpack(conn.hello_buf)
        except struct.error:
            magic, version, peer_cid = b"", 0, 0
        if magic != _MAGIC or version != _VERSION or not 0 < peer_cid < 1 << 32:
            self._close_conn(conn, f"bad handshake (magic {magic!r}, version {version}): not a "
                             f"byteps_like UCX peer of this release")
            return
        conn.peer_cid = peer_cid
        if conn.address is None:   # accepting side: answer with our id
            reply = _HELLO.pack(_MAGIC, _VERSION, 0, conn.cid, 0)
            arr = self.Array(reply)
            self._handshakes.append((conn.ep.stream_send(arr), conn, "hello-out", arr,
                                     conn.attempt))
        conn.ready = True
        pending, conn.pending = conn.pending, []
        for head, bigs in pending:
            self._post_send(conn, head, bigs)

    # -- receiving -------------------------------------------------------------------------
    def _discard(self, probe) -> None:
        """Consume a probed message without taking its memory (UCX truncates it)."""
        sink = bytearray(1)
        req = self._worker.tag_recv_with_handle(self.Array(sink), probe)
        self._recving.append((req, sink, None, None, -1))

    def _probe(self) -> bool:
        L, w = self.L, self._worker
        busy = False
        head_tag, mask = L.UCXXTag(KIND_HEAD), L.UCXXTagMask(_KIND_MASK)
        while True:
            p = w.tag_probe(head_tag, mask, remove=True)
            if not p.matched:
                break
            busy = True
            cid = p.sender_tag.value >> 32
            conn = self._conns.get(cid)
            if conn is None or conn.closed or not conn.ready:
                self._discard(p)
                if cid not in self._dead:
                    self.stats["rejected"] += 1
                    log.warning("%s: UCX message for unknown connection %d dropped", self.name,
                                cid)
                continue
            n = p.length
            if not _HEAD.size < n <= HEAD_MAX:
                self._discard(p)
                self._close_conn(conn, f"message header of {n} bytes (at most {HEAD_MAX})")
                continue
            msg = _InMsg()
            msg.head = bytearray(n)
            conn.inq.append(msg)
            req = w.tag_recv_with_handle(self.Array(msg.head), p)
            self._recving.append((req, msg.head, conn, msg, -1))
        for conn in list(self._awaiting):
            tag = L.UCXXTag((conn.cid << 32) | KIND_DATA)
            while conn.expect and not conn.closed:
                p = w.tag_probe(tag, remove=True)
                if not p.matched:
                    break
                busy = True
                msg, idx, nbytes, kind = conn.expect.popleft()
                if p.length != nbytes:
                    self._discard(p)
                    self._close_conn(conn, f"frame {idx} is {p.length} bytes, its header "
                                     f"declared {nbytes}")
                    break
                base = self.pool.take(nbytes)
                view = memoryview(base)[:nbytes]
                req = w.tag_recv_with_handle(self.Array(view), p)
                self._recving.append((req, view, conn, msg, idx))
            if not conn.expect:
                self._awaiting.discard(conn)
        if self._dead:
            now = time.monotonic()
            for cid, until in list(self._dead.items()):
                if until < now:
                    del self._dead[cid]
                    continue
                while True:   # leftovers of a closed connection
                    p = w.tag_probe(L.UCXXTag(cid << 32), L.UCXXTagMask(_CONN_MASK), remove=True)
                    if not p.matched:
                        break
                    self._discard(p)
        return busy

    def _parse_heads(self, conn: _Conn) -> None:
        """Parse the HEADs of ``conn`` in arrival order (so DATA frames match in order)."""
        for msg in conn.inq:
            if msg.parsed:
                continue
            if not msg.head_ready:
                return
            err = self._parse(conn, msg)
            if err:
                self._close_conn(conn, err)
                return

    def _parse(self, conn: _Conn, msg: _InMsg) -> str | None:
        raw = msg.head
        assert raw is not None, "parsed before the head arrived"
        magic, version, _flags, n = _HEAD.unpack_from(raw)
        if magic != _HEAD_MAGIC or version != _VERSION:
            return f"bad message header (magic {bytes(magic)!r}, version {version})"
        if not 0 < n <= MAX_FRAMES:
            return f"message of {n} frames (1 to {MAX_FRAMES})"
        off = _HEAD.size
        if len(raw) < off + 9 * n:
            return "truncated message header"
        kinds = raw[off:off + n]
        lengths = struct.unpack_from(f"<{n}Q", raw, off + n)
        off += 9 * n
        total = 0
        frames: list = [None] * n
        expect = []
        for i, (k, nb) in enumerate(zip(kinds, lengths)):
            total += nb
            if nb > self.max_message_bytes or total > self.max_message_bytes:
                return (f"message of at least {total} bytes exceeds the limit of "
                        f"{self.max_message_bytes} (BYTEPS_MAX_MESSAGE_BYTES)")
            if k == K_INLINE:
                if nb > INLINE_MAX or off + nb > len(raw):
                    return f"inline frame {i} of {nb} bytes overruns the header"
                frames[i] = bytes(raw[off:off + nb])
                off += nb
            elif k in (K_HOST, K_DEVICE):
                expect.append((msg, i, nb, k))
            else:
                return f"unknown frame kind {k}"
        if off != len(raw):
            return f"{len(raw) - off} stray bytes after the inline frames"
        msg.frames = frames
        msg.missing = len(expect)
        msg.head = None
        msg.parsed = True
        if expect:
            conn.expect.extend(expect)
            self._awaiting.add(conn)
        return None

    def _poll_requests(self) -> bool:
        busy = False
        if self._sending:
            done, self._sending = _split_completed(self._sending)
            for item in done:
                busy = True
                try:
                    item[0].check_error()
                except Exception as exc:  # noqa: BLE001
                    conn = item[2]
                    if not conn.closed and not self._stop:
                        log.warning("%s: send to %s failed: %s", self.name, conn.label, exc)
        if self._handshakes:
            hs, self._handshakes = self._handshakes, []
            now = time.monotonic()
            for item in hs:
                req, conn = item[0], item[1]
                if item[4] != conn.attempt or conn.ep is None:
                    continue   # a failed attempt's leftovers
                if req.completed:
                    busy = True
                    self._handshake_done(req, conn, item[2])
                elif conn.closed:
                    continue
                elif now > conn.deadline and not conn.ready:
                    if conn.address is not None:
                        self._connect_failed(conn, "no handshake answer in "
                                             f"{_HANDSHAKE_TIMEOUT:.0f} s")
                    else:
                        self._close_conn(conn, "no handshake in time")
                else:
                    self._handshakes.append(item)
        if self._recving:
            touched = set()
            done, self._recving = _split_completed(self._recving)
            for item in done:
                busy = True
                req, _keep, conn, msg, idx = item
                try:
                    req.check_error()
                except Exception as exc:  # noqa: BLE001
                    if conn is not None and not conn.closed:
                        self._close_conn(conn, f"receive failed ({exc})")
                    continue
                if conn is None or conn.closed:
                    continue
                if idx < 0:
                    msg.head_ready = True   # parsed below, in arrival order
                else:
                    msg.frames[idx] = item[1]
                    msg.missing -= 1
                touched.add(conn)
            for conn in touched:
                if not conn.closed:
                    self._parse_heads(conn)
                if not conn.closed:
                    self._deliver_ready(conn)
        return busy

    def _deliver_ready(self, conn: _Conn) -> None:
        q = conn.inq
        while q and q[0].parsed and q[0].missing == 0 and not conn.closed:
            msg = q.popleft()
            self.stats["received"] += 1
            if self.on_message is not None:
                self.on_message(conn.route, msg.frames)

    # -- the I/O loop ------------------------------------------------------------------------
    def _drain_inbox(self) -> bool:
        busy = False
        inbox = self._inbox
        while inbox:
            item = inbox.popleft()
            busy = True
            if item[0] == "S":
                self._send_now(item[1], item[2], item[3])
            elif item[0] == "F":
                item[1]()
            elif item[0] == "X":
                self._stop = True
                return busy
        return busy

    def _run_timers(self) -> float | None:
        self._timers.run_due()
        now = time.monotonic()
        if self._retry:
            due = [r for r in self._retry if r[0] <= now]
            if due:
                self._retry = [r for r in self._retry if r[0] > now]
                for _t, conn in due:
                    if not conn.closed:
                        self._open(conn)
        nxt = [t for t in (self._timers.next_due(),) if t is not None]
        nxt += [r[0] for r in self._retry]
        if self._handshakes:
            nxt.append(now + 0.5)  # handshake deadlines
        if not nxt:
            return None
        return max(0.0, min(nxt) - time.monotonic())

    def _progress(self) -> bool:
        w = self._worker
        busy = False
        while w.progress_once():
            busy = True
        return busy

    def _run(self) -> None:
        try:
            while not self._stop:
                busy = self._drain_inbox()
                if self._stop:
                    break
                busy |= self._progress()
                busy |= self._poll_requests()
                busy |= self._probe()
                if self._awaiting or self._recving:
                    busy |= self._poll_requests()
                wait = self._run_timers()
                if busy or self._inbox:
                    continue
                if not self._worker.arm():
                    continue   # events pending: progress again
                timeout = 1.0 if wait is None else min(wait, 1.0)
                for fd, _ev in self._poll.poll(timeout):
                    if fd == self._efd:
                        try:
                            os.eventfd_read(self._efd)
                        except BlockingIOError:
                            pass
        except BaseException as exc:  # noqa: BLE001 - reported to the owner
            if not self._stop:
                log.exception("%s: UCX I/O thread failed", self.name)
                self._stop = True
                if self.on_error is not None:
                    self.on_error(exc)
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        # flush what was already handed to UCX, for at most linger seconds
        deadline = time.monotonic() + self._linger
        try:
            while self._sending and time.monotonic() < deadline:
                self._progress()
                self._sending = [s for s in self._sending if not s[0].completed]
                if self._sending and self._worker.arm():
                    self._poll.poll(0.05)
            for conn in list(self._conns.values()):
                self._close_conn(conn, None)
            if self._listener is not None:
                self._listener = None
            try:
                self._worker.cancel_inflight_requests()
            except Exception:  # noqa: BLE001
                pass
            end = time.monotonic() + 0.2
            while time.monotonic() < end and self._progress():
                pass
        except Exception:  # noqa: BLE001
            log.debug("%s: error while closing UCX", self.name, exc_info=True)
        self._release()

    def _release(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._sending.clear()
        self._recving.clear()
        self._handshakes.clear()
        self._awaiting.clear()
        self._conns.clear()
        self._by_route.clear()
        self._by_ident.clear()
        self._inbox.clear()
        self._timers.clear()
        self.pool.clear()
        self._listener = None
        try:
            self._poll.close()
        finally:
            os.close(self._efd)
            self._efd = -1
        self._worker = None
        self._ctx = None

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, linger: float = 1.0) -> bool:
        self._linger = linger
        if self._thread is None:
            self._stop = True
            self._shutdown()
            return True
        if threading.current_thread() is self._thread:
            self._stop = True
            return True
        if self._thread.is_alive():
            self._inbox.append(("X",))
            self._wake()
            self._thread.join(linger + 5.0)
        return not self._thread.is_alive()


# --------------------------------------------------------------------------- UCX + ZeroMQ
class UcxZmqEndpoint(Endpoint):
    """The endpoint of ``BYTEPS_TRANSPORT=ucx``: ``ucx://`` addresses (the data plane, worker <->
    server) go over UCX, ``tcp://`` and ``inproc://`` ones (the scheduler's control traffic, a
    machine's local reduction) over ZeroMQ.

    The contract of one I/O thread holds: the UCX thread runs every ``on_message``, timer and
    ``call_soon``; messages the ZeroMQ side receives are handed to it with ``call_soon`` (control
    traffic is small). A reply goes back over the transport its request came in on: UCX client
    idents start with ``b"U"``, ZeroMQ's generated ones with a zero byte."""

    def __init__(self, name: str, ucx: UcxEndpoint, zmq_ep: Endpoint):
        self.name = name
        self.ucx = ucx
        self.zmq = zmq_ep
        self._zmq_peers: set[str] = set()
        self.on_message = None
        self.on_error = None
        ucx.on_message = self._deliver
        ucx.on_error = self._failed
        zmq_ep.on_message = self._from_zmq
        zmq_ep.on_error = self._failed

    def _deliver(self, route: Route, frames: list) -> None:
        if self.on_message is not None:
            self.on_message(route, frames)

    def _from_zmq(self, route: Route, frames: list) -> None:
        self.ucx.call_soon(lambda: self._deliver(route, frames))

    def _failed(self, exc: BaseException) -> None:
        if self.on_error is not None:
            self.on_error(exc)

    def bind(self, address: str) -> str:
        if address.startswith(SCHEME):
            return self.ucx.bind(address)
        return self.zmq.bind(address)

    def connect(self, peer: str, address: str, connections: int = 1,
                routing_id: bytes | None = None) -> None:
        if address.startswith(SCHEME):
            self.ucx.connect(peer, address, connections)
        else:
            self._zmq_peers.add(peer)
            self.zmq.connect(peer, address, connections, routing_id)

    def send(self, route: Route, frames: Sequence[Any]) -> None:
        if route.ident is not None:
            ep = self.ucx if route.ident[:1] == b"U" else self.zmq
        else:
            ep = self.zmq if route.peer in self._zmq_peers else self.ucx
        ep.send(route, frames)

    def call_soon(self, fn: Callable[[], None]) -> None:
        self.ucx.call_soon(fn)

    def add_timer(self, interval: float, fn: Callable[[], None]) -> None:
        self.ucx.add_timer(interval, fn)

    def start(self) -> None:
        self.ucx.start()
        self.zmq.start()

    def close(self, linger: float = 1.0) -> bool:
        ok_zmq = self.zmq.close(linger)
        ok_ucx = self.ucx.close(linger)
        return ok_zmq and ok_ucx
