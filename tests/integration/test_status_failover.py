"""``bpslaunch status`` of a job that lost a server and got it back (issue 37 item 5): each
server's keys and bytes owned now, and every loss and replacement (which server, when, why, the
stall, the keys moved), read by a worker from the scheduler's live page
(tests/integration/workers/status_failover.py)."""
from __future__ import annotations

import json

import pytest

from tests.support import free_port

from .harness import bpslaunch, worker

pytestmark = pytest.mark.integration


def test_status_shows_the_keys_of_each_server_and_every_loss_and_replacement(tmp_path):
    port = free_port()
    out = tmp_path / "state.json"
    r = bpslaunch(worker("status_failover.py", f"127.0.0.1:{port}", out), workers=2,
                  servers=3, env={"BYTEPS_REPORT_INTERVAL_SECONDS": "0.2"}, timeout=150,
                  extra=[f"--dashboard={port}", "--server-restarts", "1"])
    text = r.out + r.err
    assert r.rc == 0, text
    doc = json.loads(out.read_text())
    before = {row[0]: row for row in doc["before"]}   # rank: [rank, keys, bytes, home, home bytes]
    state = doc["state"]
    assert sum(row[1] for row in before.values()) == sum(row[3] for row in before.values())
    assert before[1][1] > 0 and before[1][1:3] == before[1][3:5]   # its own keys, before
    lost, back = state["failovers"]
    assert (lost["failover"], lost["server"], back["failover"], back["server"]) == (1, 1, 2, 1)
    assert lost["cause"] in ("exit", "stream lost"), lost   # SIGKILL: whichever told first
    assert "lost server rank 1" in lost["why"]
    assert (lost["keys_moved"], lost["bytes_moved"]) == (before[1][1], before[1][2])
    assert back["cause"] == "replacement" and "replaces server rank 1" in back["why"]
    assert (back["keys_moved"], back["bytes_moved"]) == (before[1][3], before[1][4])
    assert lost["stall"] >= 0 and back["stall"] >= 0 and lost["at"] <= back["at"]
    # the page's event log names the new server a replacement, not a join
    assert any(e["kind"] == "replacement" and e["text"].startswith("server registered")
               for e in state["events"]), state["events"]
    for s in state["servers"]:   # balanced again: every server owns its first keys
        assert (s["keys_owned"], s["bytes_owned"]) == tuple(before[s["rank"]][1:3]), s
    # the text of bpslaunch status
    assert "OWNS KEYS" in text and "servers lost and replaced (2):" in text
    assert "server 1 on 127.0.0.1" in text and "replaced: its keys moved back" in text
    assert f"{before[1][1]} keys (" in text
