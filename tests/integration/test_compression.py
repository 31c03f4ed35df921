"""Compressed push_pull on real local clusters: servers decode every push, sum, and encode the
sum for the pull; the result must equal a replay of the job through the compression library."""
from __future__ import annotations

import os

import pytest

from .harness import WORKERS_DIR, bpslaunch, worker

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("servers,partition,threads", [
    (1, "4M", "1"), (2, "64K", "1"), (2, "16K", "4")])
def test_compressed_push_pull_matches_replay(servers, partition, threads):
    # 50000 float32 = 195 KiB: one partition at 4M, four at 64K spread over two servers. The
    # compiled plane's C++ server codecs must equal the replay through compression.py bit for
    # bit. The last: 13 partitions encoded and decoded by 4 threads per codec stage, in any
    # order.
    run = bpslaunch(worker("compress_check.py", 50000), workers=2, servers=servers,
                    env={"BYTEPS_PARTITION_BYTES": partition, "STEPS": "3",
                         "BYTEPS_CODEC_THREADS": threads})
    assert run.rc == 0, run.log
    ok = run.lines("OK rank")
    assert len(ok) == 2 and all("x 3 steps exact" in ln for ln in ok), run.log
    assert all(f"(plane native, {threads} compress threads" in ln for ln in ok), run.log
    # 6 of the 7 compressors (all but the one with momentum) are coded operations: 3 steps of
    # each, encoded and decoded by the native client
    assert all("18 coded" in ln for ln in ok), run.log


def test_a_registered_compressor_sums_over_the_native_plane_exactly():
    # a compressor the test registers in every process (workers/registered/sitecustomize.py,
    # as docs/compression.md tells users): its server codec is Python, called by the compiled
    # server; payloads of varying size; 2 workers, 2 servers, 4 partitions; equal to the replay
    plugin = str(WORKERS_DIR / "registered")
    path = os.pathsep.join(p for p in (plugin, os.environ.get("PYTHONPATH", "")) if p)
    run = bpslaunch(worker("compress_check.py", 50000), workers=2, servers=2,
                    env={"BYTEPS_PARTITION_BYTES": "64K", "STEPS": "3", "PYTHONPATH": path,
                         "COMPRESSORS": "registered,registered_ef"})
    assert run.rc == 0, run.log
    ok = run.lines("OK rank")
    assert len(ok) == 2 and all("2 compressors x 3 steps exact (plane native" in ln
                                for ln in ok), run.log
    native = run.lines("NATIVE rank")   # every partition pushed over the native plane
    assert len(native) == 2 and all(ln.endswith("24 pushes of 24") for ln in native), run.log


def test_a_compressor_a_server_has_not_registered_fails_saying_what_to_do():
    # the workers know the compressor, the servers do not (sitecustomize only in workers')
    plugin = str(WORKERS_DIR / "registered")
    run = bpslaunch([*worker("compress_check.py", 20000)], workers=2, servers=1,
                    env={"STEPS": "1", "COMPRESSORS": "registered", "PYTHONPATH": plugin,
                         "BPS_TEST_SERVER_PLAIN": "1"})
    assert run.rc != 0, run.log
    text = run.out + run.err
    assert "compressor 'test-large' is not registered in this server process" in text, run.log
    assert "register('test-large', factory) in every server process" in text, run.log


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


@pytest.mark.parametrize("threads,local_size", [("1", 1), ("3", 1), ("1", 2)])
def test_cast_compressors_match_a_whole_tensor_replay(threads, local_size):
    # fp16 / bf16 convert each float32 partition on the native client's codec threads (one
    # local rank; with several, or another float dtype, the tensor is converted whole before
    # the push, worker/route.py): the bits must be those of converting the whole tensor and
    # summing it in the narrow dtype.
    # 40000 elements: 5 partitions of 16K wire bytes, converted by 1 or 3 threads in any order
    run = bpslaunch(worker("cast_check.py", 40000), workers=2, servers=2,
                    local_size=local_size,
                    env={"BYTEPS_PARTITION_BYTES": "16K", "BYTEPS_CODEC_THREADS": threads})
    assert run.rc == 0, run.log
    ok = run.lines("OK cast rank")
    assert len(ok) == 2 * local_size, run.log
    assert all(f"of {2 * local_size}: 6 cases x 2 steps exact, 5 partitions" in ln
               for ln in ok), run.log
    # the three float32 cases, two steps each, are coded operations of the native client
    coded = "6 coded" if local_size == 1 else "0 coded"
    assert all(ln.endswith(coded) for ln in ok), run.log
