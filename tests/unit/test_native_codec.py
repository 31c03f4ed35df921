"""Compressed partitions on the native data plane: the server's C++ codecs (csrc/codec.h,
``_core.NativeCodec``) against compression.py's, byte for byte, and the native server's rounds
of compressed pushes against the old engine's rule (decode the first push, decode_add the
others, encode the sum with the server's own codec at the round's step), replayed in Python.
Malformed payloads and declarations are errors naming the key, the tensor and the rank."""
from __future__ import annotations

import numpy as np
import pytest

from byteps_like import _core
from byteps_like.compression import (
    Compression,
    ErrorFeedback,
    native_params,
    register,
    unregister,
)
from byteps_like.transport.native import decode_error
from byteps_like.wire import DTYPE_CODE, pack_decl

from .test_native_dataplane import (  # stream: the module runs over both streams
    make_client,
    make_server,
    stream,  # noqa: F401
)

COMPRESSORS = {
    "onebit": Compression.onebit(),
    "onebit_noscale_ef": Compression.onebit(False, error_feedback=True),
    "onebit_ef": Compression.onebit(error_feedback=True),
    "topk_ef": Compression.topk(0.01, error_feedback=True),
    "topk_count_nesterov": Compression.topk(37, momentum=0.9),
    "randomk_ef": Compression.randomk(0.05, seed=3, error_feedback=True),
    "dithering": Compression.dithering(),
    "dithering_natural_l2_ef": Compression.dithering(8, "natural", "l2", 5, True, 0.5),
}
U8 = DTYPE_CODE["uint8"]


def test_native_params_of_a_registered_compressor_is_none():
    from byteps_like.compression import OneBit

    class Mine(OneBit):
        name = "mine_onebit"
    register("mine_onebit", lambda scaling=True: Mine(scaling))
    try:
        assert native_params(Mine(), 100) is None  # its server codec is Python (server/codecs.py)
    finally:
        unregister("mine_onebit")
    assert native_params(Compression.fp16, 100) is None


@pytest.mark.parametrize("name", sorted(COMPRESSORS))
@pytest.mark.parametrize("n", [1, 9, 1000, 65537])
def test_native_codec_is_bitwise_the_python_codec(name, n):
    comp = COMPRESSORS[name]
    rng = np.random.default_rng(n)
    py = comp.make_codec(n, role="server", key=11)
    nat = _core.NativeCodec(native_params(comp, n), 11, n)
    assert nat.max_bytes == py.max_bytes and nat.n == n
    out = np.empty(nat.max_bytes, np.uint8)
    for step in (0, 1, 2, 1 << 40):
        x = rng.standard_normal(n).astype(np.float32)
        if step == 2 and n > 3:
            x[1], x[3] = np.nan, -np.inf
        with np.errstate(invalid="ignore"):  # inf - inf in the residual: NaN, as in C++
            ref = np.array(py.encode(x, step))
        nat.encode(x, step, out)
        assert out.tobytes() == ref.tobytes(), (name, step)  # EF residuals agree too
        a = rng.standard_normal(n).astype(np.float32)
        b = a.copy()
        if _carries_non_finite(ref):  # a peer's NaN/inf: both refuse it, with the same words
            with pytest.raises(ValueError) as pe:
                py.decode_add(ref, a)
            with pytest.raises(ValueError) as ne:
                nat.decode(ref, b, True)
            assert str(pe.value) == str(ne.value) and "finite" in str(pe.value), pe.value
            assert a.tobytes() == b.tobytes()  # untouched
            continue
        assert py.decode_add(ref, a) == nat.decode(ref, b, True) == step
        assert a.tobytes() == b.tobytes()
        assert py.decode(ref, a) == nat.decode(ref, b) == step
        assert a.tobytes() == b.tobytes()


def _carries_non_finite(p: np.ndarray) -> bool:
    """Whether a framed payload holds a NaN/inf scale, norm or value (compression.py)."""
    cid, field = p[3], p[16:20].view(np.float32)[0]
    if cid in (1, 4):
        return not np.isfinite(field)
    k = int(p[16:20].view(np.uint32)[0])
    vals = p[20 + 4 * k:] if cid == 2 else p[20:]
    return not np.isfinite(vals.view(np.float32)).all()


