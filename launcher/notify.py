"""Tell the job's scheduler at once when a worker or server bpslaunch started exits (issue 30).

bpslaunch is the parent of every process it starts, so it sees an exit the moment it happens;
the scheduler, on this machine or another, would see it only once the node's heartbeats have
been silent for ``BYTEPS_HEARTBEAT_TIMEOUT_SECONDS`` (20 s). So when a worker or server exits
non-zero on its own (killed by a signal, an exit status other than ``EXIT_PEER_FAILED``: a
process that stopped because another one failed tells nothing new), bpslaunch sends the job's
scheduler an ``EXITED`` notice naming it (:func:`byteps_like.control.tell_exited`: the job's tag
and, with a secret, its CURVE keys, like every control message). The scheduler declares the
node lost as it would after the heartbeat timeout: a job that is not elastic fails within a
second, an elastic one forms its next epoch without the worker. Heartbeats stay for what no
parent sees: a machine that goes away, a process that hangs.

The notices go out from one daemon thread, started by the first of them, which imports
:mod:`byteps_like.control` (and with it pyzmq and numpy) then: bpslaunch loads neither while
nothing fails, and its supervision never waits for a notice. A notice that cannot be sent is
dropped silently (the heartbeats still find the node); nothing is printed after bpslaunch's
final line.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Mapping

from byteps_like.errors import EXIT_PEER_FAILED

from .procs import Child, describe_returncode

#: The roles whose exit the scheduler is told about (it cannot be told about its own).
NOTIFIED_ROLES = ("worker", "server")


class ExitNotices:
    """Queues an ``EXITED`` notice per worker or server that failed on its own; one daemon
    thread sends them."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.queued = 0
        self.sent = 0
        self.failed: list[str] = []   # why a notice could not be sent (for tests)

    @staticmethod
    def wanted(child: Child) -> bool:
        """Whether the scheduler should hear of this exit: a worker or server that exited
        non-zero and not only because another process failed."""
        return (child.role in NOTIFIED_ROLES and child.returncode is not None
                and child.returncode not in (0, EXIT_PEER_FAILED))

    def child_exited(self, child: Child, env: Mapping[str, str]) -> None:
        """Tell the scheduler of ``env`` (the child's environment) about ``child``'s exit, in
        the background, when :meth:`wanted`."""
        if not self.wanted(child):
            return
        self._queue.put((child, dict(env)))
        self.queued += 1
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="bpslaunch-notices",
                                            daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            child, env = self._queue.get()
            try:
                _send(child, env)
                self.sent += 1
            except Exception as exc:  # noqa: BLE001 - never fail the launch over a notice
                self.failed.append(f"{child.describe()}: {exc!r}")


def _send(child: Child, env: Mapping[str, str]) -> None:
    # imported here, on the first notice only: pyzmq, numpy (module docstring)
    from byteps_like.config import load
    from byteps_like.control import node_host, tell_exited
    cfg = load(env=env)
    tell_exited(cfg, {"role": child.role, "pid": child.pid, "host": node_host(cfg),
                      "how": describe_returncode(child.returncode), "name": child.name})
