"""The stage executors: what each pipeline stage does to one partition.

A partition's itinerary (:func:`~.pipeline.itinerary`) is a subset of, in order::

    REDUCE -> COPY_D2H -> COMPRESS -> PUSH -> PULL -> DECOMPRESS -> COPY_H2D -> BROADCAST

* COPY_D2H / COPY_H2D: a plugin's :class:`~.tensors.DeviceCopier` stages a device tensor's
  partition into the host buffer before its push, and its sum back after its pull;
* COMPRESS / DECOMPRESS: the partition's codec encodes it before the push (float32, through a
  scratch buffer for other float dtypes) and decodes the server's compressed sum (a cast
  compressor, fp16 or bf16, never reaches the pipeline: :mod:`.route` converts on the native
  client or whole);
* PUSH: the native data plane takes the partition (:mod:`.dataplane`): it pushes it and
  pulls the round's sum; the task then waits for its completion;
* PULL: the server's sum landed in the output (averaged there unless compressed);
* REDUCE / BROADCAST: the local reduction of several ranks per machine (:mod:`.local_reduce`).

Every executor takes a :class:`~.pipeline.Task` and returns True to move it on at once, False
when a native completion will advance it later.

Who calls it: the pipeline's stage threads, through the handlers :meth:`StageExecutors.
handlers` gives ``Runtime._connect`` for the job's topology.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from .. import _core
from ..errors import ProtocolError
from ..wire import as_buffer
from .pipeline import (
    BROADCAST,
    COMPRESS,
    COPY_D2H,
    COPY_H2D,
    DECOMPRESS,
    PULL,
    PUSH,
    REDUCE,
    Stage,
    Task,
)

if TYPE_CHECKING:
    from .dataplane import NativeDataPlane
    from .elastic_membership import ElasticMembership
    from .inflight import InFlight
    from .local_reduce import LocalReduction
    from .membership import Membership


class StageExecutors:
    """The stages of one runtime that reach the servers, compress and copy."""

    def __init__(self, members: Membership, flight: InFlight, plane: NativeDataPlane,
                 local: LocalReduction):
        self.members = members
        self.flight = flight
        self.plane = plane
        self.local = local
        self.elastic: ElasticMembership | None = None  # an elastic job's (set by init())

    def handlers(self, local_size: int) -> dict[Stage, Callable[[Task], bool]]:
        """The stage threads a job of ``local_size`` ranks per machine needs, in order."""
        stages: dict[Stage, Callable[[Task], bool]] = {
            COMPRESS: self.compress, PUSH: self.push, PULL: self.pull,
            DECOMPRESS: self.decompress}
        if local_size == 1:  # device tensors stage partition by partition (DeviceCopier)
            stages = {COPY_D2H: self.d2h, **stages, COPY_H2D: self.h2d}
        if local_size > 1:
            local = self.local
            stages = {REDUCE: local.reduce, **stages, BROADCAST: local.broadcast}
        return stages

    def push(self, task: Task) -> bool:
        """Hand the partition to the native data plane, which pushes it and pulls the round's
        sum (its byte credit and priority queue apply); the completion advances the task."""
        if self.elastic is not None and self.elastic.fail_stale(task):
            return False  # a partition of an elastic epoch that is over
        self.plane.submit_task(self.plane.active_client, task)
        return False

    def pull(self, task: Task) -> bool:
        """The native data plane received the sum in place (and averaged it, uncompressed;
        a compressed sum is decoded and averaged by DECOMPRESS)."""
        flight = self.flight
        flight.bytes_pulled += task.nbytes if task.codec is None else task.payload.nbytes
        return True

    # -- compression -------------------------------------------------------------------------------
    @staticmethod
    def _to_float32(task: Task, buf: np.ndarray) -> np.ndarray:
        """The partition bytes ``buf`` as float32: a view, or converted into the scratch."""
        if task.scratch is None:
            return buf.view(np.float32)
        if task.dtype == "float64":
            np.copyto(task.scratch, buf.view(np.float64), casting="same_kind")
        else:
            _core.convert(task.scratch, "float32", buf, task.dtype)
        return task.scratch

    @staticmethod
    def _from_float32(task: Task, scratch: np.ndarray, buf: np.ndarray) -> None:
        """Write the scratch's float32 values into the partition bytes ``buf`` (its dtype)."""
        if task.dtype == "float64":
            np.copyto(buf.view(np.float64), scratch, casting="same_kind")
        else:
            _core.convert(buf, task.dtype, scratch, "float32")

    def compress(self, task: Task) -> bool:
        codec = task.codec
        assert codec is not None
        task.wire = codec.encode(self._to_float32(task, task.push_src), task.round)
        return True

    def decompress(self, task: Task) -> bool:
        m = self.members
        codec = task.codec
        assert codec is not None
        buf, task.payload = as_buffer(task.payload), None
        if task.scratch is None:
            step = codec.decode(buf, task.pull_dst.view(np.float32))
        else:
            step = codec.decode(buf, task.scratch)
            self._from_float32(task, task.scratch, task.pull_dst)
        if step != task.round:
            raise ProtocolError(f"push_pull of {task.handle.name!r} (key {task.key}): the "
                                f"server's compressed sum is of step {step}, expected "
                                f"{task.round}")
        if task.average and m.size > 1 and task.seg is None:
            _core.scale_into(task.dst, task.dtype, m.divisor(task.contrib))
        return True

    # -- device copies -----------------------------------------------------------------------------
    @staticmethod
    def _copy(task: Task, way: str) -> bool:
        """The task's bytes through its device buffer's ``d2h`` or ``h2d`` (``way``)."""
        device = task.device
        assert device is not None
        getattr(device, way)(task.offset, task.nbytes)
        return True

    @staticmethod
    def d2h(task: Task) -> bool:
        return StageExecutors._copy(task, "d2h")

    @staticmethod
    def h2d(task: Task) -> bool:
        return StageExecutors._copy(task, "h2d")
