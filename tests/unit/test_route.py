"""The route plan table (byteps_like/worker/route.py): every route a push_pull can take,
decided by one pure function, with no job started.

Each case names the branch of the code before the planner that it replaces (torch/ops.py's
_start: NCCL, device chunks, device partitions, host; Rounds.push_pull's whole cast; Rounds.
start's native / native-cast / native-coded / pipeline submissions; torch/fusion.py's device
buckets and named CUDA tensors; torch/_tensor.py's grad_buffer)."""
from __future__ import annotations

import pytest

from byteps_like.compression import Compression
from byteps_like.worker import pipeline as pl
from byteps_like.worker import route as r

MB = 1 << 20
PART = 4_096_000

#: the jobs the table is drawn for
STANDALONE = r.JobFacts(distributed=False, partition_bytes=PART, fusion_bytes=4 * MB)
ALONE = r.JobFacts(distributed=True, single_machine=True, partition_bytes=PART,
                   fusion_bytes=4 * MB)
ONE_RANK = r.JobFacts(distributed=True, native=True, partition_bytes=PART, fusion_bytes=4 * MB,
                      min_compress_bytes=1024)
LOCAL_ROOT = ONE_RANK._replace(local_size=2)
LOCAL_OTHER = ONE_RANK._replace(local_size=2, local_root=False, native=False)
ONE_MACHINE_2GPU = ONE_RANK._replace(single_machine=True, local_size=2,
                                       native=False)
NO_FUSION = ONE_RANK._replace(fusion_bytes=0)

BIG = 4 * MB          # elements: 16 MiB of float32, several partitions
SMALL = 200         # elements: 800 bytes of float32, one partition, below min_compress_bytes

onebit = Compression.onebit()


def cpu(dtype="float32", count=BIG, **kw):
    return r.TensorFacts(dtype, count, **kw)


def cuda(dtype="float32", count=BIG, **kw):
    kw.setdefault("nccl", True)
    return r.TensorFacts(dtype, count, device="cuda", **kw)


# -- host tensors: Rounds.push_pull / Rounds.start ----------------------------------------------

def test_host_tensor_on_the_native_plane_is_one_native_operation():
    p = r.plan_route(cpu(), ONE_RANK)
    assert (p.staging, p.cast, p.codec, p.local_reduce) == (r.HOST, None, None, None)
    assert p.itinerary == (pl.PUSH, pl.PULL)
    assert p.submit(native=True) == r.NATIVE_WHOLE
    # no native client when the round starts (it closed): the pipeline's pl.PUSH stage
    assert p.submit(native=False) == r.PIPELINE


@pytest.mark.parametrize("job", [STANDALONE, ALONE])
def test_no_servers_the_sum_is_the_input(job):
    p = r.plan_route(cpu(), job, onebit)
    assert not p.servers and p.codec is None and p.itinerary == ()
    assert p.submit(native=True) == r.COPY


def test_fp16_float32_of_several_partitions_casts_on_the_native_client():
    p = r.plan_route(cpu(), ONE_RANK, Compression.fp16)
    assert p.cast == r.Cast(Compression.fp16, "float32", "float16", r.NATIVE)
    assert p.wire_dtype == "float16"
    assert p.itinerary == (pl.COMPRESS, pl.PUSH, pl.PULL, pl.DECOMPRESS)
    assert p.submit(native=True) == r.NATIVE_CAST


@pytest.mark.parametrize("facts,job,why", [
    (cpu(count=SMALL), ONE_RANK, "one partition: nothing to overlap"),
    (cpu("float64"), ONE_RANK, "float64: the native client casts float32 only"),
    (cpu("bfloat16"), ONE_RANK, "bfloat16 under fp16"),
    (cpu(), LOCAL_ROOT, "several local ranks sum the narrowed tensors"),
    (cpu(), STANDALONE, "standalone: converted and back, as if the caller cast"),
    (cpu(), ALONE, "alone"),
    (cpu(), ONE_RANK._replace(native=False), "no native client"),
])
def test_every_other_host_cast_converts_whole(facts, job, why):
    p = r.plan_route(facts, job, Compression.fp16)
    assert p.cast is not None and p.cast.where == r.WHOLE, why
    assert p.cast.wire_dtype == "float16"
    # the wire array then travels as any uncompressed host tensor does: never through a
    # pl.COMPRESS stage of the pipeline
    assert pl.COMPRESS not in p.itinerary
    if job is ONE_RANK:
        assert p.submit(native=True) == r.NATIVE_WHOLE


