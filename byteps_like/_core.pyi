"""Native kernels of byteps_like: summation, averaging, conversion (C++, csrc/).

Buffers are any object exporting a C-contiguous buffer (numpy arrays, bytes, bytearray,
memoryview, a pyzmq ``Frame``); they are read as raw bytes whose element type is named by a
dtype string. Alignment does not matter. Every call releases the GIL while it works.

dtype strings: ``"float32"``, ``"float64"``, ``"float16"`` (IEEE half), ``"bfloat16"``
(no numpy dtype: hold it as ``uint16``), ``"int32"``, ``"int64"``.

Errors: a dtype outside that list, a length mismatch, a read-only or non-contiguous
destination raise ``ValueError``; an object without the buffer protocol raises ``TypeError``.

``nthreads > 1`` splits large buffers over that many threads (the caller's included) from a
small persistent pool, but only as many as give each thread at least 256 KiB; ``nthreads <= 1``
runs on the calling thread. Results do not depend on ``nthreads``.
"""
from typing import Final, Literal, TypedDict, Union

from typing_extensions import Buffer, TypeAlias

DType: TypeAlias = Literal["float32", "float64", "float16", "bfloat16", "int32", "int64"]
IsaLevel: TypeAlias = Literal["scalar", "avx2", "avx512"]

DTYPES: Final[tuple[str, ...]]
"""The dtype names accepted by the kernels, in a fixed order."""

class CpuFeatures(TypedDict):
    x86_64: bool
    sse2: bool
    avx: bool
    avx2: bool
    fma: bool
    f16c: bool
    avx512f: bool
    avx512bw: bool
    avx512vl: bool
    detected_isa: IsaLevel
    isa: IsaLevel
    kernel_fp16: Literal["f16c-avx512", "f16c-avx2", "scalar"]
    kernel_bf16: IsaLevel
    kernel_float32: IsaLevel
    max_threads: int
    min_bytes_per_thread: int

def add_into(dst: Buffer, src: Buffer, dtype: Union[DType, str], nthreads: int = 1) -> None:
    """``dst += src`` elementwise, both read as raw bytes of ``dtype``.

    dst must be writable; both must have the same byte length, a multiple of the dtype's
    itemsize (ValueError naming both lengths and the dtype otherwise). src may overlap dst.

    Semantics match numpy: floats add in their own precision; float16 adds in float32 and
    rounds to nearest even (bit-identical to numpy's float16 add, NaN payloads aside);
    bfloat16 likewise (NaN stays NaN); int32/int64 wrap around on overflow.
    """

def copy_into(dst: Buffer, src: Buffer, nthreads: int = 1) -> None:
    """Copy src's bytes into dst; the byte lengths must be equal (ValueError otherwise)."""

def scale_into(buf: Buffer, dtype: Union[DType, str], divisor: int, *, nthreads: int = 1) -> None:
    """Divide every element of ``buf`` by ``divisor`` in place (averaging a sum).

    divisor must be >= 1 (ValueError otherwise). float32/float64 use true division in their
    own precision (as numpy's ``a / divisor``); float16 and bfloat16 divide in float32 and
    round to nearest even; int32/int64 use floor division (numpy's ``floor_divide``).
    """

def convert(dst: Buffer, dst_dtype: Union[DType, str], src: Buffer, src_dtype: Union[DType, str],
            *, nthreads: int = 1) -> None:
    """``dst[i] = src[i]`` converted from src_dtype to dst_dtype.

    Supported pairs: float32 -> float16, float16 -> float32, float32 -> bfloat16,
    bfloat16 -> float32 (ValueError for others). Narrowing rounds to nearest even (float16:
    overflow gives inf, subnormals are kept; NaN stays NaN). dst and src must hold the same
    number of elements (ValueError naming both lengths otherwise).
    """

def cpu_features() -> CpuFeatures:
    """CPU features seen at run time and the kernel level in use.

    ``detected_isa`` is the best level this CPU supports, ``isa`` the level in use (lower only
    after ``_set_isa``); ``kernel_fp16`` names the float16 path.
    """

def itemsize(dtype: Union[DType, str]) -> int:
    """Bytes per element of ``dtype`` (ValueError for an unknown name)."""

def _set_isa(name: Union[IsaLevel, Literal["auto"], str]) -> str:
    """Testing hook: cap the kernel level process-wide; ``"auto"`` removes the cap.

    Returns the level in use before the call. ValueError for an unknown name or a level this
    CPU lacks. Not for production use.
    """
