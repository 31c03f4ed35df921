"""The worker's side of elastic membership epochs (BYTEPS_ELASTIC; docs/elastic.md).

The scheduler owns the worker set. When it changes (a worker lost, one registering, a worker
asking to admit those waiting) it announces the next epoch (``EPOCH``, the epoch in the key).
This module, called by the :class:`~byteps_like.worker.runtime.Runtime` through a few hook lines:

* on the announcement (I/O thread) fails every in-flight handle of the old epoch with
  :class:`~byteps_like.errors.MembershipChangedError` and closes the native data plane's client,
  so nothing blocked in a collective waits for a worker that is gone (``on_epoch``);
* ``check_membership()`` raises it too, cheaply, when workers wait to join;
* ``rejoin()`` abandons what the old epoch left in flight, tells the scheduler it is ready
  (``READY``), blocks until the new epoch is formed (``EPOCH_START``: the servers have reset for
  it already, forgetting every key), adopts the new dense rank and size, forgets its tensor
  declarations (each is declared afresh at the epoch's first round, as in a fresh job; ids come
  from names, so a joiner's keys are the survivors') and reopens the native data plane's
  streams under the new rank.

Rounds carry the epoch in their high bits (:func:`byteps_like.wire.epoch_round_base`), so a
push of an older epoch is out of round at every server: no sum mixes two epochs.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from ..errors import BytePSError, MembershipChangedError, TooFewWorkersError
from ..partition import Assigner
from ..wire import epoch_round_base, round_epoch
from . import broadcast

if TYPE_CHECKING:
    from .dataplane import NativeDataPlane
    from .inflight import InFlight
    from .membership import Membership
    from .tensors import TensorRegistry

log = logging.getLogger("byteps_like.worker")

#: Bits of a tensor's id in an elastic job (its key is the id above the partition bits).
NAME_ID_BITS = 40


def name_id(name: str) -> int:
    """An elastic job's id of tensor ``name``: a hash of the name (64-bit FNV-1a, 40 bits kept),
    not the declaration order, so a worker that joins later, having declared other names first,
    gets the keys the others use. Two names of one job that hash alike (about n*n / 2**41 for n
    names) are a tensor mismatch the servers report, naming both."""
    h = 0xCBF29CE484222325
    for b in name.encode():
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h & ((1 << NAME_ID_BITS) - 1)


class ElasticAssigner(Assigner):
    """The server of each partition in an elastic job: a hash of its key over the servers of
    weight > 0, so every worker (a joiner too) computes the same map whatever it declared
    before. Each of those servers should get an equal share, whatever its weight."""

    def __init__(self, num_servers: int, weights: Any):
        self.num_servers = num_servers
        eligible = [s for s in range(num_servers) if weights[s] > 0] or [0]
        self._reset(eligible, [1.0 / len(eligible)] * num_servers)

    def _choose(self, key: int, nbytes: int) -> int:
        h = (key * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        return self._eligible[(h >> 32) % len(self._eligible)]


class ElasticMembership:
    """One worker's membership epoch. Created by the runtime when BYTEPS_ELASTIC is on."""

    def __init__(self, members: Membership, flight: InFlight, registry: TensorRegistry,
                 plane: NativeDataPlane):
        self.members = members
        self.flight = flight
        self.registry = registry
        self.plane = plane
        self.epoch = 0                   # the epoch this worker is in (0: none yet)
        self.round_base = 0
        self._lock = threading.Lock()
        self._superseded: MembershipChangedError | None = None  # the epoch was replaced
        self._announced = 0              # the newest epoch the scheduler announced
        self._added = 0                  # workers waiting to join the current epoch
        self._start: dict | None = None  # the newest EPOCH_START not adopted yet
        self._started = threading.Event()
        # called with the new epoch's first round once it is adopted (the server-held tables)
        self.on_new_epoch: list[Any] = []

    # -- hooks the runtime calls --------------------------------------------------------------
    def attach_control(self, control: Any) -> None:
        """Before registering: the control client hands this module the scheduler's notices."""
        from ..wire import MsgType
        control.on_epoch = self.on_epoch
        control.on_epoch_start = self.on_epoch_start
        self._leave_on_sigterm(control)
        early, control.early = control.early, []
        for mtype, key, meta in early:
            if mtype is MsgType.EPOCH:
                self.on_epoch(key, meta)
            else:
                self.on_epoch_start(meta)

    @staticmethod
    def _leave_on_sigterm(control: Any) -> None:
        """A preempted worker (Kubernetes, spot instances: SIGTERM first) tells the scheduler
        at once, so the others re-form without waiting for its heartbeat timeout. Only when
        SIGTERM has its default action and this is the main thread; then the default action."""
        import os
        import signal
        try:
            if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
                return

            def leave(signum: int, frame: Any) -> None:
                try:
                    control.abort("preempted: terminated by SIGTERM")
                    time.sleep(0.1)  # the I/O thread sends it
                finally:
                    signal.signal(signal.SIGTERM, signal.SIG_DFL)
                    os.kill(os.getpid(), signal.SIGTERM)
            signal.signal(signal.SIGTERM, leave)
        except ValueError:  # not the main thread: the heartbeat timeout detects it
            pass

    def adopt_table(self) -> None:
        """After the node table: the epoch, rank and size it names (a joiner's table too)."""
        m = self.members
        c = m.controller
        self.epoch = c.epoch or 1
        self._announced = max(self._announced, self.epoch)
        self.round_base = c.round_base
        if c.size:
            m.size = c.size
        # keys from names and servers from keys: the same on a joiner as on the survivors
        if m.assigner is not None and not isinstance(m.assigner, ElasticAssigner):
            m.assigner = ElasticAssigner(  # type: ignore[assignment]
                m.assigner.num_servers, m.assigner.weights)
        reg = self.registry
        reg.key_of = name_id
        reg.round_base = self.round_base

    def stale(self, task: Any) -> bool:
        """A partition of an epoch that is over (its push would be out of round)."""
        return self._superseded is not None or round_epoch(task.round) != self.epoch

    def fail_stale(self, task: Any) -> bool:
        """The push stage: fail a partition of an epoch that is over instead of pushing it.
        True: it was stale and is failed."""
        if not self.stale(task):
            return False
        self.flight.fail_task(task, self._error())
        return True

    def check_collective(self) -> None:
        """Before a collective starts: raise at once when the epoch is superseded."""
        exc = self._superseded
        if exc is not None:
            raise exc

    # -- the scheduler's notices (I/O thread) ---------------------------------------------------
    def on_epoch(self, epoch: int, meta: dict) -> None:
        lost = meta.get("lost")
        lost_t = tuple(str(x)[:500] for x in lost[:100]) if isinstance(lost, list) else ()
        added = meta.get("added")
        added = added if type(added) is int and added >= 0 else 0
        with self._lock:
            if epoch <= self.epoch:   # the current epoch: workers wait to join
                self._added = max(self._added, added)
                return
            self._announced = max(self._announced, epoch)
            first = self._superseded is None
            self._superseded = MembershipChangedError(
                f"worker rank {self.members.rank}: the membership of the job changed (epoch "
                f"{self.epoch} -> {epoch})" + (f"; lost: {'; '.join(lost_t)}" if lost_t else "")
                + (f"; {added} worker(s) waiting to join" if added else "")
                + "; call rejoin() (byteps_like.elastic.run does)",
                epoch=epoch, lost=lost_t, added=added)
        if first:
            self._abandon(self._superseded)

    def on_epoch_start(self, meta: dict) -> None:
        epoch = meta.get("epoch")
        if type(epoch) is not int or epoch <= self.epoch:
            return
        with self._lock:
            self._start = dict(meta)
            self._announced = max(self._announced, epoch)
        self._started.set()

    def _error(self) -> MembershipChangedError:
        return self._superseded or MembershipChangedError(
            f"worker rank {self.members.rank}: the membership epoch {self.epoch} ended",
            epoch=self._announced, added=self._added)

    def _abandon(self, exc: BaseException) -> None:
        """Fail every handle of the old epoch and wake whoever waits in the data plane."""
        control = self.members.control
        if control is not None:
            control.interrupt = exc   # barriers and finish() waiting raise it
        self.flight.fail_handles(exc)
        self.plane.interrupt()

    # -- the interface (user thread) ------------------------------------------------------------
    def check_membership(self) -> None:
        exc = self._superseded
        if exc is not None:
            raise exc
        if self._added:
            raise MembershipChangedError(
                f"worker rank {self.members.rank}: {self._added} worker(s) wait to join the job; "
                "call rejoin() to admit them", epoch=self.epoch + 1, added=self._added)
        control = self.members.control
        if control is not None and control.fatal is not None:
            raise control.fatal

    def rejoin(self, timeout: float | None = None) -> None:
        m = self.members
        t0 = time.monotonic()
        exc = self._error()
        with self._lock:
            if self._superseded is None:
                self._superseded = exc
        self._abandon(exc)
        self._drop_inflight()
        control = m.controller
        control.ready(self._announced)
        limit = m.config.timeouts.op_timeout if timeout is None else timeout
        deadline = t0 + limit
        while True:
            if self._started.wait(0.05):
                with self._lock:
                    start = self._start
                if start is not None and start["epoch"] >= self._announced:
                    break
                self._started.clear()
            fatal = control.fatal or self.flight.fatal
            if fatal is not None:
                raise fatal
            if time.monotonic() > deadline:
                raise TooFewWorkersError(
                    f"worker rank {m.rank}: no new membership epoch within {limit:g} s "
                    "(rejoin timeout)", min_workers=m.config.elastic.min_workers)
        self._adopt(start)

    def _drop_inflight(self) -> None:
        """Forget every operation of the old epoch: native operations are ignored when their
        (closed) client completes them."""
        with self.flight.lock:
            self.plane.forget()
            for st in self.registry.tensors.values():
                st.busy = None
                st.waiting = []

    def _adopt(self, start: dict) -> None:
        epoch, rank, size = int(start["epoch"]), int(start["rank"]), int(start["size"])
        base = epoch_round_base(epoch)
        m = self.members
        with self.flight.lock:
            self.epoch, self.round_base = epoch, base
            m.rank, m.size = rank, size
            m.machine = m.push_rank = rank   # one worker process per machine
            m.controller.rank = rank
            m.dropped.who = f"worker {rank}"
            # every tensor is declared afresh in the new epoch, as in a fresh job (the servers
            # forgot their keys): a name may come back with another shape, and the unnamed
            # sequences restart, so a joiner's names are the survivors'
            self.registry.reset(base)
            broadcast.reset_names()
            for hook in self.on_new_epoch:
                hook(base)
            self._superseded = None
            self._added = 0
            self._start = None
            self._started.clear()
        m.controller.reset_barriers()
        m.controller.interrupt = None
        if self.plane.client is not None:
            self._reopen_native()
        log.info("worker rank %d of %d: membership epoch %d", rank, size, epoch)

    def _reopen_native(self) -> None:
        """The native streams say the rank in their hello: open new ones under the new rank."""
        plane, m = self.plane, self.members
        with self.flight.lock:
            plane.forget()   # what the old client still completes is ignored
        plane.close()
        cfg = m.config
        credit = cfg.scheduling.credit * cfg.partition.partition_bytes
        try:
            plane.connect(cfg, m.servers, credit)
        except BytePSError:
            raise
        except Exception as exc:  # noqa: BLE001 - said plainly, the job cannot go on
            raise BytePSError(f"worker rank {m.rank}: cannot reopen the native data plane "
                              f"for epoch {self.epoch}: {exc}") from exc
