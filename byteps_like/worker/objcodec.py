"""A safe serialiser for ``broadcast_object`` and optimizer state: no pickle, every length checked.

Supported values: None, bool, int, float (nan/inf too), str, bytes, list, tuple, dict (any keys
of these types), numpy arrays of numeric dtypes, and framework tensors through a pair of hooks
the plugin passes in. Anything else raises TypeError naming the type, so nothing executable can
travel. Layout::

    b"BPSO" | u32 version | u64 json length | json (UTF-8) | blobs

The JSON tree refers to blobs by (offset, length); decoding checks every reference against the
buffer, every dtype against an allow-list and every shape against the blob length.
"""
from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable
from typing import Any

import numpy as np

MAGIC = b"BPSO"
VERSION = 1
_HEAD = struct.Struct("<4sIQ")
_DTYPES = {"bool", "uint8", "int8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
           "float16", "float32", "float64", "complex64", "complex128"}

# to_array(obj) -> (tag, ndarray) or None when obj is not a tensor; from_array(tag, ndarray) -> obj
ToArray = Callable[[Any], "tuple[str, np.ndarray] | None"]
FromArray = Callable[[str, np.ndarray], Any]


class CodecError(ValueError):
    """The bytes are not a valid encoding (truncated, corrupted or from another format)."""


def encode(obj: Any, to_array: ToArray | None = None) -> bytes:
    blobs: list[bytes] = []
    offset = [0]

    def blob(data: bytes) -> list[int]:
        ref = [offset[0], len(data)]
        blobs.append(data)
        offset[0] += len(data)
        return ref

    def enc(x: Any) -> Any:
        if x is None or isinstance(x, (bool, str)):
            return x
        if isinstance(x, int):
            return {"i": str(x)} if abs(x) >= 2**53 else x
        if isinstance(x, float):
            return x if math.isfinite(x) else {"f": repr(x)}
        if isinstance(x, (bytes, bytearray, memoryview)):
            return {"b": blob(bytes(x))}
        if isinstance(x, list):
            return [enc(v) for v in x]
        if isinstance(x, tuple):
            return {"t": [enc(v) for v in x]}
        if isinstance(x, dict):
            return {"d": [[enc(k), enc(v)] for k, v in x.items()]}
        if isinstance(x, np.generic):
            return enc(x.item())
        if isinstance(x, np.ndarray):
            return {"a": _array(x, blob)}
        if to_array is not None:
            got = to_array(x)
            if got is not None:
                tag, arr = got
                return {"T": tag, "a": _array(arr, blob)}
        raise TypeError(f"broadcast_object cannot send a {type(x).__module__}.{type(x).__name__}: "
                        "only None, bool, int, float, str, bytes, list, tuple, dict, numpy arrays "
                        "and tensors travel (no pickle)")

    doc = json.dumps(enc(obj), separators=(",", ":")).encode()
    return _HEAD.pack(MAGIC, VERSION, len(doc)) + doc + b"".join(blobs)


def _array(a: np.ndarray, blob) -> dict:
    if a.dtype.name not in _DTYPES:
        raise TypeError(f"arrays of dtype {a.dtype} cannot be sent")
    # tobytes() is C order whatever the layout (ascontiguousarray would turn 0-d into 1-d)
    return {"dtype": a.dtype.name, "shape": list(a.shape), "ref": blob(a.tobytes())}


def decode(data: bytes | memoryview, from_array: FromArray | None = None) -> Any:
    mv = memoryview(data).cast("B")
    if mv.nbytes < _HEAD.size:
        raise CodecError(f"object encoding truncated: {mv.nbytes} bytes")
    magic, version, n = _HEAD.unpack(mv[:_HEAD.size])
    if magic != MAGIC or version != VERSION:
        raise CodecError(f"not an object encoding (magic {bytes(magic)!r}, version {version})")
    if _HEAD.size + n > mv.nbytes:
        raise CodecError(f"object encoding truncated: header says {n} bytes of JSON")
    try:
        tree = json.loads(bytes(mv[_HEAD.size:_HEAD.size + n]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CodecError(f"corrupt object encoding: {exc}") from None
    blobs = mv[_HEAD.size + n:]

    def ref(r: Any) -> memoryview:
        if (not isinstance(r, list) or len(r) != 2 or not all(type(v) is int for v in r)
                or r[0] < 0 or r[1] < 0 or r[0] + r[1] > blobs.nbytes):
            raise CodecError(f"bad blob reference {r!r} ({blobs.nbytes} bytes of blobs)")
        return blobs[r[0]:r[0] + r[1]]

    def arr(spec: Any) -> np.ndarray:
        if not isinstance(spec, dict) or spec.get("dtype") not in _DTYPES:
            raise CodecError(f"bad array spec {spec!r}")
        shape = spec.get("shape")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise CodecError(f"bad array shape {shape!r}")
        raw = ref(spec.get("ref"))
        dt = np.dtype(spec["dtype"])
        if math.prod(shape) * dt.itemsize != raw.nbytes:
            raise CodecError(f"array of shape {shape} {dt} does not match {raw.nbytes} bytes")
        return np.frombuffer(raw, dt).reshape(shape).copy()

    def dec(x: Any) -> Any:
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        if isinstance(x, list):
            return [dec(v) for v in x]
        if not isinstance(x, dict) or len(x) not in (1, 2):
            raise CodecError(f"unexpected node {str(x)[:80]}")
        if "T" in x:
            if from_array is None:
                raise CodecError("a tensor arrived but no framework hook was given")
            return from_array(str(x["T"]), arr(x.get("a")))
        (tag, v), = x.items()
        if tag == "i":
            return int(v)
        if tag == "f":
            return float(v)
        if tag == "b":
            return bytes(ref(v))
        if tag == "t":
            return tuple(dec(e) for e in v)
        if tag == "d":
            if not isinstance(v, list):
                raise CodecError("bad dict node")
            out = {}
            for pair in v:
                if not isinstance(pair, list) or len(pair) != 2:
                    raise CodecError("bad dict item")
                try:
                    out[dec(pair[0])] = dec(pair[1])
                except TypeError:
                    raise CodecError("unhashable dict key") from None
            return out
        if tag == "a":
            return arr(v)
        raise CodecError(f"unknown tag {tag!r}")

    try:
        return dec(tree)
    except RecursionError:
        raise CodecError("object encoding nested too deeply") from None
