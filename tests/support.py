"""The test helpers every test directory shares: a free loopback port, a clean environment for a
child process, the watchdog that runs a child in its own session and on a hang kills its whole
process group and fails with everything it printed, and ``expect``.

Nothing here imports byteps_like or a framework: worker scripts import this module too (they put
the repository root on ``sys.path``, see tests/frameworks/workers/).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# Fast failure detection for tests; production defaults are far longer.
FAST_ENV = {"BYTEPS_HEARTBEAT_INTERVAL_SECONDS": "0.5", "BYTEPS_HEARTBEAT_TIMEOUT_SECONDS": "3",
            "BYTEPS_REGISTER_TIMEOUT_SECONDS": "30", "BYTEPS_TIMEOUT_SECONDS": "60"}



def wait_until(pred: Callable[[], object], timeout: float = 5.0) -> bool:
    """Poll ``pred`` until it holds (True) or ``timeout`` passes (False)."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True

def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now, picked as bpslaunch picks its ports (below the
    kernel's ephemeral range, so no outgoing connection of the test's job takes it first)."""
    from byteps_like.launcher.procs import free_port as pick
    return pick("127.0.0.1")


def clean_env(*drop: str, **extra: str) -> dict[str, str]:
    """This process's environment without any DMLC_*/BYTEPS_* setting (nor those starting with a
    prefix in ``drop``), unbuffered, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DMLC_", "BYTEPS_", *drop))}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


@dataclass
class Run:
    """What a child printed and how it ended."""
    rc: int
    out: str
    err: str
    elapsed: float

    @property
    def log(self) -> str:
        return (f"exit {self.rc} after {self.elapsed:.1f} s\n--- stdout ---\n{self.out}\n"
                f"--- stderr ---\n{self.err}")

    def lines(self, needle: str) -> list[str]:
        """The stdout lines that contain ``needle``."""
        return [ln for ln in self.out.splitlines() if needle in ln]


class WatchdogError(AssertionError):
    """A child ran past its deadline; its process group was killed. The message holds its
    output."""


def spawn(cmd: Sequence[str], env: dict[str, str] | None = None, *, merge: bool = False,
          text: bool = True, **kw) -> subprocess.Popen:
    """``cmd`` in a new session (its own process group, so the watchdog can kill it whole),
    stdin closed, stdout and stderr captured (``merge``: stderr into stdout)."""
    return subprocess.Popen(list(cmd), env=clean_env() if env is None else env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT if merge else subprocess.PIPE, text=text,
                            start_new_session=True, **kw)


def kill_group(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def watch(proc: subprocess.Popen, timeout: float, what: str = "", *,
          first: int = signal.SIGKILL, grace: float = 15.0,
          on_hang: Callable[[], None] | None = None) -> tuple[int, str, str]:
    """Wait for ``proc`` (from :func:`spawn`); its ``(returncode, stdout, stderr)``.

    Past ``timeout`` seconds: send ``first`` to its process group (SIGINT or SIGTERM lets a
    launcher stop its own children's groups), SIGKILL the group if it is still there after
    ``grace`` seconds, call ``on_hang`` and raise :class:`WatchdogError` with its output."""
    t0 = time.monotonic()
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc, first)
        try:
            out, err = proc.communicate(timeout=grace if first != signal.SIGKILL else None)
        except subprocess.TimeoutExpired:
            kill_group(proc, signal.SIGKILL)
            out, err = proc.communicate()
        if on_hang is not None:
            on_hang()
        name = what or " ".join(map(str, proc.args))
        raise WatchdogError(f"watchdog: {name} hung for {timeout} s and was killed\n"
                            + Run(-9, _text(out), _text(err), time.monotonic() - t0).log
                            ) from None
    return proc.returncode, out if out is not None else "", err if err is not None else ""


def _text(data) -> str:
    if data is None:
        return ""
    return data.decode("utf-8", errors="replace") if isinstance(data, bytes) else data


def run(cmd: Sequence[str], timeout: float, env: dict[str, str] | None = None, *,
        what: str = "", first: int = signal.SIGTERM, merge: bool = False, **kw) -> Run:
    """:func:`spawn` then :func:`watch`: a finished child as a :class:`Run`."""
    t0 = time.monotonic()
    rc, out, err = watch(spawn(cmd, env, merge=merge, **kw), timeout, what, first=first)
    return Run(rc, out, err, time.monotonic() - t0)


def python(code_or_args: Sequence[str], timeout: float, env: dict[str, str] | None = None,
           **kw) -> Run:
    """``sys.executable`` with these arguments, under the watchdog."""
    return run([sys.executable, *code_or_args], timeout, env, **kw)


def expect(exc_type: type[BaseException] | tuple[type[BaseException], ...],
           fn: Callable[[], object], *needles: str) -> str:
    """``fn()`` must raise ``exc_type`` whose message contains every needle; the message."""
    try:
        fn()
    except exc_type as exc:
        for n in needles:
            assert n in str(exc), f"{n!r} not in {exc}"
        return str(exc)
    name = getattr(exc_type, "__name__", str(exc_type))
    raise AssertionError(f"{fn} did not raise {name}")
