"""The dtypes push_pull sums, as torch and the wire name them: shared by the tensor views
(:mod:`._tensor`), fusion, broadcast and the NCCL local reduction (:mod:`.nccl`), which import
them from here rather than from each other."""
from __future__ import annotations

import torch

WIRE_DTYPE = {torch.float32: "float32", torch.float64: "float64", torch.float16: "float16",
              torch.bfloat16: "bfloat16", torch.int32: "int32", torch.int64: "int64"}
TORCH_DTYPE = {name: dtype for dtype, name in WIRE_DTYPE.items()}


def wire_dtype(t: torch.Tensor, what: str = "tensor") -> str:
    try:
        return WIRE_DTYPE[t.dtype]
    except KeyError:
        raise TypeError(f"{what} has dtype {t.dtype}; push_pull sums "
                        f"{', '.join(str(d) for d in WIRE_DTYPE)}") from None
