"""A key's declaration has one definition, csrc/decl.h: byteps_like/wire.py builds its struct
and limits from ``_core.decl_spec()``. Packed by either side, it is read the same by the other;
a malformed, short or oversized one from a peer is refused saying why, before the server keeps
anything of it."""
from __future__ import annotations

import json
import socket
import struct
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from byteps_like import _core, wire
from byteps_like.errors import ProtocolError
from byteps_like.transport.native import WIRE_CODE, decode_error
from byteps_like.wire import (
    DECL_MAX_BYTES,
    DECL_MAX_CODEC,
    DECL_MAX_DIMS,
    DECL_MAX_NAME,
    DECL_MAX_SPEC,
    DTYPE_CODE,
    pack_decl,
    parse_decl,
)

from ..native_stream import HDR, closed_by_peer
from .test_native_dataplane import _raw, hello, make_client, make_server

FLOATS = ("float32", "float64", "float16", "bfloat16", "int32", "int64")
HEAD = 32


def test_the_layout_comes_from_the_module():
    spec = _core.decl_spec()
    assert spec["magic"] == wire.DECL_MAGIC == b"BPSD" and spec["version"] == wire.DECL_VERSION
    assert [f[0] for f in spec["header"]] == list(wire.DECL_FIELDS)
    assert spec["header_size"] == HEAD == sum(f[2] for f in spec["header"])
    assert (spec["max_dims"], spec["max_codec"], spec["max_name"], spec["max_spec"]) == (
        DECL_MAX_DIMS, DECL_MAX_CODEC, DECL_MAX_NAME, DECL_MAX_SPEC)
    assert DECL_MAX_BYTES == HEAD + 8 * (DECL_MAX_DIMS + DECL_MAX_CODEC) + DECL_MAX_NAME + \
        DECL_MAX_SPEC <= wire.MAX_META_BYTES


names = st.text(max_size=40)
shapes = st.lists(st.integers(0, 1 << 40), max_size=6)
codecs = st.lists(st.integers(0, (1 << 64) - 1), max_size=DECL_MAX_CODEC)
specs = st.none() | st.dictionaries(st.text(max_size=8), st.integers(-5, 5) | st.text(max_size=8),
                                    max_size=4)


@settings(max_examples=150, deadline=None)
@given(names, shapes, st.sampled_from(FLOATS), st.integers(0, 1000), st.integers(1, 1000),
       st.integers(0, (1 << 64) - 1), codecs, specs)
def test_python_packs_and_cpp_reads_the_same_fields(name, shape, dtype, part, more, count,
                                                    codec, spec):
    nparts = part + more
    raw = pack_decl(name, shape, dtype, part, nparts, count, codec, spec)
    got = _core.decl_parse(raw)
    assert got["name"].decode() == name and got["shape"] == shape
    assert got["dtype"] == DTYPE_CODE[dtype] and (got["part"], got["nparts"]) == (part, nparts)
    assert got["count"] == count and got["codec"] == codec
    assert got["spec"] == (b"" if spec is None else  # the spec: JSON, C++ keeps it as it came
                           json.dumps(spec, separators=(",", ":")).encode())
    assert parse_decl(raw) == wire.Declaration(name, tuple(shape), dtype, part, nparts, count,
                                               tuple(codec), spec)


@settings(max_examples=150, deadline=None)
@given(names, shapes, st.sampled_from(FLOATS), st.integers(0, 1000), st.integers(1, 1000),
       st.integers(0, (1 << 64) - 1), codecs)
def test_cpp_packs_and_python_reads_the_same_fields(name, shape, dtype, part, more, count,
                                                    codec):
    nparts = part + more
    raw = _core.decl_pack(DTYPE_CODE[dtype], shape, part, nparts, count, codec,
                          name.encode(), b'{"name":"topk","k":3}')
    assert raw == pack_decl(name, shape, dtype, part, nparts, count, codec,
                            {"name": "topk", "k": 3})
    d = parse_decl(raw)
    assert (d.name, d.shape, d.dtype, d.part, d.nparts, d.count, d.native_codec) == (
        name, tuple(shape), dtype, part, nparts, count, tuple(codec))
    assert d.compressor == {"name": "topk", "k": 3}


def test_a_declaration_reads_in_errors_as_the_tensor():
    raw = pack_decl("w", [7, 3], "float32", 0, 1, 21)
    assert _core.decl_parse(raw)["text"] == "'w' shape (7, 3) float32 uncompressed"
    raw = pack_decl("b", [5], "bfloat16", 0, 1, 5, compressor={"name": "mine"})
    assert _core.decl_parse(raw)["text"] == "'b' shape (5,) bfloat16 compressed with " \
                                            '{"name":"mine"}'


def _head(**kw) -> bytes:
    f = dict(magic=b"BPSD", version=1, dtype=1, ndim=0, ncodec=0, part=0, nparts=1, count=1,
             name_len=0, backup=0, spec_len=0)
    f.update(kw)
    return struct.pack("<4sBBBBIIQHHI", *f.values())


