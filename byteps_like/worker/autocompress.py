"""``Compression.auto`` in the worker: measure, decide on rank 0, switch on every rank alike.

:func:`auto_choice` is what ``Runtime.push_pull_async`` calls for a push_pull with an
:class:`~byteps_like.autocompress.AutoCompression`: it returns the name and the concrete
compressor (none, a cast or a codec) the tensor travels with in this round. The runtime's
:class:`AutoController` (one per runtime) holds the decision.

Agreement. A tensor's push_pulls are counted per name (every rank pushes a name the same number
of times); its round ``c`` belongs to epoch ``c // rounds`` (``rounds``: BYTEPS_COMPRESSOR_AUTO_
ROUNDS). Epoch ``e``'s table (a candidate per size class) reaches every rank through a broadcast
from rank 0 over the servers, on the name ``bpsl.auto`` (its round ``e``): every rank starts it
when its first push_pull of epoch ``e - 1`` begins (rank 0 writes its decision of that moment,
the others zeros) and waits for it at its first push_pull of epoch ``e``, by which time it has
almost always arrived. Epoch 0 sends everything uncompressed. So a decision takes effect at the
same round of every tensor on every rank, one or two epochs after rank 0 made it.

A clean switch. Each candidate travels under its own name (``NAME#auto.onebit``; none under
``NAME``): its keys, its declaration and the servers' codec state (an error-feedback residual)
belong to that candidate alone, and a switch never changes the compressor of a key. A codec's
residual (worker and server) waits while another candidate is chosen and is applied when the
codec is chosen again: error feedback's invariant (what was sent plus the residual is what was
given) holds across switches.

Measurement (rank 0). A thread samples the bytes the native client moved (in and out) and its
busy time (partitions in flight) every 0.1 s; bytes over busy time give a window's bandwidth
(:class:`BandwidthMeter`), and the median of the last three is the measured bandwidth. Rank 0
decides again when it moves by more than 25% from the reference: the first window measured
under the table now in force (a codec's windows read lower than the link, as its messages are
short: comparing windows of one table keeps it from flapping). The codec speeds are measured
once, as the thread starts, while the first windows' traffic flows
(:func:`byteps_like.autocompress.measure_speeds`, on a sample of twice the last-level cache:
:func:`~byteps_like.autocompress.speed_sample_bytes`). The runtime's teardown closes the
controller and waits for the thread (:meth:`AutoController.close`).
"""
from __future__ import annotations

import logging
import math
import threading
import time
import zlib
from collections import deque
from typing import TYPE_CHECKING, Any

import numpy as np

from ..autocompress import (
    NUM_CLASSES,
    AutoCompression,
    Choice,
    CodecSpeed,
    SpeedsStopped,
    choose,
    class_bounds,
    class_size,
    last_level_cache_bytes,
    measure_speeds,
    size_class,
    speed_sample_bytes,
)
from ..compression import Compression, Compressor
from ..errors import BytePSError, MismatchError
from .pipeline import native_codec_threads

if TYPE_CHECKING:
    from .handle import Handle

Runtime = Any  # worker.runtime.Runtime (not imported: it imports this module)

log = logging.getLogger("byteps_like.worker.autocompress")

BCAST = "bpsl.auto"
_MAGIC = 0x4155544F  # "AUTO"
_HEAD = 3            # magic, epoch, candidates' hash; then one candidate index per class
_SAMPLE_S = 0.1      # the measuring thread's period
_MIN_BYTES = 256 << 10  # a bandwidth window holds at least these bytes
_MOVE = 1.25         # the bandwidth moved: by more than this factor either way
_WINDOWS = 3         # the bandwidth is the median of the last windows
_JOIN_S = 10.0       # close() waits this long for the measuring thread


def auto_choice(rt: Runtime, auto: AutoCompression, name: str | None, arr: np.ndarray,
                staged: bool) -> tuple[str | None, Compressor]:
    """The name and compressor of this push_pull of ``name`` under ``auto``. An unnamed
    push_pull, a standalone job, a tensor that is not float32, one ``staged`` from a device or
    prereduced, and one below BYTEPS_MIN_COMPRESS_BYTES travel as none under their name."""
    cfg = rt.config
    if (name is None or arr.dtype != np.float32 or staged
            or rt.members.control is None or rt.alone
            or arr.nbytes < cfg.compression.min_compress_bytes):
        return name, Compression.none
    ctl = controller(rt, auto)
    return ctl.resolve(name, arr.nbytes)


