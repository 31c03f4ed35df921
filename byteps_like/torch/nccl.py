"""Local reduction across the GPUs of one machine with NCCL (several local ranks, one GPU each).

For a CUDA tensor of a machine with ``local_size`` ranks:

1. NCCL reduce-scatter: each rank receives its slice of the machine's sum on its own GPU;
2. each rank copies only its slice into the machine's shared reduction buffer in host shared
   memory (:meth:`Runtime.local_out`), so every byte crosses PCIe once per machine;
3. the local root pushes the machine's sum from that buffer and pulls the job's sum back into it
   (``push_pull_async(..., prereduced=True)``);
4. each rank copies its slice of the result back to its GPU, and an NCCL all-gather gives every
   GPU the whole tensor.

With one worker machine (``DMLC_NUM_WORKER=1``, unless ``BYTEPS_FORCE_DISTRIBUTED=1``) there is
no network to save: the whole push_pull is one NCCL all-reduce among the local GPUs, and no
server is contacted.

The NCCL communicator is built with torch's own ``ProcessGroupNCCL`` on a ``FileStore`` in
``/dev/shm`` named after the job (swept with the other segments), so it never touches the
user's default process group.
"""
from __future__ import annotations

import atexit
import os

import numpy as np
import torch

from .. import local
from ..worker.runtime import Runtime
from ._dtypes import wire_dtype

_groups: dict = {}
_registered: dict = {}   # address of a shared reduction buffer -> its length, pinned for CUDA


def _pin(buf: np.ndarray) -> None:
    """Register a shared reduction buffer with the CUDA driver once (cudaHostRegister), so the
    slices a rank copies in and out move at pinned speed (~50 GB/s on an H200 host, against
    ~7 GB/s pageable) and asynchronously. Best effort: where registration is refused (no
    driver support, a limit), the copies stay pageable and correct."""
    addr = buf.ctypes.data
    if addr in _registered or buf.nbytes == 0:
        return
    try:
        err = torch.cuda.cudart().cudaHostRegister(addr, buf.nbytes, 0)
    except (AttributeError, RuntimeError, TypeError):
        err = -1
    code = getattr(err, "value", err)
    _registered[addr] = buf.nbytes if code == 0 else 0


def _unpin_all() -> None:
    for addr, nbytes in list(_registered.items()):
        if nbytes:
            try:
                torch.cuda.cudart().cudaHostUnregister(addr)
            except (AttributeError, RuntimeError, TypeError):
                pass
    _registered.clear()


def _group(rt: Runtime, device: torch.device):
    key = (id(rt), device)
    pg = _groups.get(key)
    if pg is None:
        import torch.distributed as dist
        c = rt.config.cluster
        path = os.path.join(local.SHM_DIR, local.segment_prefix(c.job_id, c.root_port)
                            + f"m{rt.machine}-ncclstore")
        store = dist.FileStore(path, c.local_size)
        opts = dist.ProcessGroupNCCL.Options()
        pg = dist.ProcessGroupNCCL(store, c.local_rank, c.local_size, opts)
        if not _groups:
            atexit.register(close_groups)
        _groups[key] = pg
    return pg


