"""Running ``python -m byteps_like.bench ...`` from the benchmark smoke tests: in its own session
under a watchdog, and reading its markdown tables."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

from tests.support import spawn, watch


def bench(*args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
    """Run one benchmark command; on ``timeout`` kill its process group (SIGTERM first: the
    benchmark then kills its own children's groups) and fail with both outputs."""
    cmd = [sys.executable, "-m", "byteps_like.bench", *args]
    rc, out, err = watch(spawn(cmd, dict(os.environ)), timeout, " ".join(cmd),
                         first=signal.SIGTERM, grace=10)
    return subprocess.CompletedProcess(cmd, rc, out, err)


def dump(r: subprocess.CompletedProcess) -> str:
    return f"exit {r.returncode}\n--- stdout ---\n{r.stdout}\n--- stderr ---\n{r.stderr}"


def parse_table(stdout: str, columns: list[str]) -> list[dict[str, str]]:
    """The one markdown table of the output, whose header must be ``columns``, as rows of
    {column: cell}."""
    lines = [ln for ln in stdout.splitlines() if ln.startswith("|")]
    assert len(lines) >= 3, stdout
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header == columns, header
    assert set(lines[1]) <= set("|-:"), lines[1]
    return [dict(zip(header, (c.strip() for c in ln.strip("|").split("|")))) for ln in lines[2:]]
