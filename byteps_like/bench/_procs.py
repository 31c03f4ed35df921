"""Process helpers of the benchmarks: spawn children, watch them, always clean up.

Every child runs in its own session (``start_new_session=True``), so killing its process group
also kills anything it started. stdout and stderr go to files in a private directory (no pipe can
fill up and block a child); on failure or timeout the tail of every child's stderr is printed.
Nothing here uses a shell.

Every child also finds the same ``byteps_like`` as this process: :func:`child_env` prepends the
folder that holds the imported package to the child's ``PYTHONPATH`` (``spawn`` applies it), and
:func:`role_argv` gives the command of a scheduler, server or launcher that works in an editable
install, a wheel install and a bare source tree alike (see :mod:`._role`).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TextIO


def package_root() -> str:
    """The folder that holds the imported ``byteps_like`` package (its parent folder)."""
    import byteps_like
    return os.path.dirname(os.path.dirname(os.path.abspath(byteps_like.__file__)))


def _automatic_paths() -> set[str]:
    """Folders every child of this interpreter has on sys.path anyway (site-packages): putting
    one of them on PYTHONPATH would move it before the standard library."""
    import site
    paths = list(getattr(site, "getsitepackages", lambda: [])())
    try:
        paths.append(site.getusersitepackages())
    except (AttributeError, TypeError):
        pass
    return {os.path.realpath(p) for p in paths if p}


def child_env(env: Mapping[str, str], *, always: bool = False) -> dict[str, str]:
    """``env`` with the folder of the imported byteps_like first on ``PYTHONPATH`` (before what
    was there), unless it is a site-packages folder a child of this interpreter searches anyway
    (on PYTHONPATH it would come before the standard library). ``always``: add it regardless,
    for a child that runs another interpreter."""
    out = dict(env)
    root = package_root()
    if not always and os.path.realpath(root) in _automatic_paths():
        return out
    old = [p for p in out.get("PYTHONPATH", "").split(os.pathsep) if p]
    out["PYTHONPATH"] = os.pathsep.join([root] + [p for p in old
                                                  if os.path.realpath(p)
                                                  != os.path.realpath(root)])
    return out


def role_argv(role: str, python: str | None = None) -> list[str]:
    """The command line of ``python -m byteps_like.<role>`` (role: scheduler, server, launcher)
    that runs the role of the imported byteps_like, from any install.

    ``server/``, ``scheduler/`` and ``launcher/`` sit at the root of the source tree and are
    mapped into the ``byteps_like`` namespace at install time. An installed package (wheel or
    editable) resolves ``byteps_like.<role>`` itself. A bare source tree on ``PYTHONPATH`` does
    not (``<root>/byteps_like`` holds no ``scheduler`` folder), and a source tree run from its
    own folder while the environment holds an editable install of another checkout would get
    that checkout's role. Then the role runs through :mod:`._role`, which maps
    ``<root>/<role>`` to ``byteps_like.<role>`` first."""
    from ._role import plan
    py = python or sys.executable
    how, _where = plan(role)
    if how == "import":
        return [py, "-m", f"byteps_like.{role}"]
    return [py, "-m", "byteps_like.bench._role", role]   # "missing": it says why and exits 2


class ChildFailed(RuntimeError):
    """A child exited non-zero, died, or the phase ran past its timeout."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, 0))
        return s.getsockname()[1]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct free ports (held open together while picking, so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def tail(path: str, nbytes: int = 4000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - nbytes))
            data = f.read()
    except OSError:
        return ""
    text = data.decode("utf-8", "replace")
    return ("..." if size > nbytes else "") + text


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    stdout_path: str
    stderr_path: str
    role: str = "main"          # "main": must exit 0; "service": may be killed at the end
    relay_pos: int = 0

    def stdout(self) -> str:
        with open(self.stdout_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def stderr_tail(self, nbytes: int = 4000) -> str:
        return tail(self.stderr_path, nbytes)


@dataclass
class ProcGroup:
    """A set of child processes that live and die together.

    Use as a context manager: leaving the block kills every child still running (SIGTERM to its
    process group, then SIGKILL) and removes the output directory.
    """
    label: str = "bench"
    log: TextIO = field(default_factory=lambda: sys.stderr)
    children: list[Child] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix=f"bpsl-{self.label}-")
        self.dir = self._tmp.name

    def __enter__(self) -> ProcGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- spawning ---------------------------------------------------------------------------
    def spawn(self, name: str, argv: Sequence[str], env: Mapping[str, str], *,
              role: str = "main") -> Child:
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
        out = os.path.join(self.dir, f"{safe}.out")
        err = os.path.join(self.dir, f"{safe}.err")
        with open(out, "wb") as fo, open(err, "wb") as fe:
            proc = subprocess.Popen(list(argv), env=child_env(env), stdin=subprocess.DEVNULL,
                                    stdout=fo, stderr=fe, start_new_session=True, close_fds=True)
        child = Child(name, proc, out, err, role)
        self.children.append(child)
        return child

    # -- waiting ------------------------------------------------------------------------------
    def _report(self, why: str) -> str:
        lines = [f"{self.label}: {why}"]
        for c in self.children:
            rc = c.proc.poll()
            state = "running" if rc is None else f"exit {rc}"
            lines.append(f"--- {c.name} (pid {c.proc.pid}, {state}) stderr tail ---")
            lines.append(c.stderr_tail().rstrip() or "(empty)")
        return "\n".join(lines)

    def _relay(self, child: Child | None, prefix: str) -> None:
        if child is None:
            return
        try:
            with open(child.stderr_path, "rb") as f:
                f.seek(child.relay_pos)
                data = f.read()
        except OSError:
            return
        cut = data.rfind(b"\n") + 1
        if not cut:
            return
        child.relay_pos += cut
        for line in data[:cut].decode("utf-8", "replace").splitlines():
            if line.startswith("progress: "):
                print(f"{prefix}{line[len('progress: '):]}", file=self.log, flush=True)

    def wait(self, timeout: float, *, relay: Child | None = None, relay_prefix: str = "",
             service_grace: float = 15.0) -> None:
        """Wait until every ``main`` child has exited 0, then give ``service`` children
        ``service_grace`` seconds to exit 0 on their own.

        Raises :class:`ChildFailed` (with every child's stderr tail) as soon as any child exits
        non-zero or ``timeout`` passes. A service may exit 0 before the main children (a
        scheduler ends the job once every worker has said it is finished).
        The caller's ``with`` block then kills whatever is left."""
        deadline = time.monotonic() + timeout
        mains = [c for c in self.children if c.role == "main"]
        services = [c for c in self.children if c.role != "main"]
        while True:
            self._relay(relay, relay_prefix)
            for c in self.children:
                rc = c.proc.poll()
                if rc is not None and rc != 0:
                    raise ChildFailed(self._report(f"{c.name} exited with status {rc}"))
            if all(c.proc.poll() is not None for c in mains):
                break
            if time.monotonic() > deadline:
                raise ChildFailed(self._report(f"timed out after {timeout:g} s (watchdog); "
                                               "killing every child"))
            time.sleep(0.05)
        self._relay(relay, relay_prefix)
        end = min(deadline, time.monotonic() + service_grace)
        while any(c.proc.poll() is None for c in services):
            if time.monotonic() > end:
                late = [c.name for c in services if c.proc.poll() is None]
                print(f"{self.label}: {', '.join(late)} still running {service_grace:g} s after "
                      "the workers finished; killing", file=self.log, flush=True)
                return
            time.sleep(0.05)
        for c in services:
            if c.proc.returncode != 0:
                raise ChildFailed(self._report(f"{c.name} exited with status "
                                               f"{c.proc.returncode}"))

    # -- cleanup --------------------------------------------------------------------------------
    def close(self) -> None:
        # a SIGTERM/SIGINT that arrives now must not cut the cleanup short: hold it until done
        held = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
        old = signal.pthread_sigmask(signal.SIG_BLOCK, held)
        try:
            self._kill_all()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)

    def _kill_all(self) -> None:
        live = [c for c in self.children if c.proc.poll() is None]
        for c in live:
            _signal_group(c.proc, signal.SIGTERM)
        end = time.monotonic() + 3.0
        for c in live:
            try:
                c.proc.wait(max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for c in self.children:
            # also reap anything the child left behind in its group
            _signal_group(c.proc, signal.SIGKILL)
            try:
                c.proc.wait(5.0)
            except subprocess.TimeoutExpired:
                print(f"{self.label}: {c.name} (pid {c.proc.pid}) did not die", file=self.log)
        self._tmp.cleanup()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    # The child leads its own session, so its process group id is its pid. SIGTERM goes only
    # to children still running; the final SIGKILL also reaches whatever a reaped child left
    # in its group (Linux does not reuse a pid while a process group of that id exists).
    if proc.returncode is not None and sig != signal.SIGKILL:
        return
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
