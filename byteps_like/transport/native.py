"""The native data plane seen from Python: whether it applies, how it is sized, and the
completion side of a worker.

Every worker-server byte of a dense tensor moves in ``_core`` (csrc/dataplane.cc): epoll I/O threads
that never hold the GIL, several TCP streams per worker-server pair, pushes summed on the
server's I/O threads chunk by chunk as they arrive, pull responses received straight into the
caller's output and averaged there, priorities and byte credits applied in C++. Python keeps
what it decides: registration, which tensors go native, declarations, errors shown to users,
and the per-operation bookkeeping (one completion per push_pull, not per partition).
"""
from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from ..errors import ConfigError, ProtocolError
from ..wire import DTYPE_CODE, SUMMABLE, decode_parts, split_frames
from .base import Route
from .secret import auth_secret

log = logging.getLogger("byteps_like.native")

#: wire dtype codes of the summable dtypes, what DataClient.submit takes
WIRE_CODE = {name: DTYPE_CODE[name] for name in SUMMABLE}


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def check(cfg) -> None:
    """Refuse, naming the replacement, a job the native data plane cannot serve (every
    worker-server byte moves on it): with BYTEPS_TRANSPORT=ucx its streams are UCX endpoints,
    which needs a ``_core`` that can load the libucx wheel's libucp (:mod:`.ucx_native`).
    BYTEPS_DATA_PLANE=zmq and BYTEPS_UCX_DEVICE_MEMORY=1 are refused when the configuration
    loads (config.py)."""
    if cfg.transport.transport != "ucx":
        return
    from . import ucx_native
    unavailable = ucx_native.load(loopback=loopback_job(cfg))
    if unavailable:
        raise ConfigError(
            f"BYTEPS_TRANSPORT=ucx: the native data plane's UCX streams are unavailable "
            f"({unavailable}); install byteps_like[ucx] so that _core loads libucp (rebuild "
            "_core if it was built before the extra), or unset BYTEPS_TRANSPORT for TCP "
            "(docs/transports.md)")


#: the peer name of a table stream's route (server/sparse.py answers on it)
TABLE_PEER = "table stream"


def table_route(stream: int) -> Route:
    """The route of a request that came on table stream ``stream`` of a server."""
    return Route(peer=TABLE_PEER, conn=stream)


class TableLink:
    """A worker process's table streams (csrc/dataplane_tables.h): one to each server, and a
    thread that hands their answers to ``on_answer(server, message)`` and a stream that
    closed to ``on_lost(server, why)``."""

    def __init__(self, cfg, rank: int, job: int, on_answer: Callable[[int, Any], None],
                 on_lost: Callable[[int, str], None]):
        from .. import _core
        key = auth_key(cfg)
        self.cfg, self.rank = cfg, rank
        self.client = _core.TableClient(rank, job, cfg.transport.max_message_bytes,
                                         auth_key=key)
        self.on_answer, self.on_lost = on_answer, on_lost
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="bpsl-tables", daemon=True)
        self._thread.start()

    def connect(self, server: int, host: str, port: int) -> None:
        """Open the table stream to server index ``server`` (RuntimeError: unreachable)."""
        self.client.connect(server, host, port, min(60.0, self.cfg.timeouts.register_timeout),
                            ucx=uses_ucx(self.cfg))

    def send(self, server: int, frames: list) -> bool:
        """Queue a request's frames (wire.encode) to server index ``server``; False when its
        stream is closed (its on_lost said why)."""
        return bool(self.client.send(server, *split_frames(frames)))

    def _run(self) -> None:
        max_bytes = self.cfg.transport.max_message_bytes
        while not self._closed:
            for server, header, meta, payload, lost in self.client.answers(0.5):
                try:
                    if lost:
                        self.on_lost(server, lost)
                    else:
                        self.on_answer(server, decode_parts(header, meta, payload, max_bytes))
                except ProtocolError as exc:
                    log.warning("a malformed table answer from server %d: %s", server, exc)
                except Exception:  # noqa: BLE001 - a bug must not end the answers' thread
                    log.exception("table answer from server %d", server)

    def close(self) -> None:
        self._closed = True
        self.client.close()
        if self._thread is not threading.current_thread():
            self._thread.join(5.0)


def loopback_job(cfg) -> bool:
    """Whether this node's job lives on loopback (its advertised host, DMLC_NODE_HOST, else
    the scheduler's, is a loopback address): a ``bpslaunch --local`` job, a single-node
    torchrun job. Such a job listens on loopback only, UCX's own sockets included."""
    host = (cfg.cluster.node_host or cfg.cluster.root_uri or "").strip().strip("[]")
    return host == "localhost" or host.startswith("127.") or host == "::1"


def uses_ucx(cfg) -> bool:
    """Whether the native plane's streams are UCX endpoints (else TCP sockets)."""
    return cfg.transport.transport == "ucx"


