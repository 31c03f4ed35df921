"""What the benchmarks print: sizes, markdown tables, the machine, and the result line of a child.

Standard library only (and byteps_like.config for sizes), so that every child entry point of
the benchmarks can import it, also one run by another interpreter (Horovod's).

- A child process reports with :func:`emit` (one ``BENCH_RESULT {json}`` line on stdout) and
  :func:`progress` (``progress: ...`` on stderr, relayed by the driver); the driver reads the
  result with :func:`byteps_like.bench.harness.collect`; a child of a ``torch.distributed``
  baseline ends with :func:`end_torch_distributed`.
- Sizes on a benchmark's command line read as ``BYTEPS_PARTITION_BYTES`` does
  (:func:`byteps_like.config.parse_size`): ``64K``, ``4MiB``, ``1MB``, bytes.
- Every markdown table is :func:`markdown_table`'s.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import re
import resource
import shlex
import signal
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TypeVar

from ..config import parse_size

T = TypeVar("T")

RESULT_TAG = "BENCH_RESULT "
MiB = 1 << 20
_NUMBER = re.compile(r"\s*(\d+(\.\d*)?|\.\d+)\s*")


# ------------------------------------------------------------------------ child -> driver lines
def emit(obj: dict) -> None:
    """A child's result: one ``BENCH_RESULT {json}`` line on stdout."""
    print(RESULT_TAG + json.dumps(obj), flush=True)


def progress(text: str) -> None:
    """A child's progress line on stderr; the driver relays those of one child."""
    print(f"progress: {text}", file=sys.stderr, flush=True)


def end_torch_distributed(dist: Any, result: dict) -> NoReturn:
    """The end of a child that ran a ``torch.distributed`` baseline (DDP, gloo, NCCL): every
    rank meets at a barrier (no collective is in flight anywhere after it), prints its result
    with :func:`emit` and leaves at once with status 0, without the group's or the
    interpreter's teardown.

    Why not ``destroy_process_group()`` and a normal exit: on two loaded cores a DDP-gloo
    child that had finished its steps was once killed by SIGABRT ("terminate called without
    an active exception") in torch's teardown, and its benchmark failed. Nothing of a
    baseline's teardown is measured, so it is skipped; the kernel closes the sockets. ``dist``
    is the ``torch.distributed`` module (this module imports no torch)."""
    dist.barrier()
    emit(result)
    sys.stderr.flush()
    os._exit(0)


# ------------------------------------------------------------------------------------- sizes
def size_arg(text: str, *, bare_unit: str = "", multiple: int = 1, minimum: int = 1) -> int:
    """One size of a command line, in bytes (``64K``, ``4MiB``, ``1MB``, ``4096``): an
    ``argparse.ArgumentTypeError`` naming it unless it is at least ``minimum`` and a multiple
    of ``multiple``. ``bare_unit``: the unit of a plain number (``"M"``: ``4`` is 4 MiB)."""
    if bare_unit and _NUMBER.fullmatch(text):
        value: str = text.strip() + bare_unit
    else:
        value = text
    try:
        n = parse_size(value)
    except ValueError as exc:
        reason = str(exc).split(" ", 1)[1]
        raise argparse.ArgumentTypeError(f"bad size {text!r}: {reason}") from None
    if n < minimum or n % multiple:
        what = f"at least {minimum} bytes" + (f" and a multiple of {multiple}" if multiple > 1
                                              else "")
        raise argparse.ArgumentTypeError(f"size {text!r} must be {what}"
                                         + (" (one float32 tensor)" if multiple == 4 else ""))
    return n


def size_list(text: str, **kw: Any) -> list[int]:
    """Comma-separated sizes (:func:`size_arg`), in the order given, repeats kept."""
    return [size_arg(s, **kw) for s in text.split(",") if s.strip()]


def parse_sizes(parser: argparse.ArgumentParser, text: str, option: str = "--sizes",
                **kw: Any) -> list[int]:
    """:func:`size_list` of an option, or the parser's usage error (exit 2) naming it."""
    try:
        sizes = size_list(text, **kw)
    except argparse.ArgumentTypeError as exc:
        parser.error(f"{option}: {exc}")
    if not sizes:
        parser.error(f"{option} is empty")
    return sizes


