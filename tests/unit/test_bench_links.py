"""Uneven clusters in the benchmarks (byteps_like/bench/links.py): --straggler and --rate
schedules parsed, placed, and applied; no namespaces here (tests/integration/test_uneven.py
runs them)."""
from __future__ import annotations

import argparse
import time

import pytest

from byteps_like.bench import links
from byteps_like.bench.cluster import parse_rate, parse_rates


def test_a_schedule_parses_into_segments_and_switches():
    s = parse_rates("25gbit:20s,1gbit:20s,25gbit:500ms")
    assert isinstance(s, links.RateSchedule)
    assert s.segments == ((25e9, 20.0), (1e9, 20.0), (25e9, 0.5))
    assert s.first == 25e9 and s.duration == 40.5
    assert s.switches() == [(20.0, 1e9), (40.0, 25e9)]
    assert [s.rate_at(t) for t in (0, 19.9, 20, 39.9, 40.2, 99)] == \
        [25e9, 25e9, 1e9, 1e9, 25e9, 25e9]
    assert parse_rates("10gbit,25gbit") == [10e9, 25e9]   # a list stays a list


@pytest.mark.parametrize("text,msg", [
    ("25gbit:20s", "at least two segments"),
    ("25gbit:20s,1gbit", "RATE:DURATION"),
    ("25gbit:20x,1gbit:2s", "bad duration"),
    ("25gbit:0s,1gbit:2s", "must be > 0"),
    ("25zbit:2s,1gbit:2s", "bad rate"),
])
def test_a_bad_schedule_says_what_is_wrong(text, msg):
    with pytest.raises(argparse.ArgumentTypeError, match=msg):
        links.parse_rate_schedule(text, parse_rate)


def test_rate_or_schedule_type():
    t = links.rate_or_schedule(parse_rate)
    assert t("1gbit") == 1e9
    assert isinstance(t("1gbit:1s,2gbit:1s"), links.RateSchedule)


def test_straggler_parsing_and_fit():
    st = links.parse_straggler("1:3")
    assert st == links.Straggler(1, 3.0) and st.arg() == "1:3"
    assert links.parse_straggler(" 0 : 1.5 ").factor == 1.5
    for bad in ("1", "a:2", "1:0.5", "-1:2", "1:2:3"):
        with pytest.raises(argparse.ArgumentTypeError):
            links.parse_straggler(bad)
    assert links.check_straggler(st, 2) is None
    assert "only 1 workers" in links.check_straggler(st, 1)
    assert links.host_rates(st, 1e9, "w1") == {"w1": 1e9 / 3}
    assert links.host_rates(None, 1e9, "w1") == {}
    assert links.host_rates(links.Straggler(1, 1.0), 1e9, "w1") == {}


def test_slow_compute_sleeps_factor_minus_one_times_the_compute():
    slow = links.SlowCompute(links.Straggler(0, 3.0), rank=0)
    other = links.SlowCompute(links.Straggler(0, 3.0), rank=1)
    assert slow.factor == 3.0 and other.factor == 1.0
    firsts = {}
    for sc in (slow, other):
        for step in range(2):
            sc.start()
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < 0.02:   # 20 ms of "compute"
                pass
            sc.delay()
            sc.stop()
            if step == 0:
                firsts[id(sc)] = sc.last
    # the straggler slept 2 x its last compute once it knew it (the first step has nothing to
    # go by); its measured compute leaves the sleep out
    assert firsts[id(slow)] >= 0.02 and slow.last >= 0.02
    assert slow.slept == pytest.approx(2 * firsts[id(slow)])
    assert slow._slept_now == slow.slept   # what stop() leaves out of the compute
    assert other.slept == 0.0


class _FakeCluster:
    hosts = ("w0", "w1", "s0")

    def __init__(self):
        self.calls: list[tuple[str, float]] = []

    def set_rate(self, host, rate):
        self.calls.append((host, rate))


