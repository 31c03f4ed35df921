"""Incremental snapshots of the server-held tables and the writer that keeps disks off the
tables' thread (BYTEPS_SPARSE_SURVIVAL=snapshot; docs/sparse.md, "Losing a server").

Every BYTEPS_SPARSE_SNAPSHOT_STEPS rounds (K) a server copies, on the tables' thread, the rows
of each shard it holds that were updated since its previous snapshot (and their optimizer
state) and hands the copy to :class:`Writer`, whose thread writes it as one shard file
(byteps_like/shardfile.py: checksummed, atomic, 0600)::

    BYTEPS_SPARSE_CHECKPOINT_DIR/snapshots-<job>/<table>/shard<s>of<S>/r<round>.bpst

A shard's snapshots form a chain: rounds K, 2K, ..., each file holding the rows that changed in
the K rounds before it (empty files included, so the chain has no holes). Restoring round R is
the table's initial rows with the chain up to R laid over them in order. A lost server's chain is
final: the newest round its chain holds is the round every table goes back to
(:func:`newest_round`). Checkpoints (``table.save``) go through the same writer.
"""
from __future__ import annotations

import logging
import os
import queue
import re
import threading
import time
from collections.abc import Callable

from .. import shardfile
from ..embedding import TableShard, TableSpec, file_name

log = logging.getLogger("byteps_like.server")

#: snapshots and checkpoints handed to the writer and not yet written, at most; the tables'
#: thread waits for room beyond it (a disk slower than the rounds)
WRITER_DEPTH = 8
_ROUND = re.compile(r"r(\d{10})" + re.escape(shardfile.SUFFIX))


def require_directory(directory: str) -> None:
    """TableError unless snapshots have a directory."""
    if not directory:
        raise shardfile.TableError("BYTEPS_SPARSE_SURVIVAL=snapshot needs a directory: set "
                                   "BYTEPS_SPARSE_CHECKPOINT_DIR on the servers")


def chain_dir(directory: str, job: int, spec: TableSpec, shard: int, shards: int) -> str:
    """The folder of shard ``shard`` of ``shards``' snapshots of the table ``spec``."""
    require_directory(directory)
    return os.path.join(directory, f"snapshots-{job}", file_name(spec),
                        f"shard{shard}of{shards}")


def chain(folder: str, every: int) -> list[int]:
    """The rounds of the snapshots in ``folder`` from the first (``every``) on, up to the
    first missing one: the rounds that can be restored."""
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    have = {int(m.group(1)) for n in names if (m := _ROUND.fullmatch(n))}
    out, r = [], every
    while r in have:
        out.append(r)
        r += every
    return out


def newest_round(folders: list[str], every: int) -> int:
    """The newest round that every one of these chains holds (0: none, the initial rows)."""
    return min((max(chain(f, every), default=0) for f in folders), default=0)


def restore(shard: TableShard, folder: str, every: int, upto: int,
            charge: Callable[[int], bool] | None = None) -> int:
    """Shard ``shard`` as it was after round ``upto``: its initial rows with the snapshots of
    ``folder`` (written by a shard of the same number and layout) up to ``upto`` laid over
    them. Returns the rows read. TableError names a damaged or missing file."""
    rounds = [r for r in chain(folder, every) if r <= upto]
    if upto and (not rounds or rounds[-1] != upto):
        raise shardfile.TableError(f"table {shard.spec.name!r}: the snapshots in {folder} do "
                                   f"not reach round {upto} (they hold {rounds[-1:] or 'none'})")
    expect = _expect(shard)
    shard.forget()
    taken = sum(_lay_over(shard, folder, r, shard.shard, shard.shards, expect, charge)
                for r in rounds)
    shard.changed[:] = False
    return taken


def _expect(shard: TableShard) -> shardfile.Expect:
    """What a snapshot file of ``shard``'s table must hold: its spec, its optimizer's state."""
    return shardfile.Expect(shard.spec.to_json(),
                            [n for n in shardfile.STATE_DTYPES if getattr(shard, n) is not None])


def _lay_over(shard: TableShard, folder: str, rnd: int, s: int, shards: int,
              expect: shardfile.Expect, charge: Callable[[int], bool] | None) -> int:
    """Lay the snapshot of round ``rnd`` in ``folder`` (written by shard ``s`` of ``shards``)
    over ``shard``, the bytes read charged to the memory budget meanwhile. Returns the rows
    taken; TableError names a damaged file."""
    path = os.path.join(folder, f"r{rnd:010d}{shardfile.SUFFIX}")
    data, nbytes, _ = shardfile.read(path, s, shards, expect, charge=charge)
    try:
        return shard.restore(data)
    finally:
        if charge is not None and nbytes:
            charge(-nbytes)


