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

The code: :func:`pack_frames` and :func:`parse_head` write and read a HEAD; :class:`UcxEndpoint`
runs the I/O thread and sends; its connections (opening, retrying, accepting, the handshake,
closing) are :class:`_Connections` and what it receives is :class:`_Receiver`, both used by
the I/O thread only.
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
from .base import Drops, Endpoint, Route, Timers

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


# --------------------------------------------------------------------------- the wire format
def pack_frames(frames: Sequence[Any], name: str, cuda_support: bool,
                array: Callable[[Any], Any]) -> tuple[bytes, list]:
    """A multipart message as its HEAD (frame kinds and lengths, the small frames inline) and
    the large frames that follow it as DATA messages (``array`` wraps them for ucxx)."""
    n = len(frames)
    if not 0 < n <= MAX_FRAMES:
        raise ValueError(f"{name}: a message has 1 to {MAX_FRAMES} frames, not {n}")
    kinds = bytearray(n)
    lengths = []
    inline: list = []
    bigs: list = []
    inline_total = 0
    for i, f in enumerate(frames):
        if hasattr(f, "__cuda_array_interface__"):
            if not cuda_support:
                raise ConfigError(f"{name}: a CUDA buffer was given to send, but this "
                                  "UCX has no CUDA support (ucxx-cu12 with a CUDA driver "
                                  "and UCX_TLS including cuda_copy is needed); copy it to "
                                  "host memory first")
            arr = array(f)
            if not arr.c_contiguous:
                raise ValueError(f"{name}: frame {i} is not a contiguous buffer")
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
                raise ValueError(f"{name}: frame {i} is not a contiguous buffer")
            kinds[i] = K_HOST
            bigs.append(array(mv))
        lengths.append(nb)
    head = b"".join([_HEAD.pack(_HEAD_MAGIC, _VERSION, 0, n), bytes(kinds),
                     struct.pack(f"<{n}Q", *lengths), *inline])
    return head, bigs


class _InMsg:
    __slots__ = ("frames", "missing", "head", "head_ready", "parsed")

    def __init__(self) -> None:
        self.frames: list = []
        self.missing = 0
        self.head: bytearray | None = None
        self.head_ready = False
        self.parsed = False


def parse_head(msg: _InMsg, max_message_bytes: int) -> list | str:
    """Parse the HEAD of ``msg``: its inline frames go into ``msg.frames``; returns the DATA
    frames still to come, ``(msg, index, nbytes, kind)`` each, or why the HEAD is bad."""
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
        if nb > max_message_bytes or total > max_message_bytes:
            return (f"message of at least {total} bytes exceeds the limit of "
                    f"{max_message_bytes} (BYTEPS_MAX_MESSAGE_BYTES)")
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
    return expect


# --------------------------------------------------------------------------- connections
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


