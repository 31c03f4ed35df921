"""A registered compressor (``compression.register``) on the native data plane: the compiled
server keeps the rounds, the declarations' checks, the bounds and the errors, and calls the
compressor's Python server codec (server/codecs.py, ``DataServer.set_codec_factory``) for the
math. Its payloads may vary in size up to the codec's ``max_bytes``; a codec that raises fails
the key with an error naming key, tensor and rank; a payload over ``max_bytes`` is refused
before it is read."""
from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import pytest

from byteps_like.compression import (
    Codec,
    CodecCompressor,
    CompressionError,
    register,
    unregister,
)
from byteps_like.server.codecs import make_server_codec
from byteps_like.transport.native import decode_error
from byteps_like.wire import DTYPE_CODE, pack_decl

from ..integration.workers.registered.bps_test_codecs import PairsCodec
from .test_native_dataplane import make_client, make_server

U8 = DTYPE_CODE["uint8"]


class NonzeroCodec(PairsCodec):
    """The nonzero elements as (index, value) pairs after the step and their count: payloads of
    12 to 12 + 8n bytes. ``fail``: the method that raises RuntimeError (a codec's bug)."""
    what = "nonzero"

    def __init__(self, n: int, fail: str):
        super().__init__(n)
        self.fail = fail

    def select(self, x: np.ndarray) -> np.ndarray:
        return np.flatnonzero(x)

    def encode(self, x: np.ndarray, step: int) -> np.ndarray:
        if self.fail == "encode":
            raise RuntimeError("encode is broken")
        return super().encode(x, step)

    def decode(self, payload, out: np.ndarray) -> int:
        if self.fail == "decode":
            raise RuntimeError("decode is broken")
        return super().decode(payload, out)


@dataclass(frozen=True)
class Nonzero(CodecCompressor):
    fail: str = ""
    name = "test-nonzero"

    def spec(self) -> dict:
        return {"name": self.name, "fail": self.fail}

    def _make(self, n: int, role: str, key: int) -> Codec:
        return NonzeroCodec(n, self.fail if role == "server" else "")


@pytest.fixture(autouse=True)
def registered():
    def factory(fail: str = "") -> Nonzero:
        if fail not in ("", "encode", "decode"):
            raise CompressionError(f"fail: {fail!r} is not a method")
        return Nonzero(fail)
    register("test-nonzero", factory)
    yield
    unregister("test-nonzero")


def _decl(n: int, spec: dict, name: str = "w") -> bytes:
    return pack_decl(name, [n], "float32", 0, 1, n, compressor=spec)


def _servers(cleanup, workers: int, factory: bool = True, budget: int = 1 << 32):
    srv, port = make_server(workers, budget=budget)
    srv.set_partition_bytes(1 << 22)
    if factory:
        srv.set_codec_factory(make_server_codec, CompressionError)
    cleanup.append(srv)
    clis = [make_client(r, [port]) for r in range(workers)]
    cleanup += clis
    return srv, clis


def _submit(cli, op: int, payload: np.ndarray, out: np.ndarray, rnd: int, decl: bytes | None):
    cli.submit(op, 0, payload, out, U8, 1, rnd, [(5, 0, 0, 0, payload.nbytes, decl)],
               compressed=True)


def _take(cli, op: int):
    assert cli.wait(op, 20.0), "the operation did not complete"
    return cli.take(op)


def _sparse(rng, n: int, density: float) -> np.ndarray:
    x = rng.standard_normal(n).astype(np.float32)
    x[rng.random(n) >= density] = 0
    return x


def test_a_registered_compressor_sums_over_the_native_plane_as_its_python_codec(cleanup):
    """Two workers, four rounds of payloads of different sizes (different sparsity per worker
    and round): each pull is the server codec's encoding of the decoded sum, as the Python
    engine made it, of its own size."""
    n, comp = 5000, Nonzero()
    srv, clis = _servers(cleanup, 2)
    rng = np.random.default_rng(3)
    wc = [comp.make_codec(n, role="worker", key=5) for _ in clis]
    ref, acc = comp.make_codec(n, role="server", key=5), np.empty(n, np.float32)
    sizes = set()
    for rnd in range(4):
        xs = [_sparse(rng, n, 0.05 * (1 + rnd + 2 * r)) for r in range(2)]
        payloads = [np.array(c.encode(x, rnd)) for c, x in zip(wc, xs)]
        outs = [np.empty(c.max_bytes, np.uint8) for c in wc]
        for cli, p, o in zip(clis, payloads, outs):
            _submit(cli, rnd + 1, p, o, rnd, _decl(n, comp.spec()) if rnd == 0 else None)
        comps = [_take(cli, rnd + 1) for cli in clis]
        assert all(c[1] for c in comps), comps
        ref.decode(payloads[0], acc)
        ref.decode_add(payloads[1], acc)
        want = np.array(ref.encode(acc, rnd)).tobytes()
        for c, o in zip(comps, outs):
            assert c[7] == len(want) and o[:c[7]].tobytes() == want, rnd
        sizes |= {p.nbytes for p in payloads} | {len(want)}
        assert np.array_equal(acc, xs[0] + xs[1])
    assert len(sizes) > 4, sizes  # the payloads did vary
    assert srv.stats()["rounds"] == 4 and srv.rejected() == {}


