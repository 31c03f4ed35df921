"""Compressed push_pull on real local clusters: servers decode every push, sum, and encode the
sum for the pull; the result must equal a replay of the job through the compression library."""
from __future__ import annotations

import pytest

from .harness import bpslaunch, worker

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("servers,partition,plane,threads", [
    (1, "4M", "native", "1"), (2, "64K", "native", "1"), (2, "64K", "zmq", "1"),
    (2, "16K", "native", "4")])
def test_compressed_push_pull_matches_replay(servers, partition, plane, threads):
    # 50000 float32 = 195 KiB: one partition at 4M, four at 64K spread over two servers. The
    # compiled plane (C++ server codecs) and the ZeroMQ path (the Python engine's codecs) must
    # both equal the replay through compression.py, so they equal each other bit for bit. The
    # last: 13 partitions encoded and decoded by 4 threads per codec stage, in any order.
    run = bpslaunch(worker("compress_check.py", 50000), workers=2, servers=servers,
                    env={"BYTEPS_PARTITION_BYTES": partition, "STEPS": "3",
                         "BYTEPS_DATA_PLANE": plane, "BYTEPS_CODEC_THREADS": threads})
    assert run.rc == 0, run.log
    ok = run.lines("OK rank")
    assert len(ok) == 2 and all("x 3 steps exact" in ln for ln in ok), run.log
    assert all(f"(plane {plane}, {threads} compress threads)" in ln for ln in ok), run.log


def test_compressed_push_pull_after_local_reduction():
    # 2 machines x 2 local ranks: each machine's reduced sum is compressed by its local root;
    # every local rank gets the same decompressed average
    run = bpslaunch(worker("compress_check.py", 30000), workers=2, servers=1, local_size=2,
                    env={"BYTEPS_PARTITION_BYTES": "64K", "STEPS": "2",
                         "COMPRESSORS": "onebit_ef,topk,randomk"})
    assert run.rc == 0, run.log
    ok = run.lines("OK rank")
    assert len(ok) == 4 and all("of 4: 3 compressors x 2 steps exact" in ln for ln in ok), run.log


def test_small_tensors_travel_uncompressed():
    # below BYTEPS_MIN_COMPRESS_BYTES the result is the exact average, not a compressed one
    run = bpslaunch(worker("compress_small.py"), workers=2, servers=1,
                    env={"BYTEPS_MIN_COMPRESS_BYTES": "64K"})
    assert run.rc == 0, run.log
    assert len(run.lines("OK small")) == 2, run.log


def test_workers_disagreeing_on_the_compressor_fail_clearly():
    run = bpslaunch(worker("compress_small.py", "mismatch"), workers=2, servers=1)
    assert run.rc != 0, run.log
    assert "compress" in run.err + run.out and "mismatch" in (run.err + run.out).lower(), run.log


def test_compression_in_async_mode_is_refused_with_the_reason():
    run = bpslaunch(worker("compress_small.py", "async"), workers=2, servers=1,
                    env={"BYTEPS_ENABLE_ASYNC": "1"})
    assert run.rc != 0, run.log
    assert len(run.lines("RemoteError")) == 2, run.log
    assert "compression needs synchronous mode" in run.out, run.log