class _Connections:
    """The connections of one :class:`UcxEndpoint` (its I/O thread only): opening one (and
    retrying), accepting one, the handshake that learns the peer's connection id, closing
    one. A closed connection's id stays ``dead`` a while, so its leftovers are purged."""

    def __init__(self, ep: UcxEndpoint):
        self.ep = ep
        self.conns: dict[int, _Conn] = {}             # by local conn id
        self.by_route: dict[tuple[str | None, int], _Conn] = {}
        self.by_ident: dict[bytes, _Conn] = {}
        self.cids = itertools.count(1)
        self.dead: dict[int, float] = {}              # closed cid -> purge until
        self.handshakes: list = []                     # (request, conn, what, buffer, attempt)
        self.retry: list = []                          # (when, conn) reconnects due

    def find(self, route: Route) -> _Conn | None:
        """The open connection a message to ``route`` goes on (None: dropped, logged)."""
        name = self.ep.name
        if route.ident is not None:
            conn = self.by_ident.get(route.ident)
            if conn is None or conn.closed:
                log.debug("%s: reply to vanished UCX client %r dropped", name, route.ident)
                return None
            return conn
        conn = self.by_route.get((route.peer, route.conn))
        if conn is None:
            log.error("%s: no connection %d to peer %r; message dropped", name, route.conn,
                      route.peer)
            return None
        if conn.closed:
            log.warning("%s: connection to %s is closed; message dropped", name, conn.label)
            return None
        return conn

    def connect(self, peer: str, host: str, port: int, address: str, connections: int) -> None:
        for i in range(connections):
            route = Route(peer=peer, conn=i)
            conn = _Conn(next(self.cids), route, f"{peer} ({address}) connection {i}",
                         (host, port))
            self.conns[conn.cid] = conn
            self.by_route[(peer, i)] = conn
            self.open(conn)

    def open(self, conn: _Conn) -> None:
        """Create (or re-create) the UCX endpoint of a connecting-side conn and say hello."""
        assert conn.address is not None, "only connecting-side conns are (re)opened"
        ep = self.ep
        host, port = conn.address
        conn.attempt += 1
        conn.deadline = time.monotonic() + _HANDSHAKE_TIMEOUT
        try:
            conn.ep = ep.L.UCXEndpoint.create(ep.worker, host, port, True)
        except Exception as exc:  # noqa: BLE001
            self.connect_failed(conn, exc)
            return
        conn.ep.set_close_callback(self.on_ep_closed, cb_args=(conn.cid, conn.attempt))
        hello = _HELLO.pack(_MAGIC, _VERSION, 0, conn.cid, 0)
        harr = ep.Array(hello)
        self.handshakes.append((conn.ep.stream_send(harr), conn, "hello-out", harr,
                                conn.attempt))
        rarr = ep.Array(conn.hello_buf)
        self.handshakes.append((conn.ep.stream_recv(rarr), conn, "hello-in", rarr,
                                conn.attempt))

    def connect_failed(self, conn: _Conn, exc: BaseException | str) -> None:
        ep = self.ep
        if conn.closed or ep.stopping:
            return
        if conn.address is not None and conn.attempt < _CONNECT_RETRIES and not conn.ready:
            log.debug("%s: connecting to %s failed (%s); retrying", ep.name, conn.label, exc)
            self.drop_ep(conn)
            self.retry.append((time.monotonic() + _CONNECT_BACKOFF, conn))
            return
        msg = (f"{ep.name}: cannot connect to {conn.label} over UCX after {conn.attempt} "
               f"attempts ({exc}) with {_ucx_settings(ep.ucx_env)}; check that the peer is "
               "up, that a firewall lets the port through, and that UCX_NET_DEVICES names an "
               "interface that reaches it")
        log.error("%s", msg)
        self.close(conn, None)
        if ep.on_error is not None:
            ep.on_error(CommunicationError(msg))

    @staticmethod
    def drop_ep(conn: _Conn) -> None:
        ep, conn.ep = conn.ep, None
        if ep is not None:
            try:
                ep.remove_close_callback()
                if ep.alive:   # closing an endpoint UCX already failed crashes ucxx
                    ep.close()
            except Exception:  # noqa: BLE001 - already gone
                pass

    def on_conn_request(self, conn_request: Any) -> None:
        ep = self.ep
        cid = next(self.cids)
        ident = b"U" + struct.pack("<I", cid)
        conn = _Conn(cid, Route(ident=ident), f"UCX client {cid}")
        try:
            conn.ep = ep.listener.create_endpoint_from_conn_request(conn_request, True)
        except Exception as exc:  # noqa: BLE001
            ep.drops("UCX connection that could not be accepted", str(exc)[:500])
            return
        self.conns[cid] = conn
        self.by_ident[ident] = conn
        conn.ep.set_close_callback(self.on_ep_closed, cb_args=(cid, 0))
        rarr = ep.Array(conn.hello_buf)
        self.handshakes.append((conn.ep.stream_recv(rarr), conn, "hello-in", rarr, 0))

    def on_ep_closed(self, cid: int, attempt: int, *args: Any) -> None:
        # runs inside UCX progress: closing the endpoint here would deadlock, so defer
        self.ep.defer(lambda: self.ep_closed(cid, attempt))

    def ep_closed(self, cid: int, attempt: int) -> None:
        conn = self.conns.get(cid)
        if conn is None or conn.closed or attempt != conn.attempt or conn.ep is None:
            return
        if not conn.ready and conn.address is not None:
            self.connect_failed(conn, "endpoint closed during connection setup")
            return
        level = (logging.INFO if self.ep.stopping or conn.ident is not None
                 else logging.WARNING)
        log.log(level, "%s: UCX connection to %s closed by the peer", self.ep.name, conn.label)
        self.close(conn, None)

    def close(self, conn: _Conn, error: str | None) -> None:
        if conn.closed:
            return
        if error:
            self.ep.stats["rejected"] += 1
            self.ep.drops("UCX connection closed for what it sent", f"{conn.label}: {error}"[:500])
        conn.closed = True
        conn.ready = False
        conn.pending.clear()
        conn.inq.clear()
        conn.expect.clear()
        self.ep.receiver.awaiting.discard(conn)
        self.drop_ep(conn)
        self.conns.pop(conn.cid, None)
        if conn.ident is not None:
            self.by_ident.pop(conn.ident, None)
        self.dead[conn.cid] = time.monotonic() + _DEAD_TTL

    def poll_handshakes(self) -> bool:
        """Finish the handshakes that completed; fail those past their deadline."""
        busy = False
        hs, self.handshakes = self.handshakes, []
        now = time.monotonic()
        for item in hs:
            req, conn = item[0], item[1]
            if item[4] != conn.attempt or conn.ep is None:
                continue   # a failed attempt's leftovers
            if req.completed:
                busy = True
                self.handshake_done(req, conn, item[2])
            elif conn.closed:
                continue
            elif now > conn.deadline and not conn.ready:
                if conn.address is not None:
                    self.connect_failed(conn, "no handshake answer in "
                                        f"{_HANDSHAKE_TIMEOUT:.0f} s")
                else:
                    self.close(conn, "no handshake in time")
            else:
                self.handshakes.append(item)
        return busy

    def handshake_done(self, req: Any, conn: _Conn, what: str) -> None:
        if conn.closed:
            return
        try:
            req.check_error()
        except Exception as exc:  # noqa: BLE001
            if conn.address is not None:
                self.connect_failed(conn, exc)
            else:
                log.debug("%s: handshake with %s failed: %s", self.ep.name, conn.label, exc)
                self.close(conn, None)
            return
        if what != "hello-in":
            return
        try:
            magic, version, _flags, peer_cid, _r = _HELLO.unpack(conn.hello_buf)
        except struct.error:
            magic, version, peer_cid = b"", 0, 0
        if magic != _MAGIC or version != _VERSION or not 0 < peer_cid < 1 << 32:
            self.close(conn, f"bad handshake (magic {magic!r}, version {version}): not a "
                       f"byteps_like UCX peer of this release")
            return
        conn.peer_cid = peer_cid
        if conn.address is None:   # accepting side: answer with our id
            reply = _HELLO.pack(_MAGIC, _VERSION, 0, conn.cid, 0)
            arr = self.ep.Array(reply)
            self.handshakes.append((conn.ep.stream_send(arr), conn, "hello-out", arr,
                                    conn.attempt))
        conn.ready = True
        pending, conn.pending = conn.pending, []
        for head, bigs in pending:
            self.ep.post_send(conn, head, bigs)

    def reopen_due(self, now: float) -> None:
        """Retry the connections whose backoff has passed."""
        due = [r for r in self.retry if r[0] <= now]
        if due:
            self.retry = [r for r in self.retry if r[0] > now]
            for _t, conn in due:
                if not conn.closed:
                    self.open(conn)

    def clear(self) -> None:
        self.handshakes.clear()
        self.conns.clear()
        self.by_route.clear()
        self.by_ident.clear()