#: a job's snapshot folder, as load_snapshots names it (no path: it is under the directory)
_JOB_FOLDER = re.compile(r"snapshots-\d{1,20}")
_SHARD_FOLDER = re.compile(r"shard(\d{1,6})of(\d{1,6})")


def load_job(shard: TableShard, directory: str, folder: str, upto: object,
             charge: Callable[[int], bool] | None = None) -> tuple[int, int]:
    """Shard ``shard`` of this job as another job's table stood after its round ``upto``
    (0 or None: the newest round every one of its shards' chains holds), read from that
    job's snapshots (``directory/folder/<table>/shard<s>of<S>``), whatever its number of
    servers: every old shard's chain is laid over the initial rows, and the rows this shard
    holds are taken. Returns (the round, the rows taken). TableError names what is wrong."""
    require_directory(directory)
    name = shard.spec.name
    if not isinstance(folder, str) or not _JOB_FOLDER.fullmatch(folder):
        raise shardfile.TableError(f"snapshots {folder!r}: name a job's snapshot folder under "
                                   "BYTEPS_SPARSE_CHECKPOINT_DIR, snapshots-<number>")
    if upto is not None and (type(upto) is not int or upto < 0):
        raise shardfile.TableError(f"table {name!r}: snapshot round {upto!r} is not a round")
    base = os.path.join(directory, folder, file_name(shard.spec))
    try:
        names = os.listdir(base)
    except OSError as exc:
        raise shardfile.TableError(f"table {name!r}: no snapshots of it in {base} "
                                   f"({exc.strerror})") from None
    found: dict[int, set[int]] = {}
    for n in names:
        if m := _SHARD_FOLDER.fullmatch(n):
            found.setdefault(int(m.group(2)), set()).add(int(m.group(1)))
    complete = [k for k, v in found.items() if v == set(range(k))]
    if len(complete) != 1:
        raise shardfile.TableError(f"table {name!r}: the snapshots in {base} have "
                                   f"{len(complete)} complete sets of shard folders, not one "
                                   f"(found {sorted((k, sorted(v)) for k, v in found.items())})")
    shards = complete[0]
    folders = [os.path.join(base, f"shard{s}of{shards}") for s in range(shards)]
    every = min((int(m.group(1)) for f in folders for n in _listdir(f)
                 if (m := _ROUND.fullmatch(n))), default=0)
    newest = newest_round(folders, every) if every else 0
    rnd = newest if not upto else upto
    if rnd > newest or (every and rnd % every):
        raise shardfile.TableError(f"table {name!r}: the snapshots in {base} do not all hold "
                                   f"round {rnd} (their rounds: every {every} up to {newest})")
    expect = _expect(shard)
    shard.forget()
    for s, f in enumerate(folders):
        for r in (r for r in chain(f, every) if r <= rnd) if every else ():
            _lay_over(shard, f, r, s, shards, expect, charge)
    return rnd, int(shard.made.sum())


def _listdir(folder: str) -> list[str]:
    try:
        return os.listdir(folder)
    except OSError:
        return []


class Writer(threading.Thread):
    """Writes what the tables' thread hands it, in order, on a thread of its own."""

    def __init__(self, rank: Callable[[], int]):
        super().__init__(name="bpsl-snapshots", daemon=True)
        self.rank = rank   # the server's, once registered
        self.q: queue.Queue = queue.Queue(WRITER_DEPTH)
        self.bytes_written = 0
        self.seconds = 0.0
        self.failed: str | None = None

    def put(self, path: str, spec: TableSpec, shard: int, shards: int, state: dict,
            done: Callable[[str | None], None] | None = None) -> None:
        """Write ``state`` at ``path`` (shardfile.write) and then call ``done(error)``."""
        if not self.is_alive():
            self.start()
        self.q.put((path, spec, shard, shards, state, done))

    def flush(self) -> None:
        """Wait until everything handed over is written."""
        if self.is_alive():
            self.q.join()

    def close(self) -> None:
        if self.is_alive():
            self.q.put(None)
            self.join(30.0)

    def run(self) -> None:
        while True:
            item = self.q.get()
            if item is None:
                self.q.task_done()
                return
            path, spec, shard, shards, state, done = item
            error = None
            t0 = time.monotonic()
            try:
                shardfile.write(path, spec.to_json(), shard, shards, state)
                self.bytes_written += os.path.getsize(path)
            except (OSError, ValueError) as exc:
                error = f"cannot write {path}: {exc}"
                if self.failed is None:
                    log.error("server %d: %s", self.rank(), error)
                self.failed = error
            self.seconds += time.monotonic() - t0
            try:
                if done is not None:
                    done(error)
            finally:
                self.q.task_done()
