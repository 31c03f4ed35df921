"""Unit tests of byteps_like.wire: round trips, the header contract, dtype names, and a decoder
that answers every malformed input with ProtocolError (never another exception, never a crash)."""
from __future__ import annotations

import ast
import json
import pathlib
import struct

import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from byteps_like import _core, wire
from byteps_like.errors import CommunicationError, ProtocolError
from byteps_like.wire import (
    DTYPE_CODE,
    DTYPES,
    FLAG_ASYNC,
    FLAG_DECLARE,
    FLAG_META,
    HEADER_SIZE,
    ITEMSIZE,
    MAGIC,
    MAX_META_BYTES,
    PAYLOAD_TYPES,
    VERSION,
    Header,
    Message,
    MsgType,
    Role,
    decode,
    decode_header,
    dtype_name,
    encode,
    encode_meta,
    job_hash,
)

REPO = pathlib.Path(__file__).resolve().parents[2]
DATA_TYPES = tuple(sorted(PAYLOAD_TYPES))  # with a payload frame (the tables' too, issue 31)
NATIVE_DATA = (MsgType.PUSH, MsgType.PULL_RESP)  # the native data plane's data messages
CONTROL_TYPES = tuple(t for t in MsgType if t not in DATA_TYPES)

# The header layout is a wire contract between releases: changing it needs a VERSION bump.
# magic, version, type, dtype, sender role, sender rank, flags, job, key, round, count, nbytes
LAYOUT = struct.Struct("<4sBBBBiIIQqQQ")