class NcclPushPull:
    """One push_pull of a CUDA tensor through NCCL local reduction. ``start()`` returns the core
    handle; ``finish()`` (after it completes) leaves the result in ``out`` on the GPU."""

    def __init__(self, rt: Runtime, tensor: torch.Tensor, out: torch.Tensor, name: str,
                 average: bool, priority: int):
        self.rt, self.out, self.average = rt, out, average
        self.name = name
        self.L, self.r = rt.local_size_, rt.local_rank_
        self.dtype = wire_dtype(tensor, f"push_pull of {name!r}")
        flat = tensor.detach().reshape(-1)
        self.count = flat.numel()
        self.chunk = -(-self.count // self.L)            # elements per rank (padded)
        self.pg = _group(rt, tensor.device)
        self.priority = priority
        self.allreduce = None
        if rt.single_machine:  # one machine: the all-reduce is the whole operation
            same = out.data_ptr() == tensor.data_ptr() and out.is_contiguous()
            self.result = out.detach().reshape(-1) if same else flat.clone()
            self.allreduce = self.pg.allreduce([self.result])
            self.typed = np.empty(0, np.uint8)
            return
        padded = flat
        if self.chunk * self.L != self.count:
            padded = torch.zeros(self.chunk * self.L, dtype=flat.dtype, device=flat.device)
            padded[:self.count].copy_(flat)
        self.mine = torch.empty(self.chunk, dtype=flat.dtype, device=flat.device)
        self.pg._reduce_scatter_base(self.mine, padded.contiguous()).wait()
        # my slice of the machine's sum into the shared buffer (PCIe once per byte per machine)
        shared = rt.local_out(name, tuple(tensor.shape), self.dtype)
        _pin(shared)
        lo = min(self.r * self.chunk, self.count)
        hi = min(lo + self.chunk, self.count)
        self.lo, self.hi = lo, hi
        self.shared_t = _as_tensor(shared, tensor.dtype)      # CPU tensor over shared memory
        if hi > lo:
            self.shared_t[lo:hi].copy_(self.mine[:hi - lo])   # synchronous D2H
        self.typed = _typed(shared, self.dtype, tensor.shape)

    def start(self, priority: int | None = None):
        """Push the machine's sum and pull the job's (the local root talks to the servers)."""
        if self.allreduce is not None:  # nothing leaves the machine: a handle already done
            from ..worker.handle import Handle
            return Handle(self.name, self.typed, self.typed, 0,
                          default_timeout=self.rt.config.timeouts.op_timeout)
        return self.rt.push_pull_async(self.typed, name=self.name, average=False,
                                       priority=self.priority if priority is None else priority,
                                       out=self.typed,
                                       dtype=self.dtype, prereduced=True)

    def buffer(self):
        """The GradBuffer the synchronizer uses: started by :meth:`start`, finished by
        :meth:`finish`."""
        from ..worker.sync import GradBuffer
        return GradBuffer(self.typed, self.dtype, self.finish, start=self.start)

    def finish(self) -> None:
        if self.allreduce is not None:
            self.allreduce.wait()  # orders the current stream after the all-reduce
            result = self.result.view(self.out.shape)
            if self.average:
                if result.is_floating_point():
                    result.div_(self.rt.size_)
                else:
                    result.copy_(torch.div(result, self.rt.size_, rounding_mode="floor"))
            if result.data_ptr() != self.out.data_ptr():
                self.out.copy_(result)
            return
        lo, hi = self.lo, self.hi
        if hi > lo:
            self.mine[:hi - lo].copy_(self.shared_t[lo:hi])   # H2D of my slice only
        gathered = torch.empty(self.chunk * self.L, dtype=self.mine.dtype,
                               device=self.mine.device)
        self.pg._allgather_base(gathered, self.mine).wait()
        result = gathered[:self.count].view(self.out.shape)
        if self.average:
            if result.is_floating_point():
                result = result / self.rt.size_
            else:
                result = torch.div(result, self.rt.size_, rounding_mode="floor")
        self.out.copy_(result)


def _as_tensor(u8: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    t = torch.from_numpy(u8)  # uint8, shares the shared memory
    return t.view(dtype)


def _typed(u8: np.ndarray, wire: str, shape) -> np.ndarray:
    from ..wire import NUMPY_DTYPE
    return u8.view(NUMPY_DTYPE[wire]).reshape(shape)


def close_groups() -> None:
    """Shut the NCCL communicators down (at exit, or when the job is left)."""
    for pg in list(_groups.values()):
        shutdown = getattr(pg, "shutdown", None)
        if shutdown is not None:
            try:
                shutdown()
            except Exception:  # noqa: BLE001 - best effort at exit
                pass
    _groups.clear()
    _unpin_all()  # before the runtime unmaps the shared segments
