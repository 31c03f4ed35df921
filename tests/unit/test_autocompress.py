"""The model of Compression.auto (byteps_like/autocompress.py): pure prediction and choice,
the size classes, the candidates, and codec speeds measured through the data path's codecs."""
from __future__ import annotations

import math

import numpy as np
import pytest

from byteps_like.autocompress import (
    NUM_CLASSES,
    AutoCompression,
    CodecSpeed,
    choose,
    class_bounds,
    measure_speeds,
    parse_allow,
    predict,
    size_class,
)
from byteps_like.compression import Compression, CompressionError, from_spec, resolve, split
from byteps_like.config import load

MiB = 1 << 20
# speeds (float32 bytes per second) that put the crossovers between 1 and 400 Gbit/s
FP16 = CodecSpeed("fp16", 0.5, 40e9, 40e9)
ONEBIT = CodecSpeed("onebit", 1 / 32, 10e9, 20e9, server_codec=True)
SPEEDS = [FP16, ONEBIT]


def gbit(x: float) -> float:
    """bytes/s pushed plus pulled of a full-duplex link of x Gbit/s each way"""
    return 2 * x * 1e9 / 8


def test_predict_is_wire_time_plus_coding_time():
    n = 256 * MiB
    assert predict(n, 1e9, CodecSpeed("none", 1.0)) == pytest.approx(2 * n / 1e9)
    t = predict(n, 1e9, ONEBIT, workers=2, servers=2)
    want = 2 * n / 32 / 1e9 + n / 10e9 + n / 20e9 + (2 * n / 20e9 + n / 10e9) / 2
    assert t == pytest.approx(want)
    # a cast has no server term
    assert predict(n, 1e9, FP16, workers=8, servers=1) == pytest.approx(n / 1e9 + 2 * n / 40e9)
    with pytest.raises(ValueError):
        predict(n, 0, FP16)


def test_partitions_pipeline_through_the_stages():
    n, part = 256 * MiB, 4 * MiB        # 64 partitions
    stages = [2 * n / 32 / 1e9, n / 10e9, n / 20e9, (2 * n / 20e9 + n / 10e9) / 2]
    want = sum(stages) / 64 + 63 / 64 * max(stages)
    assert predict(n, 1e9, ONEBIT, workers=2, servers=2, partition_bytes=part) == \
        pytest.approx(want)
    # one partition: the stages one after the other; none is the wire alone either way
    assert predict(n, 1e9, ONEBIT, workers=2, servers=2, partition_bytes=n) == \
        pytest.approx(sum(stages))
    none = CodecSpeed("none", 1.0)
    assert predict(n, 1e9, none, partition_bytes=part) == pytest.approx(2 * n / 1e9)


@pytest.mark.parametrize("rate,want", [(1, "onebit"), (10, "onebit"), (25, "onebit"),
                                       (100, "fp16"), (1000, "none")])
def test_pipelined_choice_with_device_like_speeds(rate, want):
    # the device cluster (2 workers, 2 servers, 256 MiB): onebit best at 1, 10 and 25
    # Gbit/s (0.19 and 0.50 of none at 10 and 25), fp16 next (0.52, 0.61)
    fp16 = CodecSpeed("fp16", 0.5, 20e9, 20e9)
    onebit = CodecSpeed("onebit", 1 / 32, 10e9, 10e9, server_codec=True)
    ch = choose(256 * MiB, gbit(rate), [fp16, onebit], workers=2, servers=2,
                partition_bytes=4096000)
    assert ch.name == want, ch.why()


@pytest.mark.parametrize("rate,want", [(1, "onebit"), (10, "onebit"), (25, "fp16"),
                                       (400, "none")])
def test_choice_follows_the_bandwidth(rate, want):
    ch = choose(256 * MiB, gbit(rate), SPEEDS, workers=2, servers=2)
    assert ch.name == want, ch.why()
    assert set(ch.predicted) == {"none", "fp16", "onebit"}
    assert ch.predicted[ch.name] == min(ch.predicted.values())


@pytest.mark.parametrize("rate", [0.01, 0.1, 1, 3, 10, 25, 50, 100, 400, 1e4])
@pytest.mark.parametrize("nbytes", [256 << 10, 4 * MiB, 256 * MiB])
def test_never_predicted_slower_than_none(rate, nbytes):
    ch = choose(nbytes, gbit(rate), SPEEDS, workers=4, servers=2, current="onebit", margin=0.1)
    assert ch.predicted[ch.name] <= ch.predicted["none"] * 1.1
    fresh = choose(nbytes, gbit(rate), SPEEDS, workers=4, servers=2)
    assert fresh.predicted[fresh.name] <= fresh.predicted["none"]


