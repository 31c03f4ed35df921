"""Unit tests of byteps_like.partition: partition bounds, keys, and the server load balance,
including the ResNet-50 imbalance report."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from byteps_like.partition import (
    MAX_PARTS,
    PART_BITS,
    ServerAssigner,
    make_key,
    partition_bounds,
    split_key,
)

DEFAULT_PARTITION_BYTES = 4096000  # BYTEPS_PARTITION_BYTES default


def assert_exact_cover(bounds, nbytes, itemsize, partition_bytes):
    step = max(itemsize, partition_bytes - partition_bytes % itemsize)
    pos = 0
    for i, (off, n) in enumerate(bounds):
        assert off == pos, f"partition {i} starts at {off}, expected {pos}"
        assert n > 0 and n % itemsize == 0 and off % itemsize == 0
        assert n <= step
        if i < len(bounds) - 1:
            assert n == step, "only the last partition may be short"
        pos += n
    assert pos == nbytes
    assert len(bounds) == -(-nbytes // step)


# ------------------------------------------------------------------------------ partition_bounds
@settings(max_examples=300, deadline=None)
@given(itemsize=st.sampled_from([1, 2, 4, 8]), count=st.integers(0, 100_000),
       partition_bytes=st.integers(1, 50_000) | st.integers(-8, 0))
def test_bounds_cover_the_tensor_exactly_with_whole_elements(itemsize, count, partition_bytes):
    nbytes = count * itemsize
    step = max(itemsize, partition_bytes - partition_bytes % itemsize)
    if -(-nbytes // step) > MAX_PARTS:
        with pytest.raises(ValueError, match="BYTEPS_PARTITION_BYTES"):
            partition_bounds(nbytes, itemsize, partition_bytes)
        return
    bounds = partition_bounds(nbytes, itemsize, partition_bytes)
    assert_exact_cover(bounds, nbytes, itemsize, partition_bytes)
    if partition_bytes >= itemsize:
        assert all(n <= partition_bytes for _off, n in bounds)


def test_zero_bytes_has_no_partitions():
    assert partition_bounds(0, 4, DEFAULT_PARTITION_BYTES) == []


def test_one_element():
    assert partition_bounds(8, 8, DEFAULT_PARTITION_BYTES) == [(0, 8)]


def test_exactly_one_partition():
    assert partition_bounds(4096000, 4, 4096000) == [(0, 4096000)]
    assert partition_bounds(4096004, 4, 4096000) == [(0, 4096000), (4096000, 4)]


def test_partition_size_rounds_down_to_whole_elements():
    # 10 bytes of 4-byte elements: 8-byte partitions
    assert partition_bounds(40, 4, 10) == [(0, 8), (8, 8), (16, 8), (24, 8), (32, 8)]
    assert partition_bounds(24, 8, 20) == [(0, 16), (16, 8)]


def test_partition_smaller_than_an_element_holds_one_element():
    assert partition_bounds(24, 8, 3) == [(0, 8), (8, 8), (16, 8)]


def test_exactly_max_parts_is_allowed():
    bounds = partition_bounds(MAX_PARTS * 4, 4, 4)
    assert len(bounds) == MAX_PARTS


def test_too_many_partitions_names_the_setting():
    with pytest.raises(ValueError) as info:
        partition_bounds((MAX_PARTS + 1) * 4, 4, 4)
    text = str(info.value)
    assert "BYTEPS_PARTITION_BYTES" in text and str(MAX_PARTS) in text


@pytest.mark.parametrize("nbytes, itemsize", [(-4, 4), (10, 4), (8, 0), (8, -2)])
def test_bad_arguments(nbytes, itemsize):
    with pytest.raises(ValueError, match="cannot partition"):
        partition_bounds(nbytes, itemsize, 1024)


# ------------------------------------------------------------------------------ keys
@settings(max_examples=300, deadline=None)
@given(decl=st.integers(0, 2 ** 40), part=st.integers(0, MAX_PARTS - 1))
def test_key_round_trip(decl, part):
    key = make_key(decl, part)
    assert split_key(key) == (decl, part)
    assert key >> PART_BITS == decl


def test_keys_are_unique_and_ordered_by_declaration():
    keys = [make_key(d, p) for d in range(50) for p in range(20)]
    assert len(set(keys)) == len(keys)
    assert keys == sorted(keys)


# ------------------------------------------------------------------------------ ServerAssigner
def test_assigner_needs_a_server():
    with pytest.raises(ValueError):
        ServerAssigner(0)


def test_assigner_is_deterministic_across_instances():
    import random
    rng = random.Random(1234)
    seq = [(make_key(d, p), rng.randrange(4, 4096000, 4)) for d in range(300)
           for p in range(rng.randrange(1, 4))]
    a, b = ServerAssigner(5), ServerAssigner(5)
    assert [a.assign(k, n) for k, n in seq] == [b.assign(k, n) for k, n in seq]
    assert a.load == b.load and a.assigned == b.assigned


def test_assign_is_sticky_per_key():
    a = ServerAssigner(3)
    first = a.assign(make_key(0, 0), 1000)
    load = list(a.load)
    assert a.assign(make_key(0, 0), 999_999) == first  # a key keeps its server and its load
    assert a.load == load


def test_assigner_goes_to_the_least_loaded_server_ties_to_lowest_rank():
    a = ServerAssigner(3)
    assert [a.assign(k, n) for k, n in [(1, 100), (2, 100), (3, 100), (4, 50), (5, 10)]] == \
        [0, 1, 2, 0, 1]
    assert a.load == [150, 110, 100]
    assert a.imbalance() == pytest.approx(150 / (360 / 3))


def test_imbalance_of_empty_assigner_is_one():
    assert ServerAssigner(4).imbalance() == 1.0


# ------------------------------------------------------------------------------ ResNet-50 report
def resnet50_parameter_shapes() -> list[tuple[int, ...]]:
    """The parameters of torchvision's resnet50(), in ``model.parameters()`` order: stem conv and
    bn, bottleneck stages [3, 4, 6, 3] of widths 64/128/256/512 with expansion 4 (conv1/bn1,
    conv2/bn2, conv3/bn3, then the downsample conv/bn on each stage's first block), fc."""
    shapes: list[tuple[int, ...]] = [(64, 3, 7, 7), (64,), (64,)]
    inplanes = 64
    for width, blocks in zip((64, 128, 256, 512), (3, 4, 6, 3)):
        out = width * 4
        for b in range(blocks):
            shapes += [(width, inplanes, 1, 1), (width,), (width,),
                       (width, width, 3, 3), (width,), (width,),
                       (out, width, 1, 1), (out,), (out,)]
            if b == 0:
                shapes += [(out, inplanes, 1, 1), (out,), (out,)]
            inplanes = out
    shapes += [(1000, 2048), (1000,)]
    return shapes


def test_resnet50_shapes_match_torchvision():
    shapes = resnet50_parameter_shapes()
    assert len(shapes) == 161
    assert sum(math.prod(s) for s in shapes) == 25_557_032  # torchvision resnet50 parameters


def _loads(shapes, num_servers, partition_bytes=DEFAULT_PARTITION_BYTES):
    """(assigner loads, naive key % n loads, number of partitions) for float32 tensors declared
    in ``shapes`` order."""
    assigner = ServerAssigner(num_servers)
    naive = [0] * num_servers
    nparts = 0
    for decl, shape in enumerate(shapes):
        nbytes = math.prod(shape) * 4
        for part, (_off, n) in enumerate(partition_bounds(nbytes, 4, partition_bytes)):
            key = make_key(decl, part)
            assigner.assign(key, n)
            naive[key % num_servers] += n
            nparts += 1
    return assigner, naive, nparts


def _imbalance(loads):
    mean = sum(loads) / len(loads)
    return max(loads) / mean


SERVER_COUNTS = (2, 3, 4, 8)


def test_resnet50_imbalance_report(record_property):
    shapes = resnet50_parameter_shapes()
    total = sum(math.prod(s) for s in shapes) * 4
    lines = [f"ResNet-50: 161 float32 tensors, {total} bytes, partitions of "
             f"{DEFAULT_PARTITION_BYTES} bytes; imbalance = max/mean bytes per server",
             f"{'servers':>7} {'order':>8} {'assigner':>9} {'key % n':>8}  bytes per server "
             f"(assigner)"]
    measured = {}
    for order in ("declared", "reversed"):
        seq = shapes if order == "declared" else shapes[::-1]
        for n in SERVER_COUNTS:
            assigner, naive, nparts = _loads(seq, n)
            assert sum(assigner.load) == sum(naive) == total
            assert len(assigner.assigned) == nparts
            ours, theirs = assigner.imbalance(), _imbalance(naive)
            assert ours == pytest.approx(_imbalance(assigner.load))
            measured[order, n] = (ours, theirs)
            lines.append(f"{n:>7} {order:>8} {ours:>9.4f} {theirs:>8.3f}  {assigner.load}")
            record_property(f"resnet50_imbalance_{order}_{n}_servers", round(ours, 4))
            record_property(f"resnet50_naive_imbalance_{order}_{n}_servers", round(theirs, 4))
    print("\n" + "\n".join(lines))

    for order in ("declared", "reversed"):
        for n in (2, 4):
            ours, _ = measured[order, n]
            assert ours <= 1.05, f"{order} order, {n} servers: imbalance {ours:.4f} > 1.05"
        for n in SERVER_COUNTS:
            ours, theirs = measured[order, n]
            # the greedy assigner beats the naive key % n mapping everywhere ...
            assert ours < theirs
    # ... and by far where n is a power of two: the partition index sits in the low 16 bits of
    # the key, so key % 2**k == part % 2**k and every single-partition tensor lands on server 0.
    for n in (2, 4, 8):
        assert measured["declared", n][1] > 1.5


def test_naive_mapping_puts_single_partition_tensors_on_server_zero():
    """Why key % n is a bad map: the low bits of a key are the partition index."""
    for n in (2, 4, 8):
        assert {make_key(d, 0) % n for d in range(161)} == {0}


# ------------------------------------------------------------------ weighted servers (mixed mode)
from byteps_like.partition import mixed_mode_fraction, mixed_mode_weights  # noqa: E402


def test_equal_weights_match_the_unweighted_assigner():
    sizes = [4096000] * 7 + [123, 4, 2048000, 999996, 4096000, 8]
    a, b = ServerAssigner(3), ServerAssigner(3, [2.0, 2.0, 2.0])
    assert [a.assign(i, n) for i, n in enumerate(sizes)] == \
           [b.assign(i, n) for i, n in enumerate(sizes)]


def test_weights_split_bytes_in_proportion():
    a = ServerAssigner(3, [0.5, 0.25, 0.25])
    for i in range(400):
        a.assign(i, 1000)
    assert a.load == [200_000, 100_000, 100_000]
    assert a.imbalance() == pytest.approx(1.0)


def test_zero_weight_server_gets_nothing_and_assignment_is_deterministic():
    seq = [(i, 1000 + 37 * (i % 5)) for i in range(200)]
    maps = []
    for _ in range(2):
        a = ServerAssigner(4, [0.0, 1.0, 0.0, 3.0])
        maps.append([a.assign(k, n) for k, n in seq])
        assert a.load[0] == a.load[2] == 0
        assert a.load[3] / a.load[1] == pytest.approx(3.0, rel=0.05)
    assert maps[0] == maps[1]


@pytest.mark.parametrize("weights", [[1.0], [0.0, 0.0], [1.0, -1.0], [1.0, math.inf]])
def test_bad_weights_are_refused(weights):
    with pytest.raises(ValueError):
        ServerAssigner(2, weights)


def test_mixed_mode_fraction_matches_the_analysis():
    # k = 0: all on colocated servers; k = n: all on the dedicated ones
    assert mixed_mode_fraction(4, 0) == 0.0
    assert mixed_mode_fraction(4, 4) == pytest.approx(1.0)
    assert mixed_mode_fraction(2, 2) == pytest.approx(1.0)
    assert mixed_mode_fraction(4, 1) == pytest.approx(6 / 18)       # 2*1*3 / (16+4-2)
    assert mixed_mode_fraction(4, 2) == pytest.approx(12 / 20)      # 2*2*3 / (16+8-4)
    assert mixed_mode_fraction(1, 3) == 0.0
    assert mixed_mode_fraction(2, 8) == 1.0


def test_mixed_mode_weights():
    assert mixed_mode_weights([True, True], 2) is None          # all colocated
    assert mixed_mode_weights([False, False], 2) is None        # all dedicated
    w = mixed_mode_weights([True] * 4 + [False], 4)              # n = 4, k = 1
    f = 6 / 18
    assert w == pytest.approx([(1 - f) / 4] * 4 + [f])
    a = ServerAssigner(5, w)
    for i in range(1000):
        a.assign(i, 4096)
    assert sum(a.load[4:]) / sum(a.load) == pytest.approx(f, abs=0.01)


@pytest.mark.parametrize("servers,lanes", [(2, 2), (2, 8), (4, 8), (3, 4)])
def test_lanes_spread_each_servers_keys_over_all_its_streams(servers, lanes):
    """Partitions of a tensor alternate servers, so ``key % lanes`` left each of 2 servers only
    the even or the odd streams (and the I/O threads behind them); ``lane`` gives each server's
    keys its streams in turn: every stream of every server gets an equal share of its keys."""
    a = ServerAssigner(servers)
    per: dict[tuple[int, int], int] = {}
    modulo: dict[tuple[int, int], int] = {}
    for decl in range(3):  # three tensors of 64 equal partitions
        for part in range(64):
            key = make_key(decl, part)
            s = a.assign(key, 1 << 20)
            per[(s, a.lane(key, lanes))] = per.get((s, a.lane(key, lanes)), 0) + 1
            modulo[(s, key % lanes)] = modulo.get((s, key % lanes), 0) + 1
            assert a.lane(key, lanes) == a.lane(key, lanes)  # stable
    for s in range(servers):
        counts = [per.get((s, i), 0) for i in range(lanes)]
        assert max(counts) - min(counts) <= 1, (s, counts)
    if lanes % servers == 0:  # what the modulo did: most streams of a server unused
        assert sum(1 for (s, _), c in modulo.items() if s == 0 and c) == lanes // servers
    assert a.lane(make_key(99, 0), lanes) == make_key(99, 0) % lanes  # never assigned here
