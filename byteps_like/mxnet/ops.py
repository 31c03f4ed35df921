"""NDArray operations: in-place push_pull, tensor declaration, parameter broadcast.

An NDArray is seen as numpy through ``asnumpy()`` (a copy, which also waits for MXNet's engine)
and the result is written back in place with ``tensor[:] = result``.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..wire import SUMMABLE
from ..worker import broadcast as core_broadcast
from ..worker.runtime import default_runtime
from ._mx import mx


def _check_ndarray(tensor: Any, what: str) -> None:
    if not isinstance(tensor, mx().nd.NDArray):
        raise TypeError(f"{what}: expected an mxnet NDArray, got {type(tensor).__name__}")
    if tensor.stype != "default":
        raise TypeError(f"{what}: sparse NDArrays ({tensor.stype}) are not supported")


def byteps_declare_tensor(name: str, **kwargs: Any) -> None:
    """Declare a tensor name; every worker must declare the same names in the same order.
    (BytePS's compression keyword arguments are accepted and ignored.)"""
    default_runtime().declare(name)


def byteps_push_pull(tensor: Any, version: int = 0, priority: int = 0, name: str | None = None,
                     is_average: bool = True) -> None:
    """Sum (``is_average=False``) or average ``tensor`` over all workers, in place.

    Larger ``priority`` goes first; ``version`` is accepted for BytePS compatibility. Unlike
    BytePS (which queues on MXNet's engine) this returns once the result is in ``tensor``."""
    rt = default_runtime()
    rt.check()
    what = f"byteps_push_pull of {name!r}" if name else "byteps_push_pull"
    _check_ndarray(tensor, what)
    arr = tensor.asnumpy()
    if arr.dtype.name not in SUMMABLE:
        raise TypeError(f"{what}: dtype {arr.dtype.name} cannot be summed; byteps_like sums "
                        f"{', '.join(sorted(SUMMABLE))}")
    rt.push_pull_async(arr, name=name, average=is_average, priority=priority, out=arr).wait()
    tensor[:] = arr


def _named_arrays(params: Any) -> list[tuple[str, Any]]:
    gluon = mx().gluon
    if isinstance(params, gluon.ParameterDict) or (
            isinstance(params, dict) and params
            and all(isinstance(v, gluon.Parameter) for v in params.values())):
        out = []
        for name in sorted(params.keys()):
            p = params[name]
            if p._deferred_init or p._data is None:
                raise ValueError(f"broadcast_parameters: parameter {name!r} is not initialised "
                                 "yet (deferred initialisation): run one forward pass first, "
                                 "or let DistributedTrainer broadcast it at its first step")
            out.append((name, p.data()))
        return out
    if isinstance(params, dict):
        return sorted(params.items())
    raise TypeError("broadcast_parameters takes a dict of NDArrays (arg_params, aux_params) or "
                    f"a gluon ParameterDict, not {type(params).__name__}")


def broadcast_arrays(pairs: list[tuple[str, Any]], root_rank: int, prefix: str) -> None:
    """Overwrite every NDArray with the root rank's values, in place."""
    rt = default_runtime()
    rt.check()
    for name, t in pairs:
        _check_ndarray(t, f"broadcast_parameters: {name!r}")
        arr = t.asnumpy()
        if arr.dtype.name not in SUMMABLE:  # bool, uint8, int8: exact through a wider type
            arr = arr.astype(np.float64 if arr.dtype.kind == "f" else np.int64)
        core_broadcast.broadcast_array(rt, arr, root_rank, prefix + name)
        t[:] = arr.astype(t.dtype, copy=False)


def broadcast_parameters(params: Any, root_rank: int = 0, prefix: str = "Parameter.") -> None:
    """Give every rank the root rank's ``params``: a dict of NDArrays (``arg_params``,
    ``aux_params`` of the Module API) or a Gluon ``ParameterDict`` (``net.collect_params()``),
    overwritten in place."""
    broadcast_arrays(_named_arrays(params), root_rank, prefix)
