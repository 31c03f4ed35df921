"""Conformance adapter: the framework-neutral numpy API, ``import byteps_like as bps``."""
from __future__ import annotations

import numpy as np
from case_common import NumpyTensors

import byteps_like as bps


class Adapter(NumpyTensors):
    name = "numpy"
    bps = bps
    dtypes = ["float32", "float64", "float16", "int32", "int64"]   # numpy has no bfloat16
    broadcast_dtypes = ["float32", "int64"]
    gather_dtypes = ["float32", "float16", "int64"]

    def push_pull(self, t, name: str, average: bool | None):
        if average is None:
            return bps.push_pull(t, name=name)
        return bps.push_pull(t, name=name, average=average)

    def push_pull_fp16(self, t, name: str):
        from byteps_like.compression import Compression
        return bps.push_pull(t, name=name, average=False, compression=Compression.fp16)

    def broadcast(self, t, root: int, name: str):
        fn = getattr(bps, "broadcast", None)   # once it exists, the strict xfail says so
        if fn is None:
            raise NotImplementedError("the numpy API has no broadcast (byteps_like exports "
                                      "push_pull, allgather and join, but no broadcast)")
        return fn(t, root_rank=root, name=name)

    def allgather(self, t, name: str):
        return bps.allgather(t, name=name)

    def gradients(self):
        """Four layers' gradients pushed in backward order (last layer first), each with the
        priority of its layer (-index), as a plugin's synchronizer does."""
        names = [f"Gradient.layer{i}" for i in range(4)]
        arrays = [np.full(64 * 64, float(i), np.float32) for i in range(4)]
        for n in names:       # declared first layer first, as a model's parameters are
            bps.declare(n)
        handles = []

        def start():
            handles.extend(bps.push_pull_async(arrays[i], name=names[i], priority=-i)
                           for i in reversed(range(4)))

        def finish():
            for h in handles:
                h.wait()
        return names, start, finish