def test_bf16_and_a_cast_that_does_not_apply():
    assert r.plan_route(cpu("float64"), ONE_RANK, Compression.bf16).cast.wire_dtype == "bfloat16"
    # bf16 leaves bfloat16 alone, fp16 and bf16 leave integers alone
    for dtype, comp in [("bfloat16", Compression.bf16), ("int32", Compression.fp16),
                        ("int64", Compression.bf16)]:
        p = r.plan_route(cpu(dtype), ONE_RANK, comp)
        assert p.cast is None and p.wire_dtype == dtype
        assert p.submit(native=True) == r.NATIVE_WHOLE


def test_a_cast_refuses_device_staging_and_prereduced_buffers():
    with pytest.raises(ValueError, match="takes a host tensor"):
        r.plan_route(cpu(staged=True), ONE_RANK, Compression.fp16)
    with pytest.raises(ValueError, match="takes a host tensor"):
        r.plan_route(cpu(prereduced=True), LOCAL_ROOT, Compression.bf16)


def test_a_codec_runs_on_the_native_client_when_compiled_else_in_the_pipeline():
    p = r.plan_route(cpu(), ONE_RANK, onebit)
    assert p.codec is onebit and p.cast is None
    assert p.itinerary == (pl.COMPRESS, pl.PUSH, pl.PULL, pl.DECOMPRESS)
    assert p.submit(compiled=True, native=True) == r.NATIVE_CODED
    assert p.submit(compiled=False, native=True) == r.PIPELINE


@pytest.mark.parametrize("facts,why", [
    (cpu(count=SMALL), "below BYTEPS_MIN_COMPRESS_BYTES"),
    (cpu("int32"), "an integer tensor"),
])
def test_a_codec_that_does_not_apply_leaves_the_tensor_as_it_is(facts, why):
    p = r.plan_route(facts, ONE_RANK, onebit)
    assert p.codec is None, why
    assert p.submit(compiled=True, native=True) == r.NATIVE_WHOLE


def test_several_local_ranks_reduce_in_shared_memory():
    root = r.plan_route(cpu(), LOCAL_ROOT, onebit)
    assert root.local_reduce == r.SHM
    assert root.itinerary == (pl.REDUCE, pl.COMPRESS, pl.PUSH, pl.PULL, pl.DECOMPRESS, pl.BROADCAST)
    assert root.submit(compiled=True, native=True) == r.PIPELINE
    other = r.plan_route(cpu(), LOCAL_OTHER)
    assert other.itinerary == (pl.REDUCE, pl.BROADCAST) and other.local_reduce == r.SHM
    one_machine = r.plan_route(cpu(), ONE_MACHINE_2GPU)
    assert one_machine.itinerary == (pl.REDUCE, pl.BROADCAST)
    assert one_machine.submit(native=False) == r.PIPELINE


def test_a_prereduced_buffer_goes_through_the_pipeline():
    p = r.plan_route(cpu(prereduced=True), LOCAL_ROOT)
    assert p.itinerary == (pl.REDUCE, pl.PUSH, pl.PULL, pl.BROADCAST)
    assert p.submit(native=True) == r.PIPELINE


def test_a_staged_device_buffer_copies_each_partition_in_the_pipeline():
    p = r.plan_route(cpu(staged=True), ONE_RANK, onebit)
    assert p.staging == r.DEVICE_PARTITIONS
    assert p.itinerary == (pl.COPY_D2H, pl.COMPRESS, pl.PUSH, pl.PULL, pl.DECOMPRESS, pl.COPY_H2D)
    assert p.submit(compiled=True, native=True) == r.PIPELINE


# -- device tensors: torch/ops.py's _start -----------------------------------------------------

def test_cuda_with_several_local_ranks_reduces_with_nccl():
    p = r.plan_route(cuda(), LOCAL_ROOT)
    assert (p.staging, p.local_reduce, p.cast, p.gathered) == (r.NCCL, r.NCCL, None, False)
    # without NCCL in this process: a host copy, reduced in shared memory
    q = r.plan_route(cuda(nccl=False), LOCAL_ROOT)
    assert (q.staging, q.local_reduce) == (r.HOST, r.SHM)
    # a compressor: never NCCL for a single tensor; the cast on the host, whole
    f = r.plan_route(cuda(), LOCAL_ROOT, Compression.fp16)
    assert f.staging == r.HOST and f.cast.where == r.WHOLE
    assert r.plan_route(cuda(), LOCAL_ROOT, onebit).staging == r.HOST


