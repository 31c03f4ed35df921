"""A compressed payload is a peer's, so its numbers are checked, not only its shape (issue 41,
item 5): a onebit scale or dithering norm that is NaN, inf or negative, a top-k / random-k value
that is NaN or inf, and a top-k index that appears twice are refused by both codecs
(compression.py and csrc/codec.cc, with the same words). The native server refuses such a push,
names the sender in its error and counts it in its rejections by rank; a worker refuses such an
answer from a server, naming the server. Before, each was accepted and spread into every
worker's result (the audit: duplicated top-k indices gave 74 instead of 77)."""
from __future__ import annotations

import struct

import numpy as np
import pytest

from byteps_like import _core
from byteps_like.compression import Compression, CompressionError, native_params
from byteps_like.transport.native import decode_error
from byteps_like.wire import DTYPE_CODE

from .test_native_codec import _coded_cluster, _decl, _native_server, _push_all
from .test_native_dataplane import stream  # noqa: F401 - the module runs over both streams

U8 = DTYPE_CODE["uint8"]
N = 1000
F32 = struct.Struct("<f")


def _put(p: np.ndarray, at: int, raw: bytes) -> np.ndarray:
    q = p.copy()
    q[at:at + len(raw)] = np.frombuffer(raw, np.uint8)
    return q


def _f(v: float) -> bytes:
    return F32.pack(v)


def _u32(v: int) -> bytes:
    return struct.pack("<I", v)


# case -> (compressor, how the good payload is damaged, words of the refusal)
CASES = {
    "onebit scale NaN": (Compression.onebit(), lambda p: _put(p, 16, _f(float("nan"))),
                         "its scale is NaN"),
    "onebit scale inf": (Compression.onebit(), lambda p: _put(p, 16, _f(float("inf"))),
                         "its scale is inf"),
    "onebit scale -inf": (Compression.onebit(), lambda p: _put(p, 16, _f(float("-inf"))),
                          "its scale is -inf"),
    "onebit scale negative": (Compression.onebit(), lambda p: _put(p, 16, _f(-2.0)),
                              "its scale is -2.000000"),
    "topk value NaN": (Compression.topk(10), lambda p: _put(p, 20 + 40 + 12, _f(float("nan"))),
                       "value 3 is NaN"),
    "topk value inf": (Compression.topk(10), lambda p: _put(p, 20 + 40, _f(float("-inf"))),
                       "value 0 is -inf"),
    # the audit's case: the same index twice, so the sum depended on the order of the writes
    "topk index twice (adjacent)": (Compression.topk(10), lambda p: _put(p, 24, p[20:24].tobytes()),
                                    "appears more than once"),
    "topk index twice (apart)": (Compression.topk(10), lambda p: _put(p, 20 + 36, p[20:24].tobytes()),
                                 "appears more than once"),
    "randomk value NaN": (Compression.randomk(10, seed=4),
                          lambda p: _put(p, 20 + 4 * 9, _f(float("nan"))), "value 9 is NaN"),
    "dithering norm NaN": (Compression.dithering(), lambda p: _put(p, 16, _f(float("nan"))),
                           "its norm is NaN"),
    "dithering norm inf": (Compression.dithering(), lambda p: _put(p, 16, _f(float("inf"))),
                           "its norm is inf"),
}


def _good(comp, seed: int = 0) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal(N).astype(np.float32)
    return np.array(comp.make_codec(N, role="worker", key=5).encode(x, 0))


@pytest.mark.parametrize("case", sorted(CASES))
def test_both_codecs_refuse_a_peers_bad_numbers_leaving_out_untouched(case):
    comp, damage, words = CASES[case]
    bad = damage(_good(comp))
    py = comp.make_codec(N, role="server", key=5)
    nat = _core.NativeCodec(native_params(comp, N), 5, N)
    a = np.full(N, 7.0, np.float32)
    b = a.copy()
    with pytest.raises(CompressionError) as pe:
        py.decode_add(bad, a)
    with pytest.raises(ValueError) as ne:
        nat.decode(bad, b, True)
    assert str(pe.value) == str(ne.value), (pe.value, ne.value)
    assert words in str(pe.value), pe.value
    with pytest.raises(ValueError, match=words.split(" is ")[0]):
        nat.decode(bad, b)  # the worker's way (no add): refused too
    assert (a == 7.0).all() and (b == 7.0).all()


