"""The local reduction: several worker processes on one machine sum through shared memory.

With ``BYTEPS_LOCAL_SIZE`` > 1 only the machine's local root (local rank 0) talks to the
servers. Each tensor has a shared segment (:class:`byteps_like.local.Segment`): one input slot
per local rank and an output. A partition's REDUCE stage copies the rank's input into its slot,
waits until every slot is filled, and sums the rank's slice of the partition over the slots
into the output (a reduce-scatter); the root then pushes the machine's sum and, in BROADCAST,
tells the local ranks it has arrived, and every rank copies (and averages) it out.

The ranks coordinate with four messages over the root's socket (:class:`~byteps_like.wire.
MsgType`): LOCAL_READY (a rank's input is in its slot) and LOCAL_REDUCED (its slice is summed)
go to the root, LOCAL_REDUCE (every input is in: sum your slice) and LOCAL_DONE (the machine's
sum is in the output) come from it. A task waits for an event in the :class:`~byteps_like.
local.Gate` and carries its progress in ``Task.phase`` (:class:`~.pipeline.Phase`).

Who calls it: the pipeline's REDUCE and BROADCAST threads (:meth:`LocalReduction.reduce`,
:meth:`LocalReduction.broadcast`); :mod:`.dispatch` with a checked local message
(:meth:`LocalReduction.on_message`); ``Rounds.start`` and ``Runtime.local_out`` for a tensor's
segment; the runtime's teardown (:meth:`LocalReduction.close`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .. import _core, local
from ..transport import Route
from ..wire import (
    CONTRIB_SHIFT,
    FLAG_CONTRIB,
    ITEMSIZE,
    Header,
    MsgType,
    Role,
    contributors,
    encode,
)
from .pipeline import Phase, Task
from .tensors import TensorState

if TYPE_CHECKING:
    from .inflight import InFlight
    from .membership import Membership

#: the messages of the local reduction (the dispatcher routes them here)
LOCAL_TYPES = frozenset({MsgType.LOCAL_READY, MsgType.LOCAL_REDUCE, MsgType.LOCAL_REDUCED,
                         MsgType.LOCAL_DONE})

Token = tuple[int, int]   # (key, round): one partition's round


class LocalReduction:
    """This machine's side of the local reduction of one runtime."""

    def __init__(self, members: Membership, flight: InFlight):
        self.members = members
        self.segments: dict[int, local.Segment] = {}    # decl_id -> the tensor's segment
        self._held: tuple[str, str] | None = None       # local.hold's (prefix, directory)
        self.routes: dict[int, Route] = {}  # local root: local rank -> the way back to it
        self.gate = local.Gate(lambda task: flight.active_pipeline.resume(task))
        self.ready = local.Counter(1)       # local root: inputs in place, per token
        self.reduced = local.Counter(1)     # local root: slices summed, per token
        # a local rank: the pushes the servers summed of a round fewer machines pushed
        # (BYTEPS_BACKUP_WORKERS), per token, as the root's LOCAL_DONE says, until it is used
        self.contrib: dict[tuple[int, int], int] = {}

    def reset(self, local_size: int) -> None:
        """Count arrivals for ``local_size`` local ranks (before any local message comes)."""
        self.ready = local.Counter(local_size)
        self.reduced = local.Counter(local_size)

    def segment(self, st: TensorState) -> local.Segment:
        """The shared segment of tensor ``st`` on this machine (created at its first use)."""
        seg = self.segments.get(st.decl_id)
        if seg is None:
            m = self.members
            c = m.config.cluster
            prefix = local.segment_prefix(c.job_id, c.root_port) + f"m{m.machine}-"
            # held while this process may use them: an orphan's only once every user is gone
            local.hold(prefix, c.shm_dir)
            self._held = (prefix, c.shm_dir)
            name = prefix + f"t{st.decl_id}"
            seg = local.Segment(name, st.nbytes, m.local_size,
                                what=f"tensor {st.name!r} on worker rank {m.rank}",
                                shm_dir=c.shm_dir)
            self.segments[st.decl_id] = seg
        return seg

    # -- the stages (pipeline threads) ---------------------------------------------------------
    def _send(self, mtype: MsgType, token: Token, route: Route, flags: int = 0) -> None:
        """Tell a local peer about the round ``token`` (key, round) of a partition."""
        m = self.members
        hdr = Header(mtype, role=Role.WORKER, rank=m.rank, flags=flags, job=m.job,
                     key=token[0], round=token[1])
        m.endpoint.send(route, encode(hdr))

    def reduce(self, task: Task) -> bool:
        """REDUCE: my input into my slot; once every slot is filled, my slice of the sum."""
        m = self.members
        seg = task.seg
        assert seg is not None
        token = (task.key, task.round)
        if task.phase == Phase.COPY_IN:  # my input into my slot, then wait for every slot
            _core.copy_into(seg.slot(m.local_rank)[task.offset:task.offset + task.nbytes],
                            task.src)
            task.phase = Phase.SUM_SLICE
            if m.is_local_root:
                self._ready(token)
            else:
                self._send(MsgType.LOCAL_READY, token, Route(peer="localroot"))
            if not self.gate.park(("reduce",) + token, task):
                return False
        if task.phase == Phase.SUM_SLICE:  # reduce-scatter: sum my slice over all slots
            lo, hi = local.slice_of(task.offset, task.nbytes, ITEMSIZE[task.dtype],
                                    m.local_rank, m.local_size)
            if hi > lo and not task.prereduced:
                out = seg.out[lo:hi]
                _core.copy_into(out, seg.slot(0)[lo:hi])
                for i in range(1, m.local_size):
                    _core.add_into(out, seg.slot(i)[lo:hi], task.dtype)
            task.phase = Phase.REDUCED
            if not m.is_local_root:
                self._send(MsgType.LOCAL_REDUCED, token, Route(peer="localroot"))
                return True  # on to the broadcast stage, which waits for the result
            if self.reduced.arrive(token):
                return True
            return self.gate.park(("reduced",) + token, task)
        return True  # REDUCED: every slice is reduced, on to the push

    def _ready(self, token: Token) -> None:
        """Local root: one more rank's input is in place; when all are, reduce."""
        if self.ready.arrive(token):
            for route in self.routes.values():
                self._send(MsgType.LOCAL_REDUCE, token, route)
            self.gate.signal(("reduce",) + token)

    def broadcast(self, task: Task) -> bool:
        """BROADCAST: the root tells the local ranks the machine's sum is in; every rank
        copies it out of the segment (and averages it)."""
        m = self.members
        seg = task.seg
        assert seg is not None
        token = (task.key, task.round)
        if m.is_local_root:  # with the pushes summed when fewer than all: every rank averages alike
            flags = FLAG_CONTRIB | (task.contrib << CONTRIB_SHIFT) if task.contrib else 0
            for route in self.routes.values():
                self._send(MsgType.LOCAL_DONE, token, route, flags)
        elif task.phase < Phase.AWAIT_RESULT:
            task.phase = Phase.AWAIT_RESULT
            if not self.gate.park(("done",) + token, task):
                return False
        if not m.is_local_root:  # the root's LOCAL_DONE came (the gate opened)
            task.contrib = self.contrib.pop(token, 0)
        if not task.prereduced:  # prereduced: the caller reads the shared buffer itself
            _core.copy_into(task.dst, seg.out[task.offset:task.offset + task.nbytes])
        if task.average and m.size > 1 and not task.prereduced:
            _core.scale_into(task.dst, task.dtype, m.divisor(task.contrib))
        return True

    # -- messages (I/O thread) -------------------------------------------------------------------
    def sender_problem(self, route: Route, h: Header) -> str | None:
        """Why a local-reduction message is not this machine's (None: it is). The root takes
        LOCAL_READY and LOCAL_REDUCED from a local rank's own connection only (its routing id,
        transport/local_peers.py); a local rank takes LOCAL_REDUCE and LOCAL_DONE from its
        connection to the root only."""
        m = self.members
        if h.job != m.controller.job or h.role is not Role.WORKER:
            return "local-reduction message of another job"
        if m.is_local_root:
            if h.type not in (MsgType.LOCAL_READY, MsgType.LOCAL_REDUCED):
                return "local-reduction message a local root never takes"
            if route.ident is None or m.local_ids.get(h.rank) != route.ident:
                return "local-reduction message from no local rank's connection"
        else:
            if h.type not in (MsgType.LOCAL_REDUCE, MsgType.LOCAL_DONE):
                return "local-reduction message a local rank never takes"
            if route.peer != "localroot" or h.rank != m.machine * m.local_size:
                return "local-reduction message from another than the local root"
        return None

    def on_message(self, route: Route, h: Header) -> None:
        """A local-reduction message whose sender :meth:`sender_problem` accepted."""
        token = (h.key, h.round)
        if route.ident is not None:  # a local rank talking to its root: remember the way back
            self.routes[h.rank % self.members.local_size] = route
        if h.type is MsgType.LOCAL_READY:
            self._ready(token)
        elif h.type is MsgType.LOCAL_REDUCED:
            if self.reduced.arrive(token):
                self.gate.signal(("reduced",) + token)
        elif h.type is MsgType.LOCAL_REDUCE:
            self.gate.signal(("reduce",) + token)
        elif h.type is MsgType.LOCAL_DONE:
            if contributors(h.flags):
                self.contrib[token] = contributors(h.flags)
            self.gate.signal(("done",) + token)

    def close(self) -> None:
        """Close every segment; every rank unlinks: whoever is last leaves nothing."""
        for seg in self.segments.values():
            seg.close(unlink=True)
        self.segments = {}
        if self._held is not None:   # the last process to let go removes what is left
            local.release(*self._held)
            self._held = None