def controller(rt: Runtime, auto: AutoCompression) -> AutoController:
    """The runtime's controller (made at its first auto push_pull); one ``auto`` per job."""
    ctl: AutoController | None = getattr(rt, "_auto_controller", None)
    if ctl is None or ctl.closed or ctl.epoch != rt.epoch:
        with _MAKE:
            ctl = getattr(rt, "_auto_controller", None)
            if ctl is not None and ctl.epoch != rt.epoch:
                ctl.close()   # an elastic job's new epoch declares every name afresh
            if ctl is None or ctl.closed:
                ctl = AutoController(rt, auto)
                rt._auto_controller = ctl
    if ctl.auto != auto:
        raise MismatchError(f"worker rank {rt.rank_}: push_pull with {auto!r} "
                            f"({auto.spec()}), but this job's auto compression is "
                            f"{ctl.auto.spec()}; use one Compression.auto per job")
    return ctl


def decisions(rt: Any) -> list[dict]:
    """Rank 0's decisions so far (the bench reports them): each with ``time`` (time.time()),
    ``bandwidth`` (bytes/s), ``table`` ({size class bounds: candidate} of the classes used),
    ``changed`` and ``why``. Empty on other ranks and before the first auto push_pull."""
    ctl = getattr(rt, "_auto_controller", None)
    return list(ctl.decisions) if ctl is not None else []


def first_decision_in_force(rt: Any) -> bool:
    """Rank 0: its first decision is made and this rank's push_pulls travel under it (the
    epoch it applies from has begun). False on other ranks and before the first auto
    push_pull."""
    ctl = getattr(rt, "_auto_controller", None)
    return ctl is not None and ctl.first_in_force()


_MAKE = threading.Lock()


