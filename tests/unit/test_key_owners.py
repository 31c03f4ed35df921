"""Where the keys live (byteps_like/worker/telemetry.py: key_owners, keys_moved), what worker
rank 0 reports for ``bpslaunch status`` (issue 37 item 5), and how the scheduler and
``bpslaunch status`` show it (scheduler/reports.py, launcher/status.py)."""
from __future__ import annotations

from collections import deque
from types import SimpleNamespace

from byteps_like import _core
from byteps_like.config import load
from byteps_like.launcher.status import render_state
from byteps_like.scheduler.failover import loss_cause
from byteps_like.scheduler.nodes import NodeInfo
from byteps_like.scheduler.reports import Reports
from byteps_like.transport import Route
from byteps_like.wire import Role
from byteps_like.worker.telemetry import key_owners, keys_moved


def runtime(gone: list[int], history=()):
    parts = [(0, 100 + k, k, k % 3) for k in range(30)]   # 30 keys over 3 servers
    st = SimpleNamespace(parts=parts)
    return SimpleNamespace(
        members=SimpleNamespace(server_ranks=[0, 1, 2], rank=0),
        plane=SimpleNamespace(client=object(), gone=gone),
        tensors=lambda: {"t": st},
        failover=SimpleNamespace(history=deque(history)) if history else None)


def test_a_lost_servers_keys_go_where_the_native_client_moves_them():
    home = key_owners(runtime([]))
    assert [r[:3] for r in home] == [[0, 10, sum(100 + k for k in range(0, 30, 3))],
                                     [1, 10, sum(100 + k for k in range(1, 30, 3))],
                                     [2, 10, sum(100 + k for k in range(2, 30, 3))]]
    assert all(r[1:3] == r[3:5] for r in home)
    lost = key_owners(runtime([1]))
    assert lost[1][1:3] == [0, 0] and lost[1][3:5] == home[1][3:5]
    want = {0: 10, 2: 10}
    for k in range(1, 30, 3):
        want[_core.failover_owner(k, [0, 2])] += 1
    assert {r[0]: r[1] for r in lost if r[0] != 1} == want
    assert sum(r[2] for r in lost) == sum(r[4] for r in lost)


def test_each_failover_says_the_keys_it_moved():
    rt = runtime([], history=[(1, [], [1]), (2, [1], [1, 2]), (3, [1, 2], [2])])
    moved = {n: (k, b) for n, k, b in keys_moved(rt)}
    ones = [k for k in range(1, 30, 3)]
    assert moved[1] == (10, sum(100 + k for k in ones))
    # the second loss moves server 2's keys and those of server 1 it had taken over
    took = [k for k in ones if _core.failover_owner(k, [0, 2]) == 2]
    assert moved[2] == (10 + len(took), sum(100 + k for k in list(range(2, 30, 3)) + took))
    # server 1's replacement takes its own keys back, and its share of lost server 2's
    share = [k for k in range(2, 30, 3) if _core.failover_owner(k, [0, 1]) == 1]
    assert moved[3][0] == 10 + len(share)
    assert keys_moved(runtime([])) == []
    cache: dict = {}   # each failover counted once, then kept
    assert keys_moved(rt, cache) == keys_moved(rt) and sorted(cache) == [1, 2, 3]
    rt.tensors = lambda: {}
    assert keys_moved(rt, cache) == keys_moved(runtime([], history=list(rt.failover.history)))


def test_loss_causes():
    assert loss_cause("lost server rank 1 ...: it announced its leave (x)") == "announced leave"
    assert loss_cause("lost server rank 1 ...: its process exited (SIGKILL; ...)") == "exit"
    assert loss_cause("lost ...: the data streams of worker rank 0 to it closed") == "stream lost"
    assert loss_cause("lost ...: no heartbeat for 3.1 s (...)") == "heartbeat"
    assert loss_cause("server rank 1 ... failed: boom") == "failed"


def test_the_scheduler_joins_the_workers_figures_to_its_losses():
    host = SimpleNamespace(cfg=load(env={}), nodes={}, elastic=False, phase="running",
                           expected={Role.WORKER: 1, Role.SERVER: 2})
    node = NodeInfo(Route(ident=b"w0"), Role.WORKER, "h", 0, 1, rank=0)
    host.nodes[b"w0"] = node
    loss = SimpleNamespace(events=[
        {"failover": 1, "server": 1, "host": "h", "pid": 7, "why": "lost server rank 1: x",
         "cause": "exit", "at": 1.7e9, "stall": 0.05},
        {"failover": 2, "server": 1, "host": "h", "pid": 8, "why": "server rank 1 replaces",
         "cause": "replacement", "at": 1.7e9 + 5, "stall": None}])
    rep = Reports(host, None, loss)
    assert [f["keys_moved"] for f in rep.failovers()] == [None, None]   # nobody said yet
    rep.report(node, {"step": 3, "owners": [[0, 4, 400, 2, 200], [1, 0, 0, 2, 200], "bad"],
                      "moved": [[1, 2, 200], [2, 2, 200, 9]]}, now=1.0)
    fos = rep.failovers()
    assert (fos[0]["keys_moved"], fos[0]["bytes_moved"]) == (2, 200)
    assert fos[1]["keys_moved"] is None                                 # malformed: dropped
    assert rep.owners() == {0: [0, 4, 400, 2, 200], 1: [1, 0, 0, 2, 200]}
    doc = {"job": {"phase": "running"}, "workers": [], "events": [], "failovers": fos,
           "servers": [{"rank": 0, "host": "h", "state": "up", "keys": 4, "keys_owned": 4,
                        "bytes_owned": 4_000_000},
                       {"rank": 1, "host": "h", "state": "lost", "keys": None,
                        "keys_owned": 0, "bytes_owned": 0}]}
    text = "\n".join(render_state(doc))
    assert "OWNS KEYS" in text and "servers lost and replaced (2):" in text
    row = next(line for line in text.splitlines() if line.strip().startswith("0 "))
    assert row.split()[-2:] == ["4", "4.0"]
    assert "#1" in text and "server 1 on h (pid 7) lost (exit): its keys moved to the others; " \
        "stall 0.05 s; 2 keys (0.0 MB) moved" in text
    assert "#2" in text and "replaced: its keys moved back; stall -; keys moved: ?" in text
