"""A compressor registered by the test (not built in): its server codec is Python, run by the
native server through its codec factory (server/codecs.py). Payloads vary in size: the
elements of at least the mean magnitude, as (index, value) pairs after the step and their
count."""
from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from byteps_like.compression import Codec, CodecCompressor, CompressionError, register

_HEAD = struct.Struct("<QI")
_PAIR = np.dtype([("i", "<u4"), ("v", "<f4")])


class PairsCodec(Codec):
    """The elements ``select(x)`` picks, as (index, value) pairs after the step and their
    count: payloads of 12 to 12 + 8n bytes. ``what`` names the payload in errors. (The unit
    tests' codec, tests/unit/test_native_registered_codec.py, is one too.)"""
    what = "pairs"

    def __init__(self, n: int):
        self.n, self.max_bytes = n, _HEAD.size + 8 * n

    def select(self, x: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def encode(self, x: np.ndarray, step: int) -> np.ndarray:
        idx = self.select(x).astype(np.uint32)
        body = np.empty(len(idx), _PAIR)
        body["i"], body["v"] = idx, x[idx]
        return np.frombuffer(_HEAD.pack(step, len(idx)) + body.tobytes(), np.uint8)

    def decode(self, payload, out: np.ndarray) -> int:
        raw = bytes(payload)
        if len(raw) < _HEAD.size:
            raise CompressionError(f"{self.what} payload of {len(raw)} bytes")
        step, count = _HEAD.unpack_from(raw)
        if len(raw) != _HEAD.size + 8 * count:
            raise CompressionError(f"{self.what} payload: {count} pairs in {len(raw)} bytes")
        body = np.frombuffer(raw, _PAIR, count, _HEAD.size)
        if count and int(body["i"].max()) >= self.n:
            raise CompressionError(f"{self.what} payload: an index out of range")
        out[:] = 0
        out[body["i"]] = body["v"]
        return step


class LargeCodec(PairsCodec):
    """The elements of at least the mean magnitude."""
    what = "large"

    def select(self, x: np.ndarray) -> np.ndarray:
        mag = np.abs(x)
        return np.flatnonzero(mag >= mag.mean())


@dataclass(frozen=True)
class Large(CodecCompressor):
    name = "test-large"

    def spec(self) -> dict:
        return {"name": self.name}

    def _make(self, n: int, role: str, key: int) -> Codec:
        return LargeCodec(n)


def register_all() -> None:
    register("test-large", Large)
