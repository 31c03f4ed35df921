"""ZeroMQ implementation of :class:`~byteps_like.transport.base.Endpoint`.

One I/O thread owns every socket (ZeroMQ sockets are not thread-safe). Other threads hand it
messages through an ``inproc`` PUSH/PULL pair: frames built with ``copy=False`` move through it
without copying the payload. Listening sockets are ROUTERs, connections are DEALERs, and every
socket has ``ZMQ_MAXMSGSIZE`` set, so an oversized message is dropped by ZeroMQ itself before
any of it is buffered.

A listening socket faces whoever connects, so it is bounded (issues 19 and 29): high-water
marks in both directions (``BYTEPS_SOCKET_HWM`` messages: a client that sends faster than it is
served is slowed by TCP, and a reply to a client whose queue is at the mark, one that does not
read, is dropped and counted), a handshake deadline, and at most ``max_connections`` accepted
connections (more are shut down as they arrive, so the process stays under its descriptor
limit, where libzmq's accept would spin). What a listening socket answers is control: a
server's errors to a stranger, the scheduler's replies to its nodes, a local root's to its local
ranks (a message each, of at most ``MAX_META_BYTES`` of JSON); every byte of a tensor or a
server-held table travels on the native data plane, whose streams have their own budgets
(csrc/dataplane_io.h). Connections this node opens itself (to the scheduler, its local root)
keep unbounded queues: what they carry is bounded by the protocol, and their receive side never
stops reading.
"""
from __future__ import annotations

import errno
import functools
import hashlib
import itertools
import logging
import operator
import socket
import struct
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import zmq
from zmq.utils import z85

from .base import Drops, Endpoint, Route, Timers

log = logging.getLogger("byteps_like.transport")

_BATCH = 32                 # messages taken from one socket per poll
_COPY_THRESHOLD = 64 * 1024  # below this pyzmq copying is cheaper than tracking a zero-copy frame
_HANDSHAKE_MS = 10_000       # a client of a listening socket must finish the ZMTP handshake in this
#: what the socket monitor of a watched connection (watch_link) reports, in its words
_LINK_EVENTS = {zmq.EVENT_CONNECTED: "connected", zmq.EVENT_CONNECT_RETRIED: "refused",
                zmq.EVENT_DISCONNECTED: "down", zmq.EVENT_HANDSHAKE_SUCCEEDED: "up",
                zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "rejected",
                zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "rejected",
                zmq.EVENT_HANDSHAKE_FAILED_AUTH: "rejected"}


def _frame(buf: Any) -> Any:
    if isinstance(buf, (bytes, zmq.Frame)):
        return buf
    mv = memoryview(buf)
    if mv.nbytes < _COPY_THRESHOLD:
        return mv.tobytes()
    return zmq.Frame(mv, copy=False)


class CurveKeys(NamedTuple):
    """The CURVE keys of one job (Z85 text), all derived from its shared secret: every listening
    socket has the server pair, every connecting socket the client pair; a listening socket's
    ZAP handler admits exactly the client public key."""
    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


def derive_curve_keys(secret: str) -> CurveKeys:
    """Deterministic CURVE key pairs from a shared secret: a Curve25519 secret key is any 32
    bytes, here BLAKE2b-256 of the secret personalised per role (a KDF for a high-entropy
    secret such as the 256-bit one bpslaunch --local --auth generates)."""
    if not secret:
        raise ValueError("empty authentication secret")
    if not zmq.has("curve"):
        from ..errors import ConfigError
        raise ConfigError("BYTEPS_AUTH_SECRET is set but this pyzmq/libzmq has no CURVE support")
    keys = []
    for label in (b"bpsl-server", b"bpsl-client"):
        raw = hashlib.blake2b(secret.encode(), digest_size=32, person=label,
                              salt=b"byteps_like.v1").digest()
        sk = z85.encode(raw)
        keys += [zmq.curve_public(sk), sk]
    return CurveKeys(*keys)