class AutoController:
    """One runtime's auto compression: the per-name counts, the epochs' tables, and on rank 0
    the measurement and the decision."""

    def __init__(self, rt: Runtime, auto: AutoCompression):
        self.rt = rt
        self.auto = auto
        self.names = list(auto.candidates)          # a table holds indices into this
        self.digest = zlib.crc32(repr(auto.spec()).encode()) & 0x7FFFFFFF
        self.closed = False
        self.epoch = rt.epoch   # an elastic job's membership epoch: its names and rounds
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}
        self._sizes: dict[str, int] = {}             # the names auto has seen, their bytes
        self._tables: dict[int, list[int]] = {0: [0] * NUM_CLASSES}
        self._pending: dict[int, tuple[Handle, np.ndarray]] = {}
        self._issued = 0                             # the last epoch whose broadcast started
        self._epoch = 0                              # the highest epoch begun on this rank
        self.root = rt.rank_ == 0
        # rank 0: the decision and what it rests on
        self.current = [0] * NUM_CLASSES
        self.seen: set[int] = set()
        self.speeds: list[CodecSpeed] | None = None
        self._speeds_lock = threading.Lock()
        self.decisions: deque[dict] = deque(maxlen=1000)
        self._ref: float | None = None               # bandwidth the current table was decided at
        self._settle_epoch = -1                      # measure again from this epoch on
        self._thread: threading.Thread | None = None
        self.measuring = True   # False: decisions only through decide() (tests, a planner)
        if self.root:
            self._thread = threading.Thread(target=self._measure, name="bpsl-auto",
                                            daemon=True)
            self._thread.start()

    # -- every rank ----------------------------------------------------------------------------
    def resolve(self, name: str, nbytes: int) -> tuple[str, Compressor]:
        cls = size_class(nbytes)
        with self._lock:
            c = self._counts.get(name, 0)
            self._counts[name] = c + 1
            epoch = c // self.auto.rounds
            if epoch > self._epoch:
                self._epoch = epoch
            while self._issued <= self._epoch:   # the next epoch's table, on its way
                self._issue(self._issued + 1)
            table = self._table(epoch, name)
            if self.root:
                self.seen.add(cls)
            if name not in self._sizes:
                self._sizes[name] = nbytes
        cand = self.names[table[cls]]
        if cand == "none":
            return name, Compression.none
        return variant(name, cand), self.auto.candidates[cand]

    def _issue(self, epoch: int) -> None:
        arr = np.zeros(_HEAD + NUM_CLASSES, np.int64)
        if self.root:
            arr[:_HEAD] = (_MAGIC, epoch, self.digest)
            arr[_HEAD:] = self.current
        h = self.rt.push_pull_async(arr, name=BCAST, average=False, out=arr)
        self._pending[epoch] = (h, arr)
        self._issued = epoch

    def _table(self, epoch: int, name: str) -> list[int]:
        table = self._tables.get(epoch)
        if table is not None:
            return table
        h, arr = self._pending.pop(epoch)
        h.wait()
        magic, got, digest = (int(v) for v in arr[:_HEAD])
        if not arr.any():   # rank 0 pushes no more (it joined): the last table stays
            table = self._tables[max(self._tables)]
            self._tables[epoch] = table
            return table
        if magic != _MAGIC or got != epoch:
            raise BytePSError(f"worker rank {self.rt.rank_}: auto compression's table of epoch "
                              f"{epoch} (for {name!r}) came as {arr[:_HEAD].tolist()}: the "
                              "ranks' push_pulls with Compression.auto are out of step")
        if digest != self.digest:
            raise MismatchError(f"worker rank {self.rt.rank_}: rank 0's Compression.auto has "
                                f"other settings than this rank's {self.auto.spec()}; every "
                                "rank must pass the same")
        table = [int(v) for v in arr[_HEAD:]]
        if any(not 0 <= v < len(self.names) for v in table):
            raise BytePSError(f"worker rank {self.rt.rank_}: auto compression's table of "
                              f"epoch {epoch} names a candidate out of range: {table}")
        if table != self._tables[max(self._tables)]:
            self._declare(table)
        self._tables = {e: t for e, t in self._tables.items() if e >= epoch - 1}
        self._tables[epoch] = table
        return table

    def _declare(self, table: list[int]) -> None:
        """Declare the names a new table makes the known tensors travel under, in the order of
        their own declarations: a name's key is its place in the order of declarations, which
        must be the same on every rank whatever order this step's push_pulls come in (the
        synchronizer declares its buckets up front for that reason)."""
        declared = self.rt.tensors()
        order = {n: i for i, n in enumerate(self._sizes)}

        def place(name: str) -> tuple[int, int]:
            st = declared.get(name)
            return (st.decl_id if st is not None else 1 << 62, order[name])

        for name in sorted(self._sizes, key=place):
            cand = self.names[table[size_class(self._sizes[name])]]
            if cand != "none" and variant(name, cand) not in declared:
                self.rt.declare(variant(name, cand))

    def first_in_force(self) -> bool:
        """Rank 0's first decision is made and applies to this rank's push_pulls now."""
        if not self.decisions:
            return False
        with self._lock:
            return self._epoch >= self.decisions[0]["applies_from_epoch"]

    def close(self) -> None:
        """Stop rank 0's measuring thread and wait for it (the runtime's teardown): a thread
        still inside a codec when the interpreter finalizes is ended by Python 3.12 through a
        forced unwind that aborts the process ("terminate called without an active
        exception"), so it must be done before. It stops before its next timed codec call
        (after at most one codec call on the sample: a candidate's untimed first encode, or
        the timed call under way)."""
        self.closed = True
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(_JOIN_S)
            if t.is_alive():
                log.warning("auto compression: the measuring thread did not stop within %g s",
                            _JOIN_S)

    # -- rank 0 --------------------------------------------------------------------------------
    def _live(self) -> bool:
        return not self.closed and self.rt.initialized and self.rt.epoch == self.epoch

    def _measure(self) -> None:
        meter = BandwidthMeter(self.rt)
        recent: deque[float] = deque(maxlen=_WINDOWS)
        try:   # while the first windows' traffic flows, not after them
            if self._live():
                self.measure_speeds()
        except SpeedsStopped:
            return
        while self._live():
            time.sleep(_SAMPLE_S)
            if not self.measuring:
                continue
            bw = meter.sample()
            if bw is None:
                continue
            recent.append(bw)
            if self._ref is None and self._settle_epoch < 0 and len(recent) < _WINDOWS:
                continue  # the first decision waits for a full median (not the start-up's)
            try:
                self.observe(sorted(recent)[len(recent) // 2])  # the median of the last few
            except Exception:  # noqa: BLE001 - a measuring thread must not die silently
                log.exception("auto compression: deciding failed; the last decision stays")

    def measure_speeds(self) -> list[CodecSpeed]:
        """The candidates' codec speeds, measured once (rank 0's thread does it as it starts):
        on a sample out of cache, as the gradients are; SpeedsStopped when closed meanwhile."""
        with self._speeds_lock:   # decide() on another thread waits for the thread's
            if self.speeds is None:
                sample = speed_sample_bytes(self.rt.config.partition.partition_bytes,
                                            last_level_cache_bytes())
                t0 = time.perf_counter()
                threads = native_codec_threads(self.rt.config.scheduling.codec_threads)
                self.speeds = measure_speeds(self.auto.candidates, sample, repeats=2,
                                             stop=lambda: not self._live(), threads=threads)
                log.info("auto compression: codec speeds on a %d KiB sample, %d thread(s) as "
                         "the codec pool (%.2f s): %s", sample >> 10, threads,
                         time.perf_counter() - t0,
                         ", ".join(f"{s.name} ratio {s.ratio:.3g} encode "
                                   f"{s.encode_bps / 1e9:.2f} GB/s decode "
                                   f"{s.decode_bps / 1e9:.2f} GB/s"
                                   for s in self.speeds[1:]) or "none only")
            return self.speeds

    def observe(self, bandwidth: float) -> None:
        """A bandwidth window (bytes/s): decide again when it moved (see the module's text)."""
        with self._lock:
            epoch = self._epoch
        if epoch < self._settle_epoch:
            return  # the table last decided is not in force yet: its windows come later
        if self._ref is None:
            if self._settle_epoch >= 0:     # the first window of a new table: the reference
                self._ref = bandwidth
                return
            self.decide(bandwidth)
        elif abs(math.log(bandwidth / self._ref)) > math.log(_MOVE):
            self.decide(bandwidth)

    def decide(self, bandwidth: float) -> list[Choice]:
        """Choose every size class's candidate at ``bandwidth`` (bytes/s), log it, and send it
        with the next epoch's broadcast."""
        speeds = self.measure_speeds()
        workers = max(1, self.rt.members.size // max(1, self.rt.members.local_size))
        servers = max(1, self.rt.members.num_servers)
        part = self.rt.config.partition.partition_bytes
        choices = [choose(class_size(c), bandwidth, speeds, workers=workers,
                          servers=servers, partition_bytes=part,
                          current=self.names[self.current[c]], margin=self.auto.margin)
                   for c in range(NUM_CLASSES)]
        new = [self.names.index(ch.name) for ch in choices]
        with self._lock:
            changed = new != self.current
            self.current = new
            applies = self._issued + 1   # the next broadcast carries it
            seen = sorted(self.seen)
        used = {c: choices[c] for c in seen}
        previous = self._ref
        if changed:
            self._ref, self._settle_epoch = None, applies
        else:
            self._ref = bandwidth
        record = {"time": time.time(), "bandwidth": bandwidth, "changed": changed,
                  "applies_from_epoch": applies,
                  "table": {_bounds(c): ch.name for c, ch in used.items()},
                  "why": {_bounds(c): ch.why() for c, ch in used.items()}}
        self.decisions.append(record)
        was = f" (was {previous * 8 / 1e9:.3g})" if previous else ""
        log.log(logging.INFO if changed or previous is None else logging.DEBUG,
                "auto compression: bandwidth %.3g Gbit/s%s: %s%s", bandwidth * 8 / 1e9, was,
                "; ".join(f"{_bounds(c)} -> {ch.name}{' (kept)' if ch.kept else ''} "
                          f"[{ch.why()}]" for c, ch in used.items()) or "no tensor yet",
                f"; from epoch {applies}" if changed else "; unchanged")
        return choices


class BandwidthMeter:
    """Windows of this worker's bandwidth (bytes pushed plus pulled per second). On the native
    data plane: its client's bytes in and out (counted by its I/O threads as they move) over the
    time the wire was asked to work: the client's ``busy_ns``, the seconds with a partition in
    flight (sent, its answer not in). Time between rounds, while the model computes or the
    caller waits, is not in it, so a round shorter than the sampling period still reads the
    link's rate (a window over wall time read 0.6 of a 25 Gbit/s link on the device). A window
    ends at the first sample after it holds 256 KiB and 20 ms of busy time, so it ends within a
    sampling period of the link's change. Without a client there is no window: rank 0 has one
    wherever a push_pull reaches the servers (it is a local root; ``NativeDataPlane.serves``)."""

    MIN_BUSY_S = 0.02

    def __init__(self, rt: Runtime):
        self.rt = rt
        self._last: tuple[float, float] | None = None

    def sample(self) -> float | None:
        """The window that ends now, in bytes/s, or None (idle, too few bytes)."""
        cli = self.rt.plane.client
        if cli is None:
            return None
        try:
            st = cli.stats()
        except Exception:  # noqa: BLE001 - closing under us: no window
            return None
        cur = (float(st["bytes_in"] + st["bytes_out"]), st["busy_ns"] / 1e9)
        prev = self._last
        if prev is None:
            self._last = cur
            return None
        db, busy = cur[0] - prev[0], cur[1] - prev[1]
        if db < _MIN_BYTES or busy < self.MIN_BUSY_S:
            return None       # the window goes on (from ``prev``)
        self._last = cur
        return db / busy


def variant(name: str, candidate: str) -> str:
    """The name a tensor travels under with a candidate other than none."""
    return f"{name}#auto.{candidate}"


def _bounds(cls: int) -> str:
    low, high = class_bounds(cls)

    def size(n: int) -> str:
        for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
            if n >= 1 << shift:
                return f"{n / (1 << shift):g} {unit}"
        return f"{n} B"
    return f"{size(low)}-{size(high)}" if high else f">= {size(low)}"