def test_the_switcher_changes_every_cap_on_time_and_scales_the_straggler():
    cl = _FakeCluster()
    sched = links.parse_rate_schedule("100mbit:200ms,10mbit:200ms,100mbit:200ms", parse_rate)
    sw = links.start_schedule(cl, sched, links.Straggler(1, 2.0))
    assert sw is not None
    deadline = time.monotonic() + 10
    while len(sw.done) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    done = sw.stop()
    assert [r for _t, r in done] == [10e6, 100e6]
    for (t, _r), at in zip(done, (0.2, 0.4)):
        assert t - sw.t0 >= at - 0.01
    assert cl.calls[:3] == [("w0", 100e6), ("w1", 50e6), ("s0", 100e6)]   # the start
    assert cl.calls[3:6] == [("w0", 10e6), ("w1", 5e6), ("s0", 10e6)]
    assert links.start_schedule(cl, None, None) is None


def test_decisions_and_rounds_are_placed_relative_to_the_switches():
    switches = [(100.0, 1e9), (120.0, 25e9)]
    decisions = [{"time": 95.0, "changed": True}, {"time": 101.5, "changed": True},
                 {"time": 103.0, "changed": False}, {"time": 140.0, "changed": False}]
    got = links.after_switches(switches, decisions)
    assert got[0][0] == pytest.approx(1.5) and got[0][1] is decisions[1]
    assert got[1][0] == pytest.approx(20.0)
    assert links.after_switches(switches, decisions[:2])[1] == (None, None)
    sched = links.RateSchedule(((25e9, 10.0), (1e9, 10.0)))
    rounds = [(100.5, 0.1), (101.0, 0.3), (112.0, 2.0), (115.0, 4.0), (125.0, 9.0)]
    assert links.segment_medians(sched, 100.0, rounds) == [0.2, 3.0]
    assert links.segment_medians(sched, 200.0, rounds) == [None, None]


def test_bench_train_passes_a_compute_straggler_to_its_workers_only_without_a_rate():
    from byteps_like.bench import train
    p = train.build_parser()
    a = p.parse_args(["--models", "mlp", "--modes", "byteps_like", "--workers", "2",
                      "--device", "cpu", "--straggler", "1:3"])
    s = train.plan_run(p, a).setup
    assert s.straggler == links.Straggler(1, 3.0) and s.schedule is None
    args = s.worker_args("mlp")
    assert args[args.index("--straggler") + 1] == "1:3"
    s.rate_bits = 1e9          # with --rate the straggler is its NIC: no compute slowdown
    assert "--straggler" not in s.worker_args("mlp")
    with pytest.raises(SystemExit):   # worker 2 of 2 workers
        train.plan_run(p, p.parse_args(["--models", "mlp", "--modes", "byteps_like",
                                        "--workers", "2", "--device", "cpu",
                                        "--straggler", "2:3"]))


def test_bench_sparse_takes_a_straggler_and_a_schedule():
    from byteps_like.bench import sparse
    p = sparse.build_parser()
    s, _modes = sparse.plan(p, p.parse_args(["--straggler", "0:2", "--modes", "sparse"]))
    argv = s.worker_argv("sparse")
    assert argv[argv.index("--straggler") + 1] == "0:2"
    a = p.parse_args(["--rate", "1gbit:5s,100mbit:5s"])
    assert isinstance(a.rate, links.RateSchedule) and a.rate.first == 1e9


def test_bench_sparse_gives_each_worker_its_share_of_the_cores(monkeypatch):
    """Every worker (byteps_like and DDP alike) gets the usable CPUs / workers torch threads by
    default, as bench train gives them (the bench once pinned 1, whatever the machine), and
    --threads sets them."""
    from byteps_like.bench import sparse
    p = sparse.build_parser()
    monkeypatch.setattr(sparse.os, "sched_getaffinity", lambda _pid: set(range(16)))

    def threads(*args: str) -> set[str]:
        s, _modes = sparse.plan(p, p.parse_args(["--modes", "sparse,ddp", *args]))
        return {argv[argv.index("--threads") + 1]
                for argv in (s.worker_argv("sparse"), s.worker_argv("ddp"))}

    assert threads("--workers", "4") == {"4"}
    assert threads("--workers", "3") == {"5"}
    assert threads("--workers", "32") == {"1"}
    assert threads("--workers", "4", "--threads", "2") == {"2"}
    with pytest.raises(SystemExit):
        threads("--threads", "-1")