FUZZ = settings(max_examples=200, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def raw_header(*, magic: bytes = MAGIC, version: int = VERSION, mtype: int = int(MsgType.HEARTBEAT),
               dcode: int = 0, role: int = int(Role.WORKER), rank: int = 0, flags: int = 0,
               job: int = 0, key: int = 0, rnd: int = 0, count: int = 0, nbytes: int = 0) -> bytes:
    return LAYOUT.pack(magic, version, mtype, dcode, role, rank, flags, job, key, rnd, count,
                       nbytes)


def payload_as_array(payload, dtype) -> np.ndarray:
    return np.frombuffer(getattr(payload, "buffer", payload), dtype=dtype)


def expect_protocol_error(frames, *fragments: str, max_bytes: int | None = None) -> str:
    """decode(frames) must raise ProtocolError whose message contains every fragment."""
    with pytest.raises(ProtocolError) as info:
        decode(frames, max_bytes)
    text = str(info.value)
    for frag in fragments:
        assert frag in text, f"{frag!r} not in error message {text!r}"
    return text


# ------------------------------------------------------------------------------ header contract
def test_header_layout_is_the_documented_struct():
    assert HEADER_SIZE == LAYOUT.size == 52
    h = Header(MsgType.PUSH, "float64", Role.SERVER, 5, FLAG_DECLARE, 77, 123, -4, 10, 80)
    assert h.pack() == LAYOUT.pack(MAGIC, VERSION, 20, DTYPE_CODE["float64"], 1, 5, FLAG_DECLARE,
                                   77, 123, -4, 10, 80)


# ------------------------------------------------------- one definition for Python and C++
# csrc/wire.h defines the wire once; _core.wire_spec() exports it and wire.py takes its values
# from it. These hold the two languages together: every C++ name has its Python twin and the
# other way round, and a header packed by either is read the same by the other.
SPEC = _core.wire_spec()


def test_every_cpp_constant_has_its_python_twin_and_back():
    assert SPEC["magic"] == MAGIC == b"BPSL" and SPEC["version"] == VERSION
    assert SPEC["header_size"] == HEADER_SIZE == wire._HEADER.size
    assert {t.name: int(t) for t in MsgType} == SPEC["msg_types"]
    assert {r.name: int(r) for r in Role} == SPEC["roles"]
    py_flags = {n: getattr(wire, n) for n in dir(wire) if n.startswith("FLAG_")}
    assert py_flags == SPEC["flags"]
    assert "FLAG_AUTH" in py_flags and MsgType.HELLO == 24   # once only in C++
    assert wire.CONTRIB_SHIFT == SPEC["contrib_shift"]
    assert MAX_META_BYTES == SPEC["max_meta"]
    assert [(n, ITEMSIZE[n], n in wire.SUMMABLE) for n in DTYPES] == \
        [tuple(d) for d in SPEC["dtypes"]]
    assert set(wire.NUMPY_DTYPE) == set(DTYPES) - {"none"}
    for name, np_dtype in wire.NUMPY_DTYPE.items():
        assert np.dtype(np_dtype).itemsize == ITEMSIZE[name], name
    # no two names share a value (an IntEnum would make one an alias of the other)
    assert len(set(SPEC["msg_types"].values())) == len(SPEC["msg_types"])
    assert len(set(SPEC["flags"].values())) == len(SPEC["flags"])
    assert all(v & (v - 1) == 0 for v in SPEC["flags"].values())   # one bit each
    assert max(SPEC["flags"].values()) < 1 << SPEC["contrib_shift"]


def test_header_fields_offsets_and_codes_are_the_cpp_structs():
    fields = SPEC["header"]
    assert tuple(f[0] for f in fields) == wire.HEADER_FIELDS == (
        "magic", "version", "type", "dtype", "role", "rank", "flags", "job", "key", "round",
        "count", "nbytes")
    assert "<" + "".join(f[3] for f in fields) == LAYOUT.format == wire._HEADER.format
    offset = 0
    for name, off, size, code in fields:
        assert (off, size) == (offset, struct.calcsize("<" + code)), name
        offset += size
    assert offset == HEADER_SIZE


def _fields(h: Header) -> dict:
    return {"magic": MAGIC, "version": VERSION, "type": int(h.type), "dtype": DTYPE_CODE[h.dtype],
            "role": int(h.role), "rank": h.rank, "flags": h.flags, "job": h.job, "key": h.key,
            "round": h.round, "count": h.count, "nbytes": h.nbytes}


@settings(max_examples=200, deadline=None)
@given(mtype=st.sampled_from(list(MsgType)), role=st.sampled_from(list(Role)),
       rank=st.integers(-2 ** 31, 2 ** 31 - 1), flags=st.integers(0, 2 ** 32 - 1),
       job=st.integers(0, 2 ** 32 - 1), key=st.integers(0, 2 ** 64 - 1),
       rnd=st.integers(-2 ** 63, 2 ** 63 - 1), dtype=st.sampled_from(DTYPES[1:]),
       count=st.integers(0, 2 ** 40))
def test_headers_packed_by_one_language_are_read_by_the_other(mtype, role, rank, flags, job, key,
                                                              rnd, dtype, count):
    h = Header(mtype, dtype, role, rank, flags, job, key, rnd, count, count * ITEMSIZE[dtype])
    parsed = _core.wire_parse_header(h.pack())            # Python packs, C++ reads
    assert parsed.pop("valid_data") == (mtype in NATIVE_DATA)
    assert parsed == _fields(h)
    f = _fields(h)
    raw = _core.wire_pack_header(f["type"], f["dtype"], f["role"], rank, flags, job, key, rnd,
                                 count, f["nbytes"])      # C++ packs, Python reads
    assert raw == h.pack()
    assert decode_header(raw) == h


@FUZZ
@given(dtype=st.sampled_from(DTYPES[1:]), count=st.integers(0, 2 ** 64 - 1),
       nbytes=st.integers(0, 2 ** 64 - 1))
def test_both_languages_agree_on_count_and_nbytes(dtype, count, nbytes):
    """C++ checks count against nbytes without overflow, as Python's integers do."""
    raw = raw_header(mtype=int(MsgType.PUSH), dcode=DTYPE_CODE[dtype], count=count,
                     nbytes=nbytes)
    assert _core.wire_parse_header(raw)["valid_data"] == (count * ITEMSIZE[dtype] == nbytes)


def test_a_count_that_wraps_times_itemsize_is_refused_by_both():
    count, nbytes = (1 << 61) + 1000, 8000   # count * 8 is 8,000 modulo 2^64
    assert count * 8 % (1 << 64) == nbytes
    raw = raw_header(mtype=int(MsgType.PUSH), dcode=DTYPE_CODE["float64"], count=count,
                     nbytes=nbytes)
    assert not _core.wire_parse_header(raw)["valid_data"]
    expect_protocol_error([raw, b"\0" * nbytes], f"{count} x float64", "header says 8000")


def test_protocol_error_is_a_communication_error():
    assert issubclass(ProtocolError, CommunicationError)


def test_job_hash_is_stable_32_bit():
    assert job_hash("default") == job_hash("default")
    assert job_hash("a") != job_hash("b")
    assert 0 <= job_hash("x" * 1000) < 2 ** 32
    assert job_hash("") == 2166136261  # FNV-1a offset basis


# ------------------------------------------------------------------------------ round trips
ARR = np.arange(1000, dtype=np.float32) * 0.5  # 4000 bytes


def _payload(kind: str):
    if kind == "bytes":
        return ARR.tobytes()
    if kind == "numpy":
        return ARR
    if kind == "numpy2d":
        return ARR.reshape(40, 25)
    if kind == "memoryview":
        return memoryview(ARR)
    if kind == "frame":
        return zmq.Frame(ARR, copy=False)
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["bytes", "numpy", "numpy2d", "memoryview", "frame"])
@pytest.mark.parametrize("mtype", DATA_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("meta", [None, {"name": "layer1.weight", "shape": [40, 25]}])
def test_data_message_round_trip(mtype, kind, meta):
    header = Header(mtype, "float32", Role.SERVER, 3, FLAG_ASYNC | FLAG_DECLARE, job_hash("j"),
                    (7 << 16) | 2, 2 ** 40, ARR.size, ARR.nbytes)
    payload = _payload(kind)
    frames = encode(header, payload, meta)
    assert len(frames) == 2 + (meta is not None)
    assert frames[1] is payload, "the payload buffer must pass through encode untouched"
    msg = decode(frames, max_bytes=ARR.nbytes)
    assert isinstance(msg, Message)
    want_flags = header.flags | (FLAG_META if meta is not None else 0)
    assert msg.header == Header(**{**header.__dict__, "flags": want_flags})
    assert msg.meta == meta
    np.testing.assert_array_equal(payload_as_array(msg.payload, np.float32), ARR)


@pytest.mark.parametrize("mtype", CONTROL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("meta", [None, {}, {"role": "worker", "ranks": [0, 1], "x": 1.5,
                                              "ok": True, "none": None, "text": "ünïcödé ✓"}])
def test_control_message_round_trip(mtype, meta):
    header = Header(mtype, "none", Role.SCHEDULER, -1, 0, 2 ** 32 - 1, 2 ** 64 - 1, -(2 ** 63),
                    5, 9)
    frames = encode(header, None, meta)
    assert len(frames) == 1 + (meta is not None)
    msg = decode(frames)
    assert msg.header.type is mtype
    assert msg.header == Header(**{**header.__dict__,
                                   "flags": FLAG_META if meta is not None else 0})
    assert msg.payload is None
    assert msg.meta == meta


@pytest.mark.parametrize("mtype", list(MsgType), ids=lambda t: t.name)
def test_round_trip_through_zmq_frames(mtype, zmq_context):
    """What a receiver really gets: zmq.Frame objects from recv_multipart(copy=False)."""
    data = mtype in DATA_TYPES
    arr = np.arange(50_000, dtype=np.int64)  # 400 kB: large enough for a real zero-copy frame
    header = Header(mtype, "int64" if data else "none", Role.WORKER, 1, 0, 9, 42, 3,
                    arr.size if data else 0, arr.nbytes if data else 0)
    a, b = zmq_context.socket(zmq.PAIR), zmq_context.socket(zmq.PAIR)
    try:
        a.bind("inproc://wire-rt")
        b.connect("inproc://wire-rt")
        a.send_multipart(encode(header, zmq.Frame(arr, copy=False) if data else None,
                                {"k": mtype.name}), copy=False)
        assert b.poll(5000)
        frames = b.recv_multipart(copy=False)
    finally:
        a.close(0)
        b.close(0)
    assert all(isinstance(f, zmq.Frame) for f in frames)
    msg = decode(frames, max_bytes=1 << 20)
    assert msg.header.key == 42 and msg.header.type is mtype and msg.meta == {"k": mtype.name}
    if data:
        np.testing.assert_array_equal(payload_as_array(msg.payload, np.int64), arr)
    else:
        assert msg.payload is None


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != "none"])
def test_every_wire_dtype_round_trips(dtype):
    n = 17
    payload = bytes(range(n * ITEMSIZE[dtype]))
    h = Header(MsgType.PULL_RESP, dtype, Role.SERVER, 0, 0, 0, 1, 1, n, len(payload))
    msg = decode(encode(h, payload))
    assert msg.header.dtype == dtype and bytes(msg.payload) == payload