class _AllowKeys:
    """ZAP credentials provider: admits exactly the given client public keys (Z85). Refusals
    are counted and logged through :class:`Drops` (the first at once, then one line per
    interval with the count): a client that retries a refused handshake for 30 s wrote 18,200
    lines before, one per connection."""

    def __init__(self) -> None:
        self.keys: set[bytes] = set()
        self.denied = 0
        self.refusals = Drops(log, "authentication", verb="refused", unit="CURVE client")

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.keys:
            return True
        self.denied += 1
        self.refusals("its client key is not this job's (another job, or no BYTEPS_AUTH_SECRET "
                      "of this job)")
        return False


# One ZAP authenticator per context (it binds inproc://zeromq.zap.01), shared by that
# context's listening endpoints and stopped when the last of them closes.
_zap_lock = threading.Lock()
#: seconds a new authenticator waits for the address of the context's previous one to be freed
ZAP_REBIND_S = 5.0
_zap: dict[int, list] = {}   # id(ctx) -> [authenticator, provider, users]


def _zap_acquire(ctx: zmq.Context, client_public: bytes) -> _AllowKeys:
    from zmq.auth.thread import ThreadAuthenticator
    with _zap_lock:
        entry = _zap.get(id(ctx))
        if entry is None:
            auth = ThreadAuthenticator(ctx, log=logging.getLogger("byteps_like.auth"))
            _start_zap(auth)
            provider = _AllowKeys()
            auth.configure_curve_callback(domain="*", credentials_provider=provider)
            entry = _zap[id(ctx)] = [auth, provider, 0]
        entry[1].keys.add(client_public)
        entry[2] += 1
        return entry[1]


def _start_zap(auth) -> None:
    """Start a ZAP authenticator. The one this context had before (its last endpoint closed
    just now) may still hold inproc://zeromq.zap.01: libzmq frees a closed socket's address
    on its reaper thread, after close() returns. So a bind that finds it in use is tried again
    until ZAP_REBIND_S; a later failure is raised."""
    deadline = time.monotonic() + ZAP_REBIND_S
    while True:
        try:
            auth.start()
            return
        except zmq.ZMQError as exc:
            if auth.zap_socket is not None:   # made, not bound: closed, or made again
                auth.zap_socket.close(linger=0)
                auth.zap_socket = None
            if exc.errno != errno.EADDRINUSE or time.monotonic() >= deadline:
                raise
            time.sleep(0.005)


def _zap_release(ctx: zmq.Context) -> None:
    with _zap_lock:
        entry = _zap.get(id(ctx))
        if entry is None:
            return
        entry[2] -= 1
        if entry[2] <= 0:
            del _zap[id(ctx)]
            entry[0].stop()
            entry[1].refusals.flush()  # the last window's count, which no refusal will write


