"""Gradient compression, written once for every framework.

Two kinds of compressor, both immutable descriptions (:class:`Compressor`):

* **cast** (``Compression.none``, ``fp16``, ``bf16``): the array travels in another dtype and
  the servers sum that dtype natively. ``compress`` turns the array to be summed into the array
  that travels; ``decompress`` turns the summed array back into the caller's dtype.
* **codec** (``onebit``, ``topk``, ``randomk``, ``dithering``, and the wrappers
  :class:`ErrorFeedback` and :class:`NesterovMomentum`): ``make_codec(n, role=, key=)`` makes a
  stateful :class:`Codec` per tensor partition and role. Workers ``encode`` their float32
  partition into a byte payload; the server ``decode_add``\\ s every worker's payload into a
  float32 accumulator and ``encode``\\ s the sum (with the step ``decode`` returned), so the pull
  is compressed too; workers ``decode`` it. ``spec()`` is a JSON-safe dict the servers rebuild
  the compressor from with :func:`from_spec` (it is untrusted input there and validated).

Payloads start with a 20-byte little-endian header: magic ``b"BC"``, version (1), compressor
id (1 onebit, 2 top-k, 3 random-k, 4 dithering), element count n (u32), step (u64), and one
4-byte field (onebit: the scale f32; top-k, random-k: k u32; dithering: the norm f32), defined
once in csrc/codec.h and read here from ``_core.codec_frame_spec()``. Every
field and the exact payload length are checked on decode; a malformed payload raises
:class:`CompressionError` and never touches memory outside the buffers (the C++ kernels check
lengths and indices again, and validate before writing, so a rejected payload leaves an
accumulator untouched).

Non-finite values: top-k and random-k carry the values as they are (top-k ranks NaN above
inf); onebit (with scaling) and dithering fold them into the scale / norm. A *decoded* payload
is a peer's, so its numbers are checked too: a scale or norm that is NaN, inf or negative, a
value that is NaN or inf, and a top-k index that appears twice are refused (CompressionError;
on the native plane the server refuses the push, naming and counting the sender, and a worker
refuses such an answer naming the server). A partition whose gradient holds NaN or inf
therefore fails its push_pull instead of spreading NaN into every worker's result. Onebit
without scaling carries only signs.

Randomness: random-k indices and dithering's stochastic rounding derive only from
``(seed, key, step)`` (see ``byteps_like/_core.pyi``), so every worker and the server draw the
same random-k indices: the servers' sum has exactly that support and re-encoding it is exact;
a random-k payload carries only the header and the k values.

Adding a compressor (no engine change): write a :class:`Compressor` subclass with ``kind =
"codec"``, ``spec()`` and ``make_codec``, and a :class:`Codec` subclass, then
``register("mine", factory)`` where ``factory(**params)`` gets ``spec()`` without ``"name"``
and returns the compressor; workers and servers then rebuild it with :func:`from_spec`.
A compressor in C or C++ plugs in the same way: build your own extension (pybind11, nanobind,
or a plain ``cc -shared`` library loaded with ``ctypes``) exposing encode/decode over raw
buffers, and register a Python factory whose Codec calls it, passing numpy buffers
(``arr.ctypes.data_as(...)`` or the buffer protocol). Release the GIL in the native code (ctypes
does so for you): a CPU-bound Python thread starves the socket threads.
``tests/unit/test_compressors.py::test_c_compressor_through_ctypes`` is a complete example.
"""
from __future__ import annotations

import math
import re
import struct
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from . import _core
from ._native import REBUILD
from .config import REGISTERED_PREFIX
from .errors import BytePSError

__all__ = [
    "CompressionError", "Compressor", "FP16Compressor", "BF16Compressor", "CodecCompressor",
    "Codec", "OneBit", "TopK", "RandomK", "Dithering", "ErrorFeedback", "NesterovMomentum",
    "Compression", "from_spec", "register", "unregister", "registered", "resolve", "split",
    "HEADER_BYTES", "native_params", "compiled_codec", "CompiledCodec", "AutoCompression",
    "AUTO_CANDIDATES",
]
# Compression.auto is an AutoCompression (kind "auto"): the worker runtime turns it into one of
# its candidates per tensor before anything is bound (worker/autocompress.py); its model (the
# prediction, the codec speeds) is byteps_like/autocompress.py


class CompressionError(BytePSError, ValueError):
    """A compressor spec or a compressed payload is invalid; the message says which field."""


# ---- cast compressors (the existing API) ---------------------------------------------------

class Compressor:
    """Identity: the array travels as it is (``Compression.none``).

    Base class of every compressor: ``name``, ``kind`` ("none", "cast" or "codec"),
    ``spec()`` and, for codecs, ``make_codec``.
    """
    name: ClassVar[str] = "none"
    kind: ClassVar[str] = "none"

    def compress(self, arr: np.ndarray, dtype: str) -> tuple[np.ndarray, str, Any]:
        """Return (array to push, its wire dtype, context for decompress)."""
        return arr, dtype, None

    def wire_dtype(self, dtype: str) -> str:
        """The dtype an array of ``dtype`` travels as (what :meth:`compress` returns)."""
        return dtype

    def decompress(self, wire: np.ndarray, ctx: Any, out: np.ndarray, dtype: str) -> None:
        """Write the pulled ``wire`` array into ``out`` (of the caller's ``dtype``)."""
        if wire is not out:
            _core.copy_into(out.reshape(-1).view(np.uint8), wire.reshape(-1).view(np.uint8))

    def spec(self) -> dict:
        """JSON-safe description the servers rebuild the compressor from (:func:`from_spec`)."""
        return {"name": self.name}

    def make_codec(self, n: int, *, role: str, key: int) -> Codec:
        raise CompressionError(f"compressor {self.name!r} is a {self.kind} compressor, not a "
                               "codec: use compress/decompress")

    def __repr__(self) -> str:
        return f"Compression.{self.name}"


