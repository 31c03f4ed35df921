"""Gradient compression, written once for every framework.

A compressor turns the array to be summed into the array that travels (``compress``) and the
summed array back into the caller's dtype (``decompress``). Plugins expose them as
``Compression.none`` and ``Compression.fp16``, as BytePS and Horovod do.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from . import _core


class Compressor:
    """Identity: the array travels as it is."""
    name = "none"

    def compress(self, arr: np.ndarray, dtype: str) -> tuple[np.ndarray, str, Any]:
        """Return (array to push, its wire dtype, context for decompress)."""
        return arr, dtype, None

    def decompress(self, wire: np.ndarray, ctx: Any, out: np.ndarray, dtype: str) -> None:
        """Write the pulled ``wire`` array into ``out`` (of the caller's ``dtype``)."""
        if wire is not out:
            _core.copy_into(out.reshape(-1).view(np.uint8), wire.reshape(-1).view(np.uint8))

    def __repr__(self) -> str:
        return f"Compression.{self.name}"


class FP16Compressor(Compressor):
    """Floating-point gradients travel as IEEE half precision (half the bytes); other dtypes are
    left alone. Sums are formed in float16 on the servers, so this trades precision for bytes."""
    name = "fp16"
    _FLOATS = ("float32", "float64", "bfloat16")

    def compress(self, arr: np.ndarray, dtype: str) -> tuple[np.ndarray, str, Any]:
        if dtype not in self._FLOATS:
            return arr, dtype, None
        wire = np.empty(arr.shape, np.float16)
        if dtype == "float64":
            np.copyto(wire, arr, casting="same_kind")
        else:
            _core.convert(wire, "float16", arr, dtype)
        return wire, "float16", dtype

    def decompress(self, wire: np.ndarray, ctx: Any, out: np.ndarray, dtype: str) -> None:
        if ctx is None:
            super().decompress(wire, ctx, out, dtype)
        elif ctx == "float64":
            np.copyto(out, wire, casting="unsafe")
        else:
            _core.convert(out, ctx, wire, "float16")


class Compression:
    """Namespace of the built-in compressors (BytePS/Horovod spelling)."""
    none = Compressor()
    fp16 = FP16Compressor()