def test_hysteresis_keeps_the_current_choice_within_the_margin():
    # find the crossover of fp16 and onebit, then look just beside it
    n = 64 * MiB
    rates = np.geomspace(1, 400, 2000)
    names = [choose(n, gbit(r), SPEEDS, workers=2, servers=2).name for r in rates]
    i = next(i for i in range(1, len(names)) if names[i] != names[i - 1])
    a, b = names[i - 1], names[i]
    near = gbit(rates[i] * 1.01)   # b is best here, by little
    assert choose(n, near, SPEEDS, workers=2, servers=2).name == b
    kept = choose(n, near, SPEEDS, workers=2, servers=2, current=a, margin=0.1)
    assert kept.name == a and kept.kept
    gone = choose(n, near, SPEEDS, workers=2, servers=2, current=a, margin=0.0)
    assert gone.name == b and not gone.kept
    # far away the margin does not hold a choice
    assert choose(n, gbit(1000), SPEEDS, workers=2, servers=2, current="onebit").name == "none"
    with pytest.raises(ValueError):
        choose(n, near, SPEEDS, margin=-1)


def test_only_none_without_candidates_and_ties_go_to_none():
    assert choose(MiB, 1.0, []).name == "none"
    same = CodecSpeed("fp16", 1.0)   # as large and free: a tie
    assert choose(MiB, 1e9, [same]).name == "none"


def test_size_classes_cover_every_size_once():
    assert size_class(0) == 0 and size_class(256 << 10) == 1
    assert size_class((1 << 20) - 1) == 1 and size_class(1 << 20) == 2
    assert size_class(1 << 50) == NUM_CLASSES - 1
    for c in range(1, NUM_CLASSES - 1):
        low, high = class_bounds(c)
        assert size_class(low) == c and size_class(high - 1) == c and size_class(high) == c + 1
    assert class_bounds(NUM_CLASSES - 1)[1] == 0


def test_codec_speed_refuses_nonsense():
    with pytest.raises(ValueError, match="ratio"):
        CodecSpeed("x", 0)
    with pytest.raises(ValueError, match="encode_bps"):
        CodecSpeed("x", 1, float("nan"))


def test_measured_speeds_come_from_the_codecs():
    auto = Compression.auto(allow=("fp16", "bf16", "onebit", "topk"))
    speeds = measure_speeds(auto.candidates, 256 << 10, repeats=1)
    by = {s.name: s for s in speeds}
    assert list(by) == ["none", "fp16", "bf16", "onebit", "topk"]
    assert by["none"].ratio == 1 and math.isinf(by["none"].encode_bps)
    assert by["fp16"].ratio == 0.5 and by["bf16"].ratio == 0.5
    assert not by["fp16"].server_codec and by["onebit"].server_codec
    assert by["onebit"].ratio == pytest.approx(1 / 32, rel=0.01)   # + a 20-byte header
    assert by["topk"].ratio < 0.03
    assert all(0 < s.encode_bps < math.inf for s in speeds[1:])


def test_codec_speeds_are_the_pools_each_part_coded_by_its_own_codec():
    # threads=3: the sample is cut into 3 parts coded at once, each by its own codec (a
    # onebit codec's payload carries one header per part); the ratios are the one thread's
    auto = Compression.auto(allow=("fp16", "onebit"))
    one = {s.name: s for s in measure_speeds(auto.candidates, 3 << 20, repeats=1)}
    three = {s.name: s for s in measure_speeds(auto.candidates, 3 << 20, repeats=1, threads=3)}
    assert three["fp16"].ratio == one["fp16"].ratio == 0.5
    header = one["onebit"].ratio * (3 << 20) - (3 << 20) / 32      # one part's header bytes
    assert header > 0
    assert three["onebit"].ratio * (3 << 20) == pytest.approx((3 << 20) / 32 + 3 * header)
    assert all(0 < s.encode_bps < math.inf and 0 < s.decode_bps < math.inf
               for s in list(three.values())[1:])


def test_the_speed_measurement_stops_when_told():
    from byteps_like.autocompress import SpeedsStopped
    calls = []

    def stop() -> bool:
        calls.append(1)
        return len(calls) > 2   # the third timed call is refused
    with pytest.raises(SpeedsStopped):
        measure_speeds(Compression.auto(allow=("fp16", "onebit")).candidates, 1 << 20,
                       repeats=2, stop=stop)
    assert len(calls) == 3


def test_codec_speeds_are_measured_out_of_cache(tmp_path):
    from byteps_like.autocompress import last_level_cache_bytes, speed_sample_bytes
    for idx, (level, size) in enumerate([(1, "48K"), (2, "1024K"), (3, "32768K"), (2, "2M")]):
        d = tmp_path / f"index{idx}"
        d.mkdir()
        (d / "level").write_text(f"{level}\n")
        (d / "size").write_text(f"{size}\n")
    (tmp_path / "uevent").write_text("")
    assert last_level_cache_bytes(str(tmp_path)) == 32 * MiB      # the highest level's
    assert last_level_cache_bytes(str(tmp_path / "none")) == 0     # unreadable: unknown
    (tmp_path / "index3" / "size").write_text("junk\n")
    assert last_level_cache_bytes(str(tmp_path)) == 0
    assert speed_sample_bytes(MiB, 32 * MiB) == 64 * MiB            # twice the cache
    assert speed_sample_bytes(MiB, 105 * MiB) == 210 * MiB
    assert speed_sample_bytes(MiB, 0) == 64 * MiB                   # at least 64 MiB
    assert speed_sample_bytes(MiB, 1 << 30) == 256 * MiB            # at most 256 MiB
    assert speed_sample_bytes(512 * MiB, 0) == 512 * MiB            # never below a partition


