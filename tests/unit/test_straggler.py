"""The straggler report (issue 38; docs/observability.md): the native server's per-rank
accounting (csrc/dataplane_straggle.h) on loopback, and the scheduler's reading of the
servers' and workers' REPORTs (scheduler/reports.py): who is named, when, how, and what the
live page's JSON says."""
from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import numpy as np
import pytest

from byteps_like import _core
from byteps_like.config import load
from byteps_like.scheduler.nodes import NodeInfo
from byteps_like.scheduler.reports import EventLog, Reports
from byteps_like.transport import Route
from byteps_like.transport.native import WIRE_CODE
from byteps_like.wire import Role, pack_decl

JOB = 0xC0FFEE
MAXMSG = 1 << 28
PART = 64 << 10


def _parts(nbytes: int, rnd: int) -> list:
    out = []
    offs = list(range(0, nbytes, PART))
    for i, off in enumerate(offs):
        decl = None
        if rnd == 0:
            decl = pack_decl("t", [nbytes // 4], "float32", i, len(offs),
                             min(PART, nbytes - off) // 4)
        out.append((i, 0, i, off, min(PART, nbytes - off), decl))  # key, server, conn, ...
    return out


def _wait_for(cond, timeout: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


# ---- the native accounting ------------------------------------------------------------------
def test_the_last_pusher_is_charged_the_gap_once_per_round_over_parallel_keys(cleanup):
    """Two workers, a tensor of two partitions (two keys): rank 1 pushes each round GAP s after
    rank 0's pushes were summed. Rank 1 held every round by at least GAP (merged over the two
    keys: at most the wall time, not twice the gap); rank 0 held nothing and waited as long."""
    srv = _core.DataServer(2, 0, JOB, 2, MAXMSG, 1 << 32, 64)
    port = srv.listen("127.0.0.1", 0)
    srv.start()
    cleanup.append(srv)
    clients = []
    for rank in (0, 1):
        cli = _core.DataClient(rank, JOB, 2, 8 * PART, MAXMSG)
        cli.connect(0, "127.0.0.1", port, 2, 5.0)
        cleanup.append(cli)
        clients.append(cli)
    assert srv.straggle() == [(0.0, 0, 0.0), (0.0, 0, 0.0)]
    x = np.ones(2 * PART // 4, np.float32)
    outs = [np.empty_like(x), np.empty_like(x)]
    gap, rounds = 0.15, 3
    t0 = time.monotonic()
    for rnd in range(rounds):
        op = 10 + rnd
        clients[0].submit(op, 0, x.view(np.uint8), outs[0].view(np.uint8), WIRE_CODE["float32"],
                          1, rnd, _parts(x.nbytes, rnd))
        # rank 0's two pushes summed: only then does the late rank start its own
        _wait_for(lambda r=rnd: srv.stats()["pushes"] >= 2 * (2 * r + 1), what="rank 0's push")
        time.sleep(gap)  # the straggler's lateness (what is measured), not a wait for an event
        clients[1].submit(op, 0, x.view(np.uint8), outs[1].view(np.uint8), WIRE_CODE["float32"],
                          1, rnd, _parts(x.nbytes, rnd))
        for cli in clients:
            assert cli.wait(op, 20.0)
            assert cli.take(op)[1]  # ok
        assert np.all(outs[0] == 2)
    wall = time.monotonic() - t0
    (held0, rounds0, waited0), (held1, rounds1, waited1) = srv.straggle()
    assert (held0, rounds0, waited1) == (0.0, 0, 0.0)
    assert rounds1 == 2 * rounds                  # each key's rounds
    assert rounds * gap <= held1 <= wall          # merged over the keys, never double
    assert rounds * gap <= waited0 <= wall


def test_a_round_of_one_worker_holds_nobody(cleanup):
    srv = _core.DataServer(1, 0, JOB, 2, MAXMSG, 1 << 32, 64)
    port = srv.listen("127.0.0.1", 0)
    srv.start()
    cleanup.append(srv)
    cli = _core.DataClient(0, JOB, 2, 8 * PART, MAXMSG)
    cli.connect(0, "127.0.0.1", port, 2, 5.0)
    cleanup.append(cli)
    x = np.ones(100, np.float32)
    y = np.empty_like(x)
    for rnd in range(3):
        cli.submit(rnd + 1, 0, x.view(np.uint8), y.view(np.uint8), WIRE_CODE["float32"], 1, rnd,
                   _parts(x.nbytes, rnd))
        assert cli.wait(rnd + 1, 20.0) and cli.take(rnd + 1)[1]
    assert srv.straggle() == [(0.0, 0, 0.0)]


# ---- the scheduler's reading ----------------------------------------------------------------
def _host(workers: int = 3, servers: int = 2, local_size: int = 1, **env: str):
    cfg = load(env={"DMLC_NUM_WORKER": str(workers), "DMLC_NUM_SERVER": str(servers),
                    "BYTEPS_LOCAL_SIZE": str(local_size), **env})
    nodes = {}
    for r in range(workers * local_size):
        nodes[b"w%d" % r] = NodeInfo(Route(ident=b"w%d" % r), Role.WORKER, f"host{r // local_size}",
                                     9000 + r, 100 + r, rank=r)
    for r in range(servers):
        nodes[b"s%d" % r] = NodeInfo(Route(ident=b"s%d" % r), Role.SERVER, "srvhost", 8000 + r,
                                     200 + r, rank=r)
    return SimpleNamespace(cfg=cfg, nodes=nodes, phase="running", elastic=False,
                           expected={Role.WORKER: workers * local_size, Role.SERVER: servers},
                           counts=lambda: "all")


def _node(host, role: Role, rank: int) -> NodeInfo:
    return next(n for n in host.nodes.values() if n.role is role and n.rank == rank)


def _feed(rep: Reports, host, t0: float, seconds: float, held_rate: dict[int, float], *,
          servers=(0, 1), step_rate: float = 5.0, start: float = 0.0) -> None:
    """Reports once a second for ``seconds``: each server charges machine m held_rate[m]
    seconds a second (server 1 half of it: its keys overlap server 0's), every worker steps
    ``step_rate`` a second and spends 20% of the time in the exchange."""
    n = rep.capacity()
    for i in range(int(seconds) + 1):
        t = t0 + i
        el = start + i
        for s in servers:
            share = 1.0 if s == 0 else 0.5
            rep.report(_node(host, Role.SERVER, s), {
                "bytes": int(el * 1e6), "cpu": el * 0.1, "keys": 4, "rounds": int(el * 10),
                "store_bytes": 1000,
                "straggle": [[held_rate.get(m, 0.0) * el * share, int(el), 0.0]
                             for m in range(n)]}, now=t)
        for w in range(n * host.cfg.cluster.local_size):
            rep.report(_node(host, Role.WORKER, w), {
                "step": int(el * step_rate), "bytes": int(el * 2e6), "exchange": el * 0.2,
                "rounds": int(el * step_rate * 2),
                "progress": {"step": int(el * step_rate), "total_steps": 1000,
                             "samples_per_step": 32}}, now=t)


def test_a_slow_worker_is_named_once_by_rank_and_host_after_a_window(caplog):
    host = _host(BYTEPS_STRAGGLER_WINDOW_SECONDS="4")
    events = EventLog()
    rep = Reports(host, events)
    t0 = 1000.0
    with caplog.at_level(logging.INFO, logger="byteps_like.scheduler"):
        _feed(rep, host, t0, 2, {1: 0.6})        # half a window: not yet
        assert rep.straggler(t0 + 2) is None and rep.flagged is None
        _feed(rep, host, t0 + 3, 6, {1: 0.6}, start=3)
    st = rep.straggler(t0 + 9)
    assert st is not None and (st["rank"], st["host"], st["ranks"]) == (1, "host1", [1])
    assert st["fraction"] == pytest.approx(0.6, abs=0.01)   # the largest server's, not a sum
    lines = [r.getMessage() for r in caplog.records if "straggler" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "worker rank 1 on host1" in lines[0] and "60%" in lines[0]
    assert "BYTEPS_STRAGGLER_FRACTION=0.1" in lines[0]
    assert [e["kind"] for e in events.recent()] == ["straggler"]
    m = rep.metrics(t0 + 9)
    assert m["byteps_scheduler_straggler_rank"] == 1
    assert m["byteps_scheduler_worker_held_fraction"]["1"] == pytest.approx(0.6, abs=0.01)
    assert m["byteps_scheduler_worker_held_fraction"]["0"] == 0


def test_recovery_is_said_once_and_small_costs_are_not_named(caplog):
    host = _host(BYTEPS_STRAGGLER_WINDOW_SECONDS="3")
    rep = Reports(host)
    with caplog.at_level(logging.INFO, logger="byteps_like.scheduler"):
        _feed(rep, host, 0.0, 5, {0: 0.05, 2: 0.08})   # under 10%: nobody
        assert rep.flagged is None and rep.straggler(5.0) is None
        rep2 = Reports(host)
        _feed(rep2, host, 0.0, 5, {2: 0.5})
        assert rep2.flagged == 2
        # it recovers: its counter stops growing
        for i in range(6):
            t = 6.0 + i
            for s in (0, 1):
                share = 1.0 if s == 0 else 0.5
                rep2.report(_node(host, Role.SERVER, s), {
                    "bytes": 0, "cpu": 0.0, "keys": 1, "rounds": 0, "store_bytes": 0,
                    "straggle": [[0.0, 0, 0.0], [0.0, 0, 0.0], [0.5 * 5 * share, 5, 0.0]]},
                    now=t)
    assert rep2.flagged is None
    said = [r.getMessage() for r in caplog.records]
    assert sum("straggler: worker rank 2 on host2" in s for s in said) == 1
    assert sum("worker rank 2 on host2 is no longer a straggler" in s for s in said) == 1


def test_a_machine_of_several_local_ranks_is_named_with_all_of_them():
    host = _host(workers=2, local_size=2, BYTEPS_STRAGGLER_WINDOW_SECONDS="2")
    rep = Reports(host)
    _feed(rep, host, 0.0, 4, {1: 0.4})
    st = rep.straggler(4.0)
    assert st is not None and st["ranks"] == [2, 3] and st["host"] == "host1"
    rows = {w["rank"]: w for w in rep.state(4.0)["workers"]}
    assert [r for r, w in rows.items() if w["straggler"]] == [2, 3]


def test_the_page_state_splits_step_time_and_gives_samples_and_eta():
    host = _host(BYTEPS_STRAGGLER_WINDOW_SECONDS="3")
    rep = Reports(host)
    _feed(rep, host, 0.0, 5, {1: 0.5})
    s = rep.state(5.0)
    assert s["straggler"]["rank"] == 1
    w0 = s["workers"][0]
    assert w0["steps_per_s"] == pytest.approx(5.0)
    assert w0["step_time_s"] == pytest.approx(0.2)
    # 20% in the exchange (no wait reported): compute 80% of the step
    assert w0["compute_s"] == pytest.approx(0.16, abs=1e-3)
    assert w0["exchange_s"] + w0["wait_s"] == pytest.approx(0.04, abs=1e-3)
    job = s["job"]
    assert job["samples_per_s"] == pytest.approx(3 * 5.0 * 32)
    assert job["total_steps"] == 1000 and job["progress_step"] == 25
    assert job["eta_s"] == pytest.approx((1000 - 25) / 5.0, rel=0.01)
    srv = s["servers"][0]
    assert srv["bytes_per_s"] == pytest.approx(1e6) and srv["cpu_cores"] == pytest.approx(0.1)
    assert srv["keys"] == 4
    assert s["timeline"] and {"time", "steps_per_s", "straggler"} <= set(s["timeline"][-1])


def test_reports_with_bad_fields_are_read_as_nothing():
    host = _host()
    rep = Reports(host)
    srv = _node(host, Role.SERVER, 0)
    for i, meta in enumerate([
            {"straggle": "x", "bytes": -5, "cpu": float("nan")},
            {"straggle": [[1e300, 1, "a"], None, [1, 2]] + [[0.0, 0, 0.0]] * 100,
             "keys": True},
            {}]):
        rep.report(srv, meta, now=float(i))
    got = rep.servers[srv.route.ident]
    assert len(got[-1][1]["straggle"]) == 0
    assert len(got[-2][1]["straggle"]) == rep.capacity()   # bounded by the job
    assert got[-2][1]["keys"] == 0
    w0 = _node(host, Role.WORKER, 0)
    rep.report(w0, {"step": "9", "progress": {"step": -1}}, now=3.0)
    assert rep.workers[w0.route.ident][-1][1]["step"] == 0
    assert rep.state(3.0)["workers"][0]["rank"] == 0


def test_event_log_is_bounded_and_ordered():
    ev = EventLog(maxlen=3)
    for i in range(5):
        ev.add("join", f"node {i}")
    got = ev.recent()
    assert [e["text"] for e in got] == ["node 2", "node 3", "node 4"]
    assert [e["seq"] for e in got] == [3, 4, 5]
    ev.add("x" * 100, "y" * 5000)
    last = ev.recent(1)[0]
    assert len(last["kind"]) == 40 and len(last["text"]) == 2000


def test_registrations_are_joins_then_the_job_forming_then_replacements():
    host = _host(workers=2, servers=1)
    host.phase = "register"
    events = EventLog()
    rep = Reports(host, events)
    w0 = _node(host, Role.WORKER, 0)
    rep.registered(w0, "register")
    host.phase = "running"  # the last registration formed the job
    rep.registered(_node(host, Role.SERVER, 0), "register")
    rep.registered(None, "running")   # a node registering again: not new
    w0.lost = True
    new = NodeInfo(Route(ident=b"w9"), Role.WORKER, "host9", 9999, 999, rank=0)
    host.nodes[b"w9"] = new
    rep.registered(new, "running")
    got = [(e["kind"], e["text"]) for e in events.recent()]
    assert got == [
        ("join", "worker registered from host0 (pid 100)"),
        ("join", "server registered from srvhost (pid 200)"),
        ("formed", "the job formed: all"),
        ("replacement", "worker registered from host9 (pid 999) during the job, after the "
                        "loss of 1 worker(s)")]
    # the lost worker's row stays, marked lost, beside its successor of the same rank
    rows = [(w["rank"], w["state"], w["host"]) for w in rep.state()["workers"]]
    assert rows[:2] == [(0, "up", "host9"), (0, "lost", "host0")]