def fmt_size(n: int) -> str:
    """``64KiB``, ``4MiB``, ``1GiB``; bytes when not a whole number of KiB."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return f"{n}B"


# ------------------------------------------------------------------------------------ tables
def num(x: float | None, spec: str) -> str:
    """``format(x, spec)``, or ``n/a`` for None."""
    return "n/a" if x is None else format(x, spec)


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[str]], *,
                   left: int = 0) -> str:
    """A markdown table, every column as wide as its widest cell: the first ``left`` columns
    left-aligned, the others right-aligned (``---:``)."""
    cells = [tuple(columns), *(tuple(r) for r in rows)]
    for r in cells:
        if len(r) != len(columns):
            raise ValueError(f"a row of {len(r)} cells in a table of {len(columns)} columns: {r}")
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    lines = ["| " + " | ".join(c[i].ljust(w) if i < left else c[i].rjust(w)
                               for i, w in enumerate(widths)) + " |" for c in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) if i < left else "-" * (w + 1) + ":"
                                   for i, w in enumerate(widths)) + "|")
    return "\n".join(lines)


# --------------------------------------------------------------------------------- the machine
def version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info() -> dict:
    import zmq
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count() or 0
    return {"nproc": usable, "cpu_count": os.cpu_count(), "machine": platform.machine(),
            "processor": cpu_model(), "platform": platform.platform(),
            "python": platform.python_version(), "numpy": version("numpy"),
            "pyzmq": zmq.__version__, "libzmq": zmq.zmq_version(), "torch": version("torch"),
            "byteps_like": version("byteps_like")}


def report_header(bench: str, argv: Sequence[str], info: dict, *, torch: bool = True) -> str:
    """Print the first lines of a benchmark's report (the command, the machine, the versions);
    returns the command, which the JSON output records too."""
    command = shlex.join(["python", "-m", "byteps_like.bench", bench, *argv])
    print(f"command: {command}")
    print(f"machine: nproc={info['nproc']} ({info['processor']}, {info['machine']}), "
          f"{info['platform']}")
    print(f"versions: python {info['python']}, numpy {info['numpy']}, pyzmq {info['pyzmq']} "
          f"(libzmq {info['libzmq']}), " + (f"torch {info['torch']}, " if torch else "") +
          f"byteps_like {info['byteps_like']}")
    return command


# ------------------------------------------------------------------------- what else ran
def cpu_busy_s() -> float | None:
    """Busy CPU-seconds of the whole machine since boot (all CPUs), from /proc/stat."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)   # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    """CPU-seconds used by this process and its reaped children."""
    me, kids = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return ""


def busy_now(seconds: float = 0.5) -> float | None:
    """Fraction of the machine's CPUs busy (with anything) over the next ``seconds``."""
    b0 = cpu_busy_s()
    time.sleep(seconds)
    b1 = cpu_busy_s()
    if b0 is None or b1 is None:
        return None
    return (b1 - b0) / seconds / (os.cpu_count() or 1)


def print_before_start() -> tuple[str, float | None]:
    """Print the ``before start:`` line (load average, how busy the CPUs are now); returns the
    load average and the busy share, which the JSON output records."""
    load = loadavg()
    busy = busy_now()
    print(f"before start: load average {load}" + (
        "" if busy is None else f", CPUs {busy:.0%} busy over 0.5 s"
        + (" (WARNING: something else is running; the numbers will be noisy)"
           if busy > 0.15 else "")), flush=True)
    return load, busy


class OthersMeter:
    """``with OthersMeter() as m: ...``: afterwards ``m.wall`` (seconds) and ``m.others``, the
    share of the machine's CPUs that other processes (or the hypervisor) took meanwhile: the
    machine-wide busy CPU time minus this process's and its reaped children's; None where
    /proc/stat cannot be read. ``m.busy`` is the machine-wide busy share, ours included."""

    wall: float = 0.0
    others: float | None = None
    busy: float | None = None

    def __enter__(self) -> OthersMeter:
        self._t0, self._busy0, self._own0 = time.monotonic(), cpu_busy_s(), own_cpu_s()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = max(1e-9, time.monotonic() - self._t0)
        busy1, own1 = cpu_busy_s(), own_cpu_s()
        ncpu = os.cpu_count() or 1
        if self._busy0 is not None and busy1 is not None:
            self.busy = (busy1 - self._busy0) / self.wall / ncpu
            self.others = max(0.0, (busy1 - self._busy0) - (own1 - self._own0)) / self.wall / ncpu


def noisy_note(shares: dict[str, float | None], what: str) -> str | None:
    """``CPU taken by other processes ... during each <what>: a 3%, b 12% (WARNING: ...)``, or
    None when nothing was measured."""
    known = {k: v for k, v in shares.items() if v is not None}
    if not known:
        return None
    noisy = any(v > 0.1 for v in known.values())
    return (f"CPU taken by other processes (or the hypervisor) during each {what}: "
            + ", ".join(f"{k} {v:.0%}" for k, v in known.items())
            + (" (WARNING: noisy; run again on an idle machine)" if noisy else ""))


def drive(prog: str, jobs: Callable[[], T], errors: type[BaseException] | tuple = ()) -> T | int:
    """Run a bench's ``jobs``: their result, or the driver's exit status where they could not
    finish: 130 on Ctrl-C (every child had been stopped by the jobs' cleanup), 1 on one of
    ``errors`` (the emulated cluster's, which say what to do), each said on stderr."""
    try:
        return jobs()
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; every process it started was stopped", file=sys.stderr)
        return 130
    except errors as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1


def exit_on_signals() -> None:
    """SIGTERM and SIGHUP end the driver through SystemExit, so every job's cleanup runs (the
    children live in their own sessions and would otherwise outlive it)."""
    def stop(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)
