"""The server: lifecycle, membership, metrics and configuration.

Every worker-server byte of a dense tensor moves on the native data plane (csrc/dataplane*.cc,
``_core.DataServer``): compiled I/O threads receive each push, sum it into the key's store,
keep the rounds, declarations, bounds, the memory budget (BYTEPS_SERVER_MAX_BYTES), join()
membership and elastic epochs, and answer the pulls. A compressed key is decoded, summed and
re-encoded there too; a registered compressor's codec math is Python (server/codecs.py). What
stays here: starting and stopping the server, its ZeroMQ endpoint (the control plane with the
scheduler, and the server-held embedding tables of server/sparse.py), handing membership
changes to the data plane, the stall inspector, rejection counts and metrics.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from .. import _core
from ..compression import CompressionError
from ..config import Config
from ..control import ControlClient
from ..errors import EXIT_PEER_FAILED, ConfigError, PeerLostError, ProtocolError
from ..transport import Route, make_endpoint, native
from ..wire import (
    ERR_PROTOCOL,
    SPARSE_REQUESTS,
    Header,
    MsgType,
    Role,
    decode,
    decode_header,
    encode,
    epoch_round_base,
    generation,
    generation_flags,
    job_hash,
    split_frames,
)
from .async_snapshots import AsyncSnapshots
from .codecs import make_server_codec
from .preempt import LEAVE_WAIT_S, PreemptionNotice, SigtermLeave, in_job
from .sparse import SparseService
from .stalls import stalled_rounds

if TYPE_CHECKING:
    from ..metrics import RoleMetrics

log = logging.getLogger("byteps_like.server")

#: rejections logged one by one for each reason; later ones are counted and summarised
REJECT_LOG_FIRST = 3
#: seconds between two summary lines of the rejections (none when there were none)
REJECT_SUMMARY_INTERVAL_S = 60.0
#: messages one client of the server's ZeroMQ socket may have waiting in ZeroMQ to be read: no
#: peer of the job sends to it (tensors and tables travel on the native data plane), so what
#: comes is a stranger's, up to BYTEPS_MAX_MESSAGE_BYTES each, and refused
CLIENT_RECV_HWM = 4


class Server:
    """One server of a job (``run()``, or ``python -m byteps_like.server``)."""

    def __init__(self, cfg: Config, *, context=None, address: str | None = None):
        native.check(cfg)  # the native data plane can serve this job (else a ConfigError)
        self.cfg = cfg
        self.async_mode = cfg.server.enable_async
        # one push per worker machine: the local ranks of a machine reduce before pushing;
        # elastic: up to the most workers at once, a round needs the epoch's (on_epoch)
        self.elastic = cfg.elastic.enabled and not cfg.server.enable_async
        self.num_workers = (cfg.elastic.capacity(cfg.cluster.num_worker) if self.elastic
                            else cfg.cluster.num_worker)
        self.required = cfg.cluster.num_worker
        self.epoch = 0
        self.joined: frozenset = frozenset()   # machines in join() (stall reports skip them)
        self.job = job_hash(cfg.cluster.job_id)
        from ..control import node_host
        host = node_host(cfg)
        address = address or f"tcp://{host}:{cfg.cluster.server_port}"
        if not address.startswith("tcp://"):
            raise ConfigError(
                f"server address {address}: a server listens on tcp:// (its data plane takes "
                "the host and a port next to it)" + (
                    "; ucx:// addresses were the ucxx endpoint's, retired in issue 39: with "
                    "BYTEPS_TRANSPORT=ucx the server's endpoint is ZeroMQ over tcp:// and its "
                    "data plane's streams are UCX" if address.startswith("ucx://") else ""))
        # no peer of the job sends to it: a stranger's messages wait a few at a time, then TCP
        # holds them back
        self.ep = make_endpoint("server", cfg, context=context, recv_hwm=CLIENT_RECV_HWM)
        self.address = self.ep.bind(address)
        port = int(self.address.rsplit(":", 1)[1])
        # the native data plane (csrc/dataplane*.cc): every push and pull of a dense tensor;
        # its port travels in the node table
        key = native.auth_key(cfg)
        self.native = _core.DataServer(
            self.num_workers, -1, self.job, native.io_threads(cfg),
            cfg.transport.max_message_bytes, native.store_budget(cfg),
            native.max_connections(), **({"auth_key": key} if key else {}),
            async_mode=self.async_mode)
        # a compressed key: at most one partition; a registered compressor's codec is Python
        self.native.set_partition_bytes(cfg.partition.partition_bytes)
        if cfg.server.async_staleness:  # asynchronous mode's bound (dataplane_server_stale.cc)
            self.native.set_staleness(cfg.server.async_staleness)
        # keys declared with backup workers: the completed rounds kept for a late worker
        self.native.set_backup_max_lag(cfg.server.backup_max_lag)
        self.native.set_codec_factory(make_server_codec, CompressionError)
        listen = self.native.listen_ucx if native.uses_ucx(cfg) else self.native.listen
        data_port_ = listen(host, native.data_port(cfg))
        self.control = ControlClient(cfg, self.ep, Role.SERVER, port=port, data_port=data_port_,
                                     on_fatal=lambda exc: self._done.set(),
                                     on_shutdown=lambda: self._done.set(),
                                     on_members=self.on_members,
                                     on_epoch=self.on_epoch if self.elastic else None)
        self.sparse = SparseService(self)  # server-held embedding tables (server/sparse.py)
        # the memory budget (BYTEPS_SERVER_MAX_BYTES): the native plane's, which the tables
        # charge too
        self.budget = native.store_budget(cfg)
        self.rejected = 0
        self.rejected_by_reason: dict[str, int] = {}
        self._reject_lock = threading.Lock()
        self._summary_lock = threading.Lock()
        self._summarised: dict[str, int] = {}
        self._summary_at = time.monotonic()
        self._done = threading.Event()
        self.metrics: RoleMetrics | None = None  # byteps_like/metrics.py
        self.ep.on_message = self._on_message
        self.ep.on_error = self._io_failed
        # asynchronous mode losing a server: snapshots of the model the servers keep
        self.async_snaps = AsyncSnapshots(self) if AsyncSnapshots.wanted(cfg) else None
        if self.async_snaps is not None:
            self.async_snaps.check()

    def _io_failed(self, exc: BaseException) -> None:
        """The I/O thread died (a bug): exit non-zero instead of hanging; the scheduler sees the
        heartbeats stop and tells every other node which server was lost."""
        self.control.fail(RuntimeError(f"server {self.rank} internal error: {exc!r}"))
        self._done.set()

    @property
    def rank(self) -> int:
        return self.control.rank

    def send(self, route: Route, frames: list) -> None:
        """Send a message to a peer: on its table stream (csrc/dataplane_tables.h) when the
        route is one, else through ZeroMQ."""
        if route.peer == native.TABLE_PEER:
            self.native.table_send(route.conn, *split_frames(frames))
        else:
            self.ep.send(route, frames)

    def reply(self, route: Route, mtype: MsgType, h: Header, meta: dict | None = None,
              job: int | None = None) -> None:
        """Answer a peer; ``job``: the tag to answer with when the peer's is not known to be
        this job's (its own, so an outsider learns nothing)."""
        # a table request's flags carry the worker's rollback generation: echoed, so the worker
        # knows an answer to a request from before a rollback (server/sparse_survival.py)
        hdr = Header(mtype, role=Role.SERVER, rank=self.rank,
                     flags=generation_flags(generation(h.flags))
                     if h.type in SPARSE_REQUESTS else 0,
                     job=self.job if job is None else job, key=h.key, round=h.round)
        self.send(route, encode(hdr, meta=meta))

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
        """The scheduler's membership (join()): machines joined and left, applied by the native
        plane and the tables at once; the scheduler reads the acknowledgement only after this
        returns."""
        try:
            joined = frozenset(int(m) for m in meta.get("joined", ())
                               if 0 <= int(m) < self.num_workers)
            left = {int(m): str(why)[:1000] for m, why in dict(meta.get("left", {})).items()
                    if 0 <= int(m) < self.num_workers}
        except (TypeError, ValueError) as exc:
            log.warning("server %d: ignored a malformed membership notice: %s", self.rank, exc)
            return
        self.joined = joined
        self.native.set_members(sorted(joined), left)
        self.sparse.members(joined, left)

    def on_epoch(self, epoch: int, meta: dict) -> None:
        """Elastic jobs: reset to membership epoch ``epoch`` of ``meta["size"]`` workers, on the
        native plane at once and in the tables' thread's order; once the tables applied it,
        the server acknowledges it to the scheduler, which starts the epoch's workers then."""
        size = meta.get("size")
        if type(size) is not int or not 1 <= size <= self.num_workers or epoch <= self.epoch:
            log.warning("server %d: ignored a malformed epoch notice (epoch %d, size %r)",
                        self.rank, epoch, size)
            return
        base = epoch_round_base(epoch)
        self.epoch, self.required = epoch, size
        self.native.reset_epoch(base, size)

        def applied() -> None:
            log.info("server %d: membership epoch %d, %d worker(s)", self.rank, epoch, size)
            self.control.ack_epoch(epoch)
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
        if h.type in (MsgType.PUSH, MsgType.PULL) or h.type in SPARSE_REQUESTS:
            # a peer of another version, or forged
            self.refuse(route, h, "data over ZeroMQ", ERR_PROTOCOL, f"server {self.rank}: "
                        f"{h.type.name} from {h.sender} over ZeroMQ; pushes, pulls and table "
                        f"requests travel on the native data plane (port "
                        f"{self.control.data_port}) only")
            return
        self.refuse(route, h, "unexpected type or rank", ERR_PROTOCOL, f"server "
                    f"{self.rank}: unexpected {h.type.name} from {h.sender}")

    # -- the memory budget ------------------------------------------------------------------
    def charge(self, nbytes: int) -> bool:
        """Take ``nbytes`` of the budget the native plane's stores hold (negative: give back),
        for the tables; False, taking nothing, when they do not fit."""
        return bool(self.native.reserve(nbytes))

    def store_bytes(self) -> int:
        """Bytes the stores and tables hold (as charged)."""
        return int(self.native.stats()["store_bytes"])

    # -- rejections: counted by reason, logged at a bounded rate ------------------------------
    def _reject(self, reason: str, detail: str | None = None) -> None:
        """Count a rejected message. The first REJECT_LOG_FIRST of each reason are logged with
        ``detail``; the rest only in the summary line log_rejections writes at most every
        REJECT_SUMMARY_INTERVAL_S."""
        with self._reject_lock:
            self.rejected += 1
            n = self.rejected_by_reason[reason] = self.rejected_by_reason.get(reason, 0) + 1
        if detail is not None and n <= REJECT_LOG_FIRST:
            log.warning("server %d: rejected a message (%s): %s%s", self.rank, reason,
                        detail[:2000], "" if n < REJECT_LOG_FIRST else
                        f" [more of '{reason}' are counted, and summed up every "
                        f"{REJECT_SUMMARY_INTERVAL_S:.0f} s]")

    def log_rejections(self) -> None:
        """One line with the messages rejected since the last such line, by reason, the native
        plane's and ZeroMQ's (nothing when there were none). The I/O thread calls it every
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
        ranks = self.sparse.ranks
        return stalled_rounds(self.native, now, limit, self.required, self.joined,
                              list(self.sparse.tables.values()),
                              (ranks.of(range(self.required)), ranks.joined_ranks()))

    def _stall_tick(self) -> None:
        if not in_job(self.control):
            return
        stalls = self.stalled_rounds()
        if stalls:
            self.control.send_stall(stalls[:200])

    def report(self) -> dict:
        """What this server tells the scheduler every BYTEPS_REPORT_INTERVAL_SECONDS
        (byteps_like/report.py): its traffic, keys, CPU seconds and, per worker machine, how
        long the others waited for it and it for them (csrc/dataplane_straggle.h)."""
        ns = self.native.stats()
        return {"bytes": ns["bytes_summed"], "pushes": ns["pushes"], "rounds": ns["rounds"],
                "keys": ns["keys"] + len(self.sparse.tables), "store_bytes": ns["store_bytes"],
                "cpu": round(time.process_time(), 4),
                "straggle": [[round(held, 6), rounds, round(waited, 6)]
                             for held, rounds, waited in self.native.straggle()]}

    def _report_tick(self) -> None:
        from ..report import send_report
        send_report(self.control, self.report())

    def start(self) -> None:
        self.sparse.start()
        self.native.start()
        self.ep.start()
        self.control.connect_and_register()
        self.native.set_rank(self.rank)
        if self.async_snaps is not None:
            self.async_snaps.start()
        if self.cfg.server.preemption_notice_file:  # server/preempt.py
            PreemptionNotice(self, self.cfg.server.preemption_notice_file).start()
        if not self.async_mode:
            check = self.cfg.timeouts.stall_check_time
            self.ep.add_timer(max(0.05, min(check / 2, 5.0)), self._stall_tick)
        self.ep.add_timer(REJECT_SUMMARY_INTERVAL_S, self.log_rejections)
        if self.cfg.metrics.report_interval > 0:
            self.ep.add_timer(self.cfg.metrics.report_interval, self._report_tick)
        log.info("server %d: serving on %s (%s mode); native data plane on port %d (%d I/O "
                 "threads)", self.rank, self.address, "async" if self.async_mode else "sync",
                 self.control.data_port, self.native.stats()["io_threads"])
        from byteps_like.metrics import serve_role  # metrics: BYTEPS_METRICS_PORT
        self.metrics = serve_role("server", self.rank, self.cfg, self._metrics_sample)

    def _metrics_sample(self) -> dict:
        """What the Prometheus endpoint reports (byteps_like/metrics.py)."""
        ns = self.native.stats()
        return {"byteps_server_bytes_summed": ns["bytes_summed"],
                "byteps_server_sum_seconds": ns["sum_ns"] / 1e9,
                "byteps_server_pushes": ns["pushes"], "byteps_server_rounds": ns["rounds"],
                "byteps_server_table_rounds": self.sparse.rounds_applied,
                "byteps_server_table_rows_updated": self.sparse.rows_updated,
                "byteps_server_table_pulls_answered": ns["table_pulls_answered"],
                "byteps_server_table_pulls_parked": ns["table_pulls_parked"],
                "byteps_server_table_bytes": self.sparse.held_bytes(),
                **{f"byteps_server_table_{k}": v for k, v in self.sparse.keep.stats().items()},
                "byteps_server_backup_rounds": ns["backup_rounds"],
                "byteps_server_late_pushes_dropped": ns["late_pushes_dropped"],
                "byteps_server_lag_errors": ns["lag_errors"]}

    def rejections(self) -> dict[str, int]:
        """Rejected messages by reason, the native plane's and ZeroMQ's."""
        with self._reject_lock:
            out = dict(self.rejected_by_reason)
        for reason, n in self.native.rejected().items():
            out[reason] = out.get(reason, 0) + n
        return out

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        self.sparse.close()
        if self.async_snaps is not None:
            self.async_snaps.close()
        self.closed_cleanly = self.ep.close(linger=1.0)
        # the data plane last: a server that failed keeps its streams until it is about to exit,
        # so its workers learn of it from the job (bpslaunch blames this server), not first
        # from a closed stream
        self.native.close()
        self.log_rejections()  # the last window's rejections, which no timer will write
        ns = self.native.stats()
        if ns["backup_rounds"] or ns["late_pushes_dropped"]:
            log.info("server %d: backup workers (BYTEPS_BACKUP_WORKERS): %d rounds completed "
                     "without every worker's push, %d late pushes dropped, %d requests of "
                     "workers too far behind", self.rank, ns["backup_rounds"],
                     ns["late_pushes_dropped"], ns["lag_errors"])

    def run(self) -> int:
        leave = SigtermLeave(self)   # SIGTERM: an announced leave, when the job can lose it
        try:
            self.start()
            leave.install()
            while not self._done.wait(0.25):   # wakes for the SIGTERM handler, too
                if leave.overdue():
                    leave.terminate(f"the scheduler did not let it go within {LEAVE_WAIT_S:g} "
                                    "s of its announced leave")
        except Exception as exc:  # noqa: BLE001 - reported, exit non-zero
            if exc is not self.control.fatal:   # (the control client logged its own)
                log.error("server: %s", exc)
            # a job that could not form because of another node (the scheduler refused one):
            # that one is to blame, not this server, which exited 1 and was blamed when
            # bpslaunch saw its exit first (issue 40)
            return EXIT_PEER_FAILED if isinstance(exc, PeerLostError) else 1
        finally:
            leave.restore()
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
