"""Broadcast of parameters, optimizer state and objects from a root rank."""
from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import torch

from ..worker import broadcast as core_broadcast
from ..worker.runtime import default_runtime
from ._dtypes import WIRE_DTYPE
from ._tensor import as_numpy


def _pairs(params) -> list[tuple[str, torch.Tensor]]:
    if isinstance(params, dict):
        return sorted(params.items())
    pairs = list(params)
    if pairs and not isinstance(pairs[0], tuple):
        return [(f"param.{i}", p) for i, p in enumerate(pairs)]
    return pairs


def broadcast_parameters(params, root_rank: int, prefix: str = "Parameter.") -> None:
    """Overwrite every tensor of ``params`` (a ``state_dict()``, ``named_parameters()`` or a
    list of tensors) with the root rank's values, in place."""
    rt = default_runtime()
    rt.check()
    handles = []
    for name, p in _pairs(params):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"broadcast_parameters: {name!r} is a {type(p).__name__}, "
                            "not a tensor")
        t = p.data if isinstance(p, torch.nn.Parameter) else p
        # dtypes that cannot be summed (bool, uint8, ...) and device tensors go through a
        # host copy; contiguous CPU tensors of summable dtypes are used in place
        direct = t.device.type == "cpu" and t.is_contiguous() and t.dtype in WIRE_DTYPE
        host = t if direct else t.detach().to("cpu", torch.float64 if t.is_floating_point()
                                               else torch.int64).contiguous()
        arr = as_numpy(host)
        if rt.rank() != root_rank:
            arr[...] = 0
        dtype = "bfloat16" if host.dtype == torch.bfloat16 else None
        h = rt.push_pull_async(arr, name=prefix + name, average=False, out=arr, dtype=dtype)
        handles.append((h, t, host, direct))
    for h, t, host, direct in handles:
        h.wait()
        if not direct:
            with torch.no_grad():
                t.copy_(host)


_unnamed = itertools.count()


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> torch.Tensor:
    """Overwrite ``tensor`` in place with the root rank's values and return it (Horovod's
    ``broadcast_``). Unnamed broadcasts are numbered in call order, the same on every rank."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"broadcast_: expected a tensor, got {type(tensor).__name__}")
    name = name or f"noname.{next(_unnamed)}"
    broadcast_parameters([(name, tensor)], root_rank, prefix="Broadcast.")
    return tensor


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> torch.Tensor:
    """A new tensor holding the root rank's values of ``tensor`` (Horovod's ``broadcast``);
    ``tensor`` itself is left as it is."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"broadcast: expected a tensor, got {type(tensor).__name__}")
    return broadcast_(tensor.detach().clone(), root_rank, name)


def _to_array(x: Any):
    if isinstance(x, torch.Tensor):
        t = x.detach().cpu()
        if t.dtype == torch.bfloat16:
            return "torch:bfloat16", t.float().numpy()
        return f"torch:{str(t.dtype).removeprefix('torch.')}", t.numpy()
    return None


def _from_array(tag: str, arr: np.ndarray) -> torch.Tensor:
    kind, _, dtype = tag.partition(":")
    if kind != "torch" or not isinstance(getattr(torch, dtype, None), torch.dtype):
        raise ValueError(f"unknown tensor tag {tag!r}")
    return torch.from_numpy(arr).to(getattr(torch, dtype))


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None) -> Any:
    """The root rank's ``obj`` on every rank. The object travels through byteps_like's restricted
    codec, never pickle: None, bool, int, float, str, bytes, list, tuple, dict, numpy arrays and
    tensors. It is accepted only as sent by the root rank of this job, through this job's
    servers."""
    rt = default_runtime()
    rt.check()
    return core_broadcast.broadcast_object(rt, obj, root_rank, name, _to_array, _from_array)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int) -> None:
    """Give every rank the root rank's optimizer state (hyper-parameters and per-parameter
    buffers such as momentum), even where this rank has not stepped yet."""
    state = broadcast_object(optimizer.state_dict(), root_rank,
                             name=f"OptimizerState.{type(optimizer).__name__}")
    optimizer.load_state_dict(state)
