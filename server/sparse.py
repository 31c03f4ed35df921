"""Server-held embedding tables: a server's shards, their rounds and their updates (docs/sparse.md).

Every worker declares a table to every server with SPARSE_CREATE (its spec as JSON and the
shard that server holds); the first declaration makes the shard, its memory charged to the
server's budget (BYTEPS_SERVER_MAX_BYTES) before anything is allocated; a later one that
differs fails the table, naming both workers. Then each training step ``t`` of each worker is

* SPARSE_PULL, round ``t``: the row ids of its batch this shard holds (int64); answered with
  SPARSE_ROWS (their float32 rows) once round ``t - 1`` is applied;
* SPARSE_PUSH, round ``t``: the same kind of ids and their gradients; answered with SPARSE_ACK.
  When every worker has pushed round ``t`` the server sums the pushes per row (in worker rank
  order, so the bits do not depend on arrival) and applies the table's optimizer to those rows.

Every request is checked before anything is allocated for it: the table exists, the dtype and
the length fit the table's row size, at most BYTEPS_SPARSE_MAX_IDS ids, every id in range and
on this shard, the round is the open one. A failed check is answered with an ERROR naming the
table, the id and the worker rank; it changes nothing. Requests and answers travel on the native
data plane's table streams (csrc/dataplane_tables.h: one per worker process and server, its
bytes moved and its lengths checked by the plane's I/O threads); one Python thread serves
every table, taking the requests from the plane's inbox; its numpy work is vectorised over the
rows.

Membership follows the dense keys' rules (docs/sparse.md, "Membership"), applied in this
thread's queue order: a round needs the pushes of the machines not in join(), and fails with
peer_left when a machine left without it; an elastic epoch drops every open round and starts
each table at the epoch's first round. In asynchronous mode a push is applied as it arrives and
a pull answered at once.
"""
from __future__ import annotations

import json
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING

import numpy as np

from ..embedding import (
    MAX_TABLES,
    PHASES_TAG,
    StepPhases,
    TableError,
    TableShard,
    TableSpec,
    held_shards,
    state_bytes,
    sum_rows,
)
from ..errors import ProtocolError
from ..transport import Route, native
from ..wire import (
    ERR_EPOCH,
    ERR_INTERNAL,
    ERR_MISMATCH,
    ERR_PEER_LEFT,
    ERR_PROTOCOL,
    Header,
    Message,
    MsgType,
    Role,
    as_buffer,
    decode_header,
    decode_parts,
    encode,
    generation,
    generation_flags,
)
from .sparse_survival import Survival
from .stalls import fail_if_left
from .table import Pushers, Table, waiting_headers
from .table_pulls import PlanePulls

if TYPE_CHECKING:
    from .core import Server

log = logging.getLogger("byteps_like.server")

#: seconds the tables' thread waits for a request before it looks at its control queue again
#: (a control item wakes it at once: SparseService.put)
_WAIT_S = 0.5

