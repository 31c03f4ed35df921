"""The restricted object codec behind broadcast_object: round trips, and hostile input."""
from __future__ import annotations

import math
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from byteps_like.worker import objcodec
from byteps_like.worker.objcodec import CodecError, decode, encode

scalars = (st.none() | st.booleans() | st.integers() | st.text()
           | st.floats(allow_nan=False) | st.binary(max_size=64))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.tuples(inner, inner)
                      | st.dictionaries(st.text(max_size=5) | st.integers(), inner, max_size=4),
                      max_leaves=20)


@settings(max_examples=200, deadline=None)
@given(values)
def test_round_trip(v):
    assert decode(encode(v)) == v


def test_arrays_special_floats_and_big_ints():
    obj = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "z": np.array(3, np.int64),
           "nan": math.nan, "inf": -math.inf, "big": 2**80, (1, "k"): b"\x00"}
    got = decode(encode(obj))
    assert got["a"].shape == (2, 3) and got["a"].dtype == np.float32
    assert np.array_equal(got["a"], obj["a"]) and got["z"].shape == ()
    assert math.isnan(got["nan"]) and got["inf"] == -math.inf and got["big"] == 2**80
    assert got[(1, "k")] == b"\x00"


class FakeTensor:
    pass


def test_tensor_hooks():
    data = encode([1, FakeTensor()],
                  to_array=lambda x: ("tag", np.ones(2)) if isinstance(x, FakeTensor) else None)
    assert decode(data, from_array=lambda tag, a: (tag, a.tolist())) == [1, ("tag", [1.0, 1.0])]
    with pytest.raises(CodecError, match="no framework hook"):
        decode(data)


@pytest.mark.parametrize("obj", [object(), {1, 2}, np.array(["s"]), lambda: 0])
def test_unsupported_types_are_refused_naming_the_type(obj):
    with pytest.raises(TypeError, match="no pickle|cannot be sent"):
        encode(obj)


def _raw(doc: bytes, blobs: bytes = b"") -> bytes:
    return struct.pack("<4sIQ", b"BPSO", 1, len(doc)) + doc + blobs


@pytest.mark.parametrize("data", [
    b"", b"BPSO", b"PICK" + b"\0" * 12, _raw(b'{"x"')[:-1], _raw(b"not json"),
    _raw(b'{"b":[0,10]}', b"abc"),                       # blob past the end
    _raw(b'{"b":[-1,1]}', b"abc"),                       # negative offset
    _raw(b'{"a":{"dtype":"object","shape":[1],"ref":[0,8]}}', b"\0" * 8),
    _raw(b'{"a":{"dtype":"int64","shape":[2],"ref":[0,8]}}', b"\0" * 8),  # shape vs bytes
    _raw(b'{"a":{"dtype":"int64","shape":[-1],"ref":[0,8]}}', b"\0" * 8),
    _raw(b'{"q":1}'), _raw(b'{"d":[[{"d":[]},1]]}'), _raw(b"[" * 100000),
    _raw(b'{"f":"1e"}'),
])
def test_hostile_input_raises_codec_error(data):
    with pytest.raises((CodecError, ValueError)):
        decode(data)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_never_crash(data):
    try:
        decode(objcodec.MAGIC + data)
    except (CodecError, ValueError):
        pass