def test_a_named_cuda_tensor_moves_in_device_chunks():
    p = r.plan_route(cuda(), ONE_RANK)
    assert (p.staging, p.chunk_bytes, p.cast) == (r.DEVICE_CHUNKS, 4 * MB, None)
    f = r.plan_route(cuda(), ONE_RANK, Compression.fp16)  # cast on the device, once
    assert f.staging == r.DEVICE_CHUNKS and f.wire_dtype == "float16"
    assert f.cast == r.Cast(Compression.fp16, "float32", "float16", r.ON_DEVICE)
    # fusion off: a cast still takes the device buffer (one chunk), nothing to cast does not
    g = r.plan_route(cuda(), NO_FUSION, Compression.bf16)
    assert (g.staging, g.chunk_bytes, g.cast.where) == (r.DEVICE_CHUNKS, 0, r.ON_DEVICE)
    assert r.plan_route(cuda(), NO_FUSION).staging == r.DEVICE_PARTITIONS


@pytest.mark.parametrize("facts", [cuda(name=None), cuda(contiguous=False)])
def test_unnamed_or_strided_cuda_tensors_do_not_keep_a_device_buffer(facts):
    assert r.plan_route(facts, ONE_RANK).staging == (
        r.DEVICE_PARTITIONS if facts.contiguous else r.HOST)
    p = r.plan_route(facts, ONE_RANK, Compression.fp16)  # a cast of them: on the host
    assert p.staging == r.HOST and p.cast.where == r.NATIVE


def test_a_codec_of_a_cuda_tensor_runs_on_the_staged_host_partitions():
    p = r.plan_route(cuda(), ONE_RANK, onebit)
    assert p.staging == r.DEVICE_PARTITIONS and p.codec is onebit
    assert p.itinerary == (pl.COPY_D2H, pl.COMPRESS, pl.PUSH, pl.PULL, pl.DECOMPRESS, pl.COPY_H2D)


def test_cuda_in_a_job_that_cannot_stage_partitions_goes_through_a_host_copy():
    for job in (STANDALONE, ALONE):
        for comp in (None, Compression.fp16):
            p = r.plan_route(cuda(), job, comp)
            assert p.staging == r.HOST and not p.servers
    # fp16 of a half tensor with fusion off: nothing to cast, a cast compressor given: host
    assert r.plan_route(cuda("float16"), NO_FUSION, Compression.fp16).staging == r.HOST


# -- buckets of gradients: torch/fusion.py's TorchFuser and grad_buffer -------------------------

def test_a_cuda_bucket_is_gathered_into_a_device_buffer():
    p = r.plan_route(cuda(), ONE_RANK, Compression.fp16, bucket=True)
    assert p.gathered and p.staging == r.DEVICE_CHUNKS and p.cast.where == r.ON_DEVICE
    n = r.plan_route(cuda(), LOCAL_ROOT, Compression.fp16, bucket=True)
    assert n.gathered and n.staging == r.NCCL and n.cast.where == r.ON_DEVICE
    a = r.plan_route(cuda(), ALONE, bucket=True)
    assert a.gathered and a.staging == r.IDENTITY and not a.servers
    # several local ranks without NCCL: the flat buffer through host memory, chunk by chunk
    s = r.plan_route(cuda(nccl=False), LOCAL_ROOT, bucket=True)
    assert s.gathered and s.staging == r.DEVICE_CHUNKS


def test_buckets_the_synchronizer_moves_itself():
    # CPU: host fusion or the gradient as it is
    assert not r.plan_route(cpu(), ONE_RANK, bucket=True).gathered
    # a codec: each gradient alone, staged partition by partition
    p = r.plan_route(cuda(), ONE_RANK, onebit, bucket=True)
    assert not p.gathered and p.staging == r.DEVICE_PARTITIONS
    # fusion off and nothing to cast: the pipeline's staging; named or not, no chunks
    q = r.plan_route(cuda(), NO_FUSION, bucket=True)
    assert not q.gathered and q.staging == r.DEVICE_PARTITIONS
    # a codec with several local ranks: a host copy (NCCL takes uncompressed tensors only)
    assert r.plan_route(cuda(), LOCAL_ROOT, onebit, bucket=True).staging == r.HOST


def test_the_plan_is_frozen_and_pure():
    p = r.plan_route(cpu(), ONE_RANK, Compression.fp16)
    with pytest.raises(AttributeError):
        p.staging = r.NCCL  # type: ignore[misc]
    assert p == r.plan_route(cpu(), ONE_RANK, Compression.fp16)


def test_spans_partitions_follows_the_partition_cut():
    assert not r.spans_partitions("float16", PART // 2, PART)
    assert r.spans_partitions("float16", PART // 2 + 1, PART)
    assert r.spans_partitions("float32", 2, 4)  # a partition is at least one element
    assert not r.spans_partitions("float32", 1, 4)


def test_a_codec_keeps_each_gradient_alone():
    assert r.fuses(None) and r.fuses(Compression.none) and r.fuses(Compression.fp16)
    assert not r.fuses(onebit) and not r.fuses(Compression.topk(0.01))
