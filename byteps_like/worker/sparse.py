"""Server-held embedding tables, the worker's side (docs/sparse.md): framework-neutral, numpy.

``runtime.sparse.create(name, rows, dim, ...)`` declares a table to every server (each holds the
rows ``i`` with ``i % S`` equal to its rank; :mod:`byteps_like.embedding`) and returns an
:class:`EmbeddingTable`. A training step is then ``rows = table.pull(ids)`` and, after the
backward pass, ``table.push(ids, grads)``: the servers sum every worker's pushes per row and
apply the table's optimizer; the next pull waits until they have (synchronous rounds, one per
push). Framework plugins (``byteps_like.torch.SparseEmbedding``) build on these two calls.

A job of one worker process and no servers keeps its table in the process (the same
:class:`~byteps_like.embedding.TableShard` a server holds), so a script runs unchanged alone.
Ids are checked here first (integers, in range, at most BYTEPS_SPARSE_MAX_IDS per server), and
again by every server before it allocates anything.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from .. import _core
from ..embedding import (
    MAX_TABLES,
    Phases,
    TableError,
    TableShard,
    TableSpec,
    load_shard,
    save_shard,
    shard_holders,
    split_by_shard,
    sum_rows,
    wire_key,
)
from ..errors import (
    BytePSError,
    CommTimeoutError,
    CommunicationError,
    MembershipChangedError,
    PeerLostError,
)
from ..transport import native
from ..wire import (
    ERR_EPOCH,
    ERR_ROLLBACK,
    HEADER_SIZE,
    SPARSE_ANSWERS,
    Header,
    Message,
    MsgType,
    Role,
    encode,
    generation,
    generation_flags,
)
from .dispatch import server_error

log = logging.getLogger("byteps_like.worker")

if TYPE_CHECKING:
    from ..config import Config
    from .elastic_membership import ElasticMembership
    from .membership import Membership


class Runtime(Protocol):
    """What the tables use of the worker runtime (:class:`~.runtime.Runtime` is one): public
    members only, so this part does not import the runtime that holds it."""

    members: Membership
    elastic_m: ElasticMembership | None

    @property
    def config(self) -> Config: ...

    @property
    def rank_(self) -> int: ...

    @property
    def local_size_(self) -> int: ...

    @property
    def alone(self) -> bool: ...

    def check(self) -> None: ...

#: the request an answer belongs to, by the request's message type
_KIND = {"SPARSE_CREATE": "create", "SPARSE_PULL": "pull", "SPARSE_PUSH": "push",
         "SPARSE_SAVE": "save", "SPARSE_LOAD": "load"}
#: how join() names a table among the tensors whose rounds it reports
_JOIN_PREFIX = "\x00table "
#: how often a waiting call looks for the job's fatal error
_POLL_S = 0.05


class _RolledBack(Exception):
    """A lost server rolled the tables back to a snapshot (failover ``number``): the request
    is sent again at the round the tables went back to, once this worker has gone back."""

    def __init__(self, number: int):
        super().__init__(f"rolled back by failover {number}")
        self.number = number


#: requests a shard's primary alone answers; the others go to every server holding the shard
_PRIMARY_ONLY = frozenset({MsgType.SPARSE_PULL, MsgType.SPARSE_SAVE})


@dataclass
class _Call:
    """One request sent to the servers holding each shard, waiting for every answer."""
    table: EmbeddingTable
    mtype: MsgType
    rnd: int
    frames: list                                  # shard -> the request's frames (re-sent)
    g: int = 0                                    # the rollback generation it was sent in
    want: set = field(default_factory=set)        # (server index, shard) asked
    got: dict = field(default_factory=dict)       # (server index, shard) -> payload or None
    expect: dict = field(default_factory=dict)    # pull: shard -> the rows' bytes
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def answers(self) -> dict:
        """Each shard's answer (its primary's for a pull)."""
        return {sh: p for (_s, sh), p in self.got.items()}

    def check_done(self) -> None:
        """Done once every server asked answered (an error too: a later request of the same
        kind and round must not take a late answer of this one)."""
        if self.want <= set(self.got):
            self.done.set()


@dataclass
class TableStats:
    """What a table moved, as a worker sees it: messages and bytes (headers included)."""
    steps: int = 0
    ids_pulled: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    rolled_back: int = 0     # steps lost servers rolled the table back (snapshots)


class EmbeddingTable:
    """One server-held table, as a worker uses it: :meth:`pull` rows, :meth:`push` gradients."""

    def __init__(self, owner: SparseTables, spec: TableSpec, table_id: int,
                 local: TableShard | None):
        self.owner, self.spec, self.table_id = owner, spec, table_id
        self.local = local           # a job of one process: the table itself
        # the round of the next pull and push: rounds pushed since the membership epoch's
        # first round (0 outside elastic jobs)
        self.step = owner.round_base
        self.stats = TableStats()
        # snapshots: (failover, round) the newest rollback sent the table back to, and the
        # newest failover whose round the table took (SparseTables._rewind)
        self.rewind: tuple[int, int] | None = None
        self.rewound = 0
        # the push sent and not acknowledged yet (SparseTables.pipelined): (key, call)
        self.pushing: tuple[tuple, _Call] | None = None

    @property
    def rewind_pending(self) -> bool:
        """A rollback sent the table back to a round it has not taken yet."""
        return self.rewind is not None and self.rewind[0] > self.rewound

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def rows(self) -> int:
        return self.spec.rows

    @property
    def dim(self) -> int:
        return self.spec.dim

    def check_ids(self, ids: Any) -> np.ndarray:
        """``ids`` as a 1-D int64 array, every one in range; IndexError/TypeError name the
        table, the id and this worker's rank."""
        arr = np.asarray(ids)
        who = f"table {self.name!r} on worker rank {self.owner.rank}"
        if arr.size == 0:   # an empty list is float64 to numpy
            arr = arr.astype(np.int64)
        if arr.dtype.kind not in "iu":
            raise TypeError(f"{who}: row ids must be integers, not {arr.dtype}")
        limit = self.owner.max_ids * max(1, self.owner.num_servers)
        if arr.size > limit:  # before any copy of them
            raise ValueError(f"{who}: {arr.size} ids in one request, more than {limit} "
                             "(BYTEPS_SPARSE_MAX_IDS per server); split the batch")
        arr = arr.reshape(-1).astype(np.int64, copy=False)
        if arr.size:
            lo, hi = int(arr.min()), int(arr.max())
            if lo < 0:
                raise IndexError(f"{who}: row id {lo} is negative")
            if hi >= self.rows:
                raise IndexError(f"{who}: row id {hi} is out of range (the table has "
                                 f"{self.rows} rows)")
        return arr

    def pull(self, ids: Any, timeout: float | None = None) -> np.ndarray:
        """The current rows of ``ids`` (any integer array; duplicates allowed, though each
        travels: pass unique ids), as a new float32 array of ``len(ids) x dim``. Waits until
        every worker's push of the previous step is applied."""
        return self.pull_async(ids, timeout).wait(timeout)

    def pull_async(self, ids: Any, timeout: float | None = None) -> PendingRows:
        """:meth:`pull` sent now, its rows taken by the returned ``wait()``: the pulls of
        several tables started before any is waited for travel and are answered together (a
        model's tables: one wait, not one per table). One pull of a table in flight at a time;
        a pull started before the table's previous push is sent is of that push's step."""
        t0 = time.perf_counter()
        ids = self.check_ids(ids)
        self.stats.ids_pulled += len(ids)
        if self.local is not None:
            return PendingRows(self, ids, t0, rows=self.local.rows(ids))
        t = self.owner.phases.add("pull: check ids", t0)
        order, per_server = self._split(ids)
        t = self.owner.phases.add("pull: split by shard", t)
        pending = PendingRows(self, ids, t0, order=order, per_server=per_server)
        try:
            pending.started = self.owner.begin(self, MsgType.SPARSE_PULL, self.step,
                                               [(p, None) for p in per_server], timeout)
        except _RolledBack:
            pass   # wait() asks again at the round the tables went back to
        return pending

    def push(self, ids: Any, grads: Any, timeout: float | None = None, *,
             average: bool = False) -> None:
        """Push the gradients of rows ``ids`` (``len(ids) x dim`` float32) for this step; the
        servers add every worker's and update the rows once all have pushed. Every worker pushes
        every table once a step (an empty push when its batch had no rows). ``average``: the
        servers divide the sum by the number of workers that pushed the round (the workers
        not in ``join()``; an elastic epoch's); every worker must push a table the same way.
        In a synchronous job without snapshots, replicas or elastic membership the push
        returns once sent: its answer is awaited (and a server's refusal raised) by the
        table's next call, ``join()`` or ``shutdown()`` (SparseTables.pipelined); else it
        returns once answered."""
        ph, t = self.owner.phases, time.perf_counter()
        t0 = t
        ids = self.check_ids(ids)
        g = np.ascontiguousarray(grads, dtype=np.float32)
        if g.shape != (len(ids), self.dim):
            raise ValueError(f"table {self.name!r} on worker rank {self.owner.rank}: gradients "
                             f"of shape {g.shape} for {len(ids)} ids, expected "
                             f"{(len(ids), self.dim)}")
        if self.local is not None:
            uniq, sums = sum_rows([ids], [g], self.dim)
            self.local.apply(uniq, sums)
        else:
            t = ph.add("push: check ids", t)
            order, per_server = self._split(ids)
            # each shard's records (its ids, then their rows) in one pass of the kernels
            counts = np.fromiter((len(p) for p in per_server), np.int64, len(per_server))
            payloads = list(zip(per_server, _core.table_push_records(ids, g, order, counts)))
            ph.add("push: split by shard", t)
            metas = [{"average": True}] * len(payloads) if average else None
            if self.owner.pipelined:   # answered by the table's next call
                self.owner.settle(self)
                self.pushing = self.owner.start(self, MsgType.SPARSE_PUSH, self.step, payloads,
                                                metas)
            elif self.owner.call(self, MsgType.SPARSE_PUSH, self.step, payloads, timeout,
                                 metas) is None:
                return   # its round was rolled back (snapshots): the push goes with it
            ph.add("push (whole call)", t0)
        self.step += 1
        self.stats.steps += 1

    def save(self, tag: str, timeout: float | None = None) -> None:
        """Checkpoint the table as ``tag``: each server writes its shard (rows touched so far,
        optimizer state) under BYTEPS_SPARSE_CHECKPOINT_DIR, once every worker's push of the
        last step is applied. Any worker may call it, or all of them: a server writes once per
        (tag, step)."""
        self._checkpoint(MsgType.SPARSE_SAVE, tag, timeout)

    def load(self, tag: str, timeout: float | None = None) -> None:
        """Restore checkpoint ``tag``, written by any number of servers: every server reads
        every shard file and keeps the rows it holds. Call it on every worker (or on one,
        before any worker pushes the step) between a step's push and the next pull."""
        self._checkpoint(MsgType.SPARSE_LOAD, tag, timeout)

    def load_snapshots(self, folder: str, round: int | None = None,
                       timeout: float | None = None) -> int:
        """Restore the table as another job's servers left it in their incremental snapshots
        (BYTEPS_SPARSE_SURVIVAL=snapshot), whatever that job's number of servers: ``folder``
        is its snapshot folder under BYTEPS_SPARSE_CHECKPOINT_DIR (``snapshots-<number>``,
        named in its servers' logs), ``round`` its round to go back to (default: the newest
        that every one of its shards holds). Returns that round. Called like :meth:`load`."""
        if self.local is not None:
            raise TableError(f"table {self.name!r} on worker rank {self.owner.rank}: a job "
                             "without servers has no snapshots to load (they are the servers')")
        if round is not None and (type(round) is not int or round < 0):
            raise ValueError(f"table {self.name!r}: round must be a whole number >= 0, not "
                             f"{round!r}")
        n = self.owner.num_servers
        answers = self.owner.call(self, MsgType.SPARSE_LOAD, self.step, [(None, None)] * n,
                                  timeout, [{"snapshots": folder, "round": round}] * n) or {}
        rounds = {a.get("round") for a in answers.values() if isinstance(a, dict)}
        got = next(iter(rounds), None)
        if len(rounds) != 1 or not isinstance(got, int):
            raise BytePSError(f"table {self.name!r}: the servers loaded {folder!r} as of "
                              f"different rounds {sorted(map(str, rounds))}")
        return got

    def _checkpoint(self, mtype: MsgType, tag: str, timeout: float | None) -> None:
        if self.local is not None:
            directory = self.owner.rt.config.server.sparse_checkpoint_dir
            try:
                if mtype is MsgType.SPARSE_SAVE:
                    save_shard(self.local, directory, tag)
                else:
                    load_shard(self.local, directory, tag,
                               repair=self.owner.rt.config.server.sparse_checkpoint_repair)
            except (TableError, OSError, ValueError) as exc:
                raise TableError(f"table {self.name!r} on worker rank {self.owner.rank}: "
                                 f"{exc}") from None
            return
        n = self.owner.num_servers
        self.owner.call(self, mtype, self.step, [(None, None)] * n, timeout,
                        [{"tag": tag}] * n)

    def _split(self, ids: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
        order, per_server = split_by_shard(ids, self.owner.num_servers)
        limit = self.owner.max_ids
        for s, p in enumerate(per_server):
            if len(p) > limit:
                raise ValueError(f"table {self.name!r} on worker rank {self.owner.rank}: "
                                 f"{len(p)} ids for server {s}, more than {limit} "
                                 "(BYTEPS_SPARSE_MAX_IDS); split the batch")
        return order, per_server


class PendingRows:
    """A pull in flight (:meth:`EmbeddingTable.pull_async`); :meth:`wait` returns its rows."""

    def __init__(self, table: EmbeddingTable, ids: np.ndarray, t0: float, *,
                 rows: np.ndarray | None = None, order: np.ndarray | None = None,
                 per_server: list[np.ndarray] | None = None):
        self.table, self.ids, self.t0, self.rows = table, ids, t0, rows
        self.order, self.per_server = order, per_server
        self.started: tuple[tuple, _Call] | None = None

    def wait(self, timeout: float | None = None) -> np.ndarray:
        """The rows (``len(ids) x dim`` float32), once every shard's server answered."""
        if self.rows is not None:
            return self.rows
        table, owner = self.table, self.table.owner
        assert self.per_server is not None and self.order is not None
        answers = None
        if self.started is not None:
            (key, call), self.started = self.started, None
            try:
                answers = owner._finish(key, call, timeout)
            except _RolledBack:
                pass
        if answers is None:   # a rollback came between: asked again at the tables' new round
            answers = owner.call(table, MsgType.SPARSE_PULL, table.step,
                                 [(p, None) for p in self.per_server], timeout) or {}
        t = time.perf_counter()
        out = np.empty((len(self.ids), table.dim), np.float32)
        at = 0
        for s, part in enumerate(self.per_server):   # each shard's rows straight to their places
            n = len(part)
            if n:
                out[self.order[at:at + n]] = np.frombuffer(answers[s], np.float32).reshape(
                    n, table.dim)
            at += n
        owner.phases.add("pull: place rows", t)
        owner.phases.add("pull (whole call)", self.t0)
        self.rows = out
        return out


class _Requests:
    """A runtime's table requests and the answers of their servers (:class:`SparseTables`
    adds the tables, their membership and their servers' losses)."""

    def __init__(self, rt: Runtime):
        self.rt = rt
        self.tables: dict[str, EmbeddingTable] = {}
        self._calls: dict[tuple, _Call] = {}
        self._lock = threading.Lock()
        # servers lost (by index): their shards are served by the copies left (replication)
        # or by the next server, which rebuilt them from snapshots; a replacement server that
        # takes a lost one's rank holds no table
        self.lost: set[int] = set()
        self.to_restore = 0   # snapshots: the newest failover whose rollback is pending...
        self.restored = 0     # ...and the newest done
        self._restored_cv = threading.Condition(self._lock)
        self._cut_off: list[tuple] = []   # requests a rollback cut off (the newest 64)
        # the next table's id: a declaration the servers refused keeps its id, so every
        # worker's next table gets the same one whichever worker saw the refusal
        self._next_id = 0
        self.link: native.TableLink | None = None   # the table streams, at the first table
        self.phases = Phases()    # where the tables' time goes, on the calling thread...
        self.io_phases = Phases()   # ...and on the I/O thread (their answers)

    @property
    def rank(self) -> int:
        return self.rt.rank_

    @property
    def push_rank(self) -> int:
        """The rank a table request carries: every worker process pushes its own rows (with
        several processes per machine, the job's rank: the servers count processes for the
        tables, server/table.py Pushers), not the machine's local reduction."""
        return self.rt.rank_ if self.rt.local_size_ > 1 else self.rt.members.push_rank

    @property
    def num_servers(self) -> int:
        return len(self.rt.members.servers)

    @property
    def survival(self) -> str:
        return self.rt.config.server.sparse_survival

    @property
    def max_ids(self) -> int:
        return self.rt.config.server.sparse_max_ids

    # -- requests and their answers -------------------------------------------------------------
    def call(self, table: EmbeddingTable, mtype: MsgType, rnd: int, payloads: list,
             timeout: float | None, metas: list | None = None) -> dict | None:
        """:meth:`begin` and :meth:`_finish`: sent again at the round the tables went back to
        when a lost server rolls them back (BYTEPS_SPARSE_SURVIVAL=snapshot); None for a push
        of a round the rollback undid (it goes with its round)."""
        while True:
            try:
                started = self.begin(table, mtype, rnd, payloads, timeout, metas)
                if started is None:
                    return None
                return self._finish(*started, timeout)
            except _RolledBack as rb:
                self._wait_restored(rb.number, timeout)

    def begin(self, table: EmbeddingTable, mtype: MsgType, rnd: int, payloads: list,
              timeout: float | None, metas: list | None = None) -> tuple[tuple, _Call] | None:
        """A request in flight (:meth:`start`), once the table's push in flight is answered
        and a rollback this worker was told of is taken; None for a push of a round the
        rollback undid. _RolledBack when a rollback began meanwhile."""
        self.settle(table, timeout)
        self._wait_restored(self.to_restore, timeout)
        if mtype is not MsgType.SPARSE_CREATE and self._rewind(table):
            if mtype is MsgType.SPARSE_PUSH and table.step != rnd:
                return None
            rnd = table.step
        return self.start(table, mtype, rnd, payloads, metas)

    def _rewind(self, table: EmbeddingTable) -> bool:
        """Take the round a rollback sent the table back to (on the thread that calls the
        table, so no step of the old timeline counts after it); True if it did now."""
        with self._lock:
            if not table.rewind_pending:
                return False
            assert table.rewind is not None
            number, rnd = table.rewind
            back, table.step, table.rewound = table.step - rnd, rnd, number
        table.stats.rolled_back += max(0, back)
        (log.warning if self.rank == 0 else log.info)(
            "worker %d: table %r went back %d step(s) to round %d, the newest snapshot of the "
            "lost server(s) (failover %d; BYTEPS_SPARSE_SURVIVAL=snapshot, every %d rounds)",
            self.rank, table.name, back, rnd, number,
            self.rt.config.server.sparse_snapshot_steps)
        return True

    def start(self, table: EmbeddingTable, mtype: MsgType, rnd: int, payloads: list,
               metas: list | None) -> tuple[tuple, _Call]:
        """Send ``mtype`` for every shard (payload i: shard i's (ids, grads) or (None, None)) to
        the servers that hold it (its primary alone for a pull or a save): the request is in
        flight once this returns; :meth:`_finish` waits for every answer."""
        rt = self.rt
        rt.check()
        if rt.elastic_m is not None:   # an epoch that is over: raise at once
            rt.elastic_m.check_collective()
        key = (table.table_id, _KIND[mtype.name], rnd)
        kind, ph, t = key[1], self.phases, time.perf_counter()
        call = _Call(table, mtype, rnd, [], self.restored)
        for sh, (ids, grads) in enumerate(payloads):
            if mtype is MsgType.SPARSE_PULL:
                call.expect[sh] = len(ids) * table.spec.row_bytes
            call.frames.append(self._frames(table, mtype, rnd, sh, ids, grads,
                                            metas[sh] if metas else None, call.g))
        with self._lock:
            if key in self._calls:
                raise BytePSError(f"table {table.name!r}: a {key[1]} of step {rnd} is already "
                                  "in flight (one pull and one push per step, one thread)")
            if (self.to_restore > self.restored or call.g != self.restored
                    or (table.rewind_pending and mtype is not MsgType.SPARSE_CREATE)):
                raise _RolledBack(self.to_restore)   # a rollback began since the call began
            sends = []
            for sh in range(len(payloads)):
                holders = self._holders(sh)
                if not holders:
                    raise self._shard_lost(table, sh)
                for srv in holders[:1] if mtype in _PRIMARY_ONLY else holders:
                    call.want.add((srv, sh))
                    sends.append((srv, sh))
            self._calls[key] = call
        t = ph.add(f"{kind}: encode", t)
        try:
            for srv, sh in sends:
                self._send(call, srv, sh)   # every one, whatever answers meanwhile
        except BaseException:
            with self._lock:
                self._calls.pop(key, None)
            raise
        ph.add(f"{kind}: send", t)
        return key, call

    def _finish(self, key: tuple, call: _Call, timeout: float | None) -> dict:
        """Every answer of the request :meth:`start` sent, by shard."""
        t = time.perf_counter()
        try:
            self._wait(call, timeout)
            self.phases.add(f"{key[1]}: wait for the answers", t)
        finally:
            with self._lock:
                self._calls.pop(key, None)
        return call.answers()

    def settle(self, table: EmbeddingTable, timeout: float | None = None) -> None:
        """Wait for the answers of the table's push in flight, if any; raise its error (the
        table is then back at that push's step, as after a push that raised at once)."""
        if table.pushing is not None:
            (key, call), table.pushing = table.pushing, None
            try:
                self._finish(key, call, timeout)
            except BaseException:
                if table.step == call.rnd + 1:
                    table.step, table.stats.steps = call.rnd, table.stats.steps - 1
                raise

    def _frames(self, table: EmbeddingTable, mtype: MsgType, rnd: int, sh: int, ids, grads,
                meta: dict | None, g: int) -> list:
        """A request's frames; its flags carry the rollback generation ``g``."""
        m, key, flags = self.rt.members, wire_key(table.table_id, sh), generation_flags(g)
        if mtype is MsgType.SPARSE_PULL:
            payload: Any = ids
            hdr = Header(mtype, "int64", Role.WORKER, self.push_rank, flags, m.job, key, rnd,
                         len(ids), ids.nbytes)
        elif mtype is MsgType.SPARSE_PUSH:   # grads: the shard's records (push_records)
            payload = grads
            hdr = Header(mtype, "uint8", Role.WORKER, self.push_rank, flags, m.job, key, rnd,
                         payload.nbytes, payload.nbytes)
        else:
            payload = None
            hdr = Header(mtype, "none", Role.WORKER, self.push_rank, flags, m.job, key, rnd)
        return encode(hdr, payload, meta)

    def _open(self) -> native.TableLink:
        """This process's table streams, one to each server left, opened at its first table
        (csrc/dataplane_tables.h), and again when its rank changed (an elastic epoch: a stream
        carries the rank of its hello); CommunicationError when a server cannot be reached."""
        rank = self.push_rank
        with self._lock:
            old = self.link
            if old is not None and old.rank == rank:
                return old
            self.link = None
        if old is not None:
            old.close()
        m = self.rt.members
        link = native.TableLink(self.rt.config, rank, m.job, self.on_message, self._on_lost)
        try:
            for idx, p in enumerate(m.servers):
                if idx not in self.lost:
                    link.connect(idx, p.host, p.data_port)
        except RuntimeError as exc:
            link.close()
            raise CommunicationError(f"worker rank {self.rank}: {exc}") from None
        with self._lock:
            self.link = link
        return link

    def _on_lost(self, server: int, why: str) -> None:
        """A table stream closed: its server is lost (the scheduler's FAILOVER moves its
        shards, or the job ends) or the worker is closing."""
        log.info("worker %d: the table stream to server %d closed: %s", self.rank, server, why)

    def close(self) -> None:
        """The runtime's teardown: close the table streams."""
        with self._lock:
            link, self.link = self.link, None
        if link is not None:
            link.close()

    def _send(self, call: _Call, srv: int, sh: int) -> None:
        frames = call.frames[sh]
        call.table.stats.bytes_sent += sum(memoryview(f).nbytes for f in frames)
        if not self._open().send(srv, frames):   # its server is lost: no answer comes
            log.debug("worker %d: no table stream to server %d", self.rank, srv)

    def _holders(self, shard: int) -> list[int]:
        return shard_holders(shard, self.num_servers, self.survival, self.lost)

    def _shard_lost(self, table: EmbeddingTable, shard: int) -> BaseException:
        copies = ("both servers holding it (its own and the next: "
                  "BYTEPS_SPARSE_SURVIVAL=replicate) were lost" if self.survival == "replicate"
                  else "its server was lost (BYTEPS_SPARSE_SURVIVAL=none: no copy)")
        return PeerLostError(f"worker rank {self.rank}: shard {shard} of table "
                             f"{table.name!r} is lost: {copies}; restart the job and load the "
                             "last checkpoint (docs/sparse.md)", role="server", rank=shard)

    def _wait(self, call: _Call, timeout: float | None) -> None:
        rt = self.rt
        limit = rt.config.timeouts.op_timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        while not call.done.wait(_POLL_S):
            rt.check()   # the job's fatal error (a lost peer) ends the wait
            if rt.elastic_m is not None:   # and so does a new membership epoch
                rt.elastic_m.check_collective()
            if time.monotonic() > deadline:
                missing = sorted({srv for srv, _sh in call.want - set(call.got)})
                raise CommTimeoutError(f"table {call.table.name!r}: {call.mtype.name} of step "
                                       f"{call.rnd} on worker rank {rt.rank_}: no answer from "
                                       f"server(s) {missing} within {limit:g} s (a worker that "
                                       "has not pushed the previous step holds the round open)")
        if call.error is not None:
            raise call.error

    def _wait_restored(self, number: int, timeout: float | None) -> None:
        """Wait until this worker went back for failover ``number`` (snapshots)."""
        if self.restored >= number:
            return
        limit = self.rt.config.timeouts.op_timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        while self.restored < number:
            self.rt.check()   # the job's fatal error (a failed rollback) ends the wait
            if time.monotonic() > deadline:
                raise CommTimeoutError(f"worker rank {self.rank}: the server-held tables did "
                                       f"not go back to their snapshot after failover {number} "
                                       f"within {limit:g} s")
            with self._restored_cv:
                self._restored_cv.wait(_POLL_S)

    def on_message(self, server: int, msg: Message) -> None:
        """A server's answer to a table request (the table streams' thread)."""
        h, m, t = msg.header, self.rt.members, time.perf_counter()
        if h.type in SPARSE_ANSWERS:
            kinds = ({"pull"} if h.type is MsgType.SPARSE_ROWS
                     else {"create", "push", "save", "load", "restore"})
        else:  # an ERROR: the request's type is in its meta
            kinds = {_KIND.get(str((msg.meta or {}).get("type")), "")}
            kinds |= {"restore"} if "load" in kinds else set()
        try:
            s = m.server_ranks.index(h.rank)
        except ValueError:
            s = -1
        tid, sh = h.key % MAX_TABLES, h.key // MAX_TABLES
        with self._lock:
            calls = [(k, c) for k, c in self._calls.items()
                     if k[0] == tid and k[2] == h.round and k[1] in kinds]
            ok = (s >= 0 and server == s and h.job == m.job
                  and h.role is Role.SERVER and len(calls) == 1 and (s, sh) in calls[0][1].want
                  and (s, sh) not in calls[0][1].got)
            stale = ok and generation(h.flags) != calls[0][1].g   # sent before a rollback
            if ok and not stale:
                self._answer(calls[0][0], calls[0][1], s, sh, msg)
                self.io_phases.add("answers (table streams' thread)", t)
        if stale or (not ok and any(k[0] == tid and k[2] == h.round and k[1] in kinds
                                    for k in self._cut_off)):
            log.debug("worker %d: an answer to a table request sent before a rollback: %s",
                      self.rank, h)
        elif not ok:
            m.dropped("table answer that matches no request in flight",
                      f"{h.type.name} table {h.key} round {h.round} from server {server}")

    def _answer(self, key: tuple, call: _Call, s: int, sh: int, msg: Message) -> None:
        h = msg.header
        what, name = key[1], call.table.name
        if h.type is MsgType.ERROR:
            meta = msg.meta if isinstance(msg.meta, dict) else {}
            if meta.get("kind") == ERR_ROLLBACK and type(meta.get("failover")) is int:
                exc: BaseException = _RolledBack(meta["failover"])
            elif meta.get("kind") == ERR_EPOCH:   # the server reset first: the epoch is over
                em = self.rt.elastic_m
                exc = MembershipChangedError(
                    f"{what} of table {name!r}: {meta.get('message', 'epoch ended')}",
                    epoch=(em.epoch + 1) if em is not None else 0)
            else:
                exc = server_error(f"{what} of table {name!r}", meta.get("kind"),
                                   str(meta.get("message", "error")), h.rank, meta)
            call.error = call.error or exc
            call.got[(s, sh)] = None
        elif what == "pull" and (h.dtype != "float32" or h.nbytes != call.expect[sh]):
            call.error = call.error or BytePSError(
                f"pull of table {name!r}: server {h.rank} answered with {h.nbytes} bytes of "
                f"{h.dtype}, expected {call.expect[sh]} bytes of float32")
            call.got[(s, sh)] = None
        else:
            call.got[(s, sh)] = msg.meta if what in ("restore", "load") else msg.payload
            call.table.stats.bytes_received += HEADER_SIZE + h.nbytes
        call.check_done()


class SparseTables(_Requests):
    """A runtime's server-held tables, and the answers of their servers."""

    @property
    def round_base(self) -> int:
        """The first round of this worker's membership epoch (elastic jobs; 0 otherwise)."""
        em = self.rt.elastic_m
        return em.round_base if em is not None else 0

    @property
    def pipelined(self) -> bool:
        """A push returns once sent, its answer awaited by the table's next call (whose pull
        waits for the round anyway) while the worker goes on. Not in asynchronous mode (an
        answer says the push is applied), with snapshots (a rollback sends a push again),
        with replicas (a push to a lost server is sent again to its replica, which must not
        count it twice) nor in elastic jobs (an epoch drops a round)."""
        cfg = self.rt.config
        return (not cfg.server.enable_async and self.survival == "none"
                and self.rt.elastic_m is None)

    def finish(self) -> None:
        """shutdown(): every push in flight answered (before the scheduler hears that this
        worker is done, or its last round could fail for the others); logs an error, as no
        call is left to raise it; waits BYTEPS_SHUTDOWN_TIMEOUT_SECONDS at most for each."""
        for table in list(self.tables.values()):
            try:
                self.settle(table, self.rt.config.timeouts.shutdown_timeout)
            except Exception as exc:  # noqa: BLE001 - logged: the caller is shutting down
                log.error("worker %d: table %r: the last push failed: %s", self.rank,
                          table.name, exc)

    # -- membership (docs/sparse.md, "Membership") ----------------------------------------------
    def new_epoch(self, base: int) -> None:
        """Elastic jobs, a new membership epoch: the servers dropped every open round and
        continue each table at the epoch's first round; so does this worker."""
        with self._lock:
            for t in self.tables.values():
                if t.local is None:
                    t.step = base

    def rounds(self) -> dict[str, int]:
        """join(): the round each server-held table reached, for the scheduler to take the
        most of; named ``_JOIN_PREFIX + name`` (a NUL first: no tensor name in practice). Every
        push in flight is answered first: the servers have it before they learn of the join."""
        for table in list(self.tables.values()):
            self.settle(table)
        return {_JOIN_PREFIX + n: t.step for n, t in self.tables.items() if t.local is None}

    def catch_up(self, rounds: dict[str, int]) -> None:
        """After join(): each table continues at the round the job reached (the ranks that
        ran more steps pushed more rounds)."""
        for n, t in self.tables.items():
            rnd = rounds.get(_JOIN_PREFIX + n)
            if t.local is None and type(rnd) is int and rnd > t.step:
                t.step = rnd

    def create(self, name: str, rows: int, dim: int, *, dtype: str = "float32",
               init: str = "normal", init_args: dict | None = None, seed: int = 0,
               optimizer: str = "sgd", timeout: float | None = None,
               **optimizer_args: Any) -> EmbeddingTable:
        """Declare table ``name`` (every worker creates the same tables in the same order) and
        return it. ``init``: zeros, uniform (low, high) or normal (mean, std), from ``seed``;
        ``optimizer``: sgd (lr), adagrad (lr, eps, initial_accumulator_value) or adam (lr,
        beta1, beta2, eps), applied on the servers. TableError (a ValueError) names a bad
        argument; a server that cannot hold its shard answers with a RemoteError naming
        BYTEPS_SERVER_MAX_BYTES."""
        rt = self.rt
        rt.check()
        try:
            spec = TableSpec.make(name, rows, dim, dtype=dtype, init=init, init_args=init_args,
                                  seed=seed, optimizer=optimizer, **optimizer_args)
        except TableError as exc:
            raise TableError(f"worker rank {rt.rank_}: {exc}") from None
        with self._lock:
            if name in self.tables:
                raise TableError(f"worker rank {rt.rank_}: table {name!r} exists already")
            table_id = self._next_id
            self._next_id += 1
        m = rt.members
        if m.control is None or rt.alone:
            table = EmbeddingTable(self, spec, table_id, TableShard(spec))
        else:
            if rt.local_size_ > 1 and rt.elastic_m is not None:
                raise BytePSError(f"table {name!r}: server-held tables in an elastic job need "
                                  "one worker process per machine (BYTEPS_LOCAL_SIZE="
                                  f"{rt.local_size_})")
            if m.server_ranks != list(range(len(m.server_ranks))) or not m.server_ranks:
                raise BytePSError(f"table {name!r}: the servers' ranks {m.server_ranks} are not "
                                  "0..S-1")
            self._open()
            table = EmbeddingTable(self, spec, table_id, None)
            metas = [{"spec": spec.to_json(), "shard": s, "shards": self.num_servers,
                      "local_size": rt.local_size_} for s in range(self.num_servers)]
            self.call(table, MsgType.SPARSE_CREATE, 0, [(None, None)] * self.num_servers,
                      timeout, metas)
        with self._lock:
            self.tables[name] = table
        return table

    # -- losing a server (docs/sparse.md, "Losing a server") -----------------------------------
    def servers_lost(self, servers: list[int], number: int = 0) -> str | None:
        """The servers of these indices are lost (the scheduler's FAILOVER; any thread). With
        replication each of their shards goes on on its copy: requests waiting for a lost
        server are sent to the copy (a pull, a save) or no longer wait for it (the copy was
        asked too). Returns why the tables cannot go on (a shard without a copy left), or
        None."""
        resend = []
        with self._lock:
            self.lost.update(servers)
            if not self.tables:
                return None
            for sh in range(self.num_servers):
                if not self._holders(sh):
                    name = min(self.tables)
                    return str(self._shard_lost(self.tables[name], sh))
            if self.survival == "snapshot":   # every request waits for the rollback
                self.to_restore = max(self.to_restore, number)
                for key, call in self._calls.items():
                    call.error = call.error or _RolledBack(number)
                    call.done.set()
                    self._cut_off = (self._cut_off + [key])[-64:]   # late answers: expected
                return None
            for call in self._calls.values():
                for srv, sh in sorted(call.want - set(call.got)):
                    if srv not in self.lost:
                        continue
                    call.want.discard((srv, sh))
                    if not any(other == sh for _s, other in call.want):   # no copy asked
                        copy = self._holders(sh)[0]
                        call.want.add((copy, sh))
                        resend.append((call, copy, sh))
                call.check_done()
        for call, srv, sh in resend:
            self._send(call, srv, sh)
        return None

    def after_failover(self, number: int, timeout: float | None = None) -> None:
        """Snapshots (BYTEPS_SPARSE_SURVIVAL=snapshot), on the failover's thread once the dense
        keys are seeded: ask every server left to roll each table back to the newest snapshot
        of the lost shards (server/sparse_survival.py), then go on from that round."""
        with self._lock:
            if self.survival != "snapshot" or number <= self.restored or not self.tables:
                self.restored = max(self.restored, number)
                self._restored_cv.notify_all()
                return
            tables = sorted(self.tables.values(), key=lambda t: t.table_id)
            lost, alive = sorted(self.lost), [s for s in range(self.num_servers)
                                             if s not in self.lost]
        holders = {str(sh): self.rt.members.server_ranks[self._holders(sh)[0]]
                   for sh in range(self.num_servers)}
        meta = {"restore": number, "lost": lost, "holders": holders}
        for table in tables:
            rounds = self._restore_one(table, number, alive, meta, timeout)
            if len(set(rounds)) != 1:
                raise BytePSError(f"table {table.name!r}: the servers went back to different "
                                  f"rounds {sorted(set(rounds))} after failover {number}")
            with self._lock:
                table.rewind = (number, rounds[0])
        with self._lock:
            self.restored = max(self.restored, number)
            self._restored_cv.notify_all()

    def _restore_one(self, table: EmbeddingTable, number: int, alive: list[int], meta: dict,
                     timeout: float | None) -> list[int]:
        key = (table.table_id, "restore", number)
        call = _Call(table, MsgType.SPARSE_LOAD, number, [None] * self.num_servers, number)
        for srv in alive:
            call.frames[srv] = self._frames(table, MsgType.SPARSE_LOAD, number, srv, None, None,
                                            meta, number)
            call.want.add((srv, srv))
        with self._lock:
            self._calls[key] = call
        try:
            for srv in alive:
                self._send(call, srv, srv)
            self._wait(call, timeout)
        finally:
            with self._lock:
                self._calls.pop(key, None)
        return [int(a.get("round", -1)) if isinstance(a, dict) else -1
                for a in call.got.values()]
