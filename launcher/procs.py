"""Child-process supervision for bpslaunch: start, pump output, watch, stop.

Standard library only. Every child runs without a shell (an argv list) in its own session, so
its process group id is its pid and the whole tree it spawns can be signalled at once with
``os.killpg``. Two daemon threads per child read its stdout and stderr line by line (bytes,
decoded as UTF-8 with replacement) and print each line prefixed with the child's name, e.g.
``[worker 1] ``. The supervisor never blocks in ``wait()`` without a bound, so a child that ignores
SIGTERM is SIGKILLed and the launcher cannot hang on it. On Linux every child is started with
``PR_SET_PDEATHSIG`` = SIGTERM, so that a bpslaunch killed with SIGKILL (which no handler sees)
does not leave its job running unsupervised.
"""
from __future__ import annotations

import atexit
import collections
import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, TextIO

#: Seconds between SIGTERM and SIGKILL when stopping children.
KILL_AFTER_S = 5.0
#: How often the supervisor polls its children.
POLL_INTERVAL_S = 0.05
#: How many of a child's last stderr lines are kept for the failure report.
TAIL_LINES = 60
#: With ``hold_tracebacks`` (bpslaunch's jobs), a child's stderr from a ``Traceback (most
#: recent call last):`` line on is held back instead of printed: the job's failure report
#: shows the root cause's, in full and last, and summarises the others'; a child that goes on
#: (or exits 0) gets its held lines printed after all (``release_held``). At most this many
#: lines are held per child; more are printed as they come.
HELD_MAX_LINES = 5000
TRACEBACK_START = "Traceback (most recent call last):"
#: How long to wait for a pump thread to drain a pipe after its child exited (a grandchild
#: may still hold the pipe open, so this is bounded).
PUMP_JOIN_S = 0.5
_READ_LIMIT = 1 << 16


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` (of this pid namespace) is alive. A process of another user
    counts as alive; a zombie does not (it has exited and waits only to be reaped). Where /proc
    cannot be read, the answer is ``kill(pid, 0)``'s alone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:  # gone since, or no /proc: ask again
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
    return stat[stat.rfind(b")") + 2:][:1] not in (b"Z", b"X")


class AffinityError(OSError):
    """The kernel refused the CPU set a child was to be bound to."""


def describe_returncode(returncode: int | None) -> str:
    """``exit status 3`` or ``killed by SIGKILL`` for a ``Popen.returncode``."""
    if returncode is None:
        return "still running"
    if returncode < 0:
        return f"killed by {signal_name(-returncode)}"
    return f"exit status {returncode}"


def exit_status_for(returncode: int | None) -> int:
    """The shell convention: a positive status is kept, a death by signal N becomes 128+N
    (a process still running: 0)."""
    if returncode is None:
        return 0
    return 128 - returncode if returncode < 0 else returncode


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


#: the lowest port free_port picks itself; it picks below the kernel's ephemeral range
PICK_FLOOR = 20000


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (outgoing connections' local ports), or
    0 when it cannot be read."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def free_port(host: str = "127.0.0.1", port: int = 0) -> int:
    """A TCP port of ``host`` that could be bound a moment ago: ``port`` itself, checked, or
    (``port`` 0) one picked at random between PICK_FLOOR and the kernel's ephemeral range,
    else one the OS picks. The only port picker of bpslaunch and the benchmarks.

    Raises OSError (its strerror says why) when ``host`` does not resolve to a local address or
    ``port`` is taken; the caller names the setting. Like every such probe it races with other
    processes: the port is free when this returns, not necessarily when a child binds it. Below
    the ephemeral range it cannot race with the job's own outgoing connections, whose local
    ports the kernel takes from that range (a port the OS picked there was taken by one in
    CI: a worker's metrics port, between bpslaunch's probe and the worker's bind)."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    low = _ephemeral_low() if port == 0 else 0
    for _ in range(64 if low > PICK_FLOOR + 1000 else 0):
        candidate = random.randrange(PICK_FLOOR, low)
        with socket.socket(family, kind, proto) as sock:
            try:
                sock.bind((address[0], candidate, *address[2:]))
            except OSError:
                continue
            return candidate
    with socket.socket(family, kind, proto) as sock:
        sock.bind(address)
        return sock.getsockname()[1]


class OutputSink:
    """Serialises whole lines from many threads onto the launcher's stdout and stderr.

    A broken or closed stream (``bpslaunch ... | head``) stops further writes to it but never
    stops the pumps from draining the children's pipes, so a child cannot block on a full pipe.
    """

    def __init__(self, stdout: TextIO, stderr: TextIO):
        self._lock = threading.Lock()
        self._streams = {"stdout": stdout, "stderr": stderr}
        self._broken: set[str] = set()
        self._children_muted = False

    def child_line(self, which: str, text: str) -> None:
        with self._lock:
            if not self._children_muted:
                self._write(which, text)

    def message(self, text: str) -> None:
        """A line of the launcher's own, on stderr; printed even after the children are muted."""
        with self._lock:
            self._write("stderr", text)

    def mute_children(self) -> None:
        """Drop every later child line, so that the launcher's final report stays last."""
        with self._lock:
            self._children_muted = True

    def _write(self, which: str, text: str) -> None:
        if which in self._broken:
            return
        stream = self._streams[which]
        line = text + "\n"
        try:
            try:
                stream.write(line)
            except UnicodeEncodeError:
                encoding = getattr(stream, "encoding", None) or "ascii"
                stream.write(line.encode(encoding, "replace").decode(encoding))
            stream.flush()
        except (OSError, ValueError):  # closed pipe or closed file
            self._broken.add(which)


@dataclass(eq=False)
class Child:
    """One started child process and what the supervisor knows about it."""

    name: str
    role: str
    rank: int | None
    argv: tuple[str, ...]
    popen: subprocess.Popen
    log_file: IO[bytes] | None = None
    stderr_tail: collections.deque = field(
        default_factory=lambda: collections.deque(maxlen=TAIL_LINES))
    pumps: list[threading.Thread] = field(default_factory=list)
    returncode: int | None = None
    reported: bool = False
    group_gone: bool = False
    restarted: bool = False   # lost, and bpslaunch started a new process in its place
    log_lock: threading.Lock = field(default_factory=threading.Lock)
    # stderr held back since a traceback began (Supervisor.hold_tracebacks): the lines, as
    # they would have been printed, and since when (None: nothing held)
    held: list[str] | None = None
    held_since: float = 0.0
    hold_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def running(self) -> bool:
        return self.returncode is None

    def describe(self) -> str:
        """``worker 1 (pid 4242)``."""
        return f"{self.name} (pid {self.pid})"

    def join_pumps(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for pump in self.pumps:
            pump.join(max(0.0, deadline - time.monotonic()))


class Supervisor:
    """Starts children, prints their output, notices exits and stops them all, tree by tree.

    Not thread-safe: one thread (normally the main thread, which also receives signals) drives
    it. ``close()`` is idempotent and is also registered with ``atexit``, so no child outlives
    the launcher's interpreter.
    """

    def __init__(self, *, stdout: TextIO | None = None, stderr: TextIO | None = None,
                 log_dir: str | os.PathLike | None = None, kill_after: float = KILL_AFTER_S,
                 hold_tracebacks: bool = False):
        self.sink = OutputSink(stdout if stdout is not None else sys.stdout,
                               stderr if stderr is not None else sys.stderr)
        self.hold_tracebacks = hold_tracebacks
        self.children: list[Child] = []
        self.kill_after = kill_after
        self._log_dir = os.fspath(log_dir) if log_dir is not None else None
        self._closed = False
        self._old_handlers: dict[int, signal.Handlers | int | Callable[..., object] | None] = {}
        self.signal_received: int | None = None
        self.signal_count = 0
        atexit.register(self.close)

    # -- starting ------------------------------------------------------------------------------

    def start(self, name: str, argv: Sequence[str], env: Mapping[str, str], *, role: str = "",
              rank: int | None = None, log_name: str | None = None,
              cpus: Iterable[int] | None = None) -> Child:
        """Start ``argv`` (no shell) in a new session; raises ``OSError`` if it cannot be run.

        ``cpus``: the child starts bound to these CPUs. The calling thread sets its own
        affinity to them around the fork and restores it; the child inherits the mask of the
        thread that forks it (AffinityError if the kernel refuses the set).
        """
        if self._closed:
            raise RuntimeError("the supervisor is closed")
        log_file = None
        if self._log_dir is not None:
            os.makedirs(self._log_dir, exist_ok=True)
            log_file = open(os.path.join(self._log_dir, log_name or f"{name}.log"), "wb")
        try:
            with _thread_affinity(cpus, name):
                popen = subprocess.Popen(
                    list(argv), env=dict(env), stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                    close_fds=True, preexec_fn=_die_with_parent(os.getpid()))
        except BaseException:
            if log_file is not None:
                log_file.close()
            raise
        child = Child(name=name, role=role, rank=rank, argv=tuple(argv), popen=popen,
                      log_file=log_file)
        self.children.append(child)
        for which, stream in (("stdout", popen.stdout), ("stderr", popen.stderr)):
            pump = threading.Thread(target=self._pump, args=(child, stream, which),
                                    name=f"bpslaunch-{name}-{which}".replace(" ", "-"),
                                    daemon=True)
            child.pumps.append(pump)
            pump.start()
        return child

    def _pump(self, child: Child, stream: IO[bytes], which: str) -> None:
        prefix = f"[{child.name}] "
        try:
            while True:
                raw = stream.readline(_READ_LIMIT)
                if not raw:
                    break
                if child.log_file is not None:
                    with child.log_lock:
                        try:
                            child.log_file.write(raw)
                            child.log_file.flush()
                        except (OSError, ValueError):
                            pass
                text = raw.decode("utf-8", errors="replace")
                if text.endswith("\n"):
                    text = text[:-1]
                if text.endswith("\r"):
                    text = text[:-1]
                if which == "stderr":
                    child.stderr_tail.append(text)
                    if self.hold_tracebacks and self._hold(child, prefix + text, text):
                        continue
                self.sink.child_line(which, prefix + text)
        except (OSError, ValueError):
            pass
        finally:
            try:
                stream.close()
            except OSError:
                pass

    def _hold(self, child: Child, line: str, text: str) -> bool:
        """Hold ``line`` back (True) when a traceback began on the child's stderr."""
        with child.hold_lock:
            if child.held is None:
                if not text.startswith(TRACEBACK_START):
                    return False
                child.held, child.held_since = [], time.monotonic()
            if len(child.held) >= HELD_MAX_LINES:  # no report needs more: print them after all
                for held in child.held:
                    self.sink.child_line("stderr", held)
                child.held = None
                return False
            child.held.append(line)
            return True

    def release_held(self, older_than: float = 0.0,
                     children: Iterable[Child] | None = None) -> None:
        """Print the stderr held back of the given (default: all) children whose hold began
        at least ``older_than`` seconds ago, in order, before any later line of theirs."""
        now = time.monotonic()
        for child in list(self.children if children is None else children):
            with child.hold_lock:
                if child.held is None or now - child.held_since < older_than:
                    continue
                for line in child.held:
                    self.sink.child_line("stderr", line)
                child.held = None

    # -- watching ------------------------------------------------------------------------------

    def running(self) -> list[Child]:
        return [c for c in self.children if c.running]

    def _reap(self, child: Child) -> None:
        if child.returncode is None:
            returncode = child.popen.poll()
            if returncode is not None:
                child.returncode = returncode

    def poll_exited(self) -> list[Child]:
        """Children that exited since the last call, each reported once, output drained."""
        for child in self.children:
            self._reap(child)
        exited = [c for c in self.children if c.returncode is not None and not c.reported]
        for child in exited:
            child.reported = True
            child.join_pumps(PUMP_JOIN_S)
        return exited

    def wait_any(self, timeout: float | None = None) -> list[Child]:
        """Block until a child exits, a signal arrives or ``timeout`` seconds pass.

        Returns the children that exited (possibly an empty list). Polls, so that a signal
        handler in the main thread runs promptly and nothing here can block forever.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        seen_signals = self.signal_count
        while True:
            exited = self.poll_exited()
            if exited or self.signal_count != seen_signals or not self.running():
                return exited
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return []
            time.sleep(POLL_INTERVAL_S if deadline is None
                       else min(POLL_INTERVAL_S, deadline - now))

    # -- stopping ------------------------------------------------------------------------------

    def _signal_group(self, child: Child, signum: int) -> None:
        if child.group_gone:
            return
        try:
            os.killpg(child.pid, signum)
        except ProcessLookupError:
            if child.returncode is not None:
                child.group_gone = True
        except PermissionError:
            pass

    def _group_done(self, child: Child) -> bool:
        """True once the child and every live process of its group have exited."""
        self._reap(child)
        if child.returncode is None:
            return False
        if not child.group_gone and not _group_has_live_members(child.pid):
            child.group_gone = True
        return child.group_gone

    def terminate_all(self, kill_after: float | None = None) -> list[Child]:
        """SIGTERM every child's process group, SIGKILL what is left after ``kill_after`` s.

        Groups of children that already exited are signalled too, so that grandchildren left
        behind die with them. A new signal to the launcher while waiting skips to SIGKILL.
        Returns the children whose group needed SIGKILL.
        """
        kill_after = self.kill_after if kill_after is None else kill_after
        seen_signals = self.signal_count
        for child in self.children:
            self._signal_group(child, signal.SIGTERM)
        deadline = time.monotonic() + kill_after
        while True:
            pending = [c for c in self.children if not self._group_done(c)]
            if not pending or time.monotonic() >= deadline or self.signal_count != seen_signals:
                break
            time.sleep(POLL_INTERVAL_S)
        if pending:
            self.kill_all(pending)
        return pending

    def kill_all(self, children: Iterable[Child] | None = None) -> None:
        """SIGKILL the given (default: all) children's process groups and reap the children."""
        children = list(self.children if children is None else children)
        for child in children:
            self._signal_group(child, signal.SIGKILL)
        deadline = time.monotonic() + KILL_AFTER_S
        for child in children:
            if child.returncode is None:
                try:
                    child.returncode = child.popen.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:  # stuck in the kernel; nothing more to do
                    pass
        for child in children:
            self._group_done(child)

    # -- signals -------------------------------------------------------------------------------

    def install_signal_handlers(self, signums: Iterable[int] = (
            signal.SIGINT, signal.SIGTERM, signal.SIGHUP)) -> None:
        """Record SIGINT/SIGTERM/SIGHUP instead of dying; the driving loop acts on them."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in signums:
            self._old_handlers[signum] = signal.signal(signum, self._on_signal)

    def restore_signal_handlers(self) -> None:
        while self._old_handlers:
            signum, handler = self._old_handlers.popitem()
            signal.signal(signum, handler)

    def _on_signal(self, signum: int, frame: object) -> None:
        self.signal_count += 1
        if self.signal_received is None:
            self.signal_received = signum

    # -- teardown ------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop every child tree still alive, drain the pumps and close the logs. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if any(not self._group_done(c) for c in self.children):
                self.terminate_all()
        finally:
            for child in self.children:
                child.join_pumps(PUMP_JOIN_S)
            self.sink.mute_children()
            for child in self.children:
                if child.log_file is not None:
                    with child.log_lock:
                        child.log_file.close()
            self.restore_signal_handlers()
            atexit.unregister(self.close)


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _load_prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_prctl = _load_prctl()


def _die_with_parent(parent: int):
    """The child's ``preexec_fn``: SIGTERM it when the thread that started it (the launcher's
    main thread) dies, SIGKILL of bpslaunch included; and when the launcher is already gone
    (it died between fork and here), at once. ``None`` where prctl is not available."""
    if _prctl is None:
        return None

    def preexec() -> None:  # in the forked child, before exec: no locks, no allocation to speak of
        if _prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) == 0 and os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGTERM)
    return preexec


@contextlib.contextmanager
def _thread_affinity(cpus: Iterable[int] | None, name: str):
    """Run the body with the calling thread bound to ``cpus`` (nothing when None). Linux keeps
    an affinity mask per thread (pid 0 means the calling thread), so the launcher's other
    threads are untouched."""
    if cpus is None:
        yield
        return
    wanted = set(cpus)
    saved = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, wanted)
    except OSError as exc:
        raise AffinityError(exc.errno, f"cannot bind {name} to CPUs "
                            f"{','.join(map(str, sorted(wanted)))}: {exc.strerror}") from None
    try:
        yield
    finally:
        os.sched_setaffinity(0, saved)


def _group_has_live_members(pgid: int) -> bool:
    """Whether process group ``pgid`` still has a member that is not a zombie.

    Zombies are ignored because an orphaned grandchild's zombie may never be reaped in a
    container whose PID 1 does not reap; on Linux /proc tells them apart, elsewhere we fall back
    to ``killpg(pgid, 0)``.
    """
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        entries = os.listdir("/proc")
    except OSError:
        return True
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...; comm may contain spaces and parentheses.
        fields = stat[stat.rfind(b")") + 2:].split()
        if len(fields) >= 3 and int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            return True
    return False