class _CastCompressor(Compressor):
    """Floating-point dtypes of ``_FLOATS`` travel as ``_WIRE`` (held in numpy as ``wire_np``);
    other dtypes are left alone. A subclass converts: :meth:`narrow_into` into the wire array,
    :meth:`widen_into` back into the caller's. Both are elementwise, so converting a tensor
    partition by partition (what the native client does, ``worker/route.py``) gives the same
    bits as converting it whole; ``nthreads`` splits one call over threads (``_core``'s
    parallel_for, which keeps at least 256 KiB per thread)."""
    kind = "cast"
    _FLOATS: ClassVar[tuple[str, ...]]
    _WIRE: ClassVar[str]
    wire_np: ClassVar[type]

    def wire_dtype(self, dtype: str) -> str:
        return self._WIRE if dtype in self._FLOATS else dtype

    def compress(self, arr: np.ndarray, dtype: str, *,
                 nthreads: int = 1) -> tuple[np.ndarray, str, Any]:
        if dtype not in self._FLOATS:
            return arr, dtype, None
        wire: np.ndarray = np.empty(arr.shape, self.wire_np)
        self.narrow_into(wire, arr, dtype, nthreads=nthreads)
        return wire, self._WIRE, dtype

    def decompress(self, wire: np.ndarray, ctx: Any, out: np.ndarray, dtype: str, *,
                   nthreads: int = 1) -> None:
        if ctx is None:
            super().decompress(wire, ctx, out, dtype)
        else:
            self.widen_into(out, wire, ctx, nthreads=nthreads)

    def narrow_into(self, wire: np.ndarray, arr: np.ndarray, dtype: str, *,
                    nthreads: int = 1) -> None:
        """``wire`` (``wire_np``, as many elements as ``arr``) = ``arr`` of ``dtype`` narrowed."""
        raise NotImplementedError

    def widen_into(self, out: np.ndarray, wire: np.ndarray, dtype: str, *,
                   nthreads: int = 1) -> None:
        """``out`` (of ``dtype``) = the wire array ``wire`` widened."""
        raise NotImplementedError


class FP16Compressor(_CastCompressor):
    """Floating-point gradients travel as IEEE half precision (half the bytes); other dtypes are
    left alone. Sums are formed in float16 on the servers, so this trades precision for bytes."""
    name = "fp16"
    _FLOATS = ("float32", "float64", "bfloat16")
    _WIRE, wire_np = "float16", np.float16

    def narrow_into(self, wire: np.ndarray, arr: np.ndarray, dtype: str, *,
                    nthreads: int = 1) -> None:
        if dtype == "float64":
            np.copyto(wire, arr.reshape(wire.shape), casting="same_kind")
        elif dtype == "bfloat16":  # no direct kernel: through float32 (exact widening)
            wide = np.empty(arr.shape, np.float32)
            _core.convert(wide, "float32", arr, "bfloat16", nthreads=nthreads)
            _core.convert(wire, "float16", wide, "float32", nthreads=nthreads)
        else:
            _core.convert(wire, "float16", arr, dtype, nthreads=nthreads)

    def widen_into(self, out: np.ndarray, wire: np.ndarray, dtype: str, *,
                   nthreads: int = 1) -> None:
        if dtype == "float64":
            np.copyto(out, wire.reshape(out.shape), casting="unsafe")
        elif dtype == "bfloat16":
            wide = np.empty(wire.shape, np.float32)
            _core.convert(wide, "float32", wire, "float16", nthreads=nthreads)
            _core.convert(out, "bfloat16", wide, "float32", nthreads=nthreads)
        else:
            _core.convert(out, dtype, wire, "float16", nthreads=nthreads)


class BF16Compressor(_CastCompressor):
    """float32/float64 gradients travel as bfloat16 (held as uint16; half the bytes of float32,
    float32's range); the servers sum bfloat16 natively. float64 goes through float32 first
    (two roundings). Other dtypes, bfloat16 included, travel as they are."""
    name = "bf16"
    _FLOATS = ("float32", "float64")
    _WIRE, wire_np = "bfloat16", np.uint16

    def narrow_into(self, wire: np.ndarray, arr: np.ndarray, dtype: str, *,
                    nthreads: int = 1) -> None:
        src = arr if dtype == "float32" else np.asarray(arr, dtype=np.float32)
        _core.convert(wire, "bfloat16", np.ascontiguousarray(src), "float32", nthreads=nthreads)

    def widen_into(self, out: np.ndarray, wire: np.ndarray, dtype: str, *,
                   nthreads: int = 1) -> None:
        if dtype == "float32":
            _core.convert(out, "float32", wire, "bfloat16", nthreads=nthreads)
        else:
            tmp = np.empty(np.shape(wire), np.float32)
            _core.convert(tmp, "float32", wire, "bfloat16", nthreads=nthreads)
            np.copyto(out, tmp.reshape(np.shape(out)), casting="unsafe")


# ---- codecs ---------------------------------------------------------------------------------

class Codec:
    """Encoder/decoder of one tensor partition for one role; stateful (residuals, momentum,
    buffers). Subclasses set ``n`` and ``max_bytes`` and implement ``encode`` and ``decode``;
    ``decode_add`` defaults to decode into a scratch buffer plus ``_core.add_into``."""
    n: int
    max_bytes: int
    _scratch: np.ndarray | None = None
    _scratch_lock: threading.Lock | None = None

    def encode(self, x: np.ndarray, step: int) -> np.ndarray:
        """Compress float32 ``x`` (length n, not modified) of round ``step`` into a uint8 payload
        (may be a view of an internal buffer, valid until the next encode)."""
        raise NotImplementedError

    def decode(self, payload: Any, out: np.ndarray) -> int:
        """Write the n float32 values of ``payload`` into ``out``; return the payload's step."""
        raise NotImplementedError

    def decode_add(self, payload: Any, acc: np.ndarray) -> int:
        """``acc += decoded payload``; return the payload's step."""
        if self._scratch_lock is None:
            self._scratch_lock = threading.Lock()
        with self._scratch_lock:
            if self._scratch is None:
                self._scratch = np.empty(self.n, np.float32)
            step = self.decode(payload, self._scratch)
            _core.add_into(_check_out(acc, self.n, "acc"), self._scratch, "float32")
        return step


# The frame's one definition lives in csrc/codec.h, which the native data plane compiles and
# _core.codec_frame_spec() exports: the header's fields (struct codes and offsets), magic,
# version, and each built-in codec's id and the struct code of its 4-byte field. The structs
# below are built from it; a codec missing on either side refuses the import
# (tests/unit/test_codec_frame.py).
try:
    _FRAME = _core.codec_frame_spec()
except AttributeError:  # a _core built before the frame was exported
    raise ImportError("byteps_like._core has no codec_frame_spec(): it was built from older "
                      "sources. " + REBUILD) from None
MAGIC: bytes = _FRAME["magic"]
VERSION: int = _FRAME["version"]
HEADER_BYTES: int = _FRAME["header_size"]  # 20
_BUILTIN = ("onebit", "topk", "randomk", "dithering")  # the codecs this module implements
_CODEC_IDS: dict[str, int] = {name: cid for name, cid, _code in _FRAME["codecs"]}
_ID_NAMES = {cid: name for name, cid in _CODEC_IDS.items()}