def test_auto_compressor_settings_and_spec():
    a = Compression.auto(allow="onebit, fp16 ,none")
    assert isinstance(a, AutoCompression) and a.kind == "auto"
    assert a.allow == ("onebit", "fp16") and list(a.candidates) == ["none", "onebit", "fp16"]
    assert from_spec(a.spec()) == a
    assert split(a) == (a, None)   # the runtime resolves it, never a plugin's cast path
    assert a.wire_dtype("float32") == "float32"
    with pytest.raises(CompressionError, match="'zstd' is not a candidate"):
        Compression.auto(allow=("zstd",))
    with pytest.raises(CompressionError, match="rounds"):
        Compression.auto(rounds=0)
    assert parse_allow(["fp16", "fp16", ""]) == ("fp16",)


def test_byteps_compressor_auto_from_the_environment():
    cfg = load(env={"BYTEPS_COMPRESSOR": "auto", "BYTEPS_COMPRESSOR_AUTO_CODECS": "bf16,onebit",
                    "BYTEPS_COMPRESSOR_AUTO_MARGIN": "0.2", "BYTEPS_COMPRESSOR_AUTO_ROUNDS": "3"})
    a = resolve(None, cfg)
    assert isinstance(a, AutoCompression)
    assert a.allow == ("bf16", "onebit") and a.margin == 0.2 and a.rounds == 3


def test_a_wrong_auto_candidate_in_the_environment_fails_at_load():
    from byteps_like.errors import ConfigError
    with pytest.raises(ConfigError, match="BYTEPS_COMPRESSOR_AUTO_CODECS.*zstd"):
        load(env={"BYTEPS_COMPRESSOR": "auto", "BYTEPS_COMPRESSOR_AUTO_CODECS": "fp16,zstd"})


# ---- the worker's controller (rank 0's decisions), over a stand-in runtime ----------------------

class _Rt:
    """What AutoController reads of a runtime; ``initialized`` False keeps its measuring
    thread from running (the test feeds the bandwidths)."""
    rank_ = 0
    initialized = False
    telemetry = None
    epoch = 0

    class config:  # noqa: N801
        class partition:  # noqa: N801
            partition_bytes = 1 << 20

    class members:  # noqa: N801
        size, local_size, num_servers = 2, 1, 2

    def __init__(self):
        self.pushed: list[str] = []

    def push_pull_async(self, arr, name, average, out):
        self.pushed.append(name)
        return None


def _controller():
    from byteps_like.worker.autocompress import AutoController
    rt = _Rt()
    ctl = AutoController(rt, Compression.auto(allow=("fp16", "onebit")))
    ctl.speeds = [CodecSpeed("none", 1.0), FP16, ONEBIT]
    return rt, ctl


def test_rank0_decides_at_the_first_window_then_only_when_the_bandwidth_moves():
    rt, ctl = _controller()
    ctl.seen.add(size_class(64 * MiB))
    ctl.observe(gbit(400))                       # the first window: a decision (none)
    assert len(ctl.decisions) == 1 and not ctl.decisions[0]["changed"]
    ctl.observe(gbit(440))                       # within 25%: nothing
    assert len(ctl.decisions) == 1
    ctl.observe(gbit(1))                         # the link fell: onebit from the next epoch
    last = ctl.decisions[-1]
    assert last["changed"] and last["table"] == {"64 MiB-256 MiB": "onebit"}
    assert last["applies_from_epoch"] == 1
    # until that epoch is in force its windows are the old table's: not looked at
    ctl.observe(gbit(400))
    assert len(ctl.decisions) == 2
    ctl._epoch = 1                               # the table is in force now
    ctl.observe(gbit(0.5))                       # the first window under it: the reference
    assert len(ctl.decisions) == 2 and ctl._ref == gbit(0.5)
    ctl.observe(gbit(0.55))
    assert len(ctl.decisions) == 2
    ctl.observe(gbit(400))                       # the link came back
    assert ctl.decisions[-1]["changed"]
    assert ctl.decisions[-1]["table"] == {"64 MiB-256 MiB": "none"}


def test_the_tables_travel_in_epoch_order_from_the_first_push_pull():
    rt, ctl = _controller()
    name, comp = ctl.resolve("g", 4 * MiB)       # epoch 0: none, and epoch 1's table is sent
    assert (name, comp) == ("g", Compression.none)
    assert rt.pushed == ["bpsl.auto"] and ctl._issued == 1
