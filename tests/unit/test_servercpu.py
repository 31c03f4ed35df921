"""The servers' CPU per GB column of bench pushpull and bench cluster (bench/servercpu.py): the
/proc reading, the interpolation between samples, the repetition windows across workers and the
division by the bytes the servers received."""
from __future__ import annotations

import os
import sys
import time

import pytest

from byteps_like.bench.servercpu import (
    CpuSampler,
    core_seconds_per_gb,
    proc_cpu_seconds,
    repetition_windows,
)

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


@linux
def test_proc_cpu_seconds_follows_this_process():
    before = proc_cpu_seconds(os.getpid())
    end = time.process_time() + 0.05
    while time.process_time() < end:   # burn 50 ms of CPU
        pass
    after = proc_cpu_seconds(os.getpid())
    assert before is not None and after is not None and after - before >= 0.02
    assert proc_cpu_seconds(2 ** 22 + 12345) is None   # no such process


def _sampler(times: list[float], cpu: list[float]) -> CpuSampler:
    s = CpuSampler([1])
    s.times, s.cpu = times, cpu
    return s


def test_cpu_between_interpolates_between_samples_and_clamps_outside():
    s = _sampler([10.0, 11.0, 12.0], [0.0, 0.5, 1.5])
    assert s.at(10.5) == pytest.approx(0.25) and s.at(11.5) == pytest.approx(1.0)
    assert s.at(9.0) == 0.0 and s.at(13.0) == 1.5
    assert s.between([(10.0, 11.0), (11.0, 12.0)]) == pytest.approx(1.5)


def test_windows_span_every_workers_repetition():
    per_worker = [{"windows": {"8": [[1.0, 2.0], [5.0, 6.0]]}},
                  {"windows": {"8": [[1.1, 2.5], [4.9, 5.5]]}}]
    assert repetition_windows(per_worker, 8) == [(1.0, 2.5), (4.9, 6.0)]
    assert repetition_windows([{"times": {}}], 8) == []   # a worker without windows: none


def test_core_seconds_per_gb_divides_by_what_the_servers_received():
    # 2 repetitions of 1 s each at 0.5 cores: 1 core-second for 2 x 250 MB received
    s = _sampler([0.0, 10.0], [0.0, 5.0])
    per_worker = [{"windows": {"4": [[1.0, 2.0], [3.0, 4.0]]}}]
    assert core_seconds_per_gb(s, per_worker, 4, 250_000_000) == pytest.approx(2.0)
    assert core_seconds_per_gb(None, per_worker, 4, 1) is None
    unreadable = _sampler([0.0, 10.0], [0.0, 5.0])
    unreadable.readable = False
    assert core_seconds_per_gb(unreadable, per_worker, 4, 1) is None


@linux
def test_the_sampler_runs_until_left():
    with CpuSampler([os.getpid()], interval=0.001) as s:
        end = time.process_time() + 0.03
        while time.process_time() < end:
            pass
    assert s.readable and len(s.times) >= 2 and s.cpu[-1] >= s.cpu[0]
    assert s.times == sorted(s.times)
