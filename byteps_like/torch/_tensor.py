"""How byteps_like sees a torch tensor: a numpy view of its memory (zero-copy on CPU), its wire
dtype, and a staging copy for tensors on a device."""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from ..sync import GradBuffer

WIRE_DTYPE = {torch.float32: "float32", torch.float64: "float64", torch.float16: "float16",
              torch.bfloat16: "bfloat16", torch.int32: "int32", torch.int64: "int64"}


def wire_dtype(t: torch.Tensor, what: str = "tensor") -> str:
    try:
        return WIRE_DTYPE[t.dtype]
    except KeyError:
        raise TypeError(f"{what} has dtype {t.dtype}; push_pull sums "
                        f"{', '.join(str(d) for d in WIRE_DTYPE)}") from None


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy array sharing ``t``'s memory (``t`` must be a contiguous CPU tensor)."""
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def stage(t: torch.Tensor, what: str = "tensor", copy_in: bool = True) -> GradBuffer:
    """A host buffer for ``t``: ``t`` itself when it is a contiguous CPU tensor, otherwise a
    (pinned, for devices) copy with a write-back into ``t``. ``copy_in=False`` skips filling
    the copy (for an output buffer)."""
    dtype = wire_dtype(t, what)
    if t.device.type == "cpu" and t.is_contiguous():
        return GradBuffer(as_numpy(t), dtype)
    host = torch.empty(t.shape, dtype=t.dtype, device="cpu",
                       pin_memory=t.device.type == "cuda" and torch.cuda.is_available())
    if copy_in:
        host.copy_(t.detach())
    writeback: Callable[[], None] = lambda: t.detach().copy_(host)  # noqa: E731
    return GradBuffer(as_numpy(host), dtype, writeback)