@settings(max_examples=200, deadline=None)
@given(mtype=st.sampled_from(list(MsgType)), role=st.sampled_from(list(Role)),
       rank=st.integers(-2 ** 31, 2 ** 31 - 1), flags=st.integers(0, 2 ** 32 - 1),
       job=st.integers(0, 2 ** 32 - 1), key=st.integers(0, 2 ** 64 - 1),
       rnd=st.integers(-2 ** 63, 2 ** 63 - 1), dtype=st.sampled_from(DTYPES[1:]),
       count=st.integers(0, 64))
def test_header_round_trip_property(mtype, role, rank, flags, job, key, rnd, dtype, count):
    data = mtype in DATA_TYPES
    flags &= ~FLAG_META  # the meta flag follows the frames actually present
    nbytes = count * ITEMSIZE[dtype]
    h = Header(mtype, dtype, role, rank, flags, job, key, rnd, count, nbytes)
    assert decode_header(h.pack()) == h
    msg = decode(encode(h, b"\0" * nbytes if data else None))
    assert msg.header == h


def test_meta_json_round_trip_and_bounds():
    meta = {"nodes": [{"role": "server", "rank": i, "host": f"10.0.0.{i}", "port": 9000 + i}
                      for i in range(100)], "nested": {"a": [1, 2.5, None, True, "x"]}}
    raw = encode_meta(meta)
    assert json.loads(raw) == meta
    assert decode(encode(Header(MsgType.NODE_TABLE), meta=meta)).meta == meta
    with pytest.raises(ProtocolError, match=str(MAX_META_BYTES)):
        encode_meta({"blob": "x" * MAX_META_BYTES})