def auth_key(cfg) -> bytes:
    """The key the native plane's handshake proves knowledge of, derived from the job's secret
    (b"" without one). The secret itself never reaches the C++ side."""
    import hashlib
    import hmac

    secret = auth_secret(cfg)
    if not secret:
        return b""
    return hmac.new(secret.encode(), b"byteps_like native data plane v1",
                    hashlib.sha256).digest()


def io_threads(cfg) -> int:
    n = cfg.transport.io_threads
    return n if n > 0 else max(2, min(8, usable_cpus() // 2))


def streams(cfg) -> int:
    n = cfg.transport.data_streams
    return n if n > 0 else io_threads(cfg)


def store_budget(cfg) -> int:
    """A server's memory budget: BYTEPS_SERVER_MAX_BYTES, or by default 80% of the memory this
    machine (or its cgroup, when that is lower) has, divided among the servers that share the
    machine (:func:`local_servers`): two local servers took 160% of it between them before."""
    if cfg.server.max_bytes:
        return cfg.server.max_bytes
    return int(machine_memory() * 0.8) // local_servers(cfg)


def machine_memory() -> int:
    """Physical memory, or the cgroup's memory limit (v2 memory.max, v1 limit_in_bytes) when
    that is lower: a container sees the host's memory in sysconf."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):  # pragma: no cover
        total = 16 << 30
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                raw = f.read().strip()
        except OSError:
            continue
        if raw.isdigit() and 0 < int(raw) < total:
            total = int(raw)
    return total


def local_servers(cfg) -> int:
    """The servers that share this machine's default budget: BYTEPS_SERVER_LOCAL_SIZE, else
    every server of the job when this node's address is loopback (a loopback node serves only
    this machine: bpslaunch --local, a one-node torchrun job), else 1."""
    if cfg.server.local_servers:
        return cfg.server.local_servers
    return max(1, cfg.cluster.num_server) if loopback_job(cfg) else 1


def fd_budget() -> int:
    """Descriptors a process may spend on connections: its limit (ulimit -n) but 64."""
    import resource
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1 << 20
    return max(32, soft - 64)


def max_connections() -> int:
    """Streams a server's native data plane keeps: three quarters of the descriptor budget
    (the ZeroMQ socket next to it takes the rest, zmq_max_connections), at most 4096; more
    are closed as they arrive."""
    budget = fd_budget()
    return max(16, min(4096, budget - budget // 4))


def zmq_max_connections(cfg, data_plane: bool) -> int:
    """Clients a listening ZeroMQ socket keeps (BYTEPS_MAX_CONNECTIONS, else derived): the
    descriptor budget, a quarter of it where a native data plane listens too."""
    if cfg.transport.max_connections:
        return cfg.transport.max_connections
    budget = fd_budget()
    if data_plane:
        return max(16, budget // 4)  # a native plane listens next to it
    return max(16, min(budget, 1 << 16))


def data_port(cfg) -> int:
    """The port a server's data plane listens on: BYTEPS_SERVER_PORT + 1 when a fixed port
    is asked for (firewalls), else an ephemeral one; the node table carries it."""
    return cfg.cluster.server_port + 1 if cfg.cluster.server_port else 0


def decode_error_meta(raw: bytes) -> dict:
    """A server's ERROR meta (JSON, at most 1 MiB, checked in C++): kind, message and any
    further members (peer_left: rank, last_round)."""
    try:
        meta = json.loads(raw.decode("utf-8"))
        if isinstance(meta, dict):
            return {**meta, "kind": str(meta.get("kind", "internal")),
                    "message": str(meta.get("message", "error"))}
    except (UnicodeDecodeError, ValueError, RecursionError):
        pass
    return {"kind": "protocol", "message": f"unreadable error from the server: {raw[:200]!r}"}


def decode_error(raw: bytes) -> tuple[str, str]:
    """(kind, message) of a server's ERROR meta."""
    meta = decode_error_meta(raw)
    return meta["kind"], meta["message"]


class Completions(threading.Thread):
    """Takes the data plane's completions in batches (the GIL is released while it waits) and
    hands each to ``on_done``. Waiters of a push_pull take their own completion directly
    (``DataClient.wait`` + ``take``), which saves a thread handoff; this thread serves the
    rest (asynchronous handles, pipeline stages)."""

    def __init__(self, client: Any, on_done: Callable[[tuple], None]):
        super().__init__(name="bpsl-native-completions", daemon=True)
        self.client = client
        self.on_done = on_done
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            try:
                batch = self.client.completions(0.25)
            except RuntimeError:  # closed
                return
            for comp in batch:
                try:
                    self.on_done(comp)
                except Exception:  # noqa: BLE001 - a bug must not stop completions
                    log.exception("native data plane: completion handler failed")

    def stop(self) -> None:
        self._halt.set()
        if self.is_alive() and self is not threading.current_thread():
            self.join(2.0)
