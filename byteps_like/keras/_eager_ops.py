"""Tensor operations for Keras 3 on a backend other than TensorFlow (JAX, PyTorch): eager
only, through numpy copies (``keras.ops.convert_to_numpy``). With the TensorFlow backend
``byteps_like.keras`` uses :mod:`byteps_like.tensorflow.ops`, which also works in graphs."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..compression import Compression, Compressor
from ..wire import dtype_name
from ..worker import broadcast as core_broadcast
from ..worker.runtime import default_runtime
from ..worker.sync import GradBuffer, GradientSynchronizer, dtype_layout


class EagerOps:
    def __init__(self, keras: Any):
        self.keras = keras
        self._syncs: dict = {}

    def push_pull_gradients(self, grads: Sequence[Any], variables: Sequence[Any],
                            compression: Compressor = Compression.none, average: bool = True,
                            prefix: str = "Gradient.") -> list:
        k = self.keras
        rt = default_runtime()
        idx = [i for i, g in enumerate(grads) if g is not None]
        names = tuple(f"{i}.{getattr(variables[i], 'path', i)}" for i in idx)
        arrays = [self._numpy(grads[i]) for i in idx]
        key = (id(rt), names, prefix, compression, average)
        sync = self._syncs.get(key)
        if sync is None:
            sync = self._syncs[key] = GradientSynchronizer(
                rt, names, lambda j: GradBuffer(self._cur[j], dtype_name(self._cur[j].dtype)),
                compression=compression, average=average, prefix=prefix,
                layout=dtype_layout([(a.nbytes, dtype_name(a.dtype)) for a in arrays],
                                    compression, rt.cfg))  # tensor fusion
        self._cur = arrays
        sync.synchronize()  # one training step
        out = list(grads)
        for i, a in zip(idx, arrays):
            out[i] = k.ops.convert_to_tensor(a, dtype=grads[i].dtype)
        return out

    def _numpy(self, t: Any) -> np.ndarray:
        """A writable C-contiguous copy, 0-d for a scalar (``np.ascontiguousarray`` would make it
        1-d, and a scalar variable would not take it back)."""
        return np.array(self.keras.ops.convert_to_numpy(t), order="C", copy=True)

    def push_pull(self, tensor: Any, average: bool = True, name: str | None = None,
                  compression: Compressor = Compression.none) -> Any:
        from ..worker.api import push_pull_async
        rt = default_runtime()
        rt.check()
        a = self._numpy(tensor)
        name = f"PushPull.{name}" if name else rt.auto_name()
        out = push_pull_async(a, name=name, average=average, compression=compression).wait()
        return self.keras.ops.convert_to_tensor(out, dtype=tensor.dtype)

    def broadcast(self, tensor: Any, root_rank: int, name: str | None = None) -> Any:
        rt = default_runtime()
        rt.check()
        a = self._numpy(tensor)
        core_broadcast.broadcast_array(rt, a, root_rank,
                                       f"Broadcast.{name}" if name else rt.auto_name())
        return self.keras.ops.convert_to_tensor(a, dtype=tensor.dtype)

    def allgather(self, tensor: Any, name: str | None = None) -> Any:
        out = core_broadcast.allgather_array(default_runtime(), self._numpy(tensor), name)
        return self.keras.ops.convert_to_tensor(out, dtype=tensor.dtype)

    def broadcast_variables(self, variables: Sequence[Any], root_rank: int,
                            prefix: str = "BroadcastVariables.") -> None:
        rt = default_runtime()
        for i, v in enumerate(variables):
            a = self._numpy(v)
            core_broadcast.broadcast_array(rt, a, root_rank, f"{prefix}{i}.{v.path}")
            v.assign(a)
