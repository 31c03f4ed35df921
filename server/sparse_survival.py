"""What keeps a server's tables (docs/sparse.md, "Checkpoints" and "Losing a server"): the
checkpoints workers ask for (``table.save`` / ``table.load``), the incremental snapshots of
BYTEPS_SPARSE_SURVIVAL=snapshot, and the rollback to them after a lost server.

Files are written by :class:`~.snapshots.Writer`'s thread, so the thread that serves the tables
never waits for a disk: a save copies the shard's rows on the tables' thread and is answered
once the writer has written them; a snapshot copies the rows updated since the previous one.

**Rollback.** When a server is lost, each worker asks every server left to restore each table
(SPARSE_LOAD with ``restore``: the failover's number, the lost shards and the server that now
holds each of them). The first such request a server sees for a failover decides the round
``R`` every table goes back to: the newest round the lost shards' snapshot chains hold (they
are final, so every server finds the same one). The server waits until it has applied round
``R`` itself (the pushes of every round up to it reached every server before the lost one
applied it), writes out what its writer holds, and rebuilds each shard it holds, its own and
those it takes over, from their chains up to ``R``; every waiting request is answered with a
``rolled_back`` error. A table request's header flags carry its worker's generation, the newest
failover it went back for (answers echo them): a request of an older generation than the
table's, sent before its worker went back, is refused the same way, whatever order the
worker's threads' messages arrive in; and the worker takes no answer of another generation.
"""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from ..embedding import (
    MAX_TABLES,
    TableError,
    TableShard,
    TableSpec,
    load_shard,
    state_bytes,
    wire_key,
)
from ..transport import Route
from ..wire import ERR_ROLLBACK, Message, MsgType, generation
from . import snapshots
from .table import Table, waiting_headers

if TYPE_CHECKING:
    from .sparse import SparseService

log = logging.getLogger("byteps_like.server")