class SparseService(threading.Thread):
    """The tables of one server, served on a thread of their own."""

    def __init__(self, server: Server):
        super().__init__(name="bpsl-sparse", daemon=True)
        self.server = server
        self.max_ids = server.cfg.server.sparse_max_ids
        # membership changes and saves written, in this thread's order (put, then wake() it);
        # the requests wait in the native plane's table inbox (csrc/dataplane_tables.h)
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.tables: dict[int, Table] = {}
        self.rounds_applied = 0
        self.rows_updated = 0
        # membership, in this thread's queue order (Server.on_members, Server.on_epoch): the
        # machines in join(), those that finished without it, the pushes a round needs
        self.ranks = Pushers(server.num_workers)   # machines x processes (server/table.py)
        self.required = server.required
        self.round_base = 0   # elastic: the epoch's first round
        self.keep = Survival(self)   # checkpoints, snapshots, rollbacks (sparse_survival.py)
        self.plane = PlanePulls(self)   # the pulls the plane answers (server/table_pulls.py)
        # where this thread's time goes, per step (a round of the first table): bench sparse
        self.phases = StepPhases()

    def put(self, item: tuple | None) -> None:
        """Queue a control item for this thread (None: stop) and wake it."""
        self.q.put(item)
        self.server.native.table_wake()

    def members(self, joined: frozenset, left: dict[int, str]) -> None:
        """join(): queue a membership change, applied before the next requests are served."""
        self.put(("members", joined, left))

    def epoch(self, base: int, size: int, applied) -> None:
        """Elastic jobs: queue a new membership epoch; ``applied()`` once it is."""
        self.put(("epoch", base, size, applied))

    def close(self) -> None:
        if self.is_alive():
            self.put(None)
            self.join(5.0)
        self.keep.close()
        if self.phases.steps:
            log.info("server %d: %s %s", self.server.rank, PHASES_TAG,
                     json.dumps(self.phases.report()))

    def held_bytes(self) -> int:
        return sum(t.charged for t in list(self.tables.values()))

    def run(self) -> None:
        while self._control():
            batch = self.server.native.table_requests(_WAIT_S)
            for stream, header, meta, payload in batch:
                if not self._control():
                    return
                self.request(native.table_route(stream), header, meta, payload)

    def _control(self) -> bool:
        """Apply the membership changes and saves queued so far; False: stop."""
        while True:
            try:
                item = self.q.get_nowait()
            except queue.Empty:
                return True
            if item is None:
                return False
            if item[0] == "epoch":
                self.apply_epoch(*item[1:])
            elif item[0] == "saved":
                self.keep.saved(*item[1:])
            else:
                self.apply_members(*item[1:])

    def request(self, route: Route, header: bytes, meta: bytes, payload: bytes) -> None:
        """One request of a table stream (its job and rank checked by the stream)."""
        srv = self.server
        try:
            msg = decode_parts(header, meta, payload, srv.cfg.transport.max_message_bytes)
        except ProtocolError as exc:
            srv.refuse(route, decode_header(header), "malformed", ERR_PROTOCOL,
                       f"server {srv.rank}: {exc}")
            return
        h = msg.header
        if not 0 <= h.rank < self.ranks.limit():
            self.refuse(route, h, "unexpected type or rank", f"{h.type.name} from worker rank "
                        f"{h.rank}, not below the tables' {self.ranks.limit()} process ranks")
            return
        # a worker can be quicker than the scheduler's node table is to this server (they
        # are told at once): its first requests wait here until the server knows its rank
        while not srv.control.wait_admitted(0.5):
            if srv.control.shutting_down or srv.control.fatal is not None:
                return
        try:
            self.process(route, msg)
        except Exception as exc:  # noqa: BLE001 - a bug must not kill the service silently
            log.exception("server %d: the sparse service failed on table %d", srv.rank, h.key)
            srv.reply_error(route, h, ERR_INTERNAL, f"server {srv.rank} internal error: {exc!r}")

    # -- requests ---------------------------------------------------------------------------------
    def process(self, route: Route, msg: Message) -> None:
        h = msg.header
        if h.type is MsgType.SPARSE_CREATE:
            self._create(route, msg)
            return
        if h.type is MsgType.SPARSE_LOAD and "restore" in (msg.meta or {}):
            self.keep.restore(route, msg)
            return
        if self.keep.refuse_unrolled(route, msg):
            return
        table = self.tables.get(h.key)
        if table is None:
            self.refuse(route, h, "request for an unknown table", f"{h.type.name} of table id "
                         f"{h.key} from worker rank {h.rank}: no such table (create it first)")
            return
        if table.failed is not None:
            self._reply_failed(table, route, h)
            return
        if h.round < self.round_base:   # elastic: sent in an epoch that has ended
            self.refuse(route, h, "sparse request of a superseded epoch", f"table "
                         f"{table.spec.name!r}: {h.type.name} of round {h.round} from worker rank "
                         f"{h.rank} belongs to a membership epoch that has ended", ERR_EPOCH)
            return
        if h.type is MsgType.SPARSE_PULL:
            self._pull(table, route, msg)
        elif h.type is MsgType.SPARSE_PUSH:
            self._push(table, route, msg)
        else:
            self._at_round(table, route, msg, None)

    def _reply_failed(self, table: Table, route: Route, h: Header) -> None:
        self.server.reply_error(route, h, table.failed_kind, table.failed or "",
                                table.failed_extra)

    def _fail(self, table: Table, text: str, kind: str = ERR_MISMATCH,
              extra: dict | None = None) -> None:
        """The table serves no more: answer what waits, and every later request, with ``text``."""
        table.failed, table.failed_kind, table.failed_extra = text, kind, extra or {}
        log.error("server %d: %s", self.server.rank, text)
        waiting, table.pending = table.pending, []
        for proute, pmsg, _ids in waiting:
            self._reply_failed(table, proute, pmsg.header)
        self.plane.reopen(table)   # closed now: what the plane parked is answered here

    # -- membership: join() and elastic epochs (docs/sparse.md, "Membership") -------------------
    def apply_members(self, joined: frozenset, left: dict[int, str]) -> None:
        """join(): a round needs the pushes of the machines not in join(); a round that a
        machine which left without join() has not pushed can never complete (peer_left)."""
        self.ranks.joined, self.ranks.left = joined, left
        if self.server.async_mode:
            return
        for table in self.tables.values():
            if table.failed is None and not self._doom_if_left(table):
                self._complete_if_ready(table)

    def apply_epoch(self, base: int, size: int, applied) -> None:
        """Elastic jobs: a new membership epoch. The tables stay (their rows are the servers');
        every open round is dropped (its pushes forgotten, its waiting requests answered with
        an epoch error) and the next round is ``base``, the first of the epoch, which needs
        ``size`` pushes."""
        self.ranks.joined, self.ranks.left = frozenset(), {}
        self.required, self.round_base = size, base
        for table in self.tables.values():
            for route, h in waiting_headers(table, self.plane.closed(table)):
                self.server.reply_error(route, h, ERR_EPOCH, (
                    f"table {table.spec.name!r}: the membership epoch of round "
                    f"{h.round} ended (a worker left or joined); the round was dropped"))
            table.pending, table.pushes, table.average = [], {}, None
            table.round_started = None
            table.applied = base
            self.plane.reopen(table)
        applied()

    def _doom_if_left(self, table: Table) -> bool:
        return fail_if_left(self.ranks.left_ranks(), table.pushes, bool(table.pending),
                            table.applied, f"table {table.spec.name!r}",
                            lambda text, meta: self._fail(table, text, ERR_PEER_LEFT, meta))

    def _complete_if_ready(self, table: Table) -> None:
        """Apply the open round once every process rank not in join() has pushed it (a rank
        may push a round and join before the round completes: its push is acknowledged as
        it arrives)."""
        need = self.ranks.of(range(self.required)) - self.ranks.of(self.ranks.joined)
        if (table.pushes and len(table.pushes) >= need   # the count first: once a round
                and not self.ranks.missing(table.pushes, self.required)):
            self._apply(table)

    def refuse(self, route: Route, h: Header, reason: str, text: str,
               kind: str = ERR_PROTOCOL, extra: dict | None = None) -> None:
        self.server.refuse(route, h, reason, kind, f"server {self.server.rank}: {text}", extra)

    def _create(self, route: Route, msg: Message) -> None:
        h, srv, meta = msg.header, self.server, msg.meta or {}
        try:
            if not 0 <= h.key < MAX_TABLES * srv.cfg.cluster.num_server:
                raise TableError(f"table key {h.key} is not below {MAX_TABLES} tables x "
                                 f"{srv.cfg.cluster.num_server} shards")
            spec = TableSpec.from_json(meta.get("spec"))
            self.keep.check()   # snapshots: the directory is set
            shard, shards = meta.get("shard"), meta.get("shards")
            why = self.ranks.declare(meta.get("local_size", 1), h.rank)
            if why is not None:
                raise TableError(f"table {spec.name!r}: {why}")
            held = sorted({*held_shards(srv.rank, srv.cfg.cluster.num_server,
                                        srv.cfg.server.sparse_survival), *self.keep.adopted})
            if (shards != srv.cfg.cluster.num_server or shard not in held
                    or shard != h.key // MAX_TABLES):
                raise TableError(f"table {spec.name!r}: declared as shard {shard!r} of "
                                 f"{shards!r} to server {srv.rank} of "
                                 f"{srv.cfg.cluster.num_server}, which holds shard(s) {held} "
                                 f"(BYTEPS_SPARSE_SURVIVAL={srv.cfg.server.sparse_survival} "
                                 "here: every node must use the same value)")
        except TableError as exc:
            self.refuse(route, h, "bad table declaration", f"declaration of table id {h.key} "
                         f"from worker rank {h.rank}: {exc}")
            return
        table = self.tables.get(h.key)
        if table is not None:
            if table.failed is None and spec != table.spec:
                self._fail(table, f"table mismatch on table id {h.key}: worker rank "
                           f"{table.decl_rank} declared {table.spec.describe()} but worker "
                           f"rank {h.rank} declared {spec.describe()}; every worker must "
                           "create the same tables in the same order")
            if table.failed is not None:
                self._reply_failed(table, route, h)
                return
            srv.reply(route, MsgType.SPARSE_ACK, h)
            return
        nrows = (spec.rows - shard + shards - 1) // shards
        need = state_bytes(spec, nrows)
        if not srv.charge(need):
            self.refuse(route, h, "server memory budget exhausted", (
                f"table {spec.name!r} (table id {h.key}) from worker rank {h.rank}: its shard "
                f"of {nrows} rows x {spec.dim} needs {need} bytes with the {spec.optimizer} "
                f"state, over the budget of {srv.budget} bytes (BYTEPS_SERVER_MAX_BYTES); "
                f"{srv.store_bytes()} bytes are held"))
            return
        self.plane.add(Table(spec, TableShard(spec, shard, shards), shards, h.rank, need,
                             applied=self.round_base, key=h.key))
        log.info("server %d: table %s, shard %d of %d%s: %d rows, %d bytes charged", srv.rank,
                 spec.describe(), shard, shards, "" if shard == srv.rank else " (a replica)",
                 nrows, need)
        srv.reply(route, MsgType.SPARSE_ACK, h)

    def _ids(self, table: Table, route: Route, h: Header, buf, count: int) -> np.ndarray | None:
        """The ids of a request, checked (count, range, shard) before anything is allocated for
        the request; None (answered with an error) when one fails."""
        spec = table.spec
        what = f"table {spec.name!r}: {h.type.name} from worker rank {h.rank}"
        if count > self.max_ids:
            self.refuse(route, h, "too many ids", f"{what} carries {count} ids, more than "
                         f"{self.max_ids} (BYTEPS_SPARSE_MAX_IDS)")
            return None
        ids = np.frombuffer(buf, np.int64, count)
        if not count:
            return ids
        lo, hi = int(ids.min()), int(ids.max())
        bad = None
        if lo < 0:
            bad = (lo, "negative")
        elif hi >= spec.rows:
            bad = (hi, f"out of range (the table has {spec.rows} rows)")
        elif table.shards > 1 and np.any(ids % table.shards != table.shard.shard):
            first = int(ids[np.flatnonzero(ids % table.shards != table.shard.shard)[0]])
            bad = (first, f"held by server {first % table.shards}, not this one")
        if bad is not None:
            self.refuse(route, h, "bad row id", f"{what}: row id {bad[0]} is {bad[1]}")
            return None
        return ids

    def _pull(self, table: Table, route: Route, msg: Message) -> None:
        h = msg.header
        if h.dtype != "int64":
            self.refuse(route, h, "wrong dtype for row ids", f"table {table.spec.name!r}: "
                         f"SPARSE_PULL from worker rank {h.rank} carries {h.dtype}, not int64")
            return
        reply_bytes = h.count * table.spec.row_bytes
        if h.count <= self.max_ids and reply_bytes > self.server.cfg.transport.max_message_bytes:
            self.refuse(route, h, "reply too large", f"table {table.spec.name!r}: "
                         f"{h.count} rows of {table.spec.row_bytes} bytes would be a reply of "
                         f"{reply_bytes} bytes, over BYTEPS_MAX_MESSAGE_BYTES")
            return
        t = time.perf_counter()
        ids = self._ids(table, route, h, as_buffer(msg.payload), h.count)
        self.phases.add("pull: check ids", t)
        if ids is not None:
            self._at_round(table, route, msg, ids)

    def _at_round(self, table: Table, route: Route, msg: Message, ids) -> None:
        """Serve a pull, save or load of round ``r`` once round ``r - 1`` is applied (now, or
        when the round completes)."""
        h = msg.header
        if h.round == table.applied or self.server.async_mode:   # async: no rounds
            self._serve(table, route, msg, ids)
        elif h.round == table.applied + 1 and len(table.pending) < 2 * self.ranks.limit():
            table.pending.append((route, msg, ids))
        else:  # neither the open round nor the next: a worker out of step, or a flood
            self.refuse(route, h, "sparse request out of round", f"table {table.spec.name!r}:"
                         f" {h.type.name} of round {h.round} from worker rank {h.rank} is out "
                         "of round")

    def _serve(self, table: Table, route: Route, msg: Message, ids) -> None:
        if msg.header.type is MsgType.SPARSE_PULL:
            self._answer(table, route, msg.header, ids)
        else:
            self.keep.checkpoint(table, route, msg)

    def _answer(self, table: Table, route: Route, h: Header, ids: np.ndarray) -> None:
        srv, t = self.server, time.perf_counter()   # (the plane answers most pulls itself)
        rows = table.shard.rows(ids)
        srv.send(route, encode(Header(MsgType.SPARSE_ROWS, "float32", Role.SERVER, srv.rank,
                                      generation_flags(generation(h.flags)), srv.job, h.key,
                                      h.round, rows.size, rows.nbytes), rows))
        self.phases.add("pull: answer here", t)

    def _push(self, table: Table, route: Route, msg: Message) -> None:
        h, spec = msg.header, table.spec
        per = 8 + spec.row_bytes
        if h.dtype != "uint8" or h.nbytes % per:
            self.refuse(route, h, "malformed sparse push", f"table {spec.name!r}: SPARSE_PUSH "
                         f"from worker rank {h.rank}: {h.nbytes} bytes of {h.dtype}, not "
                         f"uint8 records of {per} bytes (an int64 id and {spec.dim} float32)")
            return
        n, t = h.nbytes // per, time.perf_counter()
        buf = as_buffer(msg.payload)
        ids = self._ids(table, route, h, buf, n)
        t = self.phases.add("push: check ids", t)
        if ids is None:
            return
        average = bool((msg.meta or {}).get("average"))
        grads = np.frombuffer(buf, np.float32, n * spec.dim, 8 * n).reshape(n, spec.dim)
        if self.server.async_mode:
            self._apply_now(table, route, h, ids, grads, average)
            return
        if h.round != table.applied or h.rank in table.pushes:
            self.refuse(route, h, "sparse push out of round", f"table {spec.name!r}: push of "
                         f"round {h.round} from worker rank {h.rank}, a round that is not open "
                         "or that this rank has pushed already")
            return
        if h.rank in self.ranks.joined_ranks():
            self.refuse(route, h, "push after join()", f"table {spec.name!r}: push from "
                         f"worker rank {h.rank}, which has called join(); a joined rank pushes "
                         "again only after every rank has joined")
            return
        if table.average is not None and average != table.average:
            self.refuse(route, h, "averaged and summed pushes in one round", (
                f"table {spec.name!r}: push of round {h.round} from worker rank {h.rank} is "
                f"{'averaged' if average else 'summed'}, the round's first push was not; every "
                "worker must push a table the same way"), ERR_MISMATCH)
            return
        if not table.pushes:
            table.round_started = time.monotonic()
        table.average = average
        table.pushes[h.rank] = (ids, grads)
        if self.ranks.left and self._doom_if_left(table):
            self._reply_failed(table, route, h)
            return
        # applied before the last push is acknowledged: a replica holds the round once every
        # worker's push to it is acknowledged (BYTEPS_SPARSE_SURVIVAL=replicate)
        self._complete_if_ready(table)
        t = time.perf_counter()
        self.server.reply(route, MsgType.SPARSE_ACK, h)
        self.phases.add("push: reply", t)

    def _apply_now(self, table: Table, route: Route, h: Header, ids: np.ndarray,
                   grads: np.ndarray, average: bool) -> None:
        """Asynchronous mode: a push updates its rows as it arrives, alone (an averaged one
        divided by the job's number of workers), and is acknowledged after that."""
        uniq, sums = sum_rows([ids], [grads], table.spec.dim)
        if average and self.ranks.of(range(self.required)) > 1:
            sums /= np.float32(self.ranks.of(range(self.required)))
        table.shard.apply(uniq, sums)
        table.applied += 1
        self.rounds_applied += 1
        self.rows_updated += len(uniq)
        self.server.reply(route, MsgType.SPARSE_ACK, h)

    def _apply(self, table: Table) -> None:
        """Every worker pushed the open round: sum per row (rank order), update, answer the
        pulls of the next round."""
        order, t = sorted(table.pushes), time.perf_counter()
        ids, sums = sum_rows([table.pushes[r][0] for r in order],
                             [table.pushes[r][1] for r in order], table.spec.dim)
        if table.average and len(order) > 1:   # over the workers that pushed the round
            sums /= np.float32(len(order))
        t = self.phases.add("round: sum pushes", t)
        table.shard.apply(ids, sums, applied=table.applied + 1)   # the plane's parked pulls
        self.phases.add("round: optimizer", t)                    # of the next are answered
        table.pushes, table.average = {}, None
        table.round_started = None
        table.applied += 1
        self.rounds_applied += 1
        self.rows_updated += len(ids)
        waiting, table.pending = table.pending, []
        for route, msg, pids in waiting:
            self._serve(table, route, msg, pids)
        t = time.perf_counter()
        self.keep.after_apply(table)
        self.keep.try_deferred(table.key % MAX_TABLES)
        self.phases.add("round: snapshots/replicas", t)
        if table.key == min(self.tables):
            self.phases.end_step()
