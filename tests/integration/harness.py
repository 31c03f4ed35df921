"""Runs a local byteps_like cluster through ``bpslaunch --local`` under a watchdog.

Every run gets free ports (bpslaunch picks them), its own process group, and a hard deadline: on a
hang the whole group is killed and the captured output is put in the assertion message.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

WORKERS_DIR = Path(__file__).parent / "workers"

# Fast failure detection for tests; production defaults are far longer.
FAST_ENV = {"BYTEPS_HEARTBEAT_INTERVAL_SECONDS": "0.5", "BYTEPS_HEARTBEAT_TIMEOUT_SECONDS": "3",
            "BYTEPS_REGISTER_TIMEOUT_SECONDS": "30", "BYTEPS_TIMEOUT_SECONDS": "60"}


@dataclass
class Run:
    rc: int
    out: str
    err: str
    elapsed: float

    @property
    def log(self) -> str:
        return f"exit {self.rc} after {self.elapsed:.1f} s\n--- stdout ---\n{self.out}\n--- stderr ---\n{self.err}"

    def lines(self, prefix: str) -> list[str]:
        return [ln for ln in self.out.splitlines() if prefix in ln]


def bpslaunch(args: list[str], *, workers: int, servers: int | None, env: dict | None = None,
              timeout: float = 120, local_size: int = 1, extra: list[str] | None = None) -> Run:
    """``servers=None``: bpslaunch's own default."""
    cmd = [sys.executable, "-m", "byteps_like.launcher", "--local", "--workers", str(workers),
           *(["--servers", str(servers)] if servers is not None else []),
           "--local-size", str(local_size), *(extra or []), "--", sys.executable, *args]
    full_env = {k: v for k, v in os.environ.items()
                if not k.startswith(("DMLC_", "BYTEPS_"))}
    full_env.update(FAST_ENV)
    full_env.update(env or {})
    full_env["PYTHONUNBUFFERED"] = "1"
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=full_env, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # bpslaunch forwards SIGINT to every child's process group; SIGKILL it if that hangs
        os.killpg(p.pid, signal.SIGINT)
        try:
            out, err = p.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate()
        run = Run(-9, out, err, time.monotonic() - t0)
        raise AssertionError(f"watchdog: bpslaunch hung for {timeout} s and was killed\n{run.log}")
    return Run(p.returncode, out, err, time.monotonic() - t0)


def worker(name: str, *args: object) -> list[str]:
    return [str(WORKERS_DIR / name), *map(str, args)]


def pids_in(text: str) -> set[int]:
    """PIDs a worker script reported with lines like ``PIDS 12 34 56``."""
    pids: set[int] = set()
    for m in re.finditer(r"PIDS ([\d ]+)", text):
        pids |= {int(x) for x in m.group(1).split()}
    return pids


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie nobody has reaped yet still answers kill(0): it counts as gone
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:][:1] not in (b"Z", b"X")


def wait_gone(pids: set[int], timeout: float = 10.0) -> set[int]:
    deadline = time.monotonic() + timeout
    left = {p for p in pids if alive(p)}
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = {p for p in left if alive(p)}
    return left
