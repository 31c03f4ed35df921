"""The spot-preemption notice file (BYTEPS_PREEMPTION_NOTICE_FILE, server/preempt.py): the
server announces its leave once when the file appears or changes, never for a file that was
there before it started (until it changes), with the file's first bytes as the reason."""
from __future__ import annotations

import os

from byteps_like.server.preempt import REASON_BYTES, PreemptionNotice


class FakeControl:
    def __init__(self):
        self.rank, self.fatal, self.shutting_down = 1, None, False
        self.left: list[str] = []

    def leave(self, reason: str) -> None:
        self.left.append(reason)


class FakeServer:
    def __init__(self):
        self.rank = 1
        self.control = FakeControl()
        self.timers: list = []
        self.ep = self

    def add_timer(self, interval, fn):
        self.timers.append((interval, fn))


def test_a_notice_that_appears_makes_the_server_leave_once(tmp_path):
    srv = FakeServer()
    notice = PreemptionNotice(srv, str(tmp_path / "notice-{rank}"))
    notice.start()
    assert notice.path == str(tmp_path / "notice-1") and srv.timers[0][0] == 1.0
    notice.tick()
    assert srv.control.left == []
    (tmp_path / "notice-1").write_bytes(b"TERMINATE\tat 12:00\x00\n" + b"x" * 1000)
    notice.tick()
    notice.tick()
    assert len(srv.control.left) == 1
    reason = srv.control.left[0]
    assert reason.startswith(f"preemption notice in {tmp_path / 'notice-1'}: TERMINATE at 12:00 x")
    assert len(reason) < len(str(tmp_path)) + 40 + REASON_BYTES  # bounded, printable


def test_an_old_notice_is_ignored_until_it_changes(tmp_path, caplog):
    path = tmp_path / "notice"
    path.write_text("old")
    srv = FakeServer()
    notice = PreemptionNotice(srv, str(path))
    notice.start()
    assert "exists already" in caplog.text
    notice.tick()
    assert srv.control.left == []
    path.write_text("new notice")
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    notice.tick()
    assert srv.control.left == [f"preemption notice in {path}: new notice"]


def test_nothing_is_announced_by_a_node_that_is_ending(tmp_path):
    srv = FakeServer()
    notice = PreemptionNotice(srv, str(tmp_path / "n"))
    notice.start()
    (tmp_path / "n").write_text("")
    srv.control.shutting_down = True
    notice.tick()
    assert srv.control.left == []
    srv.control.shutting_down = False
    notice.tick()   # an empty file is a notice too, with no reason quoted
    assert srv.control.left == [f"preemption notice in {tmp_path / 'n'}"]