def test_data_message_without_payload_is_refused_at_encode():
    with pytest.raises(ProtocolError, match="PUSH needs a payload"):
        encode(Header(MsgType.PUSH, "float32", count=1, nbytes=4))


# ------------------------------------------------------------------------------ dtype names
@pytest.mark.parametrize("dt, name", [
    (np.float32, "float32"), (np.dtype("float64"), "float64"), ("float16", "float16"),
    (np.int32, "int32"), (np.dtype(np.int64), "int64"), (np.uint8, "uint8"), ("int8", "int8"),
    ("bfloat16", "bfloat16"), ("f4", "float32"), ("<i8", "int64"),
])
def test_dtype_name_supported(dt, name):
    assert dtype_name(dt) == name
    assert name in DTYPE_CODE


@pytest.mark.parametrize("dt, shown", [
    (np.complex64, "complex64"), (np.complex128, "complex128"), (complex, "complex128"),
    (object, "object"), (np.dtype("O"), "object"), (bool, "bool"), (np.bool_, "bool"),
    (np.uint16, "uint16"), (np.uint32, "uint32"), (np.uint64, "uint64"),
    ("datetime64[s]", "datetime64[s]"), ("U4", "str128"), ("none", "none"),
    ("not-a-dtype", "not-a-dtype"),
])
def test_dtype_name_rejects_unsupported_with_a_clear_message(dt, shown):
    with pytest.raises(TypeError) as info:
        dtype_name(dt)
    text = str(info.value)
    assert "unsupported dtype" in text and shown in text, text


def test_dtype_name_rejection_lists_the_summable_dtypes():
    with pytest.raises(TypeError) as info:
        dtype_name(np.complex64)
    for name in ("float32", "float64", "float16", "bfloat16", "int32", "int64"):
        assert name in str(info.value)


# ---------------------------------------------------------------------- targeted decode errors
def test_empty_message():
    expect_protocol_error([], "empty message")


@pytest.mark.parametrize("n", [0, 1, HEADER_SIZE - 1, HEADER_SIZE + 1, 4096])
def test_header_of_wrong_length(n):
    expect_protocol_error([b"\0" * n], "bad header", f"{n} bytes", f"expected {HEADER_SIZE}")


def test_data_type_without_dtype():
    expect_protocol_error([raw_header(mtype=int(MsgType.PUSH), dcode=0), b""], "PUSH",
                          "without a dtype")


def test_nesting_bomb_in_meta_is_a_protocol_error():
    """Deeply nested JSON well under MAX_META_BYTES: json raises RecursionError, which must
    not escape (it would kill the receiving I/O thread: a remote crash of any node)."""
    head = raw_header(mtype=int(MsgType.REGISTER), flags=FLAG_META)
    for bomb in (b"[" * 100_000, b'{"a":' * 50_000):
        expect_protocol_error([head, bomb], "REGISTER", "meta")