class ZmqEndpoint(Endpoint):
    def __init__(self, name: str, *, max_message_bytes: int = 1 << 30,
                 context: zmq.Context | None = None, curve: CurveKeys | None = None,
                 hwm: int = 1000, max_connections: int = 0, recv_hwm: int | None = None):
        self.name = name
        self.hwm = int(hwm)                          # per client of the listening socket; 0: none
        # what a client may have waiting to be read (ZeroMQ counts messages, not bytes)
        self.recv_hwm = self.hwm if recv_hwm is None else (
            int(recv_hwm) if not self.hwm else min(self.hwm, int(recv_hwm)))
        self.max_connections = int(max_connections)  # clients of the listening socket; 0: any
        self.drops = Drops(log, name)                # what this endpoint dropped, by reason
        self._monitor: zmq.Socket | None = None
        # watch_link: a peer's watcher, and each watched connection's monitor -> (its socket,
        # the watcher)
        self._watchers: dict[str, Callable[[str], None]] = {}
        self._links: dict[zmq.Socket, tuple[zmq.Socket, Callable[[str], None]]] = {}
        self._accepted: set[int] = set()             # descriptors of the listener's clients
        self._port = 0
        self.ctx = context or zmq.Context.instance()
        self.curve = curve
        self.auth: _AllowKeys | None = None
        self.max_message_bytes = int(max_message_bytes)
        self._router: zmq.Socket | None = None
        self._dealers: dict[tuple[str | None, int], zmq.Socket] = {}
        self._sock_route: dict[zmq.Socket, Route] = {}
        self._outbox_addr = f"inproc://bpsl-out-{uuid.uuid4().hex}"
        self._outbox = self.ctx.socket(zmq.PULL)
        self._outbox.bind(self._outbox_addr)
        self._local = threading.local()
        self._senders: list[zmq.Socket] = []
        self._senders_lock = threading.Lock()
        self._calls: dict[int, Callable[[], None]] = {}   # keyed by token: order per sender
        self._call_ids = itertools.count()
        self._timers = Timers()
        self._poller = zmq.Poller()
        self._poller.register(self._outbox, zmq.POLLIN)
        self._thread: threading.Thread | None = None
        self._stop = False
        self._draining = False
        self._linger_ms = 0
        self.on_message = None
        self.on_error = None

    # -- setup ---------------------------------------------------------------------------
    def _socket(self, kind: int) -> zmq.Socket:
        s = self.ctx.socket(kind)
        s.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        s.setsockopt(zmq.LINGER, 0)
        if kind == zmq.ROUTER:  # faces whoever connects: bounded (see the module's notes)
            s.setsockopt(zmq.SNDHWM, self.hwm)
            s.setsockopt(zmq.RCVHWM, self.recv_hwm)
            s.setsockopt(zmq.HANDSHAKE_IVL, _HANDSHAKE_MS)
        else:
            s.setsockopt(zmq.SNDHWM, 0)
            s.setsockopt(zmq.RCVHWM, 0)
        if self.curve is not None:
            if kind == zmq.ROUTER:
                s.curve_secretkey = self.curve.server_secret
                s.curve_publickey = self.curve.server_public
                s.curve_server = True
            else:
                s.curve_serverkey = self.curve.server_public
                s.curve_publickey = self.curve.client_public
                s.curve_secretkey = self.curve.client_secret
        return s

    def bind(self, address: str) -> str:
        if self._router is not None:
            raise RuntimeError(f"{self.name}: already bound")
        if self.curve is not None and self.auth is None and not address.startswith("inproc://"):
            self.auth = _zap_acquire(self.ctx, self.curve.client_public)
        s = self._socket(zmq.ROUTER)
        s.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if address.startswith("tcp://") and address.endswith(":0"):
            port = s.bind_to_random_port(address[:-2])
            bound = f"{address[:-2]}:{port}"
        else:
            s.bind(address)
            bound = s.getsockopt_string(zmq.LAST_ENDPOINT)
        self._router = s
        self._poller.register(s, zmq.POLLIN)
        if bound.startswith("tcp://"):
            self._port = int(bound.rsplit(":", 1)[1])
        if bound.startswith("tcp://") and self.max_connections > 0:
            self._monitor = self._monitor_of(s, zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        return bound

    def _monitor_of(self, s: zmq.Socket, events: int) -> zmq.Socket:
        """A socket that receives ``events`` of ``s`` (its socket monitor), polled by the I/O
        thread; no event may be lost (a count would drift, a link's state be missed)."""
        addr = f"inproc://bpsl-monitor-{uuid.uuid4().hex}"
        s.monitor(addr, events)
        m = self.ctx.socket(zmq.PAIR)
        m.setsockopt(zmq.LINGER, 0)
        m.setsockopt(zmq.RCVHWM, 0)
        m.connect(addr)
        self._poller.register(m, zmq.POLLIN)
        return m

    def _on_monitor_event(self) -> None:
        """Count the listener's clients; close one past ``max_connections`` at once."""
        assert self._monitor is not None, "monitor events come only from a bound listener"
        frames = self._monitor.recv_multipart()
        event, fd = struct.unpack_from("=HI", frames[0])  # libzmq's native layout
        if event == zmq.EVENT_DISCONNECTED:
            self._accepted.discard(fd)
        elif event == zmq.EVENT_ACCEPTED:
            self._accepted.add(fd)
            if len(self._accepted) > self.max_connections:
                self._accepted.discard(fd)
                self._shed(fd)
                self.drops(f"connection past the limit of {self.max_connections} "
                           "(BYTEPS_MAX_CONNECTIONS)")

    def _shed(self, fd: int) -> None:
        """Shut a connection libzmq accepted down (it then closes the descriptor itself);
        checked to still be a connection to our listening port, never closed here."""
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            return
        try:
            if sock.getsockname()[1] == self._port:
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        finally:
            sock.detach()

    def connect(self, peer: str, address: str, connections: int = 1,
                routing_id: bytes | None = None) -> None:
        def do() -> None:
            for i in range(connections):
                s = self._socket(zmq.DEALER)
                if routing_id is not None:
                    s.setsockopt(zmq.ROUTING_ID, routing_id if connections == 1
                                 else routing_id + b".%d" % i)
                fn = self._watchers.get(peer) if i == 0 else None
                if fn is not None:
                    self._watch(s, fn)
                s.connect(address)
                self._dealers[(peer, i)] = s
                self._sock_route[s] = Route(peer=peer, conn=i)
                self._poller.register(s, zmq.POLLIN)
        self._on_io_thread(do)

    def watch_link(self, peer: str, fn: Callable[[str], None]) -> bool:
        self._watchers[peer] = fn
        return True

    def _watch(self, s: zmq.Socket, fn: Callable[[str], None]) -> None:
        m = self._monitor_of(s, functools.reduce(operator.or_, _LINK_EVENTS))
        self._links[m] = (s, fn)

    def _on_link_event(self, m: zmq.Socket) -> None:
        frames = m.recv_multipart()
        event = struct.unpack_from("=H", frames[0])[0]
        what = _LINK_EVENTS.get(event)
        if what is not None:
            self._links[m][1](what)

    def connections(self, peer: str) -> int:
        return sum(1 for (p, _i) in self._dealers if p == peer)

    def add_timer(self, interval: float, fn: Callable[[], None]) -> None:
        entry = self._timers.entry(interval, fn)
        self._on_io_thread(lambda: self._timers.push(entry))  # wakes a blocked poll

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"bpsl-io-{self.name}", daemon=True)
        self._thread.start()

    # -- sending ---------------------------------------------------------------------------
    def _on_io_thread(self, fn: Callable[[], None]) -> None:
        if self._thread is None or threading.current_thread() is self._thread:
            fn()
        else:
            self.call_soon(fn)

    def _sender(self) -> zmq.Socket:
        s = getattr(self._local, "sock", None)
        if s is None:
            s = self.ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 0)
            s.connect(self._outbox_addr)
            self._local.sock = s
            with self._senders_lock:
                self._senders.append(s)
        return s

    def call_soon(self, fn: Callable[[], None]) -> None:
        # The callable is found by its own token, so it runs in the order of this thread's
        # messages through the outbox, whatever other threads do meanwhile.
        cid = next(self._call_ids)
        self._calls[cid] = fn
        self._sender().send(b"F%d" % cid)

    def send(self, route: Route, frames: Sequence[Any]) -> None:
        frames = [_frame(f) for f in frames]
        if self._thread is None or threading.current_thread() is self._thread:
            self._send_now(route, frames)
            return
        if route.ident is not None:
            head = b"R" + route.ident
        else:
            head = b"D%d:" % route.conn + (route.peer or "").encode()
        self._sender().send_multipart([head, *frames], copy=False)

    def _send_now(self, route: Route, frames: list) -> None:
        if self._stop and not self._draining:
            return
        if route.ident is not None:
            self._reply(route.ident, frames)
            return
        sock = self._dealers.get((route.peer, route.conn))
        if sock is None:  # a bug in the caller; must not take the I/O thread down with it
            log.error("%s: no connection %d to peer %r; message dropped", self.name, route.conn,
                      route.peer)
            return
        sock.send_multipart(frames, copy=False)

    def _reply(self, ident: bytes, frames: list) -> None:
        """Answer a client of the listening socket, never blocking: dropped and counted when
        its queue is at the high-water mark (it does not read), or when it went away."""
        assert self._router is not None, "replies go only through a bound listener"
        try:
            self._router.send_multipart([ident, *frames], copy=False, flags=zmq.NOBLOCK)
        except zmq.Again:
            self.drops("reply to a client that does not read: its queue is at "
                       f"BYTEPS_SOCKET_HWM ({self.hwm} messages)")
        except zmq.ZMQError as exc:  # EHOSTUNREACH: the client went away
            log.debug("%s: reply to vanished client dropped (%s)", self.name, exc)

    # -- the I/O loop ------------------------------------------------------------------------
    def _dispatch_outbox(self) -> None:
        frames = self._outbox.recv_multipart(copy=False)
        head = frames[0].bytes
        if head[:1] == b"F":
            self._calls.pop(int(head[1:]))()
            return
        if head == b"S":
            if not self._stop:
                self._stop = True
                self._flush_outbox()
            return
        if head[:1] == b"R":
            route = Route(ident=head[1:])
        else:
            conn, _, peer = head[1:].partition(b":")
            route = Route(peer=peer.decode(), conn=int(conn))
        self._send_now(route, frames[1:])

    def _flush_outbox(self) -> None:
        """At close: send what other threads queued before the close. Each thread has its own
        pipe into the outbox, so the stop request can overtake messages another thread sent
        earlier (e.g. the scheduler's SHUTDOWN to every node, queued by the thread that runs
        its handlers); whatever is in the pipes now goes out before the sockets close."""
        self._draining = True
        try:
            while self._outbox.poll(0):
                self._dispatch_outbox()
        finally:
            self._draining = False

    def _run(self) -> None:
        try:
            while not self._stop:
                wait = self._timers.run_due()
                events = self._poller.poll(None if wait is None else max(1, int(wait * 1000)))
                for sock, _ev in events:
                    # drain a bounded batch per socket so no socket starves the others
                    for _ in range(_BATCH):
                        if sock is self._outbox:
                            self._dispatch_outbox()
                        elif sock is self._router and sock is not None:
                            frames = sock.recv_multipart(copy=False)
                            self._deliver(Route(ident=frames[0].bytes), frames[1:])
                        elif sock is self._monitor:
                            self._on_monitor_event()
                        elif sock in self._links:
                            self._on_link_event(sock)
                        else:
                            self._deliver(self._sock_route[sock], sock.recv_multipart(copy=False))
                        if self._stop or not sock.get(zmq.EVENTS) & zmq.POLLIN:
                            break
        except BaseException as exc:  # noqa: BLE001 - reported to the owner
            if not self._stop:
                log.exception("%s: I/O thread failed", self.name)
                if self.on_error is not None:
                    self.on_error(exc)
        finally:
            self._close_sockets()

    def _deliver(self, route: Route, frames: list) -> None:
        if self.on_message is not None:
            self.on_message(route, frames)

    def _close_sockets(self) -> None:
        monitors = [(m, watched) for m, (watched, _fn) in self._links.items()]
        if self._monitor is not None and self._router is not None:
            monitors.append((self._monitor, self._router))
        for m, watched in monitors:
            try:
                watched.disable_monitor()
            except zmq.ZMQError:
                pass
            m.close(0)
        self._monitor = None
        self._links.clear()
        for s in [self._router, *self._dealers.values()]:
            if s is not None:
                s.close(self._linger_ms)
        self._outbox.close(0)
        if self.auth is not None:
            self.auth = None
            _zap_release(self.ctx)

    def close(self, linger: float = 1.0) -> bool:
        """Stop the I/O thread and close the sockets; False if the thread did not stop in time
        (the caller must then not terminate the context, which would block)."""
        self._linger_ms = int(linger * 1000)
        self.drops.flush()
        if self._thread is None:
            self._close_sockets()
            return True
        if threading.current_thread() is self._thread:
            self._stop = True
            return True
        deadline = time.monotonic() + linger + 5.0
        while self._thread.is_alive() and time.monotonic() < deadline:
            # never block here: an I/O thread that died (a bug, reported through on_error)
            # closed its outbox, and a PUSH without a peer would wait forever
            try:
                self._sender().send(b"S", zmq.NOBLOCK)
                break
            except zmq.Again:
                self._thread.join(0.05)
        self._thread.join(max(0.0, deadline - time.monotonic()))
        with self._senders_lock:
            for s in self._senders:
                s.close(0)
            self._senders.clear()
        return not self._thread.is_alive()
