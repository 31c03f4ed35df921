"""The tensor registry: what a worker knows of each tensor it push_pulls, by name.

A name is *declared* once (:meth:`TensorRegistry.declare`: the next key, the same on every
worker because every worker declares in the same order) and *bound* at its first use
(:meth:`TensorRegistry.bind`: its shape and dtype, cut into partitions, each with its key and
server; :meth:`TensorRegistry.bind_compressor`: a codec compressor, one codec per partition).
The registry also holds the rounds a ``join()`` handed back for names not declared yet.

Who calls it: the :class:`~byteps_like.worker.runtime.Runtime` facade (``declare``,
``local_out``, ``push_pull_async``), always holding the runtime's lock. ``Rounds.start``
reads the bound partitions to cut a push_pull into pipeline tasks, and the native data plane
(:mod:`.dataplane`) to submit a whole tensor at once.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ..compression import CompiledCodec, compiled_codec, native_params
from ..errors import MismatchError
from ..partition import ServerAssigner, make_key, partition_bounds
from ..wire import ITEMSIZE, pack_decl
from .handle import Handle

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..compression import Codec

#: one partition of a bound tensor: (offset, nbytes, key, server)
Part = tuple[int, int, int, int]
#: one partition as the native data plane takes it: (key, server, stream, offset, nbytes,
#: the first round's declaration or None)
NativePart = tuple[int, int, int, int, int, bytes | None]

#: dtypes a codec compressor applies to (codecs work in float32; the others are converted)
COMPRESSIBLE = frozenset({"float32", "float16", "bfloat16", "float64"})


class DeviceCopier:
    """What a plugin implements to stage an accelerator tensor partition by partition.

    Both methods run on pipeline threads and must return once the copy is complete (d2h) or
    ordered before any later use of the output (h2d)."""

    def d2h(self, offset: int, nbytes: int) -> None:
        raise NotImplementedError

    def h2d(self, offset: int, nbytes: int) -> None:
        raise NotImplementedError



@dataclass
class TensorState:
    """What a worker knows of one declared tensor."""
    decl_id: int
    name: str
    shape: tuple | None = None
    dtype: str | None = None
    nbytes: int = 0
    parts: list[Part] = field(default_factory=list)
    round: int = 0
    busy: Handle | None = None
    # (handle, start) of the push_pulls queued behind the one in flight: start(block) starts it
    waiting: list[tuple[Handle, Callable[[bool], None]]] = field(default_factory=list)
    compressor: Any = None     # a codec-kind Compressor bound at first use, or None
    spec: dict | None = None   # its spec (what the servers get)
    comp_bound: bool = False
    codecs: list[Codec] = field(default_factory=list)    # one worker Codec per partition
    # float32 staging per partition (None for a float32 tensor, which needs none)
    scratch: list[np.ndarray | None] = field(default_factory=list)
    native_parts: list[NativePart] | None = None  # (key, server, stream, offset, nbytes, None)
    # per partition, the server codec's parameters for the native data plane
    # (compression.native_params); None when a codec has none (a registered compressor)
    native_codec: list[list[int]] | None = None
    # per partition, the worker codec's _core.NativeCodec when every one is compiled (a float32
    # tensor with a built-in codec): the native data plane then runs them itself
    compiled: list[Any] | None = None
    compiled_bytes: int = 0   # their payloads' bytes together: what a coded round pushes
    # a float32 tensor pushed with a cast compressor (fp16, bf16) on the native data plane
    # (worker/route.py's NATIVE cast): the _core.NativeCast of each partition, which the native
    # client narrows and widens with (worker/dataplane.py); nbytes are the wire bytes
    cast_coders: list[Any] | None = None


def declaration(st: TensorState, dtype: str, part: int, backup: int = 0,
                coded: bool = False) -> dict[str, Any]:
    """What the first round of partition ``part`` declares to its server (both data paths):
    the fields of a declaration (``wire.pack_decl``). ``coded``: a compressed partition, which
    names its compressor (it travels once per key) and, for a built-in codec, the server
    codec's parameters (``native_codec``). ``backup``: an averaged tensor of a job with b
    backup workers (:func:`backs_up`), whose rounds complete without the last b pushes
    (csrc/dataplane_server_backup.cc)."""
    assert st.shape is not None
    decl = {"name": st.name, "shape": list(st.shape), "dtype": dtype, "part": part,
            "nparts": len(st.parts), "count": st.parts[part][1] // ITEMSIZE[dtype],
            "backup": backup}
    if coded:
        if st.native_codec is not None:
            decl["native_codec"] = st.native_codec[part]
        decl["compressor"] = st.spec
    return decl


def backs_up(cfg: Any, average: bool, size: int) -> int:
    """The backup workers b of a push_pull, whose rounds may complete without the last b
    pushes (BYTEPS_BACKUP_WORKERS): an average's; 0 for a sum, a broadcast, an allgather,
    which wait for every worker."""
    return cfg.server.backup_workers if average and size > 1 and cfg is not None else 0


def decl_bytes(decl: dict[str, Any]) -> bytes:
    """A declaration as the servers compare it: the same bytes on every worker, in the binary
    layout csrc/decl.h defines (``wire.pack_decl``)."""
    return pack_decl(**decl)


class TensorRegistry:
    """The declared tensors of one runtime. Every method expects the runtime's lock held."""

    def __init__(self) -> None:
        self.tensors: dict[str, TensorState] = {}
        self.round_floor: dict[str, int] = {}  # after join(): rounds of names not declared yet
        # elastic jobs (elastic_membership.py): ids from names, rounds from the epoch
        self.key_of: Callable[[str], int] | None = None
        self.round_base = 0
        self._noname = 0

    def auto_name(self) -> str:
        """The next BytePS-style name for an unnamed tensor (same sequence on every worker)."""
        name = f"PushPull.noname.{self._noname}"
        self._noname += 1
        return name

    def reset(self, round_base: int) -> None:
        """Forget every declaration (an elastic job's new epoch, which the servers start with
        no keys): names are declared afresh from ``round_base`` and the unnamed sequence
        restarts, so a joiner's names are the survivors'."""
        self.tensors.clear()
        self.round_floor = {}
        self.round_base = round_base
        self._noname = 0

    def declare(self, name: str) -> TensorState:
        """The state of ``name``, declaring it (the next key) if it is new; after a join() a
        new name starts at the round the job is at."""
        st = self.tensors.get(name)
        if st is None:
            st = self.tensors[name] = TensorState(
                len(self.tensors) if self.key_of is None else self.key_of(name), name,
                round=self.round_floor.pop(name, self.round_base))
        return st

    def rounds(self) -> dict[str, int]:
        """The round each declared tensor is at (what join() reports)."""
        return {st.name: st.round for st in self.tensors.values()}

    def catch_up(self, rounds: dict[str, int]) -> None:
        """After join(): each tensor continues at the round the job is at (the ranks that ran
        more steps pushed more rounds); names not declared yet start there."""
        for name, rnd in rounds.items():
            st = self.tensors.get(name)
            if st is None:
                self.round_floor[name] = rnd
            elif rnd > st.round:
                st.round = rnd

    @staticmethod
    def bind(st: TensorState, shape: tuple, dtype: str, nbytes: int, *, rank: int,
             partition_bytes: int, assigner: ServerAssigner | None) -> None:
        """Fix ``st``'s shape and dtype at its first use and cut it into partitions (each with
        its key and server; none without an ``assigner``: a standalone job); refuse another
        shape or dtype later."""
        if st.dtype is None:
            st.shape, st.dtype, st.nbytes = shape, dtype, nbytes
            if assigner is None:
                return
            bounds = partition_bounds(nbytes, ITEMSIZE[dtype], partition_bytes)
            for part, (off, n) in enumerate(bounds):
                key = make_key(st.decl_id, part)
                st.parts.append((off, n, key, assigner.assign(key, n)))
        elif (st.shape, st.dtype) != (shape, dtype):
            raise MismatchError(f"worker rank {rank}: tensor {st.name!r} was first used "
                                f"with shape {st.shape} {st.dtype}, now {shape} {dtype}; use a "
                                "different name for a different tensor")

    @staticmethod
    def bind_compressor(st: TensorState, compression: Any, *, rank: int, min_bytes: int,
                        makes_codecs: bool) -> None:
        """Bind a codec compressor to a tensor at its first push_pull (every worker does the
        same, so the servers see one compressor per key); refuse a different one later.
        ``makes_codecs``: this rank compresses (the local root: only it pushes)."""
        is_codec = getattr(compression, "kind", "none") == "codec"
        if st.comp_bound and (compression is st.compressor
                              or (st.compressor is None and not is_codec)):
            return  # the usual case, every step: the same compressor (or none) as bound
        # too small to gain, or not a float tensor: travels as it is
        codec = is_codec and st.dtype in COMPRESSIBLE and st.nbytes >= min_bytes
        wanted = compression.spec() if codec else None
        if not st.comp_bound:
            st.comp_bound = True
            if wanted is None:
                return
            st.compressor, st.spec = compression, wanted
            if makes_codecs:
                assert st.dtype is not None
                native: list[list[int]] | None = []
                compiled: list[Any] | None = []
                for _off, n, key, _server in st.parts:
                    count = n // ITEMSIZE[st.dtype]
                    # a float32 tensor's built-in codec runs in C++, where the native data
                    # plane can run it too (a coded operation, worker/dataplane.py)
                    codec = (compiled_codec(compression, count, key)
                             if st.dtype == "float32" else None)
                    if codec is None:
                        codec = compression.make_codec(count, role="worker", key=key)
                    st.codecs.append(codec)
                    compiled = (compiled + [codec.native]
                                if compiled is not None and isinstance(codec, CompiledCodec)
                                else None)
                    st.scratch.append(None if st.dtype == "float32"
                                      else np.empty(count, np.float32))
                    params = native_params(compression, count)
                    native = None if native is None or params is None else native + [params]
                st.native_codec = native
                st.compiled = compiled if native is not None else None
                st.compiled_bytes = sum(c.max_bytes for c in st.compiled or ())
            return
        if st.spec != wanted:
            raise MismatchError(f"worker rank {rank}: tensor {st.name!r} was first "
                                f"pushed with compression {st.spec or 'none'}, now with "
                                f"{wanted or 'none'}; a tensor keeps its compressor (use "
                                "another name for another setting)")
