"""Asynchronous mode's parameters surviving a lost server (``BYTEPS_ASYNC_SNAPSHOT_SECONDS``;
docs/reliability.md, "Losing a server").

In asynchronous mode the servers hold the model itself: each key's value is the sum of every
push. With snapshots on, every T seconds each server copies the value of every key it holds
(between two pushes: ``DataServer.async_values``) and a thread of its own writes them as one
file, replaced atomically (the newest only)::

    BYTEPS_SPARSE_CHECKPOINT_DIR/async-<job>/server<rank>.bpsa

When a server is lost, the scheduler tells the servers left (``FAILOVER``) and waits for them
before it lets the workers go on: each server reads the lost server's file and hands the values
of the keys that move to it (rendezvous hashing over the servers alive, as the workers route
them) to the native plane (``DataServer.adopt_async``), so that a moved key's store made here
starts from its snapshot instead of zero; then it answers ``SEEDED``. The moved keys go back to the
snapshot: the pushes applied to them since (at most T seconds of them) are lost, and each
server logs how old the snapshot was. A key made after the snapshot starts again from zero
(as it stood then). A push that was in flight when the server was lost is sent again by its
worker and applied here; if the lost server had applied it before its snapshot, it counts
twice.

The file: ``MAGIC``, a little-endian u32 header length, a JSON header (format, job, rank,
time, keys as ``[key, wire dtype code, offset, nbytes]``), the values, and a SHA-256 of all that
comes before it. A reader checks every length before it allocates, and the checksum.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import threading
import time
from typing import Any

from .. import _core
from ..shardfile import write_checksummed

log = logging.getLogger("byteps_like.server")

MAGIC = b"BPSASYN1"
SUFFIX = ".bpsa"
#: the largest JSON header a reader takes
MAX_HEADER = 64 << 20
_DIGEST = 32


class SnapshotError(ValueError):
    """A snapshot file that cannot be used: what is wrong and where."""


def path_for(directory: str, job: int, rank: int) -> str:
    return os.path.join(directory, f"async-{job}", f"server{rank}{SUFFIX}")


def write(path: str, job: int, rank: int, values: list[tuple[int, int, bytes]],
          taken: float) -> int:
    """Write ``values`` ((key, wire dtype code, bytes) each, copied at wall-clock time
    ``taken``) at ``path`` (shardfile.write_checksummed: 0600, atomic, fsynced). Returns the
    bytes written."""
    keys, offset = [], 0
    for key, dtype, data in values:
        keys.append([key, dtype, offset, len(data)])
        offset += len(data)
    head = json.dumps({"format": 1, "job": job, "rank": rank, "time": taken,
                       "keys": keys}).encode()
    return write_checksummed(path, MAGIC, head, (data for _k, _d, data in values))


def read(path: str, limit: int) -> tuple[dict, dict[int, tuple[int, bytes]]]:
    """The header and values (key -> (wire dtype code, bytes)) of the file at ``path``, of
    at most ``limit`` bytes. SnapshotError names what is wrong."""
    try:
        size = os.path.getsize(path)
    except OSError as exc:
        raise SnapshotError(f"{path}: {exc.strerror}") from None
    if size > limit:
        raise SnapshotError(f"{path}: {size} bytes, over the {limit} this server may take "
                            "(BYTEPS_SERVER_MAX_BYTES)")
    with open(path, "rb") as f:
        raw = f.read(size + 1)
    if len(raw) != size or size < len(MAGIC) + 4 + _DIGEST or not raw.startswith(MAGIC):
        raise SnapshotError(f"{path}: not an asynchronous snapshot (or truncated)")
    if hashlib.sha256(raw[:-_DIGEST]).digest() != raw[-_DIGEST:]:
        raise SnapshotError(f"{path}: checksum mismatch (damaged)")
    (hlen,) = struct.unpack_from("<I", raw, len(MAGIC))
    start = len(MAGIC) + 4
    if hlen > MAX_HEADER or start + hlen > size - _DIGEST:
        raise SnapshotError(f"{path}: header of {hlen} bytes does not fit the file")
    try:
        head = json.loads(raw[start:start + hlen])
        data = memoryview(raw)[start + hlen:size - _DIGEST]
        out: dict[int, tuple[int, bytes]] = {}
        for key, dtype, off, n in head["keys"]:
            if not all(type(v) is int for v in (key, dtype, off, n)) or off < 0 or n < 0 \
                    or off + n > len(data):
                raise SnapshotError(f"{path}: key {key!r} at {off!r}+{n!r} is not in the file")
            out[key] = (dtype, bytes(data[off:off + n]))
    except (ValueError, KeyError, TypeError) as exc:
        if isinstance(exc, SnapshotError):
            raise
        raise SnapshotError(f"{path}: malformed header ({exc})") from None
    return head, out


class AsyncSnapshots:
    """One server's snapshots of its asynchronous keys, and its part in a lost server's."""

    def __init__(self, server: Any):
        self.server = server
        cfg = server.cfg
        self.every = cfg.server.async_snapshot_seconds
        self.directory = cfg.server.sparse_checkpoint_dir
        self.files = 0
        self.adopted_from: set[int] = set()
        self._due = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bpsl-async-snapshots",
                                        daemon=True)

    @staticmethod
    def wanted(cfg: Any) -> bool:
        return bool(cfg.server.enable_async and cfg.server.async_snapshot_seconds > 0
                    and cfg.can_lose_servers)

    def check(self) -> None:
        if not self.directory:
            from ..errors import ConfigError
            raise ConfigError("BYTEPS_ASYNC_SNAPSHOT_SECONDS needs a directory every server "
                              "reaches: set BYTEPS_SPARSE_CHECKPOINT_DIR on the servers")

    def start(self) -> None:
        """Once the server has its rank: a snapshot every ``every`` seconds, and FAILOVER."""
        self.server.control.on_failover = self.on_failover
        self._thread.start()
        self.server.ep.add_timer(self.every, self._due.set)

    def close(self) -> None:
        self._stop.set()
        self._due.set()
        if self._thread.is_alive():
            self._thread.join(10.0)

    @property
    def path(self) -> str:
        return path_for(self.directory, self.server.job, self.server.rank)

    def _run(self) -> None:
        while True:
            self._due.wait()
            self._due.clear()
            if self._stop.is_set():
                return
            try:
                taken = time.time()   # before the copy: the values hold every push up to it
                values = self.server.native.async_values()
                write(self.path, self.server.job, self.server.rank, values, taken)
                self.files += 1
                if self.files == 1:
                    log.info("server %d: asynchronous snapshots of %d key(s) go to %s every "
                             "%g s (BYTEPS_ASYNC_SNAPSHOT_SECONDS)", self.server.rank,
                             len(values), self.path, self.every)
            except (OSError, ValueError) as exc:
                log.error("server %d: cannot write the asynchronous snapshot %s: %s",
                          self.server.rank, self.path, exc)

    def on_failover(self, number: int, meta: dict) -> None:
        """The scheduler's FAILOVER (I/O thread): take the lost servers' snapshots on a thread
        of its own, then SEEDED."""
        threading.Thread(target=self._adopt, args=(number, meta), daemon=True,
                         name="bpsl-async-adopt").start()

    def _adopt(self, number: int, meta: dict) -> None:
        srv = self.server
        gone = {r for r in meta.get("lost", []) if type(r) is int}
        lost = [r for r in gone if r != srv.rank and r not in self.adopted_from]
        # the keys that move here: a lost server's key goes to the server rendezvous hashing
        # picks among those alive (the native client's route); the others' are not held here
        alive = [r for r in range(srv.cfg.cluster.num_server) if r not in gone]
        ages: dict[str, float] = {}   # lost server -> its snapshot's age (-1: none), said
        # to the workers in RESUME
        for rank in lost:
            path = path_for(self.directory, srv.job, rank)
            try:
                head, values = read(path, srv.budget)
            except SnapshotError as exc:
                if not os.path.exists(path):
                    log.warning("server %d: lost server %d left no asynchronous snapshot (%s):"
                                " its keys start again from zero here", srv.rank, rank, path)
                else:
                    log.error("server %d: the asynchronous snapshot of lost server %d cannot "
                              "be used: %s; its keys start again from zero here", srv.rank,
                              rank, exc)
                self.adopted_from.add(rank)
                ages[str(rank)] = -1.0
                continue
            mine = {key: data for key, (_dtype, data) in values.items()
                    if _core.failover_owner(key, alive) == srv.rank}
            refused = sum(not srv.native.adopt_async(key, data) for key, data in mine.items())
            if refused:
                log.error("server %d: %d key(s) of lost server %d's snapshot do not fit the "
                          "memory budget (BYTEPS_SERVER_MAX_BYTES): they start again from zero "
                          "here", srv.rank, refused, rank)
            self.adopted_from.add(rank)
            age = time.time() - float(head.get("time", 0.0))
            ages[str(rank)] = round(age, 3)
            log.warning("server %d: the parameters of lost server %d's %d key(s) go back to "
                        "its snapshot of %.2f s ago (BYTEPS_ASYNC_SNAPSHOT_SECONDS=%g): the "
                        "%d that move here start from it", srv.rank, rank, len(values), age,
                        self.every, len(mine))
        srv.control.seeded(number, {"async_snapshot_age": ages})