@pytest.mark.parametrize("text", [b'{"a": NaN}', b'{"a": Infinity}', b'{"a": -Infinity}'])
def test_non_standard_json_constants_are_rejected(text):
    """encode_meta refuses NaN/Infinity (allow_nan=False); the decoder must not accept what is
    not JSON either."""
    expect_protocol_error([raw_header(mtype=int(MsgType.REGISTER), flags=FLAG_META), text],
                          "meta")


def test_oversized_meta_frame():
    head = raw_header(mtype=int(MsgType.NODE_TABLE), flags=FLAG_META)
    big = b'{"a":"' + b"x" * MAX_META_BYTES + b'"}'
    expect_protocol_error([head, big], "NODE_TABLE", "meta", str(MAX_META_BYTES))


def test_meta_exactly_at_the_limit_is_accepted():
    head = raw_header(mtype=int(MsgType.NODE_TABLE), flags=FLAG_META)
    prefix, suffix = b'{"a":"', b'"}'
    raw = prefix + b"x" * (MAX_META_BYTES - len(prefix) - len(suffix)) + suffix
    assert len(raw) == MAX_META_BYTES
    assert len(decode([head, raw]).meta["a"]) == MAX_META_BYTES - 8


# ------------------------------------------------------------------------------ fuzzing the decoder
def _check_decoded(msg: Message, frames, max_bytes) -> None:
    """Invariants of anything the decoder accepts."""
    h = msg.header
    assert isinstance(h.type, MsgType) and isinstance(h.role, Role) and h.dtype in DTYPE_CODE
    data = h.type in DATA_TYPES
    assert len(frames) == 1 + data + bool(h.flags & FLAG_META)
    if data:
        assert h.dtype != "none"
        assert h.count * ITEMSIZE[h.dtype] == h.nbytes == memoryview(msg.payload).nbytes
        assert max_bytes is None or h.nbytes <= max_bytes
    else:
        assert msg.payload is None
    assert msg.meta is None or isinstance(msg.meta, dict)


def _decode_or_protocol_error(frames, max_bytes=None) -> None:
    try:
        msg = decode(frames, max_bytes)
    except ProtocolError as exc:
        assert str(exc), "a ProtocolError must say what was wrong"
        return
    _check_decoded(msg, frames, max_bytes)


@FUZZ
@given(frames=st.lists(st.binary(max_size=128), max_size=5),
       max_bytes=st.none() | st.integers(0, 256))
def test_random_frames_never_crash(frames, max_bytes):
    _decode_or_protocol_error(frames, max_bytes)


@FUZZ
@given(frames=st.lists(st.binary(min_size=HEADER_SIZE, max_size=HEADER_SIZE)
                       .map(lambda b: MAGIC + bytes([VERSION]) + b[5:]), min_size=1, max_size=1)
       .flatmap(lambda hs: st.lists(st.binary(max_size=64), max_size=4).map(lambda r: hs + r)))
def test_random_headers_with_valid_magic_never_crash(frames):
    """Past the magic and version, every field is random: most fail one check or another."""
    _decode_or_protocol_error(frames)


_small_meta = st.one_of(
    st.binary(max_size=64),
    st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                 lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c,
                                                                      max_size=3),
                 max_leaves=8).map(lambda v: json.dumps(v).encode()),
)


@FUZZ
@given(mtype=st.integers(0, 255), dcode=st.integers(0, 255), role=st.integers(0, 255),
       flags=st.integers(0, 2 ** 32 - 1), count=st.integers(0, 40), slack=st.integers(-3, 3),
       payload_len=st.integers(0, 200), meta=_small_meta, nframes_delta=st.integers(-1, 1),
       max_bytes=st.none() | st.integers(0, 200))
def test_structured_fuzz_never_crashes(mtype, dcode, role, flags, count, slack, payload_len,
                                       meta, nframes_delta, max_bytes):
    """Headers near the valid region: small counts, byte lengths off by a little, the meta flag
    random, meta frames of random bytes or arbitrary JSON values, one frame too few or too many."""
    isz = ITEMSIZE.get(DTYPES[dcode], 1) if dcode < len(DTYPES) else 1
    nbytes = max(0, count * isz + slack)
    frames = [raw_header(mtype=mtype, dcode=dcode, role=role, flags=flags, count=count,
                         nbytes=nbytes)]
    if mtype in {int(t) for t in DATA_TYPES}:
        frames.append(b"\x01" * payload_len)
    if flags & FLAG_META:
        frames.append(meta)
    if nframes_delta < 0 and len(frames) > 1:
        frames.pop()
    elif nframes_delta > 0:
        frames.append(meta)
    _decode_or_protocol_error(frames, max_bytes)