GOOD = pack_decl("t", [4], "float32", 0, 1, 4)
MALFORMED = {
    "empty": (b"", "shorter than its 32-byte head"),
    "short head": (GOOD[:31], "shorter than its 32-byte head"),
    "short body": (GOOD[:-1], "whose lengths add up to"),
    "trailing byte": (GOOD + b"\0", "whose lengths add up to"),
    "magic": (b"BPSX" + GOOD[4:], "not a declaration of this version"),
    "json": (b'{"name":"t","part":0,"nparts":1,"count":4}', "not a declaration"),
    "version": (GOOD[:4] + b"\x09" + GOOD[5:], "not a declaration of this version"),
    "dims": (_head(ndim=DECL_MAX_DIMS + 1) + b"\0" * 8 * (DECL_MAX_DIMS + 1), "at most"),
    "codec": (_head(ncodec=DECL_MAX_CODEC + 1) + b"\0" * 8 * (DECL_MAX_CODEC + 1), "at most"),
    "name": (_head(name_len=DECL_MAX_NAME + 1) + b"n" * (DECL_MAX_NAME + 1), "at most"),
    "spec": (_head(spec_len=DECL_MAX_SPEC + 1) + b"{" * (DECL_MAX_SPEC + 1), "at most"),
    "spec over the frame": (_head(spec_len=0xFFFFFFFF), "at most"),
    "dtype none": (_head(dtype=0), "unknown dtype code 0"),
    "dtype unknown": (_head(dtype=200), "unknown dtype code 200"),
    "part": (_head(part=3, nparts=3), "part 3 of 3"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_declaration_is_refused_by_both_sides_saying_why(case):
    raw, why = MALFORMED[case]
    with pytest.raises(ValueError, match=why):
        _core.decl_parse(raw)
    with pytest.raises(ProtocolError):
        parse_decl(raw)


def test_packing_past_a_limit_is_a_clear_error():
    with pytest.raises(ValueError, match="over the data plane's limit of 4096"):
        pack_decl("x" * (DECL_MAX_NAME + 1), [1], "float32", 0, 1, 1)
    with pytest.raises(ValueError, match="dims"):
        pack_decl("x", [1] * (DECL_MAX_DIMS + 1), "float32", 0, 1, 1)
    with pytest.raises(ValueError, match="compressor spec bytes"):
        pack_decl("x", [1], "float32", 0, 1, 1, compressor={"a": "b" * DECL_MAX_SPEC})
    with pytest.raises(ValueError, match="not a wire dtype"):
        pack_decl("x", [1], "complex64", 0, 1, 1)
    with pytest.raises(ValueError, match="fields no declaration has"):
        pack_decl("x", [1], "float32", 0, 1, 1, colour="red")
    with pytest.raises(ValueError, match="past its limits"):
        _core.decl_pack(1, [1], 0, 1, 1, [0] * (DECL_MAX_CODEC + 1), b"x", b"")


@pytest.mark.parametrize("case", ["short body", "json", "dims", "part", "dtype unknown"])
def test_the_server_refuses_a_malformed_declaration_and_keeps_nothing(case, cleanup):
    srv, port = make_server(1)
    cleanup.append(srv)
    cli = make_client(0, [port])
    cleanup.append(cli)
    x, y = np.ones(4, np.float32), np.empty(4, np.float32)
    raw, why = MALFORMED[case]
    cli.submit(1, 0, x.view(np.uint8), y.view(np.uint8), WIRE_CODE["float32"], 1, 0,
               [(3, 0, 0, 0, x.nbytes, raw)])
    assert cli.wait(1, 20.0)
    c = cli.take(1)
    kind, text = decode_error(c[4])
    assert not c[1] and c[2] == "remote" and kind == "protocol", c
    assert "key 3" in text and "worker rank 0" in text and why in text, text
    assert srv.rejected() == {"malformed declaration": 1}
    assert srv.stats()["keys"] == 0 and srv.stats()["store_bytes"] == 0
    # the same key declared well afterwards is served
    cli.submit(2, 0, x.view(np.uint8), y.view(np.uint8), WIRE_CODE["float32"], 1, 0,
               [(3, 0, 0, 0, x.nbytes, GOOD)])
    assert cli.wait(2, 20.0) and cli.take(2)[1] and (y == 1).all()


def test_a_meta_frame_longer_than_any_declaration_is_refused_unread(cleanup):
    srv, port = make_server(1)
    cleanup.append(srv)
    s = _raw(port)
    s.sendall(hello())
    assert HDR.unpack(s.recv(HDR.size, socket.MSG_WAITALL))[2] == 24
    s.sendall(HDR.pack(b"BPSL", 1, 20, 1, 2, 0, 1 | 2, 0xC0FFEE, 1, 0, 1, 4)
              + struct.pack("<I", DECL_MAX_BYTES + 1))
    assert closed_by_peer(s)
    deadline = time.monotonic() + 10
    while not srv.rejected() and time.monotonic() < deadline:
        time.sleep(0.02)  # the stream's close is seen before the count: wait for the count
    assert srv.rejected() == {"oversized meta": 1} and srv.stats()["keys"] == 0