def _frame_struct(field_code: str) -> struct.Struct:
    """The header as a struct whose 4-byte field reads as ``field_code`` ('f' or 'I'), checked
    against the C++ struct's offsets and size."""
    codes, offset = [], 0
    for name, off, size, code in _FRAME["header"]:
        code = field_code if name == "field" else code
        if off != offset or struct.calcsize("<" + code) != size:
            raise ImportError(f"byteps_like.compression: frame field {name} is at {off} with "
                              f"{size} bytes in _core, the struct code {code!r} puts it at "
                              f"{offset} with {struct.calcsize('<' + code)}: rebuild _core")
        codes.append(code)
        offset += size
    if offset != HEADER_BYTES:
        raise ImportError(f"byteps_like.compression: frame header of {offset} bytes, _core's is "
                          f"{HEADER_BYTES}: rebuild _core")
    return struct.Struct("<" + "".join(codes))


if sorted(_CODEC_IDS) != sorted(_BUILTIN):
    raise ImportError(f"byteps_like.compression implements the codecs {sorted(_BUILTIN)}, "
                      f"_core's frame (csrc/codec.h) defines {sorted(_CODEC_IDS)}: rebuild _core "
                      "from these sources")
_HEADERS = {name: _frame_struct(code) for name, _cid, code in _FRAME["codecs"]}
_U64 = 1 << 64


def _payload_bytes(payload: Any) -> np.ndarray:
    try:
        return np.frombuffer(payload, dtype=np.uint8)
    except (TypeError, ValueError, BufferError) as exc:
        raise CompressionError(f"compressed payload must be a contiguous bytes-like buffer "
                               f"({type(payload).__name__}: {exc})") from None


def _check_x(x: Any, n: int) -> np.ndarray:
    if (not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.size != n
            or not x.flags.c_contiguous):
        raise CompressionError(f"encode: x must be a C-contiguous float32 array of {n} "
                               f"elements, got {getattr(x, 'dtype', type(x).__name__)} of "
                               f"{getattr(x, 'size', '?')}")
    return x.reshape(-1)


def _check_out(out: Any, n: int, what: str = "out") -> np.ndarray:
    if (not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.size != n
            or not out.flags.c_contiguous or not out.flags.writeable):
        raise CompressionError(f"decode: {what} must be a writable C-contiguous float32 array "
                               f"of {n} elements, got {getattr(out, 'dtype', type(out).__name__)}"
                               f" of {getattr(out, 'size', '?')}")
    return out.reshape(-1)


def _check_scale(name: str, field: str, v: float) -> None:
    """A peer's scale / norm: what an encoder writes for a finite tensor (csrc/codec.cc)."""
    if not (math.isfinite(v) and v >= 0):
        raise CompressionError(f"{name} payload: its {field} is {_show(v)}, not a finite number "
                               ">= 0 (the sender's tensor held NaN or inf?)")


def _show(v: float) -> str:
    return "NaN" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) else f"{v:f}"


def _check_values(name: str, vals: np.ndarray) -> None:
    fin = np.isfinite(vals)
    if not fin.all():
        j = int(np.argmin(fin))
        raise CompressionError(f"{name} payload: value {j} is {_show(float(vals[j]))}, not finite "
                               "(the sender's tensor held NaN or inf?)")


def _check_distinct(name: str, idx: np.ndarray) -> None:
    if idx.size < 2 or bool((idx[1:] > idx[:-1]).all()):
        return
    s = np.sort(idx)
    dup = np.flatnonzero(s[1:] == s[:-1])
    if dup.size:
        raise CompressionError(f"{name} payload: index {int(s[dup[0]])} appears more than once "
                               "(top-k indices are distinct)")


def _check_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or not 0 <= step < _U64:
        raise CompressionError(f"encode: step must be an integer in [0, 2^64), got {step!r}")
    return int(step)