# -- one property per kind of malformation: always ProtocolError, and the message names it
@FUZZ
@given(raw=st.binary(max_size=HEADER_SIZE - 1), cut=st.integers(0, HEADER_SIZE - 1))
def test_truncated_headers(raw, cut):
    expect_protocol_error([raw], "bad header", f"{len(raw)} bytes")
    valid = Header(MsgType.PUSH, "float32", count=1, nbytes=4).pack()
    expect_protocol_error([valid[:cut], b"\0" * 4], "bad header", f"{cut} bytes")


@FUZZ
@given(magic=st.binary(min_size=4, max_size=4).filter(lambda m: m != MAGIC))
def test_wrong_magic(magic):
    expect_protocol_error([raw_header(magic=magic)], "bad magic", repr(magic))


# a one-byte code this side does not know, field by field: (which codes are unknown, the rest
# of the message, what the error says: {} is the code)
UNKNOWN_CODES = {
    "version": (lambda v: v != VERSION, {}, [], ("protocol version {}", f"speaks {VERSION}")),
    "mtype": (lambda c: c not in {int(t) for t in MsgType}, {}, [], ("unknown message type {}",)),
    "dcode": (lambda c: c >= len(DTYPES), {"mtype": int(MsgType.PUSH)}, [b""],
              ("unknown dtype code {}",)),
    "role": (lambda c: c not in {int(r) for r in Role}, {}, [], ("unknown sender role {}",)),
}


@pytest.mark.parametrize("field", sorted(UNKNOWN_CODES))
@FUZZ
@given(data=st.data())
def test_an_unknown_code_is_named(field, data):
    unknown, fields, rest, says = UNKNOWN_CODES[field]
    code = data.draw(st.integers(0, 255).filter(unknown), label=field)
    expect_protocol_error([raw_header(**{field: code}, **fields)] + rest,
                          *(s.format(code) for s in says))


@FUZZ
@given(mtype=st.sampled_from(DATA_TYPES), dtype=st.sampled_from(DTYPES[1:]),
       count=st.integers(0, 2 ** 40), nbytes=st.integers(0, 2 ** 64 - 1))
def test_count_times_itemsize_differs_from_nbytes(mtype, dtype, count, nbytes):
    assume(count * ITEMSIZE[dtype] != nbytes)
    frames = [raw_header(mtype=int(mtype), dcode=DTYPE_CODE[dtype], count=count, nbytes=nbytes,
                         key=99), b""]
    expect_protocol_error(frames, mtype.name, "key 99", f"{count} x {dtype}",
                          f"header says {nbytes}")


@FUZZ
@given(mtype=st.sampled_from(DATA_TYPES), dtype=st.sampled_from(DTYPES[1:]),
       count=st.integers(0, 64), actual=st.integers(0, 600))
def test_payload_length_differs_from_nbytes(mtype, dtype, count, actual):
    nbytes = count * ITEMSIZE[dtype]
    assume(actual != nbytes)
    frames = [raw_header(mtype=int(mtype), dcode=DTYPE_CODE[dtype], count=count, nbytes=nbytes),
              b"\0" * actual]
    expect_protocol_error(frames, mtype.name, f"payload is {actual} bytes",
                          f"header says {nbytes}")


@FUZZ
@given(mtype=st.sampled_from(list(MsgType)), meta_flag=st.booleans(), n=st.integers(1, 6))
def test_wrong_number_of_frames(mtype, meta_flag, n):
    data = mtype in DATA_TYPES
    want = 1 + data + meta_flag
    assume(n != want)
    head = raw_header(mtype=int(mtype), dcode=DTYPE_CODE["uint8"] if data else 0,
                      flags=FLAG_META if meta_flag else 0)
    frames = [head] + [b"{}"] * (n - 1)
    expect_protocol_error(frames, mtype.name, f"{n} frames", f"expected {want}")