# --------------------------------------------------------------------------- receiving
class _Receiver:
    """What one :class:`UcxEndpoint` receives (its I/O thread only): every HEAD and DATA
    message is probed before any memory is taken for it, HEADs are parsed in arrival order,
    DATA frames land in staging buffers from the pool, and a message whose frames are all in
    is delivered."""

    def __init__(self, ep: UcxEndpoint):
        self.ep = ep
        self.recving: list = []                        # (request, keepalive, conn, msg, idx)
        self.awaiting: set[_Conn] = set()              # conns with DATA frames to probe for

    def discard(self, probe: Any) -> None:
        """Consume a probed message without taking its memory (UCX truncates it)."""
        sink = bytearray(1)
        req = self.ep.worker.tag_recv_with_handle(self.ep.Array(sink), probe)
        self.recving.append((req, sink, None, None, -1))

    def probe(self) -> bool:
        ep, cs = self.ep, self.ep.conns
        L, w = ep.L, ep.worker
        busy = False
        head_tag, mask = L.UCXXTag(KIND_HEAD), L.UCXXTagMask(_KIND_MASK)
        while True:
            p = w.tag_probe(head_tag, mask, remove=True)
            if not p.matched:
                break
            busy = True
            cid = p.sender_tag.value >> 32
            conn = cs.conns.get(cid)
            if conn is None or conn.closed or not conn.ready:
                self.discard(p)
                if cid not in cs.dead:
                    ep.stats["rejected"] += 1
                    ep.drops("UCX message for an unknown connection", f"connection {cid}")
                continue
            n = p.length
            if not _HEAD.size < n <= HEAD_MAX:
                self.discard(p)
                cs.close(conn, f"message header of {n} bytes (at most {HEAD_MAX})")
                continue
            msg = _InMsg()
            msg.head = bytearray(n)
            conn.inq.append(msg)
            req = w.tag_recv_with_handle(ep.Array(msg.head), p)
            self.recving.append((req, msg.head, conn, msg, -1))
        for conn in list(self.awaiting):
            tag = L.UCXXTag((conn.cid << 32) | KIND_DATA)
            while conn.expect and not conn.closed:
                p = w.tag_probe(tag, remove=True)
                if not p.matched:
                    break
                busy = True
                msg, idx, nbytes, kind = conn.expect.popleft()
                if p.length != nbytes:
                    self.discard(p)
                    cs.close(conn, f"frame {idx} is {p.length} bytes, its header declared "
                             f"{nbytes}")
                    break
                base = ep.pool.take(nbytes)
                view = memoryview(base)[:nbytes]
                req = w.tag_recv_with_handle(ep.Array(view), p)
                self.recving.append((req, view, conn, msg, idx))
            if not conn.expect:
                self.awaiting.discard(conn)
        if cs.dead:
            now = time.monotonic()
            for cid, until in list(cs.dead.items()):
                if until < now:
                    del cs.dead[cid]
                    continue
                while True:   # leftovers of a closed connection
                    p = w.tag_probe(L.UCXXTag(cid << 32), L.UCXXTagMask(_CONN_MASK), remove=True)
                    if not p.matched:
                        break
                    self.discard(p)
        return busy

    def parse_heads(self, conn: _Conn) -> None:
        """Parse the HEADs of ``conn`` in arrival order (so DATA frames match in order)."""
        for msg in conn.inq:
            if msg.parsed:
                continue
            if not msg.head_ready:
                return
            expect = parse_head(msg, self.ep.max_message_bytes)
            if isinstance(expect, str):
                self.ep.conns.close(conn, expect)
                return
            if expect:
                conn.expect.extend(expect)
                self.awaiting.add(conn)

    def poll(self) -> bool:
        """Account for the receives that completed; parse and deliver what they finish."""
        busy = False
        touched = set()
        done, self.recving = _split_completed(self.recving)
        for item in done:
            busy = True
            req, _keep, conn, msg, idx = item
            try:
                req.check_error()
            except Exception as exc:  # noqa: BLE001
                if conn is not None and not conn.closed:
                    self.ep.conns.close(conn, f"receive failed ({exc})")
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
                self.parse_heads(conn)
            if not conn.closed:
                self.deliver_ready(conn)
        return busy

    def deliver_ready(self, conn: _Conn) -> None:
        q = conn.inq
        ep = self.ep
        while q and q[0].parsed and q[0].missing == 0 and not conn.closed:
            msg = q.popleft()
            ep.stats["received"] += 1
            if ep.on_message is not None:
                ep.on_message(conn.route, msg.frames)

    def clear(self) -> None:
        self.recving.clear()
        self.awaiting.clear()