class _FramedCodec(Codec):
    """A built-in codec: fixed payload size, header with one 4-byte field."""
    _NAME: ClassVar[str]
    _ID: ClassVar[int]
    _HDR: ClassVar[struct.Struct]

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if "_NAME" in cls.__dict__:   # a concrete codec: its id and header from the frame
            cls._ID, cls._HDR = _CODEC_IDS[cls._NAME], _HEADERS[cls._NAME]

    def __init__(self, n: int, body_bytes: int):
        self.n = n
        self.max_bytes = HEADER_BYTES + body_bytes
        self._buf = np.zeros(self.max_bytes, np.uint8)
        self._body = self._buf[HEADER_BYTES:]

    def _seal(self, step: int, field: Any) -> np.ndarray:
        self._HDR.pack_into(self._buf, 0, MAGIC, VERSION, self._ID, self.n, step, field)
        return self._buf

    def _open(self, payload: Any) -> tuple[np.ndarray, int, Any]:
        """(body, step, field) of a checked payload."""
        p = _payload_bytes(payload)
        name = _ID_NAMES[self._ID]
        if p.size != self.max_bytes:
            raise CompressionError(f"{name} payload has {p.size} bytes; {self.n} elements need "
                                   f"exactly {self.max_bytes}")
        magic, version, cid, n, step, field = self._HDR.unpack_from(p, 0)
        if magic != MAGIC or version != VERSION:
            raise CompressionError(f"{name} payload: bad magic/version {magic!r}/{version}; "
                                   f"expected {MAGIC!r}/{VERSION}")
        if cid != self._ID:
            raise CompressionError(f"{name} payload carries compressor id {cid} "
                                   f"({_ID_NAMES.get(cid, 'unknown')}), expected {self._ID}")
        if n != self.n:
            raise CompressionError(f"{name} payload is of {n} elements, expected {self.n}")
        return p[HEADER_BYTES:], step, field

    def _kernel(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        try:
            return fn(*args, **kw)
        except (ValueError, IndexError) as exc:
            raise CompressionError(f"{_ID_NAMES[self._ID]} payload: {exc}") from None

    def _decode(self, payload: Any, out: np.ndarray, add: bool, check: bool = True) -> int:
        """Decode into ``out``, or add to it (``add``); the payload's step. ``check``: the
        payload is a peer's, so its numbers are checked too (finite scale / norm >= 0, finite
        values, distinct top-k indices); False only for a codec's own payload (error
        feedback's residual)."""
        raise NotImplementedError

    def decode(self, payload: Any, out: np.ndarray) -> int:
        return self._decode(payload, out, False)

    def decode_add(self, payload: Any, acc: np.ndarray) -> int:
        return self._decode(payload, acc, True)


class _OneBitCodec(_FramedCodec):
    _NAME = "onebit"

    def __init__(self, n: int, scaling: bool):
        super().__init__(n, (n + 7) // 8)
        self.scaling = scaling

    def encode(self, x: np.ndarray, step: int) -> np.ndarray:
        x, step = _check_x(x, self.n), _check_step(step)
        return self._seal(step, _core.onebit_encode(x, self._body, self.scaling))

    def _decode(self, payload: Any, out: np.ndarray, add: bool, check: bool = True) -> int:
        body, step, scale = self._open(payload)
        if check:
            _check_scale("onebit", "scale", scale)
        self._kernel(_core.onebit_decode, body, scale, _check_out(out, self.n), add)
        return step


class _SparseCodec(_FramedCodec):
    def __init__(self, n: int, k: int, body_bytes: int):
        super().__init__(n, body_bytes)
        self.k = k

    def _open_k(self, payload: Any) -> tuple[np.ndarray, int]:
        body, step, k = self._open(payload)
        if k != self.k:
            raise CompressionError(f"{_ID_NAMES[self._ID]} payload carries k = {k}, "
                                   f"expected {self.k}")
        return body, step


class _TopKCodec(_SparseCodec):
    """Payload body: k u32 indices (increasing), then their k float32 values."""
    _NAME = "topk"

    def __init__(self, n: int, k: int):
        super().__init__(n, k, 8 * k)
        self._idx, self._val = self._body[:4 * k], self._body[4 * k:]

    def encode(self, x: np.ndarray, step: int) -> np.ndarray:
        x, step = _check_x(x, self.n), _check_step(step)
        _core.topk_select(x, self._idx, self._val)
        return self._seal(step, self.k)

    def _decode(self, payload: Any, out: np.ndarray, add: bool, check: bool = True) -> int:
        body, step = self._open_k(payload)
        k = self.k
        if check:
            _check_values("topk", body[4 * k:].view(np.float32))
            _check_distinct("topk", body[:4 * k].view(np.uint32))
        self._kernel(_core.scatter, body[:4 * k], body[4 * k:], _check_out(out, self.n), add)
        return step


class _RandomKCodec(_SparseCodec):
    """Payload body: the k float32 values at the indices drawn from (seed, key, step)."""
    _NAME = "randomk"

    def __init__(self, n: int, k: int, seed: int, key: int):
        super().__init__(n, k, 4 * k)
        self.seed, self.key = seed, key
        self._cached: tuple[int, np.ndarray] | None = None

    def indices(self, step: int) -> np.ndarray:
        """The k increasing indices of round ``step`` (the same on every worker and server)."""
        cached = self._cached
        if cached is not None and cached[0] == step:
            return cached[1]
        idx = np.empty(self.k, np.uint32)
        _core.randomk_indices(self.n, self.seed, self.key, step, idx)
        self._cached = (step, idx)
        return idx

    def encode(self, x: np.ndarray, step: int) -> np.ndarray:
        x, step = _check_x(x, self.n), _check_step(step)
        _core.gather(x, self.indices(step), self._body)
        return self._seal(step, self.k)

    def _decode(self, payload: Any, out: np.ndarray, add: bool, check: bool = True) -> int:
        body, step = self._open_k(payload)
        if check:
            _check_values("randomk", body.view(np.float32))
        self._kernel(_core.scatter, self.indices(step), body, _check_out(out, self.n), add)
        return step


class _DitheringCodec(_FramedCodec):
    _NAME = "dithering"

    def __init__(self, n: int, levels: int, natural: bool, l2: bool, seed: int, key: int):
        super().__init__(n, _core.dither_bytes(n, levels))
        self.levels, self.natural, self.l2, self.seed, self.key = levels, natural, l2, seed, key

    def encode(self, x: np.ndarray, step: int) -> np.ndarray:
        x, step = _check_x(x, self.n), _check_step(step)
        norm = _core.dither_encode(x, self._body, self.levels, self.natural, self.l2, self.seed,
                                   self.key, step)
        return self._seal(step, norm)

    def _decode(self, payload: Any, out: np.ndarray, add: bool, check: bool = True) -> int:
        body, step, norm = self._open(payload)
        if check:
            _check_scale("dithering", "norm", norm)
        self._kernel(_core.dither_decode, body, norm, _check_out(out, self.n), self.levels,
                     self.natural, add)
        return step


_SCRATCH = threading.local()


def _scratch(slot: str, n: int) -> np.ndarray:
    """A float32 scratch of ``n`` elements, one per thread and slot, shared by every codec of
    the thread. Scratch per codec made each partition's error feedback write and read buffers
    of its own, out of cache: a 64 MiB model of 1 MiB partitions touched 256 MiB of scratch a
    step, and memory bandwidth, not the kernels, set the speed."""
    buf = getattr(_SCRATCH, slot, None)
    if buf is None or buf.size < n:
        buf = np.empty(n, np.float32)
        setattr(_SCRATCH, slot, buf)
    return buf[:n]


class _ErrorFeedbackCodec(Codec):
    """encode(x): y = x + r; p = inner.encode(y); r = y - inner.decode(p). Decoding is the
    inner codec's."""

    def __init__(self, inner: Codec):
        self.inner = inner
        self.n, self.max_bytes = inner.n, inner.max_bytes
        self._r = np.zeros(inner.n, np.float32)
        # onebit: the buffer holds y with its residual not yet taken, and the scale it was
        # encoded with; the next encode's one pass settles it (onebit_residual's arithmetic)
        self._unsettled: float | None = None

    @property
    def residual(self) -> np.ndarray:
        """r = y - decode(payload) of the last encode (settled here if the next encode's pass
        has not done it yet)."""
        if self._unsettled is not None:
            _core.onebit_residual(self._r, self._unsettled)
            self._unsettled = None
        return self._r

    def encode(self, x: np.ndarray, step: int) -> np.ndarray:
        # y = x + r is formed in the residual's own memory (r is not needed again), so a
        # partition's passes stream x and r once each instead of a third buffer
        y, inner = self._r, self.inner
        if type(inner) is _OneBitCodec:  # the same bits in one pass over r instead of four
            step = _check_step(step)
            scale = _core.onebit_ef_encode(_check_x(x, self.n), y, inner._body, inner.scaling,
                                           self._unsettled)
            self._unsettled = scale  # r = y - decode(payload): the next encode's pass
            return inner._seal(step, scale)
        if type(inner) is _TopKCodec:  # y, its selection and r = y - decoded in two passes
            step = _check_step(step)
            _core.topk_ef_encode(_check_x(x, self.n), y, inner._idx, inner._val)
            return inner._seal(step, inner.k)
        np.add(_check_x(x, self.n), y, out=y)
        payload = inner.encode(y, step)
        # random-k: d is 0 but at the k indices, so r = y there (y - 0 is y: y is a sum, no
        # signalling NaN) and y - value at them
        if type(inner) is _RandomKCodec:
            y[inner.indices(_check_step(step))] -= inner._body.view(np.float32)
            return payload
        d = _scratch("ef_d", self.n)
        if isinstance(inner, _FramedCodec):  # its own payload: a NaN norm may stay (residual)
            inner._decode(payload, _check_out(d, self.n), False, check=False)
        else:
            inner.decode(payload, d)
        np.subtract(y, d, out=y)
        return payload

    def decode(self, payload: Any, out: np.ndarray) -> int:
        return self.inner.decode(payload, out)

    def decode_add(self, payload: Any, acc: np.ndarray) -> int:
        return self.inner.decode_add(payload, acc)


class _NesterovCodec(Codec):
    """encode(x): m = mu*m + x; encode x + mu*m with the inner codec."""

    def __init__(self, inner: Codec, mu: float):
        self.inner, self.mu = inner, np.float32(mu)
        self.n, self.max_bytes = inner.n, inner.max_bytes
        self.momentum = np.zeros(inner.n, np.float32)

    def encode(self, x: np.ndarray, step: int) -> np.ndarray:
        x = _check_x(x, self.n)
        m, y = self.momentum, _scratch("nesterov_y", self.n)
        np.multiply(m, self.mu, out=m)
        np.add(m, x, out=m)
        np.multiply(m, self.mu, out=y)
        np.add(y, x, out=y)
        return self.inner.encode(y, step)

    def decode(self, payload: Any, out: np.ndarray) -> int:
        return self.inner.decode(payload, out)

    def decode_add(self, payload: Any, acc: np.ndarray) -> int:
        return self.inner.decode_add(payload, acc)


# ---- codec compressors ------------------------------------------------------------------------

def _field(cond: bool, name: str, what: str, value: Any) -> None:
    if not cond:
        raise CompressionError(f"{name}: {what}, got {value!r}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_seed(seed: Any) -> None:
    _field(_is_int(seed) and 0 <= seed < _U64, "seed", "must be an integer in [0, 2^64)", seed)


def _check_k(k: Any) -> None:
    if _is_int(k):
        _field(1 <= k < 1 << 32, "k", "a count must be in [1, 2^32)", k)
    else:
        _field(isinstance(k, float) and math.isfinite(k) and 0 < k < 1, "k",
               "must be a fraction in (0, 1) or an integer count >= 1", k)


def _k_count(k: int | float, n: int) -> int:
    return min(int(k), n) if _is_int(k) else max(1, min(n, int(k * n)))


class CodecCompressor(Compressor):
    """Base of the compressors that work through per-partition :class:`Codec`\\ s."""
    kind = "codec"

    def compress(self, arr: np.ndarray, dtype: str) -> tuple[np.ndarray, str, Any]:
        raise CompressionError(f"{self!r} is a codec compressor: use make_codec")

    def decompress(self, wire: np.ndarray, ctx: Any, out: np.ndarray, dtype: str) -> None:
        raise CompressionError(f"{self!r} is a codec compressor: use make_codec")

    def make_codec(self, n: int, *, role: str, key: int) -> Codec:
        _field(_is_int(n) and 1 <= n < 1 << 32, "n", "must be an element count in [1, 2^32)", n)
        _field(role in ("worker", "server"), "role", "must be 'worker' or 'server'", role)
        _field(_is_int(key) and 0 <= key < _U64, "key", "must be an integer in [0, 2^64)", key)
        return self._make(n, role, key)

    def _make(self, n: int, role: str, key: int) -> Codec:
        raise NotImplementedError

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.spec().items() if k != "name")
        return f"{type(self).__name__}({args})"


@dataclass(frozen=True, repr=False)
class OneBit(CodecCompressor):
    """Signs, 1 bit per element; with ``scaling`` each decodes to ±mean|x| of the partition,
    else ±1."""
    scaling: bool = True
    name: ClassVar[str] = "onebit"

    def __post_init__(self) -> None:
        _field(isinstance(self.scaling, bool), "scaling", "must be a bool", self.scaling)

    def spec(self) -> dict:
        return {"name": self.name, "scaling": self.scaling}

    def _make(self, n: int, role: str, key: int) -> Codec:
        return _OneBitCodec(n, self.scaling)


@dataclass(frozen=True, repr=False)
class TopK(CodecCompressor):
    """The k entries of largest magnitude (ties to the lower index) as (u32 index, f32 value);
    ``k < 1`` is a fraction of the partition (at least 1 element), ``k >= 1`` an int count
    (capped at the partition size)."""
    k: int | float = 0.01
    name: ClassVar[str] = "topk"

    def __post_init__(self) -> None:
        _check_k(self.k)

    def spec(self) -> dict:
        return {"name": self.name, "k": self.k}

    def _make(self, n: int, role: str, key: int) -> Codec:
        return _TopKCodec(n, _k_count(self.k, n))


@dataclass(frozen=True, repr=False)
class RandomK(CodecCompressor):
    """k entries drawn uniformly without replacement from ``(seed, key, step)`` only, so all
    workers and the servers pick the same ones; the payload carries only the values."""
    k: int | float = 0.01
    seed: int = 0
    name: ClassVar[str] = "randomk"

    def __post_init__(self) -> None:
        _check_k(self.k)
        _check_seed(self.seed)

    def spec(self) -> dict:
        return {"name": self.name, "k": self.k, "seed": self.seed}

    def _make(self, n: int, role: str, key: int) -> Codec:
        return _RandomKCodec(n, _k_count(self.k, n), self.seed, key)


@dataclass(frozen=True, repr=False)
class Dithering(CodecCompressor):
    """Stochastic quantisation of x / norm to ``levels`` levels: ``partition="linear"`` (q/s,
    levels 1..65535) or ``"natural"`` (0 and powers of two 2^(q-s), levels 1..127);
    ``normalize="max"`` (max |x|) or ``"l2"``. Each element takes 1 + bit_length(levels) bits."""
    levels: int = 16
    partition: str = "linear"
    normalize: str = "max"
    seed: int = 0
    name: ClassVar[str] = "dithering"

    def __post_init__(self) -> None:
        _field(self.partition in ("linear", "natural"), "partition",
               "must be 'linear' or 'natural'", self.partition)
        _field(self.normalize in ("max", "l2"), "normalize", "must be 'max' or 'l2'",
               self.normalize)
        hi = 127 if self.partition == "natural" else 65535
        _field(_is_int(self.levels) and 1 <= self.levels <= hi, "levels",
               f"must be an integer in [1, {hi}] for {self.partition} dithering", self.levels)
        _check_seed(self.seed)

    def spec(self) -> dict:
        return {"name": self.name, "levels": self.levels, "partition": self.partition,
                "normalize": self.normalize, "seed": self.seed}

    def _make(self, n: int, role: str, key: int) -> Codec:
        return _DitheringCodec(n, self.levels, self.partition == "natural",
                               self.normalize == "l2", self.seed, key)


def _check_inner(inner: Any) -> None:
    if not isinstance(inner, Compressor) or inner.kind != "codec":
        raise CompressionError(f"inner: must be a codec compressor (onebit, topk, ...), got "
                               f"{inner!r}")


@dataclass(frozen=True, repr=False)
class ErrorFeedback(CodecCompressor):
    """Error feedback around a codec: each encode adds the residual left by the previous one
    (y = x + r; p = inner.encode(y); r = y - inner.decode(p)). Applies on both roles: on the
    server it compensates the error of re-compressing the merged sum for the pull."""
    inner: Compressor
    name: ClassVar[str] = "ef"

    def __post_init__(self) -> None:
        _check_inner(self.inner)

    def spec(self) -> dict:
        return {"name": self.name, "inner": self.inner.spec()}

    def _make(self, n: int, role: str, key: int) -> Codec:
        return _ErrorFeedbackCodec(self.inner.make_codec(n, role=role, key=key))


@dataclass(frozen=True, repr=False)
class NesterovMomentum(CodecCompressor):
    """Nesterov momentum before a codec, on the workers (as BytePS): m = mu*m + x, then
    encode x + mu*m. On role="server" it is a pass-through (the server codec is the inner
    one): momentum is a worker concern. Leave momentum out of the optimizer when using it."""
    inner: Compressor
    mu: float = 0.9
    name: ClassVar[str] = "nesterov"

    def __post_init__(self) -> None:
        _check_inner(self.inner)
        _field(isinstance(self.mu, (int, float)) and not isinstance(self.mu, bool)
               and math.isfinite(self.mu) and 0 <= self.mu <= 1, "mu", "must be in [0, 1]",
               self.mu)

    def spec(self) -> dict:
        return {"name": self.name, "mu": self.mu, "inner": self.inner.spec()}

    def _make(self, n: int, role: str, key: int) -> Codec:
        inner = self.inner.make_codec(n, role=role, key=key)
        return inner if role == "server" else _NesterovCodec(inner, self.mu)


def _wrap(c: Compressor, error_feedback: bool, momentum: float | None) -> Compressor:
    _field(isinstance(error_feedback, bool), "error_feedback", "must be a bool", error_feedback)
    if error_feedback:
        c = ErrorFeedback(c)
    if momentum:
        c = NesterovMomentum(c, mu=momentum)
    return c


class Compression:
    """Namespace of the built-in compressors (BytePS/Horovod spelling)."""
    none = Compressor()
    fp16 = FP16Compressor()
    bf16 = BF16Compressor()

    @staticmethod
    def onebit(scaling: bool = True, error_feedback: bool = False,
               momentum: float | None = None) -> Compressor:
        return _wrap(OneBit(scaling), error_feedback, momentum)

    @staticmethod
    def topk(k: int | float, error_feedback: bool = False,
             momentum: float | None = None) -> Compressor:
        return _wrap(TopK(k), error_feedback, momentum)

    @staticmethod
    def randomk(k: int | float, seed: int = 0, error_feedback: bool = False,
                momentum: float | None = None) -> Compressor:
        return _wrap(RandomK(k, seed), error_feedback, momentum)

    @staticmethod
    def dithering(levels: int = 16, partition: str = "linear", normalize: str = "max",
                  seed: int = 0, error_feedback: bool = False,
                  momentum: float | None = None) -> Compressor:
        return _wrap(Dithering(levels, partition, normalize, seed), error_feedback, momentum)

    @staticmethod
    def auto(allow: Any = ("fp16",), error_feedback: bool = True, k: float = 0.01,
             seed: int = 0, levels: int = 16, margin: float = 0.1,
             rounds: int = 1) -> Compressor:
        """Each tensor travels with none or one of ``allow`` (fp16, bf16, onebit, topk,
        randomk, dithering), whichever rank 0 predicts fastest for its size at the measured
        bandwidth; re-decided when the bandwidth changes (``margin``: how much faster another
        candidate must be predicted to replace the current one; ``rounds``: rounds between
        the points where every rank may switch). docs/compression.md, "auto"."""
        return AutoCompression(parse_auto_allow(allow),
                               error_feedback, k, seed, levels, margin, rounds)


#: names Compression.auto may be allowed (BYTEPS_COMPRESSOR_AUTO_CODECS); none is always one
AUTO_CANDIDATES = ("fp16", "bf16", "onebit", "topk", "randomk", "dithering")


# ---- auto: the candidates (byteps_like/autocompress.py holds the model) --------------------

def auto_candidate(name: str, *, error_feedback: bool = True, k: float = 0.01, seed: int = 0,
              levels: int = 16) -> Compressor:
    """The compressor a candidate name stands for (none, a cast, or a codec with the given
    settings; codecs with error feedback by default)."""
    if name == "none":
        return Compression.none
    if name == "fp16":
        return Compression.fp16
    if name == "bf16":
        return Compression.bf16
    if name == "onebit":
        return Compression.onebit(True, error_feedback=error_feedback)
    if name == "topk":
        return Compression.topk(k, error_feedback=error_feedback)
    if name == "randomk":
        return Compression.randomk(k, seed, error_feedback=error_feedback)
    if name == "dithering":
        return Compression.dithering(levels, seed=seed, error_feedback=error_feedback)
    raise CompressionError(f"auto compression: {name!r} is not a candidate; allow some of "
                           f"{', '.join(AUTO_CANDIDATES)} (none is always one)")


def parse_auto_allow(text: str | Iterable[str]) -> tuple[str, ...]:
    """The allowed candidates of a comma-separated list (or an iterable of names), checked,
    without duplicates and without ``none`` (always a candidate)."""
    names = [t.strip() for t in (text.split(",") if isinstance(text, str) else text)]
    out: list[str] = []
    for n in names:
        if not n or n == "none":
            continue
        if n not in AUTO_CANDIDATES:
            raise CompressionError(f"auto compression: {n!r} is not a candidate; allow some "
                                   f"of {', '.join(AUTO_CANDIDATES)} (none is always one)")
        if n not in out:
            out.append(n)
    return tuple(out)



# ---- auto: the compressor users pass -----------------------------------------------------------

@dataclass(frozen=True, repr=False)
class AutoCompression(Compressor):
    """``Compression.auto(allow=("fp16", "onebit"))``: each tensor travels with the candidate
    (none or one of ``allow``) that rank 0 predicts fastest for its size class at the measured
    bandwidth; every rank switches at the same round (:mod:`byteps_like.worker.autocompress`).
    Codecs come with error feedback unless ``error_feedback=False``. A tensor staged from a
    device, an integer tensor and one below BYTEPS_MIN_COMPRESS_BYTES travel as none."""
    allow: tuple[str, ...] = ("fp16",)
    error_feedback: bool = True
    k: float = 0.01
    seed: int = 0
    levels: int = 16
    margin: float = 0.1
    rounds: int = 1
    candidates: dict[str, Compressor] = field(init=False, compare=False, hash=False)
    name: ClassVar[str] = "auto"
    kind: ClassVar[str] = "auto"

    def __post_init__(self) -> None:
        allow = parse_auto_allow(self.allow)
        object.__setattr__(self, "allow", allow)
        if not (isinstance(self.margin, (int, float)) and 0 <= self.margin <= 10):
            raise CompressionError(f"auto compression: margin must be in [0, 10], got "
                                   f"{self.margin!r}")
        if isinstance(self.rounds, bool) or not isinstance(self.rounds, int) \
                or not 1 <= self.rounds <= 1_000_000:
            raise CompressionError(f"auto compression: rounds must be an int >= 1, got "
                                   f"{self.rounds!r}")
        cands: dict[str, Compressor] = {"none": Compression.none}
        for n in allow:
            cands[n] = auto_candidate(n, error_feedback=self.error_feedback, k=self.k,
                                 seed=self.seed, levels=self.levels)
        object.__setattr__(self, "candidates", cands)

    def spec(self) -> dict:
        return {"name": self.name, "allow": ",".join(self.allow),
                "error_feedback": self.error_feedback, "k": self.k, "seed": self.seed,
                "levels": self.levels, "margin": self.margin, "rounds": self.rounds}

    def __repr__(self) -> str:
        return f"Compression.auto(allow={self.allow!r})"


# ---- registry ---------------------------------------------------------------------------------

_REGISTRY: dict[str, Callable[..., Compressor]] = {}
_REGISTRY_LOCK = threading.Lock()
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]{0,63}")
_MAX_DEPTH = 8


def register(name: str, factory: Callable[..., Compressor]) -> None:
    """Make ``from_spec({"name": name, **params})`` call ``factory(**params)``; the factory
    must validate its params (they come off the wire) and return a :class:`Compressor`.
    A name already registered raises :class:`CompressionError`."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise CompressionError(f"register: name must be 1-64 characters [A-Za-z0-9_.-] starting "
                               f"with a letter or underscore, got {name!r}")
    if not callable(factory):
        raise CompressionError(f"register: factory of {name!r} is not callable: {factory!r}")
    with _REGISTRY_LOCK:
        if name in _REGISTRY:
            raise CompressionError(f"register: a compressor named {name!r} is already registered")
        _REGISTRY[name] = factory


def unregister(name: str) -> None:
    """Remove a registered compressor (tests, reloading plugins); unknown names raise."""
    with _REGISTRY_LOCK:
        if _REGISTRY.pop(name, None) is None:
            raise CompressionError(f"unregister: no compressor named {name!r}")


def registered() -> tuple[str, ...]:
    """Names from_spec understands."""
    return tuple(sorted(_REGISTRY))


def _check_json(value: Any, path: str, depth: int) -> None:
    if depth > _MAX_DEPTH:
        raise CompressionError(f"compressor spec nested deeper than {_MAX_DEPTH} at {path}")
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise CompressionError(f"compressor spec: key {k!r} at {path} is not a string")
            _check_json(v, f"{path}.{k}", depth + 1)
    elif value is not None and not isinstance(value, (str, int, float, bool)):
        raise CompressionError(f"compressor spec: {path} has a value of type "
                               f"{type(value).__name__}; only str/int/float/bool/None/dict")


def from_spec(spec: dict) -> Compressor:
    """The compressor a :meth:`Compressor.spec` dict describes. The spec is untrusted (it comes
    off the wire as JSON): every field is validated and errors raise :class:`CompressionError`
    naming it."""
    if not isinstance(spec, dict):
        raise CompressionError(f"compressor spec must be a dict, got {type(spec).__name__}")
    _check_json(spec, "spec", 0)
    name = spec.get("name")
    if not isinstance(name, str):
        raise CompressionError(f"compressor spec: 'name' must be a string, got {name!r}")
    factory = _REGISTRY.get(name)
    if factory is None:
        raise CompressionError(f"compressor spec: unknown name {name!r}; registered: "
                               f"{', '.join(registered())}")
    params = {k: v for k, v in spec.items() if k != "name"}
    try:
        comp = factory(**params)
    except CompressionError as exc:
        raise CompressionError(f"compressor {name!r}: {exc}") from None
    except TypeError as exc:
        raise CompressionError(f"compressor {name!r}: bad fields {sorted(params)} ({exc})") \
            from None
    if not isinstance(comp, Compressor) or comp.kind not in ("none", "cast", "codec", "auto"):
        raise CompressionError(f"compressor {name!r}: its factory returned {comp!r}, not a "
                               "Compressor")
    return comp


def _inner(inner: Any) -> Compressor:
    if isinstance(inner, Compressor):
        return inner
    try:
        return from_spec(inner)
    except CompressionError as exc:
        raise CompressionError(f"inner: {exc}") from None


def _no_params(c: Compressor) -> Callable[[], Compressor]:
    return lambda: c


register("none", _no_params(Compression.none))
register("fp16", _no_params(Compression.fp16))
register("bf16", _no_params(Compression.bf16))
register("onebit", OneBit)
register("topk", TopK)
register("randomk", RandomK)
register("dithering", Dithering)
register("ef", lambda inner: ErrorFeedback(_inner(inner)))
register("nesterov", lambda inner, mu=0.9: NesterovMomentum(_inner(inner), mu))
register("auto", lambda **kw: Compression.auto(**kw))


# ---- engine helpers -----------------------------------------------------------------------------

def split(c: Compressor | None) -> tuple[Compressor, Compressor | None]:
    """(cast compressor, codec compressor or None): a codec travels with Compression.none as
    its cast."""
    if c is None:
        return Compression.none, None
    if c.kind == "auto":  # the runtime resolves it per tensor (worker/autocompress.py)
        return c, None
    return (Compression.none, c) if c.kind == "codec" else (c, None)


def resolve(c: Compressor | None, cfg: Any) -> Compressor:
    """The compressor to use: ``c`` when the code passed one (not ``Compression.none``), else
    the one ``cfg.compression`` (BYTEPS_COMPRESSOR*) describes, else ``Compression.none``."""
    if c is not None and c is not Compression.none:
        return c
    cc = cfg.compression
    name = cc.compressor.strip()
    if not name:
        return Compression.none
    k: int | float = cc.k
    if k >= 1:
        _field(float(k).is_integer(), "BYTEPS_COMPRESSOR_K", "a count >= 1 must be whole", k)
        k = int(k)
    momentum = cc.momentum or None
    if name == "onebit":
        return Compression.onebit(cc.onebit_scaling, cc.error_feedback, momentum)
    if name == "topk":
        return Compression.topk(k, cc.error_feedback, momentum)
    if name == "randomk":
        return Compression.randomk(k, cc.seed, cc.error_feedback, momentum)
    if name == "dithering":
        return Compression.dithering(cc.levels, cc.partition, cc.normalize, cc.seed,
                                     cc.error_feedback, momentum)
    if name == "auto":
        return Compression.auto(cc.auto_codecs, True, k, cc.seed, cc.levels,
                                cc.auto_margin, cc.auto_rounds)
    if name.startswith(REGISTERED_PREFIX):  # config.py checked the rest of the name's form
        name = name[len(REGISTERED_PREFIX):]
        if name not in registered():
            raise CompressionError(
                f"BYTEPS_COMPRESSOR={cc.compressor.strip()!r}: no compressor is registered as "
                f"{name!r} in this process (registered: {', '.join(registered())}); call "
                "byteps_like.compression.register before the optimizer is made")
    base = from_spec({"name": name})
    return _wrap(base, cc.error_feedback, momentum) if base.kind == "codec" else base


def native_params(c: Compressor, n: int) -> list[int] | None:
    """The server's codec of ``c`` for partitions of ``n`` elements as the compiled data plane
    takes it (``_core.NativeCodec``, csrc/codec.h): ``[id, ef, scaling, k, seed, levels,
    natural, l2]`` with k resolved for n; None when ``c`` is not built of the built-in codecs
    (a registered compressor: its server codec is Python, server/codecs.py). Momentum is a
    worker concern, so NesterovMomentum is the inner codec here, as ``make_codec(role=
    "server")`` makes it."""
    ef = 0
    while True:
        if type(c) is NesterovMomentum:
            c = c.inner
        elif type(c) is ErrorFeedback and not ef:
            ef, c = 1, c.inner
        else:
            break
    ids = _CODEC_IDS
    if type(c) is OneBit:
        return [ids["onebit"], ef, int(c.scaling), 0, 0, 0, 0, 0]
    if type(c) is TopK:
        return [ids["topk"], ef, 0, _k_count(c.k, n), 0, 0, 0, 0]
    if type(c) is RandomK:
        return [ids["randomk"], ef, 0, _k_count(c.k, n), c.seed, 0, 0, 0]
    if type(c) is Dithering:
        return [ids["dithering"], ef, 0, 0, c.seed, c.levels, int(c.partition == "natural"),
                int(c.normalize == "l2")]
    return None


def compiled_codec(c: Compressor, n: int, key: int) -> Codec | None:
    """A worker codec of ``c`` run by ``_core`` (csrc/codec.h), or None when ``c`` has a part
    that only Python runs (momentum, a registered compressor). It writes and reads the same
    bytes as ``c.make_codec(n, role="worker", key=key)`` (tests/unit/test_native_codec.py) and
    keeps its state (the error-feedback residual) in C++, where the native data plane's worker
    side runs it too: a float32 host tensor compressed with it is one native operation, its
    partitions encoded and decoded on the client's codec threads (worker/dataplane.py)."""
    inner = c
    while isinstance(inner, (ErrorFeedback, NesterovMomentum)):
        if isinstance(inner, NesterovMomentum):
            return None
        inner = inner.inner
    params = native_params(c, n)
    return None if params is None else CompiledCodec(_core.NativeCodec(params, key, n))


class CompiledCodec(Codec):
    """A built-in codec (with or without error feedback) in ``_core``: ``native`` is the
    ``_core.NativeCodec`` the native data plane's worker side takes."""

    def __init__(self, native: Any):
        self.native = native
        self.n = native.n
        self.max_bytes = native.max_bytes
        self._buf = np.zeros(self.max_bytes, np.uint8)

    def encode(self, x: np.ndarray, step: int) -> np.ndarray:
        self.native.encode(_check_x(x, self.n), _check_step(step), self._buf)
        return self._buf

    def _decode(self, payload: Any, out: np.ndarray, add: bool) -> int:
        try:
            return int(self.native.decode(_payload_bytes(payload), out, add))
        except ValueError as exc:
            raise CompressionError(str(exc)) from None

    def decode(self, payload: Any, out: np.ndarray) -> int:
        return self._decode(payload, _check_out(out, self.n), False)

    def decode_add(self, payload: Any, acc: np.ndarray) -> int:
        return self._decode(payload, _check_out(acc, self.n, "acc"), True)


# ---- server-side bounds: a compressed key's declaration is untrusted ---------------------------

#: the dtypes workers compress with a codec (the declared dtype of a compressed partition), with
#: their item sizes
CODEC_DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


def check_declared_count(count: Any, dtype: Any, partition_bytes: int) -> int:
    """The element count of a compressed partition's declaration, checked against what a worker
    declares: at most one partition (``BYTEPS_PARTITION_BYTES``) of the declared dtype. The
    server's float32 accumulator has this many elements, so a declaration must not choose it
    freely. Raises :class:`CompressionError` naming the setting."""
    if not isinstance(dtype, str) or dtype not in CODEC_DTYPES:
        raise CompressionError(f"declared dtype {dtype!r} is not one workers compress "
                               f"({', '.join(CODEC_DTYPES)})")
    limit = partition_bytes // CODEC_DTYPES[dtype]
    if not _is_int(count) or not 0 < count <= limit:
        raise CompressionError(
            f"element count {count!r} is not an integer in 1..{limit}, one partition of "
            f"{dtype} (BYTEPS_PARTITION_BYTES={partition_bytes} on this server; workers and "
            "servers must use the same)")
    return count


def codec_bytes(codec: Codec) -> int:
    """An estimate of the memory a codec holds: its numpy buffers (views counted once, wrapped
    codecs included) and ``4 * n`` for buffers codecs allocate on first use (the scratch of
    :meth:`Codec.decode_add`, random-k's indices). What a server charges to its memory budget
    for a compressed key's codec."""
    seen: set[int] = set()

    def arrays(obj: Any, depth: int) -> int:
        total = 0
        if isinstance(obj, np.ndarray):
            base = obj
            while isinstance(base.base, np.ndarray):
                base = base.base
            if id(base) not in seen:
                seen.add(id(base))
                total += base.nbytes
        elif isinstance(obj, (tuple, list)) and depth < 4:
            total += sum(arrays(v, depth + 1) for v in obj)
        elif isinstance(obj, Codec) and depth < 4:
            total += sum(arrays(v, depth + 1) for v in getattr(obj, "__dict__", {}).values())
        return total

    return arrays(codec, 0) + 4 * int(codec.n)
