"""Drops (byteps_like/transport/base.py): what a node drops is counted by reason and logged at
a bounded rate, and what the last window counted is logged at close (issue 29)."""
from __future__ import annotations

import logging

from byteps_like.transport.base import Drops


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_a_flood_costs_one_line_per_reason_and_its_last_window_is_logged_at_close():
    log = logging.getLogger("test_drops")
    log.propagate = False
    got = _Lines()
    log.addHandler(got)
    try:
        d = Drops(log, "worker 0", interval=3600.0)
        for i in range(1000):
            d("local-reduction message from no local rank's connection", f"#{i}")
        d("malformed")
        assert d.counts == {"local-reduction message from no local rank's connection": 1000,
                            "malformed": 1}
        assert len(got.lines) == 2          # the first of each reason, at once
        d.flush()
        assert got.lines[2:] == ["worker 0: dropped 999 messages: local-reduction message from "
                                 "no local rank's connection (since the last line of it, at "
                                 "close)"]
        d.flush()                           # nothing new: no line
        assert len(got.lines) == 3 and d.total == 1001
    finally:
        log.removeHandler(got)


def test_thirty_seconds_of_refusals_cost_a_few_lines_with_their_counts():
    """A peer refused 600 times a second for 30 s (the audit: 18,200 CURVE-refusal lines in
    30 s): the first line at once, then one per interval, and every refusal is in a count."""
    log = logging.getLogger("test_drops_30s")
    log.propagate = False
    got = _Lines()
    log.addHandler(got)
    now = [1000.0]
    try:
        d = Drops(log, "authentication", verb="refused", unit="CURVE client",
                  clock=lambda: now[0])
        for _ in range(30 * 600):
            d("its client key is not this job's")
            now[0] += 1 / 600
        d.flush()
        assert 3 <= len(got.lines) <= 5, got.lines
        assert got.lines[0] == ("authentication: refused 1 CURVE client: its client key is not "
                                "this job's")
        counted = sum(int(line.split("refused ")[1].split(" ")[0]) for line in got.lines)
        assert counted == d.total == 30 * 600
    finally:
        log.removeHandler(got)