@pytest.mark.parametrize("scaling", [True, False])
def test_onebit_residual_is_decode_then_subtract(scaling):
    """Error feedback's fused onebit residual (both codecs use it) against its definition."""
    rng = np.random.default_rng(5)
    y = rng.standard_normal(1003).astype(np.float32)
    y[:6] = [0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan]
    bits = np.empty((y.size + 7) // 8, np.uint8)
    scale = _core.onebit_encode(y, bits, scaling)
    d = np.empty_like(y)
    _core.onebit_decode(bits, scale, d)
    with np.errstate(invalid="ignore"):
        want = y - d
    got = y.copy()
    _core.onebit_residual(got, scale)
    assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("isa", ["auto", "scalar"])
@pytest.mark.parametrize("scaling", [True, False])
def test_onebit_ef_encode_settles_the_last_residual_in_its_pass(scaling, isa):
    """onebit_ef_encode(.., settle=s) on the last step's y is onebit_residual(r, s) and then
    onebit_ef_encode: the same bits, scale and new y, bit for bit, for every vector tail."""
    old = _core._set_isa(isa)
    try:
        for n in (1, 15, 16, 17, 31, 32, 33, 47, 48, 1000, 100003):
            rng = np.random.default_rng(n)
            x = rng.standard_normal(n).astype(np.float32)
            y = rng.standard_normal(n).astype(np.float32)
            y[:min(n, 6)] = [0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan][:min(n, 6)]
            prev = np.float32(0.75)
            bits_a = np.empty((n + 7) // 8, np.uint8)
            bits_b = np.empty_like(bits_a)
            a, b = y.copy(), y.copy()
            with np.errstate(invalid="ignore"):
                _core.onebit_residual(a, prev)
                sa = _core.onebit_ef_encode(x, a, bits_a, scaling)
                sb = _core.onebit_ef_encode(x, b, bits_b, scaling, float(prev))
            assert a.tobytes() == b.tobytes(), n
            assert bits_a.tobytes() == bits_b.tobytes(), n
            assert np.float32(sa).tobytes() == np.float32(sb).tobytes(), n
    finally:
        _core._set_isa(old)


@pytest.mark.parametrize("isa", ["auto", "scalar"])
@pytest.mark.parametrize("inner", ["onebit", "onebit_noscale", "topk", "topk3", "randomk"])
def test_fused_error_feedback_is_the_unfused_composition(inner, isa):
    """Both codecs run error feedback fused for onebit (onebit_ef_encode, onebit_residual) and
    the sparse codecs (the residual touched at the k indices only): the same payloads and
    residuals as y = x + r, the plain codec of y, r = y - decode(payload), for every tail length
    of the vector loops (32 and 16 elements)."""
    plain_c = {"onebit": Compression.onebit(), "onebit_noscale": Compression.onebit(False),
               "topk": Compression.topk(0.05), "topk3": Compression.topk(3),
               "randomk": Compression.randomk(0.05, seed=9)}[inner]
    comp = ErrorFeedback(plain_c)
    old = _core._set_isa(isa)
    try:
        for n in (3, 15, 16, 17, 31, 32, 33, 47, 48, 50, 1000, 100003):
            rng = np.random.default_rng(n)
            py = comp.make_codec(n, role="worker", key=1)
            lazy = comp.make_codec(n, role="worker", key=1)  # residual read only at the end
            nat = _core.NativeCodec(native_params(comp, n), 1, n)
            plain = plain_c.make_codec(n, role="worker", key=1)
            r = np.zeros(n, np.float32)
            out = np.empty(nat.max_bytes, np.uint8)
            for step in range(3):
                x = rng.standard_normal(n).astype(np.float32)
                if step == 1:
                    x[0], x[-1] = -0.0, np.inf
                with np.errstate(invalid="ignore"):
                    y = x + r
                    want = np.array(plain.encode(y, step))
                    d = np.empty(n, np.float32)
                    plain._decode(want, d, False, check=False)  # its own: inf may stay
                    r = y - d
                    got = np.array(py.encode(x, step))
                    got_lazy = np.array(lazy.encode(x, step))
                    nat.encode(x, step, out)
                assert (got.tobytes() == want.tobytes() == out.tobytes()
                        == got_lazy.tobytes()), (n, step)
                assert py.residual.tobytes() == r.tobytes(), (n, step)
            assert lazy.residual.tobytes() == r.tobytes(), n
    finally:
        _core._set_isa(old)


def _frame(p: np.ndarray, at: int, value: bytes) -> np.ndarray:
    q = p.copy()
    q[at:at + len(value)] = np.frombuffer(value, np.uint8)
    return q


@pytest.mark.parametrize("case,field", [
    ("short", "bytes"), ("long", "bytes"), ("magic", "magic"), ("version", "magic"),
    ("id", "compressor id"), ("n", "elements"), ("k", "k =")])
def test_native_codec_rejects_a_malformed_payload_leaving_out_untouched(case, field):
    n = 1000
    nat = _core.NativeCodec(native_params(Compression.topk(10), n), 0, n)
    p = np.empty(nat.max_bytes, np.uint8)
    nat.encode(np.arange(n, dtype=np.float32), 3, p)
    bad = {"short": p[:-1], "long": np.concatenate([p, p[:1]]), "magic": _frame(p, 0, b"XC"),
           "version": _frame(p, 2, b"\x02"), "id": _frame(p, 3, b"\x01"),
           "n": _frame(p, 4, (999).to_bytes(4, "little")),
           "k": _frame(p, 16, (11).to_bytes(4, "little"))}[case]
    out = np.full(n, 7.0, np.float32)
    with pytest.raises(ValueError, match=field):
        nat.decode(bad, out, True)
    assert (out == 7.0).all()
    idx = _frame(p, 20, (n + 5).to_bytes(4, "little"))  # an index out of range
    with pytest.raises(ValueError, match="topk payload"):
        nat.decode(idx, out, True)
    assert (out == 7.0).all()


@pytest.mark.parametrize("params,field", [
    ([9, 0, 0, 0, 0, 0, 0, 0], "compressor id"), ([2, 0, 0, 0, 0, 0, 0, 0], "k:"),
    ([2, 0, 0, 101, 0, 0, 0, 0], "k:"), ([4, 0, 0, 0, 0, 200, 1, 0], "levels"),
    ([1, 2, 0, 0, 0, 0, 0, 0], "ef"), ([1, 0, 0], "8 integers")])
def test_native_codec_params_are_checked(params, field):
    with pytest.raises(ValueError, match=field):
        _core.NativeCodec(params, 0, 100)


# ---- the native server's rounds of compressed pushes ---------------------------------------

def _decl(name: str, comp, n: int, dtype: str = "float32", params=None, part: int = 0,
          nparts: int = 1) -> bytes:
    return pack_decl(name, [n], dtype, part, nparts, n,
                     native_params(comp, n) if params is None else params, comp.spec())


def _native_server(cleanup, workers: int, partition_bytes: int = 1 << 22, **kw):
    srv, port = make_server(workers, **kw)
    srv.set_partition_bytes(partition_bytes)
    cleanup.append(srv)
    clis = [make_client(r, [port]) for r in range(workers)]
    cleanup += clis
    return srv, clis


def _push_all(clis, payloads, outs, rnd, op, decl):
    for cli, p, o in zip(clis, payloads, outs):
        cli.submit(op, 0, p, o, U8, 1, rnd, [(5, 0, 0, 0, p.nbytes, decl if rnd == 0 else None)],
                   compressed=True)
    comps = []
    for cli in clis:
        assert cli.wait(op, 20.0), "the operation did not complete"
        comps.append(cli.take(op))
    return comps


@pytest.mark.parametrize("name", sorted(COMPRESSORS))
def test_native_server_sums_compressed_pushes_exactly_as_the_python_engine(name, cleanup):
    """Three workers, four rounds: every pulled payload equals the old engine's (the server's
    Python codec decoding the first push, decode_add of the others in arrival order -- any
    order gives the same float32 sum for these inputs' first two; the third is added last
    because it is pushed after the others are acknowledged -- and encode at the step)."""
    comp, n, workers = COMPRESSORS[name], 20000, 3
    srv, clis = _native_server(cleanup, workers)
    rng = np.random.default_rng(1)
    wcodecs = [comp.make_codec(n, role="worker", key=5) for _ in range(workers)]
    ref = comp.make_codec(n, role="server", key=5)
    acc = np.empty(n, np.float32)
    decl = _decl("w", comp, n)
    for rnd in range(4):
        payloads = [np.array(c.encode(rng.standard_normal(n).astype(np.float32), rnd))
                    for c in wcodecs]
        outs = [np.empty(p.nbytes, np.uint8) for p in payloads]
        # the first two together (their sum commutes), then the third once they are summed
        for cli, p, o in zip(clis[:2], payloads, outs):
            cli.submit(rnd + 1, 0, p, o, U8, 1, rnd,
                       [(5, 0, 0, 0, p.nbytes, decl if rnd == 0 else None)], compressed=True)
        while srv.stats()["pushes"] < 2 + workers * rnd:
            assert not any(c.wait(rnd + 1, 0.01) for c in clis[:2])
        comps = _push_all(clis[2:], payloads[2:], outs[2:], rnd, rnd + 1, decl)
        comps += [c.wait(rnd + 1, 20.0) and c.take(rnd + 1) for c in clis[:2]]
        assert all(c[1] for c in comps), comps
        ref.decode(payloads[0], acc)
        ref.decode_add(payloads[1], acc)
        ref.decode_add(payloads[2], acc)
        want = np.array(ref.encode(acc, rnd))
        for o in outs:
            assert o.tobytes() == want.tobytes(), (name, rnd)
    st = srv.stats()
    assert st["rounds"] == 4 and st["keys"] == 1
    assert srv.rejected() == {}


def test_native_server_charges_the_accumulator_and_codec_to_the_budget(cleanup):
    comp, n = Compression.onebit(error_feedback=True), 100000
    srv, clis = _native_server(cleanup, 1)
    p = np.array(comp.make_codec(n, role="worker", key=5).encode(np.ones(n, np.float32), 0))
    (c,) = _push_all(clis, [p], [np.empty_like(p)], 0, 1, _decl("w", comp, n))
    assert c[1], c
    # two encoded sums, the float32 sum and the residual of error feedback
    assert srv.stats()["store_bytes"] >= 2 * p.nbytes + 2 * 4 * n
    # a budget without room for them refuses the key, naming the budget
    srv2, clis2 = _native_server(cleanup, 1, budget=4 * n)
    (c,) = _push_all(clis2, [p], [np.empty_like(p)], 0, 1, _decl("w", comp, n))
    assert not c[1] and "BYTEPS_SERVER_MAX_BYTES" in decode_error(c[4])[1]
    assert srv2.stats()["store_bytes"] == 0


@pytest.mark.parametrize("case,text", [
    ("count", "is not an integer in 1..1024"), ("params", "k:"),
    ("size", "takes"), ("dtype", "is not one workers compress"),
    ("none", "no native codec parameters")])
def test_native_server_refuses_a_bad_compressed_declaration(case, text, cleanup):
    n = 1000
    comp = Compression.topk(10)
    srv, clis = _native_server(cleanup, 1, partition_bytes=4096)
    p = np.array(comp.make_codec(n, role="worker", key=5).encode(np.ones(n, np.float32), 0))
    decl = {"count": _decl("w", comp, 2000), "params": _decl("w", comp, n, params=[2, 0, 0, 0,
                                                                                   0, 0, 0, 0]),
            "size": _decl("w", Compression.topk(11), n), "dtype": _decl("w", comp, n, "int32"),
            "none": pack_decl("w", [n], "float32", 0, 1, n)}[case]
    (c,) = _push_all(clis, [p], [np.empty_like(p)], 0, 1, decl)
    assert not c[1] and c[2] == "remote", c
    kind, msg = decode_error(c[4])
    assert kind == "protocol" and text in msg, msg
    assert "key 5" in msg and "worker rank 0" in msg, msg
    assert srv.stats()["keys"] == 0 and srv.stats()["store_bytes"] == 0


@pytest.mark.parametrize("case", ["magic", "n", "index", "size"])
def test_a_malformed_compressed_push_is_an_error_naming_key_tensor_and_rank(case, cleanup):
    n, comp = 1000, Compression.topk(10)
    srv, clis = _native_server(cleanup, 2)
    good = np.array(comp.make_codec(n, role="worker", key=5).encode(np.ones(n, np.float32), 0))
    bad = {"magic": _frame(good, 0, b"ZZ"), "n": _frame(good, 4, (7).to_bytes(4, "little")),
           "index": _frame(good, 20, (5000).to_bytes(4, "little")), "size": good[:-8]}[case]
    decl = _decl("w", comp, n)
    # rank 1 declares the key with a good push first; rank 0's bad one is then refused alone
    clis[1].submit(1, 0, good, np.empty_like(good), U8, 1, 0,
                   [(5, 0, 0, 0, good.nbytes, decl)], compressed=True)
    while srv.stats()["pushes"] < 1:
        assert not clis[1].wait(1, 0.01)
    (c,) = _push_all(clis[:1], [bad], [np.empty_like(bad)], 0, 1, decl)
    assert not c[1] and c[2] == "remote", c
    msg = decode_error(c[4])[1]
    assert "key 5" in msg and "'w'" in msg and "worker rank 0" in msg, msg
    assert srv.stats()["store_bytes"] > 0 and srv.stats()["keys"] == 1


def test_a_compressed_round_of_fewer_workers_after_join_reports_its_contributors(cleanup):
    """join(): rank 1 has joined, so rank 0's push alone completes the round; the completion
    carries the number of pushes summed (1), which the worker divides the decoded sum by."""
    comp, n = Compression.onebit(error_feedback=True), 5000
    srv, clis = _native_server(cleanup, 2)
    srv.set_members([1], {})
    x = np.random.default_rng(2).standard_normal(n).astype(np.float32)
    p = np.array(comp.make_codec(n, role="worker", key=5).encode(x, 0))
    out = np.empty_like(p)
    (c,) = _push_all(clis[:1], [p], [out], 0, 1, _decl("w", comp, n))
    assert c[1] and c[9] == 1, c
    ref, acc = comp.make_codec(n, role="server", key=5), np.empty(n, np.float32)
    ref.decode(p, acc)
    assert out.tobytes() == np.array(ref.encode(acc, 0)).tobytes()


def test_pushes_of_another_step_in_one_round_fail_the_key_naming_both_steps(cleanup):
    """Every push of a round must carry the same step (workers pushed the tensor a different
    number of times): the second one fails the key for everyone, as on the Python engine."""
    n, comp = 1000, Compression.onebit()
    srv, clis = _native_server(cleanup, 2)
    x = np.ones(n, np.float32)
    p0 = np.array(comp.make_codec(n, role="worker", key=5).encode(x, 0))
    p5 = np.array(comp.make_codec(n, role="worker", key=5).encode(x, 5))
    decl = _decl("w", comp, n)
    clis[0].submit(1, 0, p0, np.empty_like(p0), U8, 1, 0, [(5, 0, 0, 0, p0.nbytes, decl)],
                   compressed=True)
    while srv.stats()["pushes"] < 1:
        assert not clis[0].wait(1, 0.01)
    (c1,) = _push_all(clis[1:], [p5], [np.empty_like(p5)], 0, 1, decl)
    c0 = clis[0].wait(1, 20.0) and clis[0].take(1)
    for c in (c0, c1):
        assert not c[1] and c[2] == "remote", c
        msg = decode_error(c[4])[1]
        assert "pushed step 5 while the round holds step 0" in msg and "'w'" in msg, msg


# ---- coded operations: the worker's codecs run by the native client ----------------------------

def _coded_cluster(cleanup, workers: int, servers: int, codec_threads: int):
    from .test_native_dataplane import JOB, MAXMSG, PART, connect
    srvs = []
    for r in range(servers):
        srv, port = make_server(workers, rank=r)
        srv.set_partition_bytes(1 << 22)
        cleanup.append(srv)
        srvs.append((srv, port))
    clis = []
    for r in range(workers):
        cli = _core.DataClient(r, JOB, 2, 4 * PART, MAXMSG, codec_threads=codec_threads)
        cleanup.append(cli)
        for i, (_srv, port) in enumerate(srvs):
            connect(cli, i, port, 2)
        clis.append(cli)
    return [s for s, _ in srvs], clis


@pytest.mark.parametrize("name", ["onebit", "onebit_ef", "topk_ef", "randomk_ef",
                                  "dithering_natural_l2_ef"])
@pytest.mark.parametrize("threads", [1, 3])
def test_a_coded_operation_equals_the_pipelines_codecs_bit_for_bit(name, threads, cleanup):
    """Two workers push a 3-partition float32 tensor over two servers for three rounds as one
    coded operation each (the client encodes with its codecs, the servers sum, the client
    decodes and divides as it decodes): every result equals the Python pipeline's way --
    compression.py's worker codecs encode, the server codec decodes, sums and encodes, the
    worker codec decodes, scale_into divides afterwards -- so the error-feedback residuals on
    both sides agree too. The divisor is 3, whose quotients round (2 would be exact)."""
    from byteps_like.compression import compiled_codec
    comp = COMPRESSORS[name]
    if name == "dithering_natural_l2_ef":  # its momentum is Python's: not compiled
        assert compiled_codec(comp, 100, 1) is None
        comp = Compression.dithering(8, "natural", "l2", 5, True)
    sizes = [20000, 20000, 7001]
    offs = np.cumsum([0] + sizes[:-1])
    keys = [5, 6, 7]
    srvs, clis = _coded_cluster(cleanup, 2, 2, threads)
    natives = [[compiled_codec(comp, n, k) for n, k in zip(sizes, keys)] for _ in clis]
    py_w = [[comp.make_codec(n, role="worker", key=k) for n, k in zip(sizes, keys)] for _ in clis]
    py_s = [comp.make_codec(n, role="server", key=k) for n, k in zip(sizes, keys)]
    rng = np.random.default_rng(3)
    for rnd in range(3):
        xs = [rng.standard_normal(sum(sizes)).astype(np.float32) for _ in clis]
        outs = [np.full(sum(sizes), np.nan, np.float32) for _ in clis]
        for r, cli in enumerate(clis):
            parts = []
            for i, (n, k) in enumerate(zip(sizes, keys)):
                decl = _decl("t", comp, n, part=i, nparts=3) if rnd == 0 else None
                parts.append((k, k % 2, 0, int(offs[i]) * 4, n * 4, decl))
            cli.submit(rnd + 1, 0, xs[r], outs[r], DTYPE_CODE["float32"], 3, rnd, parts,
                       compressed=True, codecs=[c.native for c in natives[r]])
        comps = [cli.wait(rnd + 1, 20.0) and cli.take(rnd + 1) for cli in clis]
        assert all(c and c[1] for c in comps), comps
        for i, (n, off) in enumerate(zip(sizes, offs)):
            pushes = [np.array(py_w[r][i].encode(xs[r][off:off + n], rnd)) for r in range(2)]
            acc = np.empty(n, np.float32)
            py_s[i].decode(pushes[0], acc)
            py_s[i].decode_add(pushes[1], acc)
            summed = np.array(py_s[i].encode(acc, rnd))
            want = np.empty(n, np.float32)
            py_w[0][i].decode(summed, want)
            _core.scale_into(want, "float32", 3)
            for r in range(2):
                assert outs[r][off:off + n].tobytes() == want.tobytes(), (name, rnd, i, r)
        # the wire carried the payloads: the completion counts their bytes
        assert comps[0][7] == sum(c.max_bytes for c in natives[0])
    assert sum(s.stats()["rounds"] for s in srvs) == 9


def test_a_coded_operation_checks_its_codecs(cleanup):
    _srvs, (cli,) = _coded_cluster(cleanup, 1, 1, 1)
    x, out = np.ones(1000, np.float32), np.empty(1000, np.float32)
    good = _core.NativeCodec(native_params(Compression.onebit(), 1000), 5, 1000)
    small = _core.NativeCodec(native_params(Compression.onebit(), 999), 5, 999)
    part = [(5, 0, 0, 0, 4000, None)]
    f32 = DTYPE_CODE["float32"]
    with pytest.raises(ValueError, match="not one of 1000 float32"):
        cli.submit(1, 0, x, out, f32, 1, 0, part, compressed=True, codecs=[small])
    with pytest.raises(ValueError, match="one codec per part"):
        cli.submit(2, 0, x, out, f32, 1, 0, part, compressed=True, codecs=[good, good])
    with pytest.raises(ValueError, match="wire dtype float32"):
        cli.submit(3, 0, x, out, DTYPE_CODE["float64"], 1, 0, part, compressed=True,
                   codecs=[good])


def test_closing_with_coded_operations_in_flight_fails_them(cleanup):
    """A coded operation whose round never completes (the server waits for a second worker)
    fails with 'closed' when the client closes, with its codec threads stopped first."""
    comp, n = Compression.onebit(error_feedback=True), 50000
    _srvs, clis = _coded_cluster(cleanup, 2, 1, 2)
    from byteps_like.compression import compiled_codec
    c = compiled_codec(comp, n, 5)
    x, out = np.ones(n, np.float32), np.empty(n, np.float32)
    clis[0].submit(1, 0, x, out, DTYPE_CODE["float32"], 1, 0,
                   [(5, 0, 0, 0, 4 * n, _decl("t", comp, n))], compressed=True,
                   codecs=[c.native])
    assert not clis[0].wait(1, 0.3)
    clis[0].close()
    (comp1,) = clis[0].completions(5.0)
    assert comp1[0] == 1 and not comp1[1] and comp1[2] == "closed", comp1


@pytest.mark.parametrize("wire", ["float16", "bfloat16"])
def test_a_cast_coded_operation_equals_converting_the_whole_tensor(wire, cleanup):
    """fp16/bf16 of a float32 tensor as one coded operation: each partition narrowed by the
    client, summed in the narrow dtype by its server, divided there by 3 and widened into the
    caller's output: bit for bit the whole tensor narrowed, summed, divided and widened."""
    sizes = [20000, 20000, 7001]
    offs = np.cumsum([0] + sizes[:-1])
    keys = [5, 6, 7]
    _srvs, clis = _coded_cluster(cleanup, 2, 2, 2)
    coders = [[_core.NativeCast(n, wire) for n in sizes] for _ in clis]
    rng = np.random.default_rng(4)
    total = sum(sizes)
    for rnd in range(2):
        xs = [(rng.standard_normal(total) * 3).astype(np.float32) for _ in clis]
        xs[0][::997] *= 30000.0  # beyond float16's range: inf on the wire
        outs = [np.full(total, np.nan, np.float32) for _ in clis]
        for r, cli in enumerate(clis):
            parts = []
            for i, (n, k) in enumerate(zip(sizes, keys)):
                decl = (pack_decl("c", [total], wire, i, 3, n) if rnd == 0 else None)
                parts.append((k, k % 2, 0, int(offs[i]) * 4, n * 4, decl))
            cli.submit(rnd + 1, 0, xs[r], outs[r], DTYPE_CODE[wire], 3, rnd, parts,
                       codecs=coders[r])
        comps = [cli.wait(rnd + 1, 20.0) and cli.take(rnd + 1) for cli in clis]
        assert all(c and c[1] for c in comps), comps
        narrow = []
        for x in xs:
            w = np.empty(total * 2, np.uint8)
            _core.convert(w, wire, x, "float32")
            narrow.append(w)
        _core.add_into(narrow[0], narrow[1], wire)
        _core.scale_into(narrow[0], wire, 3)
        want = np.empty(total, np.float32)
        _core.convert(want, "float32", narrow[0], wire)
        for r in range(2):
            assert outs[r].tobytes() == want.tobytes(), (wire, rnd, r)
        assert comps[0][7] == 2 * total  # the wire carried the narrow bytes


def test_a_cast_coded_operation_checks_its_coders(cleanup):
    _srvs, (cli,) = _coded_cluster(cleanup, 1, 1, 1)
    x, out = np.ones(1000, np.float32), np.empty(1000, np.float32)
    part = [(5, 0, 0, 0, 4000, None)]
    with pytest.raises(ValueError, match="wire dtype differs"):
        cli.submit(1, 0, x, out, DTYPE_CODE["float16"], 1, 0, part,
                   codecs=[_core.NativeCast(1000, "bfloat16")])
    with pytest.raises(ValueError, match="not one of 1000 float32"):
        cli.submit(2, 0, x, out, DTYPE_CODE["float16"], 1, 0, part,
                   codecs=[_core.NativeCast(999, "float16")])
    with pytest.raises(ValueError, match="NativeCast objects"):  # a cast is not compressed
        cli.submit(3, 0, x, out, DTYPE_CODE["float16"], 1, 0, part, compressed=True,
                   codecs=[_core.NativeCast(1000, "float16")])
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        _core.NativeCast(10, "float32")
