"""The report of a failed job: one failure, one report (issue 40).

While the job runs, bpslaunch holds back each child's stderr from its first ``Traceback (most
recent call last):`` on (launcher/procs.py, ``hold_tracebacks``), so that a failure is not
printed once per process. When the job fails, :func:`failure_report` says, in this order:

* the other processes in one line: which exited because of the failure (exit status 75),
  which were stopped, which failed too;
* the last lines of the root cause's stderr (its traceback), extended back so that its final
  exception is shown whole, however many lines its message takes;
* the final line, which names the root cause: process, pid, host, how it ended and its
  exception statement, whole.

Standard library and byteps_like.errors only, like the rest of the launcher.
"""
from __future__ import annotations

import re
import socket
from collections.abc import Collection, Sequence

from byteps_like.errors import EXIT_PEER_FAILED

from .procs import Child, describe_returncode

#: Lines of the root cause's stderr shown (more when its final exception takes more, up to
#: REPORT_MAX_LINES), and on the final line when it states no exception.
REPORT_TAIL_LINES = 10
REPORT_MAX_LINES = 40
SUMMARY_TAIL_LINES = 3
_SUMMARY_MAX_CHARS = 600
#: The line that states an exception: ``ValueError: boom``,
#: ``byteps_like.errors.PeerLeftError: ...``, ``KeyboardInterrupt`` (not indented: a traceback's
#: source lines are).
_EXCEPTION = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt)"
                        r"(?:: \S.*)?$")


def secondary(child: Child) -> bool:
    """Whether the child exited only because another process of the job failed."""
    return child.returncode == EXIT_PEER_FAILED


def failed_how(child: Child) -> str:
    return ("exited because another process of the job failed" if secondary(child)
            else "failed")


def _text(child: Child) -> list[str]:
    return [line.rstrip() for line in child.stderr_tail if line.strip()]


def exception_start(lines: Sequence[str]) -> int | None:
    """The index of the last line that states an exception (None: none does)."""
    for i in range(len(lines) - 1, -1, -1):
        if _EXCEPTION.match(lines[i]):
            return i
    return None


def exception_statement(child: Child) -> str | None:
    """The child's final exception, whole (its message may take several lines, and a framework
    may wrap byteps_like's exception in its own: the last statement is byteps_like's)."""
    lines = _text(child)
    start = exception_start(lines)
    if start is None:
        return None
    return " | ".join(line.strip() for line in lines[start:])


def report_tail(child: Child) -> list[str]:
    """The root cause's last stderr lines for the report: REPORT_TAIL_LINES, or from its final
    exception on when that begins earlier (at most REPORT_MAX_LINES)."""
    lines = _text(child)
    first = max(0, len(lines) - REPORT_TAIL_LINES)
    start = exception_start(lines)
    if start is not None and start < first:
        first = max(start, len(lines) - REPORT_MAX_LINES)
    return lines[first:]


def failure_summary(child: Child) -> str:
    """One line: who failed first (or, when no process failed on its own, who reacted to the
    failure elsewhere), how, and its exception statement whole (else its last stderr lines)."""
    text = (f"{child.describe()} {failed_how(child)}" if secondary(child)
            else f"{child.describe()} failed first")
    text += f": {describe_returncode(child.returncode)}"
    stated = exception_statement(child)
    tail = [line.strip() for line in child.stderr_tail if line.strip()]
    if stated is not None:
        text += f"; last stderr: {stated}"
    elif tail:
        last = " | ".join(tail[-SUMMARY_TAIL_LINES:])
        if len(last) > _SUMMARY_MAX_CHARS:
            last = "..." + last[-_SUMMARY_MAX_CHARS:]
        text += f"; last stderr: {last}"
    else:
        text += "; it wrote nothing to stderr"
    return text


def others_line(blamed: Child, children: Sequence[Child], stopped: Collection[Child]) -> str:
    """The processes other than the root cause, in one line."""
    parts = []
    for c in children:
        if c is blamed:
            continue
        if c.restarted:
            how = f"was lost ({describe_returncode(c.returncode)}) and restarted"
        elif secondary(c):
            how = "exited because of it"
        elif c in stopped and (c.returncode is None or c.returncode < 0):
            how = "stopped by bpslaunch"
        elif c.returncode == 0:
            how = "had exited 0"
        else:
            how = f"failed too ({describe_returncode(c.returncode)})"
        parts.append(f"{c.describe()} {how}")
    return "the other processes: " + "; ".join(parts)


def failure_report(blamed: Child, children: Sequence[Child],
                   stopped: Collection[Child]) -> list[str]:
    """The lines of the report (without the ``bpslaunch: `` prefix), the root cause last."""
    lines = []
    if len(children) > 1:
        lines.append(others_line(blamed, children, stopped))
    tail = report_tail(blamed)
    if tail:
        lines.append(f"last stderr lines of {blamed.describe()} on {socket.gethostname()}:")
        lines += [f"| {line}" for line in tail]
    lines.append("error: " + ("no process failed on its own; " if secondary(blamed) else "")
                 + failure_summary(blamed))
    return lines


__all__ = ["failure_report", "failure_summary", "failed_how", "secondary", "exception_statement",
           "REPORT_TAIL_LINES"]