class UcxEndpoint(Endpoint):
    """An :class:`Endpoint` over UCX (``ucx://host:port`` addresses): the I/O thread, sending,
    and the lifecycle; its connections (:class:`_Connections`, ``conns``) and what it
    receives (:class:`_Receiver`, ``receiver``) are parts of their own."""

    def __init__(self, name: str, *, max_message_bytes: int = 1 << 30,
                 ucx_env: dict[str, str] | None = None, device_memory: bool = False):
        self.name = name
        self.max_message_bytes = int(max_message_bytes)
        self.ucx_env = dict(ucx_env or {})
        # refusals (a bad message, an unknown connection, an accept that failed): counted and
        # logged at a bounded rate, as the ZeroMQ endpoint's
        self.drops = Drops(log, name)
        self.L, self.Array = import_ucxx()
        L = self.L
        try:
            self._ctx = L.UCXContext(feature_flags=(L.Feature.TAG, L.Feature.WAKEUP,
                                                    L.Feature.STREAM))
            self.worker = L.UCXWorker(self._ctx)
            self.worker.init_blocking_progress_mode()
        except Exception as exc:  # noqa: BLE001 - ucxx raises its own UCXXError tree
            raise ConfigError(
                f"{name}: UCX found no usable transport ({type(exc).__name__}: {exc}) with "
                f"{_ucx_settings(self.ucx_env)}. Check that UCX_TLS names transports this "
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
        self.listener: Any = None  # ucxx objects (untyped library)
        self._bound: str | None = None
        self.conns = _Connections(self)
        self.receiver = _Receiver(self)
        self._sending: list = []                        # (request, keepalive, conn)
        self._inbox: collections.deque = collections.deque()
        self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._poll = select.epoll()
        self._poll.register(self._efd, select.EPOLLIN)
        self._poll.register(self.worker.epoll_file_descriptor, select.EPOLLIN)
        self._timers = Timers()
        self._thread: threading.Thread | None = None
        self._stop = False
        self._closed = False
        self._linger = 1.0
        self._lock = threading.Lock()
        self.on_message = None
        self.on_error = None
        self.stats: collections.Counter[str] = collections.Counter()

    @property
    def stopping(self) -> bool:
        """The I/O thread is stopping (or has stopped)."""
        return self._stop

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
                if self.listener is not None:
                    raise RuntimeError(f"{self.name}: already bound")
                self.listener = self.L.UCXListener.create(self.worker, port,
                                                          self.conns.on_conn_request)
                self._bound = f"{SCHEME}{host}:{self.listener.port}"
                result.append(self._bound)
            except Exception as exc:  # noqa: BLE001
                result.append(exc)
        self._run_sync(do)
        if isinstance(result[0], RuntimeError):
            raise result[0]
        if isinstance(result[0], BaseException):
            raise CommunicationError(
                f"{self.name}: cannot listen on {address} over UCX ({result[0]}) with "
                f"{_ucx_settings(self.ucx_env)}; the port may be taken, or UCX_TLS lacks a "
                "transport that can accept connections (it needs `tcp` or an RDMA transport "
                "with rdmacm)") from None
        return result[0]

    def connect(self, peer: str, address: str, connections: int = 1,
                routing_id: bytes | None = None) -> None:
        # UCX carries the data plane only (worker -> server); routing ids are for the local
        # root's ZeroMQ socket, which UcxZmqEndpoint hands to ZeroMQ
        host, port = self.parse(address)
        self._on_io_thread(lambda: self.conns.connect(peer, host, port, address, connections))

    def connections(self, peer: str) -> int:
        return sum(1 for (p, _i) in self.conns.by_route if p == peer)

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

    def defer(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the I/O thread after the current UCX progress (called from it)."""
        self._inbox.append(("F", fn))

    # -- sending ---------------------------------------------------------------------------
    def send(self, route: Route, frames: Sequence[Any]) -> None:
        if self._closed:
            log.debug("%s: send after close dropped", self.name)
            return
        head, bigs = pack_frames(frames, self.name, self.cuda_support, self.Array)
        if self._thread is None or threading.current_thread() is self._thread:
            self._send_now(route, head, bigs)
            return
        self._inbox.append(("S", route, head, bigs))
        self._wake()

    def _send_now(self, route: Route, head: bytes, bigs: list) -> None:
        if self._stop:
            return
        conn = self.conns.find(route)
        if conn is None:
            return
        if not conn.ready:
            conn.pending.append((head, bigs))
            return
        self.post_send(conn, head, bigs)

    def post_send(self, conn: _Conn, head: bytes, bigs: list) -> None:
        """Send one message on a connection whose handshake is done."""
        L = self.L
        assert conn.peer_cid is not None, "sent on a connection before its handshake"
        base = conn.peer_cid << 32
        harr = self.Array(head)
        self._sending.append((conn.ep.tag_send(harr, L.UCXXTag(base | KIND_HEAD)), harr, conn))
        for arr in bigs:
            self._sending.append((conn.ep.tag_send(arr, L.UCXXTag(base | KIND_DATA)), arr, conn))
        self.stats["sent"] += 1

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
        if self.conns.handshakes:
            busy |= self.conns.poll_handshakes()
        if self.receiver.recving:
            busy |= self.receiver.poll()
        return busy

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
        cs = self.conns
        if cs.retry:
            cs.reopen_due(now)
        nxt = [t for t in (self._timers.next_due(),) if t is not None]
        nxt += [r[0] for r in cs.retry]
        if cs.handshakes:
            nxt.append(now + 0.5)  # handshake deadlines
        if not nxt:
            return None
        return max(0.0, min(nxt) - time.monotonic())

    def _progress(self) -> bool:
        w = self.worker
        busy = False
        while w.progress_once():
            busy = True
        return busy

    def _run(self) -> None:
        rx = self.receiver
        try:
            while not self._stop:
                busy = self._drain_inbox()
                if self._stop:
                    break
                busy |= self._progress()
                busy |= self._poll_requests()
                busy |= rx.probe()
                if rx.awaiting or rx.recving:
                    busy |= self._poll_requests()
                wait = self._run_timers()
                if busy or self._inbox:
                    continue
                if not self.worker.arm():
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
        self.drops.flush()  # the last window's refusals, which no later one will write
        # flush what was already handed to UCX, for at most linger seconds
        deadline = time.monotonic() + self._linger
        try:
            while self._sending and time.monotonic() < deadline:
                self._progress()
                self._sending = [s for s in self._sending if not s[0].completed]
                if self._sending and self.worker.arm():
                    self._poll.poll(0.05)
            for conn in list(self.conns.conns.values()):
                self.conns.close(conn, None)
            if self.listener is not None:
                self.listener = None
            try:
                self.worker.cancel_inflight_requests()
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
        self.receiver.clear()
        self.conns.clear()
        self._inbox.clear()
        self._timers.clear()
        self.pool.clear()
        self.listener = None
        try:
            self._poll.close()
        finally:
            os.close(self._efd)
            self._efd = -1
        self.worker = None
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

    def watch_link(self, peer: str, fn: Callable[[str], None]) -> bool:
        return self.zmq.watch_link(peer, fn)  # the scheduler's connection is ZeroMQ's

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