def test_distinct_top_k_indices_in_any_order_are_accepted():
    """Order is not part of the format, repetition is: pairs permuted decode the same."""
    comp, k = Compression.topk(10), 10
    good = _good(comp)
    idx, val = good[20:20 + 4 * k].view(np.uint32), good[20 + 4 * k:].view(np.float32)
    perm = np.random.default_rng(1).permutation(k)
    shuffled = good.copy()
    shuffled[20:20 + 4 * k] = idx[perm].view(np.uint8)
    shuffled[20 + 4 * k:] = val[perm].view(np.uint8)
    nat = _core.NativeCodec(native_params(comp, N), 5, N)
    want, got, py = (np.zeros(N, np.float32) for _ in range(3))
    nat.decode(good, want)
    nat.decode(shuffled, got)
    comp.make_codec(N, role="server", key=5).decode(shuffled, py)
    assert got.tobytes() == want.tobytes() == py.tobytes()


def test_a_nan_gradient_with_error_feedback_still_encodes():
    """A codec's own payload (error feedback's residual) is not a peer's: a worker whose
    gradient holds NaN still encodes it (and the server then refuses the push)."""
    comp = Compression.dithering(error_feedback=True)
    x = np.ones(N, np.float32)
    x[3] = np.nan
    p = np.array(comp.make_codec(N, role="worker", key=5).encode(x, 0))
    assert np.isnan(p[16:20].view(np.float32)[0])
    nat = _core.NativeCodec(native_params(comp, N), 5, N)
    out = np.empty(nat.max_bytes, np.uint8)
    nat.encode(x, 0, out)
    assert out.tobytes() == p.tobytes()


@pytest.mark.parametrize("case", ["onebit scale NaN", "topk value NaN",
                                  "topk index twice (adjacent)", "dithering norm inf"])
def test_the_native_server_refuses_the_push_naming_and_counting_the_sender(case, cleanup):
    """Worker 1's bad push is refused alone, with an error naming it; the server counts it
    under its rank; the round then completes with good pushes, exact."""
    comp, damage, words = CASES[case]
    srv, clis = _native_server(cleanup, 2)
    decl = _decl("w", comp, N)
    goods = [_good(comp, seed=0), _good(comp, seed=9)]
    (c,) = _push_all(clis[1:], [damage(goods[1])], [np.empty_like(goods[1])], 0, 1, decl)
    assert not c[1] and c[2] == "remote", c
    kind, msg = decode_error(c[4])
    assert kind == "protocol" and "worker rank 1" in msg and "key 5" in msg, msg
    assert words in msg and "malformed payload" in msg, msg
    assert srv.rejected() == {"malformed compressed payload from worker rank 1": 1}
    outs = [np.empty_like(g) for g in goods]
    comps = _push_all(clis, goods, outs, 0, 2, decl)
    assert all(x[1] for x in comps), comps
    ref, acc = comp.make_codec(N, role="server", key=5), np.empty(N, np.float32)
    ref.decode(goods[0], acc)
    ref.decode_add(goods[1], acc)
    want = np.array(ref.encode(acc, 0)).tobytes()
    assert outs[0].tobytes() == outs[1].tobytes() == want
    assert srv.stats()["rounds"] == 1


def test_a_worker_refuses_a_server_answer_holding_inf_naming_the_server(cleanup):
    """Two finite top-k values whose float32 sum overflows: the server's answer carries inf,
    which each worker's codec thread refuses, failing the operation with the server named."""
    from byteps_like.compression import compiled_codec
    comp = Compression.topk(1)
    _srvs, clis = _coded_cluster(cleanup, 2, 1, 1)
    x = np.zeros(N, np.float32)
    x[17] = 3e38
    outs = [np.zeros(N, np.float32) for _ in clis]
    decl = _decl("t", comp, N)
    for r, cli in enumerate(clis):
        cli.submit(1, 0, x, outs[r], DTYPE_CODE["float32"], 1, 0, [(5, 0, 0, 0, 4 * N, decl)],
                   compressed=True, codecs=[compiled_codec(comp, N, 5).native])
    comps = [cli.wait(1, 20.0) and cli.take(1) for cli in clis]
    for c in comps:
        assert c and not c[1], c
        text = " ".join(str(f) for f in c[2:6])
        assert "server 0's answer for key 5" in text and "value 0 is inf" in text, c