@pytest.mark.parametrize("method", ["decode", "encode"])
def test_a_server_codec_that_raises_fails_the_key_for_every_worker_naming_it(method, cleanup):
    n = 1000
    srv, clis = _servers(cleanup, 2)
    p = np.array(Nonzero().make_codec(n, role="worker", key=5).encode(np.ones(n, np.float32), 0))
    decl = _decl(n, Nonzero(method).spec())
    for cli in clis:
        _submit(cli, 1, p, np.empty(12 + 8 * n, np.uint8), 0, decl)
    comps = [_take(cli, 1) for cli in clis]   # no hang: both answered
    for c in comps:
        assert not c[1] and c[2] == "remote", c
        kind, msg = decode_error(c[4])
        assert kind == "internal", (kind, msg)
        assert f"{method} is broken" in msg and "RuntimeError" in msg, msg
        assert "key 5" in msg and "'w'" in msg and "test-nonzero" in msg, msg
    assert srv.rejected() == {"server codec failed": 1}
    if method == "decode":
        assert "worker rank" in msg, msg


def test_a_payload_the_codec_calls_malformed_is_refused_alone(cleanup):
    """CompressionError from the codec is a malformed payload: the first push of a round is
    refused alone and the key keeps serving."""
    n, comp = 1000, Nonzero()
    srv, clis = _servers(cleanup, 2)
    good = np.array(comp.make_codec(n, role="worker", key=5).encode(np.ones(n, np.float32), 0))
    bad = good.copy()
    bad[8:12] = np.frombuffer(struct.pack("<I", 7), np.uint8)  # 7 pairs in 8000 bytes
    decl = _decl(n, comp.spec())
    _submit(clis[0], 1, bad, np.empty(good.nbytes, np.uint8), 0, decl)
    c = _take(clis[0], 1)
    assert not c[1] and c[2] == "remote", c
    msg = decode_error(c[4])[1]
    assert "malformed payload" in msg and "7 pairs" in msg and "worker rank 0" in msg, msg
    assert "CompressionError" not in msg, msg
    outs = [np.empty(good.nbytes, np.uint8) for _ in clis]
    for i, cli in enumerate(clis):
        _submit(cli, 2, good, outs[i], 0, decl)
    assert all(_take(cli, 2)[1] for cli in clis)
    assert srv.rejected() == {"malformed compressed payload from worker rank 0": 1}


def test_a_payload_over_the_codecs_max_bytes_is_refused_before_it_is_read(cleanup):
    n, comp = 100, Nonzero()
    srv, clis = _servers(cleanup, 1)
    decl = _decl(n, comp.spec())
    over = np.zeros(12 + 8 * n + 1, np.uint8)
    _submit(clis[0], 1, over, np.empty_like(over), 0, decl)     # the declaring push
    c = _take(clis[0], 1)
    msg = decode_error(c[4])[1]
    assert not c[1] and "takes at most 812" in msg and "key 5" in msg, msg
    assert srv.stats()["keys"] == 0 and srv.stats()["store_bytes"] == 0
    ok = np.array(comp.make_codec(n, role="worker", key=5).encode(np.ones(n, np.float32), 0))
    _submit(clis[0], 2, ok, np.empty(812, np.uint8), 0, decl)
    assert _take(clis[0], 2)[1]
    held = srv.stats()["store_bytes"]
    _submit(clis[0], 3, over, np.empty_like(over), 1, None)     # a declared key's push
    c = _take(clis[0], 3)
    msg = decode_error(c[4])[1]
    assert not c[1] and "payloads of at most 812 bytes" in msg, msg
    assert srv.stats()["store_bytes"] <= held  # nothing staged for it
    assert srv.rejected() == {"bad compressor declaration": 1,
                              "wrong dtype or size for a declared key": 1}


@pytest.mark.parametrize("case,text", [
    ("unknown", "compressor 'nope' is not registered in this server process"),
    ("param", "fail: 'sideways' is not a method"),
    ("nofactory", "no codec factory")])
def test_a_registered_compressor_the_server_cannot_make_is_refused_saying_why(case, text,
                                                                              cleanup):
    n = 100
    srv, clis = _servers(cleanup, 1, factory=case != "nofactory")
    spec = {"unknown": {"name": "nope"}, "param": {"name": "test-nonzero", "fail": "sideways"},
            "nofactory": Nonzero().spec()}[case]
    p = np.array(Nonzero().make_codec(n, role="worker", key=5).encode(np.ones(n, np.float32), 0))
    _submit(clis[0], 1, p, np.empty(812, np.uint8), 0, _decl(n, spec))
    c = _take(clis[0], 1)
    kind, msg = decode_error(c[4])
    assert not c[1] and kind == "protocol" and text in msg, msg
    assert "key 5" in msg and "worker rank 0" in msg, msg
    if case == "unknown":  # what to do: register it in the server process too
        assert "register('nope', factory) in every server process" in msg, msg
    assert srv.stats()["keys"] == 0 and srv.rejected() == {"bad compressor declaration": 1}
