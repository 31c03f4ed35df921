"""The codec frame has one definition, csrc/codec.h: compression.py derives its header structs,
magic, version and codec ids from ``_core.codec_frame_spec()``. A frame packed by either side is
read by the other, field by field, and a frame wrong in one field is refused by both, naming it."""
from __future__ import annotations

import struct

import numpy as np
import pytest

from byteps_like import _core
from byteps_like import compression as C
from byteps_like.compression import Compression, CompressionError

SPEC = _core.codec_frame_spec()
N, STEP, KEY = 1000, 7, 11
X = np.random.default_rng(3).standard_normal(N).astype(np.float32)

# every built-in codec, as a compressor, with the value its header's field must carry
CASES = {
    "onebit": Compression.onebit(),
    "topk": Compression.topk(17),
    "randomk": Compression.randomk(23, seed=5),
    "dithering": Compression.dithering(5, seed=5),
}


def _codecs():
    """The Python codec classes that implement a frame (concrete _FramedCodec subclasses)."""
    todo, out = [C._FramedCodec], {}
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if "_NAME" in cls.__dict__:
            out[cls._NAME] = cls
    return out


def test_the_spec_is_the_20_byte_header_of_the_docs():
    assert SPEC["magic"] == b"BC" and SPEC["version"] == 1 and SPEC["header_size"] == 20
    assert [(f[0], f[1], f[2]) for f in SPEC["header"]] == [
        ("magic", 0, 2), ("version", 2, 1), ("id", 3, 1), ("n", 4, 4), ("step", 8, 8),
        ("field", 16, 4)]
    assert {name: (cid, code) for name, cid, code in SPEC["codecs"]} == {
        "onebit": (1, "f"), "topk": (2, "I"), "randomk": (3, "I"), "dithering": (4, "f")}


def test_python_takes_every_value_from_the_spec():
    assert (C.MAGIC, C.VERSION, C.HEADER_BYTES) == (SPEC["magic"], SPEC["version"],
                                                    SPEC["header_size"])
    classes = _codecs()
    # a codec on either side and not on the other is an error (compression.py refuses to import)
    assert set(classes) == {name for name, _cid, _code in SPEC["codecs"]} == set(CASES)
    for name, cid, code in SPEC["codecs"]:
        cls = classes[name]
        assert cls._ID == cid, name
        assert cls._HDR.size == SPEC["header_size"], name
        assert cls._HDR.format == "<" + "".join(code if f == "field" else c
                                                for f, _o, _s, c in SPEC["header"]), name
        assert C.native_params(CASES[name], N)[0] == cid, name


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_frame_cpp_packs_python_reads_field_by_field(name):
    comp = CASES[name]
    native = C.compiled_codec(comp, N, KEY)
    payload = bytes(native.encode(X, STEP))
    py = comp.make_codec(N, role="worker", key=KEY)
    magic, version, cid, n, step, field = py._HDR.unpack_from(payload, 0)
    assert (magic, version, cid, n, step) == (b"BC", 1, py._ID, N, STEP)
    if name in ("topk", "randomk"):
        assert field == py.k
    else:   # the scale / norm: a finite positive float32
        assert field > 0 and np.isfinite(field)
    out = np.empty(N, np.float32)
    assert py.decode(payload, out) == STEP   # the Python codec takes the C++ frame
    ref = np.empty(N, np.float32)
    native.decode(payload, ref)
    np.testing.assert_array_equal(out, ref)


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_frame_python_packs_cpp_reads_field_by_field(name):
    comp = CASES[name]
    py = comp.make_codec(N, role="worker", key=KEY)
    payload = bytes(py.encode(X, STEP))
    native = C.compiled_codec(comp, N, KEY)
    assert payload == bytes(native.encode(X, STEP))   # the same bytes, header included
    out = np.empty(N, np.float32)
    assert native.decode(payload, out) == STEP


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("field,value,says", [
    ("magic", b"BD", "bad magic/version"), ("version", 2, "bad magic/version"),
    ("id", 9, "compressor id 9"), ("n", N + 1, f"of {N + 1} elements")])
def test_a_frame_wrong_in_one_field_is_refused_by_both(name, field, value, says):
    comp = CASES[name]
    py = comp.make_codec(N, role="worker", key=KEY)
    good = bytearray(py.encode(X, STEP))
    names = [f for f, _o, _s, _c in SPEC["header"]]
    values = list(py._HDR.unpack_from(good, 0))
    values[names.index(field)] = value
    bad = bytearray(good)
    py._HDR.pack_into(bad, 0, *values)
    out = np.zeros(N, np.float32)
    with pytest.raises(CompressionError, match=says):
        py.decode(bytes(bad), out)
    with pytest.raises(CompressionError, match=says):
        C.compiled_codec(comp, N, KEY).decode(bytes(bad), out)
    assert not out.any(), "a refused frame left its output untouched"


def test_the_field_reads_as_the_codecs_struct_code():
    """onebit's scale is a float32 in the field: the C++ side stores its bits."""
    native = C.compiled_codec(CASES["onebit"], N, KEY)
    payload = bytes(native.encode(X, STEP))
    (scale,) = struct.unpack_from("<f", payload, 16)
    assert scale == pytest.approx(float(np.abs(X).mean()), rel=1e-5)


@pytest.mark.parametrize("change,says", [
    ("spec['codecs'] = spec['codecs'][:-1]", "defines ['onebit', 'randomk', 'topk']"),
    ("spec['codecs'].append(('fivebit', 5, 'I'))", "'fivebit'"),
    ("spec['header'][3] = ('n', 4, 4, 'Q')", "frame field n is at 4 with 4 bytes"),
    ("spec['header_size'] = 24", "frame header of 20 bytes, _core's is 24")])
def test_compression_refuses_to_import_against_another_frame(change, says):
    """A codec on one side only, or a field the struct code does not place where C++ does."""
    import subprocess
    import sys
    code = ("import byteps_like._core as c\n"
            "spec = c.codec_frame_spec()\n"
            f"{change}\n"
            "c.codec_frame_spec = lambda: spec\n"
            "try:\n"
            "    import byteps_like.compression\n"
            "except ImportError as exc:\n"
            "    print(exc)\n"
            "else:\n"
            "    print('imported')\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert says in p.stdout and "rebuild _core" in p.stdout, p.stdout
