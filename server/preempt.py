"""A server's announced leave: a spot-preemption notice file (``BYTEPS_PREEMPTION_NOTICE_FILE``)
or SIGTERM (docs/reliability.md, "Losing a server", and docs/deployment.md, "Spot and
preemptible servers").

SIGTERM is how Kubernetes deletes a pod, how a cloud's shutdown stops a process and how an
operator asks a process to go: in a job that can lose the server (:class:`SigtermLeave`) the
server announces its leave as for a notice and exits 0 once the scheduler moved its keys; a
second SIGTERM, or no word from the scheduler within :data:`LEAVE_WAIT_S`, ends it as SIGTERM
would have. A job that cannot lose it (failover off, asynchronous mode, one server) and a
server that has not joined the job or whose job is already ending get SIGTERM's default: the
process ends at once, as before.

A cloud takes a spot or preemptible machine back with a short warning (AWS: two minutes, in the
instance metadata's ``spot/instance-action``; GCE: about 30 s, ``instance/preempted``; a
Kubernetes node drain: the pod's termination grace period). Something on the machine that sees
the warning (a sidecar, the node's metadata watcher, a preStop hook) writes a file; the server
polls it every :data:`NOTICE_POLL_S` and, once it appears or changes, announces its leave to the
scheduler (ABORT with ``"leave": true``). The scheduler moves the server's keys to the others at
once, as for a lost server but with no stall of detection, and tells it to shut down; the
server exits 0. A job that cannot lose the server (failover off, asynchronous mode, its last
server) keeps it: the scheduler logs why, and the server serves until the machine goes.

The contract: the file's appearance (or any change of it after the server started) is the
notice; its first 200 bytes, if any, are quoted in the logs as the reason. A file already there
when the server starts is an old notice and is ignored until it changes. ``{rank}`` in the path
is replaced by the server's rank (several servers on one machine).
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any

log = logging.getLogger("byteps_like.server")

#: seconds between two looks at the notice file (a stat each)
NOTICE_POLL_S = 1.0
#: bytes of the file quoted as the reason
REASON_BYTES = 200
#: seconds a server that announced its leave on SIGTERM waits for the scheduler to let it go
#: before it ends as SIGTERM would have (the scheduler is gone, or the job cannot lose it)
LEAVE_WAIT_S = 5.0


def in_job(control: Any) -> bool:
    """Whether a server takes part in its job: registered, and the job is not ending (no fatal
    error, no shutdown notice). Otherwise no leave is announced and no stall is reported."""
    return control.rank >= 0 and control.fatal is None and not control.shutting_down


def _stamp(path: str) -> tuple[int, int, int] | None:
    """What tells one version of the file from another; None when there is none."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def _reason(path: str) -> str:
    try:
        with open(path, "rb") as f:
            raw = f.read(REASON_BYTES)
    except OSError:
        return ""
    text = raw.decode("utf-8", "replace")
    return " ".join("".join(c if c.isprintable() else " " for c in text).split())


class PreemptionNotice:
    """Watches one server's notice file from its I/O thread (:meth:`start` once it has a
    rank)."""

    def __init__(self, server: Any, pattern: str):
        self.server = server
        self.pattern = pattern
        self.path = ""
        self.before: tuple[int, int, int] | None = None
        self.sent = False

    def start(self) -> None:
        self.path = self.pattern.replace("{rank}", str(self.server.rank))
        self.before = _stamp(self.path)
        if self.before is not None:
            log.warning("server %d: the preemption notice file %s exists already; taken for an "
                        "old notice and ignored until it changes (BYTEPS_PREEMPTION_NOTICE_FILE)",
                        self.server.rank, self.path)
        self.server.ep.add_timer(NOTICE_POLL_S, self.tick)

    def tick(self) -> None:
        control = self.server.control
        if self.sent or not in_job(control):
            return
        now = _stamp(self.path)
        if now is None or now == self.before:
            return
        self.sent = True
        text = _reason(self.path)
        reason = f"preemption notice in {self.path}" + (f": {text}" if text else "")
        log.warning("server %d: %s; announcing its leave: the scheduler moves its keys to the "
                    "other servers and then stops it", self.server.rank, reason)
        control.leave(reason)


class SigtermLeave:
    """SIGTERM as an announced leave (module docstring). :meth:`install` from the main thread
    once the server has its rank; :meth:`restore` when it stops serving."""

    def __init__(self, server: Any):
        self.server = server
        self.since: float | None = None   # when the leave was announced
        self._before: Any = None

    def install(self) -> None:
        """Take SIGTERM when the job can lose this server (else, or off the main thread,
        SIGTERM is left as it was)."""
        if self.server.cfg.can_lose_servers \
                and threading.current_thread() is threading.main_thread():
            self._before = signal.signal(signal.SIGTERM, self._signalled)

    def restore(self) -> None:
        if self._before is not None:
            signal.signal(signal.SIGTERM, self._before)
            self._before = None

    def _signalled(self, signum: int, frame: Any) -> None:
        control = self.server.control
        if self.since is not None or not in_job(control):
            # the job is ending (bpslaunch stops what is left): as before, without a word
            self.terminate("a second SIGTERM" if self.since is not None else "")
            return
        self.since = time.monotonic()
        log.warning("server %d: SIGTERM; announcing its leave: the scheduler moves its keys to "
                    "the other servers and then stops it", self.server.rank)
        self.server.ep.call_soon(lambda: control.leave("SIGTERM"))

    def overdue(self) -> bool:
        """Whether the announced leave has waited longer than LEAVE_WAIT_S (the server then
        ends as SIGTERM would have)."""
        return self.since is not None and time.monotonic() - self.since > LEAVE_WAIT_S

    def terminate(self, why: str) -> None:
        """End the process the way SIGTERM's default does (status 128 + 15 for its parent),
        saying ``why`` unless it is empty."""
        if why:
            log.warning("server %d: %s: ending now", self.server.rank, why)
            logging.shutdown()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1.0)   # the signal ends the process; this is only if it did not
        os._exit(128 + signal.SIGTERM)