@FUZZ
@given(mtype=st.sampled_from(DATA_TYPES), n=st.integers(1, 4096), data=st.data())
def test_oversized_payload_against_max_bytes(mtype, n, data):
    max_bytes = data.draw(st.integers(0, n - 1))
    frames = [raw_header(mtype=int(mtype), dcode=DTYPE_CODE["uint8"], count=n, nbytes=n), b"\0" * n]
    expect_protocol_error(frames, mtype.name, f"payload of {n} bytes",
                          f"limit of {max_bytes}", max_bytes=max_bytes)
    assert decode(frames, max_bytes=n).header.nbytes == n  # the limit itself is allowed


def _not_json(raw: bytes) -> bool:
    try:
        json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return True
    return False


@FUZZ
@given(raw=st.binary(max_size=200).filter(_not_json))
def test_meta_not_json(raw):
    head = raw_header(mtype=int(MsgType.BARRIER), flags=FLAG_META)
    expect_protocol_error([head, raw], "BARRIER", "meta frame is not UTF-8 JSON")


@FUZZ
@given(value=st.none() | st.booleans() | st.integers() | st.text()
       | st.lists(st.integers(), max_size=4) | st.floats(allow_nan=False, allow_infinity=False))
def test_meta_not_an_object(value):
    head = raw_header(mtype=int(MsgType.BARRIER), flags=FLAG_META)
    expect_protocol_error([head, json.dumps(value).encode()], "BARRIER",
                          "meta frame is not a JSON object")


@FUZZ
@given(prefix=st.text(max_size=20), bad=st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80",
                                                           b"\xf8\x88\x80\x80\x80", b"\x80"]))
def test_meta_not_utf8(prefix, bad):
    raw = b'{"a": "' + prefix.encode() + bad + b'"}'
    head = raw_header(mtype=int(MsgType.REGISTER), flags=FLAG_META)
    expect_protocol_error([head, raw], "meta frame is not UTF-8 JSON")


@settings(max_examples=20, deadline=None)
@given(extra=st.integers(1, 4096))
def test_oversized_meta_property(extra):
    head = raw_header(mtype=int(MsgType.NODE_TABLE), flags=FLAG_META)
    expect_protocol_error([head, b" " * (MAX_META_BYTES + extra)], "meta frame exceeds",
                          str(MAX_META_BYTES))


# ------------------------------------------------------------------------------ nothing unpickled
PICKLE_MODULES = {"pickle", "cPickle", "_pickle", "marshal", "shelve", "dill", "cloudpickle",
                  "joblib", "copyreg"}
ZMQ_PICKLING = {"recv_pyobj", "send_pyobj", "recv_serialized", "send_serialized"}


def _package_sources():
    for top in ("byteps_like", "server", "scheduler", "launcher"):
        yield from sorted((REPO / top).rglob("*.py"))


def pickle_uses(tree: ast.AST, rel: str) -> list[str]:
    """Imports and uses of pickle-like modules, pyzmq's pickling helpers and allow_pickle.
    An AST walk, so comments and docstrings ("nothing is unpickled") do not count."""
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] + [a.name for a in node.names]
        elif isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.Attribute) and node.attr in ZMQ_PICKLING:
            found.append(f"{rel}:{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.keyword) and node.arg == "allow_pickle":
            if not (isinstance(node.value, ast.Constant) and node.value.value is False):
                found.append(f"{rel}:{node.value.lineno}: allow_pickle={ast.unparse(node.value)}")
        found += [f"{rel}:{node.lineno}: {name}" for name in names
                  if name.split(".")[0] in PICKLE_MODULES]
    return found


def test_pickle_scan_catches_what_it_should():
    code = '''"""Nothing from the network is unpickled."""
import json  # not pickle
import pickle as p
from marshal import loads
def f(sock, np, buf):
    sock.recv_pyobj()
    np.load(buf, allow_pickle=True)
    np.load(buf, allow_pickle=False)
'''
    assert [hit.split(":")[1] for hit in pickle_uses(ast.parse(code), "x.py")] == \
        ["3", "4", "6", "7"]


def test_nothing_in_the_package_uses_pickle_or_marshal():
    found = []
    for path in _package_sources():
        rel = path.relative_to(REPO).as_posix()
        found += pickle_uses(ast.parse(path.read_text(), rel), rel)
    assert not found, "pickle/marshal on the wire path:\n" + "\n".join(found)


def test_the_pickle_scan_sees_the_package():
    files = {p.relative_to(REPO).as_posix() for p in _package_sources()}
    assert {"byteps_like/wire.py", "byteps_like/transport/zmq_transport.py",
            "server/core.py", "scheduler/core.py"} <= files
