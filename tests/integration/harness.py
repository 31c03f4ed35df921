"""Runs a local byteps_like cluster through ``bpslaunch --local`` under a watchdog.

Every run gets free ports (bpslaunch picks them), its own process group, and a hard deadline: on a
hang the whole group is killed and the captured output is put in the assertion message. The
watchdog, ``Run`` and ``free_port`` are tests/support.py's, re-exported here.
"""
from __future__ import annotations

import re
import signal
import sys
import time
from pathlib import Path

from byteps_like.launcher.procs import pid_alive as alive
from tests.support import FAST_ENV, Run, WatchdogError, clean_env, free_port, spawn, watch

__all__ = ["FAST_ENV", "Run", "WatchdogError", "alive", "bpslaunch", "free_port", "pids_in",
           "wait_gone", "worker"]

WORKERS_DIR = Path(__file__).parent / "workers"


def bpslaunch(args: list[str], *, workers: int, servers: int | None, env: dict | None = None,
              timeout: float = 120, local_size: int = 1, extra: list[str] | None = None,
              python: str | None = None) -> Run:
    """``python args...`` (``sys.executable`` by default) on ``workers`` workers of a local
    cluster. ``servers=None``: bpslaunch's own default. On a hang bpslaunch gets SIGINT (it
    forwards it to every child's process group), then its group SIGKILL."""
    py = python or sys.executable
    cmd = [py, "-m", "byteps_like.launcher", "--local", "--workers", str(workers),
           *(["--servers", str(servers)] if servers is not None else []),
           "--local-size", str(local_size), *(extra or []), "--", py, *args]
    full_env = clean_env(**FAST_ENV)
    full_env.update(env or {})
    t0 = time.monotonic()
    rc, out, err = watch(spawn(cmd, full_env), timeout, "bpslaunch", first=signal.SIGINT)
    return Run(rc, out, err, time.monotonic() - t0)


def worker(name: str, *args: object) -> list[str]:
    return [str(WORKERS_DIR / name), *map(str, args)]


def pids_in(text: str) -> set[int]:
    """PIDs a worker script reported with lines like ``PIDS 12 34 56``."""
    pids: set[int] = set()
    for m in re.finditer(r"PIDS ([\d ]+)", text):
        pids |= {int(x) for x in m.group(1).split()}
    return pids


def wait_gone(pids: set[int], timeout: float = 10.0) -> set[int]:
    deadline = time.monotonic() + timeout
    left = {p for p in pids if alive(p)}
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = {p for p in left if alive(p)}
    return left