class Survival:
    """Checkpoints, snapshots and rollbacks of one server's tables (the tables' thread)."""

    def __init__(self, service: SparseService):
        self.svc = service
        srv = service.server
        self.mode = srv.cfg.server.sparse_survival
        self.every = srv.cfg.server.sparse_snapshot_steps
        self.directory = srv.cfg.server.sparse_checkpoint_dir
        self.writer = snapshots.Writer(lambda: self.svc.server.rank)
        self.adopted: set[int] = set()        # shards taken over from lost servers
        self.generation: dict[int, int] = {}  # table id -> the failover it was restored for
        self.restored_to: dict[int, int] = {}  # table id -> the round it went back to
        self.deferred: dict[int, list] = {}   # table id -> restores waiting for rounds
        self.snapshots = 0
        self.changed_bytes = 0                # what the snapshots held (ids, rows, state)
        self.rollbacks = 0
        self.rounds_rolled_back = 0
        self.loaded: dict[tuple, dict] = {}   # (table key, tag) -> a snapshot load's answer

    @property
    def rank(self) -> int:
        return self.svc.server.rank

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()

    def stats(self) -> dict:
        w = self.writer
        return {"snapshots": self.snapshots, "snapshot_changed_bytes": self.changed_bytes,
                "snapshot_bytes_written": w.bytes_written, "snapshot_write_s": round(w.seconds, 3),
                "rollbacks": self.rollbacks, "rounds_rolled_back": self.rounds_rolled_back}

    # -- snapshots ----------------------------------------------------------------------------
    def folder(self, table: Table, shard: int | None = None) -> str:
        return self.folder_for(table.spec, table.shard.shard if shard is None else shard,
                               table.shards)

    def folder_for(self, spec: TableSpec, shard: int, shards: int) -> str:
        """Where shard ``shard`` of ``shards`` of table ``spec`` keeps its snapshots; ""
        without snapshots. TableError when snapshots have no directory."""
        if self.mode != "snapshot":
            return ""
        return snapshots.chain_dir(self.directory, self.svc.server.job, spec, shard, shards)

    def check(self) -> None:
        """TableError when this server takes snapshots and has no directory for them."""
        if self.mode == "snapshot":
            snapshots.require_directory(self.directory)

    def _shards_of(self, tid: int) -> list[Table]:
        """The shards of table ``tid`` this server holds."""
        return [t for t in self.svc.tables.values() if t.key % MAX_TABLES == tid]

    def after_apply(self, table: Table) -> None:
        """A round was applied: every K rounds, hand the rows it changed to the writer."""
        if self.mode != "snapshot" or table.applied % self.every:
            return
        state = table.shard.take_changes()
        self.changed_bytes += sum(a.nbytes for a in state.values())
        if not self.snapshots:   # what a later job's load_snapshots names
            log.info("server %d: snapshots of the tables go to %s every %d rounds "
                     "(BYTEPS_SPARSE_SURVIVAL=snapshot)", self.rank,
                     os.path.dirname(os.path.dirname(self.folder(table))), self.every)
        self.snapshots += 1
        path = os.path.join(self.folder(table), f"r{table.applied:010d}.bpst")
        self.writer.put(path, table.spec, table.shard.shard, table.shards, state)

    # -- checkpoints ----------------------------------------------------------------------------
    def checkpoint(self, table: Table, route: Route, msg: Message) -> None:
        """Save or load the shard for the tag in the meta, once per (tag, round): every worker
        may ask, the first one does it. A load needs the round not yet pushed by anyone. A
        save is written by the writer and answered once it is on disk."""
        h, srv = msg.header, self.svc.server
        meta = msg.meta or {}
        snaps = meta.get("snapshots")   # a load of another job's snapshots (load_snapshots)
        tag = meta.get("tag") if snaps is None else f"{snaps}@{meta.get('round')}"
        tag = tag if isinstance(tag, str) else ""   # refused by the tag's check
        key = (h.type, tag)
        what = "save" if h.type is MsgType.SPARSE_SAVE else "load"
        if table.done.get(key) == h.round:
            srv.reply(route, MsgType.SPARSE_ACK, h, self.loaded.get((table.key, tag)))
            return
        if key in table.saving:   # being written: answered with the first one
            table.saving[key][1].append((route, h))
            return
        if what == "load" and table.pushes:
            self.svc.refuse(route, h, "load during an open round", f"table "
                            f"{table.spec.name!r}: load of {tag!r} from worker rank {h.rank} "
                            f"while round {h.round} is being pushed; load before the step's "
                            "pushes")
            return
        # the plane answers no pull while rows are loaded; reopened however the load ends
        loading = what == "load"
        late = self.svc.plane.closed(table) if loading else []
        try:
            if what == "save":
                self._save(table, tag, key, route, msg)
                return
            self.writer.flush()   # a save of the same tag finishes first
            if snaps is not None:
                rnd, n = snapshots.load_job(table.shard, self.directory, snaps,
                                            meta.get("round"), charge=srv.charge)
                self.loaded[(table.key, tag)] = {"round": rnd}
                log.info("server %d: shard %d of table %r loaded from %s as of its round %d: "
                         "%d rows", srv.rank, table.shard.shard, table.spec.name, snaps, rnd, n)
            else:
                n = load_shard(table.shard, self.directory, tag, charge=srv.charge,
                               repair=srv.cfg.server.sparse_checkpoint_repair)
                log.info("server %d: table %r loaded from checkpoint %r: %d rows", srv.rank,
                         table.spec.name, tag, n)
            # what was loaded goes into this job's next snapshot: a later rollback rebuilds
            # from the initial rows and the chain, which must hold it
            with table.shard.locked():
                table.shard.changed[:] = table.shard.made
        except (TableError, OSError, ValueError) as exc:
            what = "snapshots" if snaps is not None else f"checkpoint {tag!r}"
            self.svc.refuse(route, h, "sparse load failed", f"table {table.spec.name!r}: "
                            f"load of {what} from worker rank {h.rank}: {exc}")
            return
        finally:
            if loading:
                self.svc.plane.reopen(table, late)
        self._done(table, key, h.round)
        srv.reply(route, MsgType.SPARSE_ACK, h, self.loaded.get((table.key, tag)))

    def _save(self, table: Table, tag: str, key: tuple, route: Route, msg: Message) -> None:
        from ..embedding import checkpoint_path
        h = msg.header
        path = checkpoint_path(self.directory, tag, table.spec, table.shard.shard, table.shards)
        table.saving[key] = (h.round, [(route, h)])

        def written(error: str | None) -> None:   # the writer's thread: back to the tables'
            self.svc.put(("saved", table.key, key, path, error))
        self.writer.put(path, table.spec, table.shard.shard, table.shards,
                        table.shard.state(), written)

    def saved(self, tid_key: int, key: tuple, path: str, error: str | None) -> None:
        """The writer wrote (or failed to write) a save: answer everyone who asked for it."""
        table = self.svc.tables.get(tid_key)
        if table is None or key not in table.saving:
            return
        rnd, waiting = table.saving.pop(key)
        srv = self.svc.server
        if error is None:
            log.info("server %d: table %r saved as %s", srv.rank, table.spec.name, path)
            self._done(table, key, rnd)
        for route, h in waiting:
            if error is None:
                srv.reply(route, MsgType.SPARSE_ACK, h)
            else:
                self.svc.refuse(route, h, "sparse save failed", f"table {table.spec.name!r}: "
                                f"save of checkpoint {key[1]!r} from worker rank {h.rank}: "
                                f"{error}")

    @staticmethod
    def _done(table: Table, key: tuple, rnd: int) -> None:
        if len(table.done) > 64:
            table.done.clear()
        table.done[key] = rnd

    # -- rollback after a lost server ----------------------------------------------------------
    def refuse_unrolled(self, route: Route, msg: Message) -> bool:
        """Refuse (True) a request sent before its worker went back to the restored round: its
        flags carry the newest rollback the worker had made (its generation)."""
        h = msg.header
        tid = h.key % MAX_TABLES
        expected = self.generation.get(tid, 0)
        if generation(h.flags) >= expected:
            return False
        self.svc.refuse(route, h, "request from before a rollback", (
            f"table id {tid}: {h.type.name} of round {h.round} from worker rank {h.rank}: the "
            f"tables went back to round {self.restored_to[tid]} after losing a server"),
            ERR_ROLLBACK, {"failover": expected, "round": self.restored_to[tid]})
        return True

    def restore(self, route: Route, msg: Message) -> None:
        """A worker asks for the rollback of failover ``restore`` (module docstring)."""
        h, meta = msg.header, msg.meta or {}
        tid, number = h.key % MAX_TABLES, meta.get("restore")
        lost, holders = meta.get("lost"), meta.get("holders")
        shards = self.svc.server.cfg.cluster.num_server
        if (self.mode != "snapshot" or type(number) is not int or not isinstance(lost, list)
                or not isinstance(holders, dict) or len(lost) > shards
                or any(type(s) is not int or not 0 <= s < shards for s in lost)):
            self.svc.refuse(route, h, "bad restore request", f"table id {tid}: a restore from "
                            f"worker rank {h.rank} that is malformed, or this server does not "
                            "take snapshots (BYTEPS_SPARSE_SURVIVAL differs between nodes)")
            return
        if number <= self.generation.get(tid, 0):   # done for an earlier request
            self._answer(route, msg, tid)
            return
        self.deferred.setdefault(tid, []).append((route, msg))
        self.try_deferred(tid)

    def try_deferred(self, tid: int) -> None:
        """Run the restores waiting for table ``tid`` once its shards reached the round."""
        waiting = self.deferred.get(tid)
        if not waiting:
            return
        route, msg = waiting[0]
        meta = msg.meta or {}
        mine = self._shards_of(tid)
        if not mine:
            return
        template = mine[0]
        try:
            lost_dirs = [self.folder(template, s) for s in meta["lost"]]
            upto = snapshots.newest_round(lost_dirs, self.every)
        except TableError as exc:
            self._fail_all(tid, str(exc))
            return
        if any(t.applied < upto for t in mine):
            return   # the pushes of the rounds before it are on their way: tried again then
        del self.deferred[tid]
        # the plane answers none meanwhile; reopened however the rollback ends (a shard's
        # late pulls were refused by its rewind, or come back to this thread here)
        late = {t.key: self.svc.plane.closed(t) for t in mine}
        try:
            before = self._rebuild(tid, mine, meta, upto, late)
            self.generation[tid], self.restored_to[tid] = meta["restore"], upto
        except (TableError, OSError, ValueError) as exc:
            for r, m in waiting:
                self.svc.refuse(r, m.header, "rollback failed", f"table {template.spec.name!r}"
                                f": server {self.rank} cannot go back to round {upto}: {exc}")
            return
        finally:
            for t in self._shards_of(tid):
                self.svc.plane.reopen(t, late.get(t.key, ()))
        self.rollbacks += 1
        self.rounds_rolled_back += max(0, before - upto)
        log.warning("server %d: table %r went back %d round(s) to round %d, the newest "
                    "snapshot of lost shard(s) %s (BYTEPS_SPARSE_SURVIVAL=snapshot)", self.rank,
                    template.spec.name, before - upto, upto, meta["lost"])
        for r, m in waiting:
            self._answer(r, m, tid)

    def _rebuild(self, tid: int, mine: list, meta: dict, upto: int, late: dict) -> int:
        """Every shard of table ``tid`` this server holds now, rebuilt as of round ``upto``;
        returns the round the tables had reached."""
        self.writer.flush()
        svc, srv = self.svc, self.svc.server
        before = max(t.applied for t in mine)
        template = mine[0]
        for key, holder in sorted(meta["holders"].items()):
            s = int(key) if str(key).isdigit() else -1
            if holder == self.rank and 0 <= s < srv.cfg.cluster.num_server \
                    and wire_key(tid, s) not in svc.tables:
                self.adopt(template, s)
                self.adopted.add(s)
        for t in self._shards_of(tid):
            snapshots.restore(t.shard, self.folder(t), self.every, upto, charge=srv.charge)
            self.rewind(t, upto, meta["restore"], late.pop(t.key, ()))
        return before

    def adopt(self, template: Table, shard: int) -> None:
        """Hold shard ``shard`` of ``template``'s table too (a lost server's, rebuilt from its
        snapshots by the caller), charged to the memory budget."""
        spec, shards = template.spec, template.shards
        shard_obj = TableShard(spec, shard, shards)
        need = state_bytes(spec, shard_obj.nrows)
        if not self.svc.server.charge(need):
            raise TableError(f"shard {shard} of table {spec.name!r} needs {need} bytes, over "
                             f"the server's budget of {self.svc.server.budget} bytes "
                             "(BYTEPS_SERVER_MAX_BYTES)")
        key = wire_key(template.key % MAX_TABLES, shard)
        self.svc.plane.add(Table(spec, shard_obj, shards, template.decl_rank, need,
                           applied=template.applied, key=key), open_=False)
        log.warning("server %d: took over shard %d of table %r from a lost server",
                    self.rank, shard, spec.name)

    def rewind(self, table: Table, rnd: int, number: int, late: list | tuple = ()) -> None:
        """The table went back to round ``rnd`` (a rollback): its open round is dropped and what
        waited (``late``: the pulls the plane had parked) is answered with a rolled_back
        error."""
        waiting, table.pending = waiting_headers(table, list(late)), []
        table.pushes, table.average, table.round_started = {}, None, None
        table.applied = rnd
        for route, h in waiting:
            self.svc.refuse(route, h, "request from before a rollback", f"table "
                            f"{table.spec.name!r}: the tables went back to round {rnd} after "
                            "losing a server", ERR_ROLLBACK, {"round": rnd, "failover": number})

    def _fail_all(self, tid: int, text: str) -> None:
        for r, m in self.deferred.pop(tid, []):
            self.svc.refuse(r, m.header, "rollback failed", text)

    def _answer(self, route: Route, msg: Message, tid: int) -> None:
        self.svc.server.reply(route, MsgType.SPARSE_ACK, msg.header,
                              {"round": self.restored_to[tid]})
