"""The wire protocol: a fixed, versioned binary header plus zero-copy payload frames.

A message is a ZeroMQ multipart message::

    [header (HEADER_SIZE bytes)]
    [payload (nbytes bytes), when the type carries data]
    [meta (JSON), when FLAG_META]

The header is a little-endian ``struct`` with a magic number and a version, defined once in
csrc/wire.h for both languages: this module builds its struct format, enums, flags and dtype
tables from ``_core.wire_spec()``. Nothing that arrives from the network is unpickled: control
payloads are UTF-8 JSON objects of bounded size, data payloads are raw bytes whose length is
checked against ``count * itemsize(dtype)``. Every decode failure raises
:class:`~byteps_like.errors.ProtocolError` with a message that says what was wrong.
"""
from __future__ import annotations

import enum
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _core
from ._native import REBUILD
from .errors import ProtocolError


def _check_layout(spec: dict, size: int, what: str) -> None:
    """The struct built from a spec's field codes has the C++ struct's offsets and size (the
    wire header's, and the declaration's head below)."""
    offset = 0
    for name, off, fsize, code in spec["header"]:
        if off != offset or struct.calcsize("<" + code) != fsize:
            raise ImportError(f"byteps_like.wire: {what} field {name} is at {off} with {fsize} "
                              f"bytes in _core, the struct code {code!r} puts it at {offset} "
                              f"with {struct.calcsize('<' + code)}: rebuild _core")
        offset += fsize
    if offset != spec["header_size"] or size != offset:
        raise ImportError(f"byteps_like.wire: {what} of {size} bytes, _core's is "
                          f"{spec['header_size']}: rebuild _core")


def _load_spec(export: str, source: str, what: str) -> tuple[dict, struct.Struct,
                                                              tuple[str, ...]]:
    """``_core.<export>()`` (a format defined in csrc/``source``), the struct its header's
    field codes make (checked against the C++ offsets) and the fields' names; ImportError
    saying to rebuild when _core predates it."""
    try:
        spec = getattr(_core, export)()
    except AttributeError:  # a _core built before that source
        raise ImportError(f"byteps_like._core has no {export}() (csrc/{source}): it was built "
                          "from older sources. " + REBUILD) from None
    packer = struct.Struct("<" + "".join(code for _name, _off, _size, code in spec["header"]))
    _check_layout(spec, packer.size, what)
    return spec, packer, tuple(name for name, _off, _size, _code in spec["header"])


# The wire's one definition lives in csrc/wire.h, which the native data plane compiles and
# _core.wire_spec() exports: the header's fields (their struct codes and offsets), magic,
# version, message types, flags, roles and dtypes. This module takes every value from it and
# refuses to import when a name is missing on either side (tests/unit/test_wire.py).
# magic, version, type, dtype, sender role, sender rank, flags, job, key, round, count, nbytes
_SPEC, _HEADER, HEADER_FIELDS = _load_spec("wire_spec", "wire.h", "header")
MAGIC: bytes = _SPEC["magic"]
VERSION: int = _SPEC["version"]
HEADER_SIZE = _HEADER.size
MAX_META_BYTES: int = _SPEC["max_meta"]  # JSON control payloads: tables of thousands of nodes fit
_T: dict[str, int] = _SPEC["msg_types"]


class MsgType(enum.IntEnum):
    # control plane (node <-> scheduler)
    REGISTER = _T["REGISTER"]
    NODE_TABLE = _T["NODE_TABLE"]
    BARRIER = _T["BARRIER"]
    BARRIER_DONE = _T["BARRIER_DONE"]
    HEARTBEAT = _T["HEARTBEAT"]
    PEER_LOST = _T["PEER_LOST"]
    FINISH = _T["FINISH"]
    SHUTDOWN = _T["SHUTDOWN"]
    ABORT = _T["ABORT"]
    STALL = _T["STALL"]              # server -> scheduler: synchronous rounds waiting on some
    #                                  workers
    JOIN = _T["JOIN"]                # worker -> scheduler: this rank is out of data (join())
    MEMBERS = _T["MEMBERS"]          # scheduler -> servers: ranks joined / left (servers answer
    #                                  with the key)
    JOIN_DONE = _T["JOIN_DONE"]      # scheduler -> workers: every rank has joined (or the join
    #                                  failed)
    EPOCH = _T["EPOCH"]              # elastic: scheduler -> servers: reset to a new membership
    #                                  epoch (they answer with the epoch in the key); scheduler ->
    #                                  workers: the epoch in the key is superseded (or, for the
    #                                  current one, workers wait to join)
    READY = _T["READY"]              # elastic: worker -> scheduler: left the epoch in the key,
    #                                  ready for the next
    EPOCH_START = _T["EPOCH_START"]  # elastic: scheduler -> workers: the new epoch is formed
    EXITED = _T["EXITED"]            # launcher -> scheduler: a process it started exited (pid,
    #                                  host, how)
    # losing a server (docs/reliability.md): the key is the failover's number
    FAILOVER = _T["FAILOVER"]        # scheduler -> workers: a server is lost; its keys move
    SEEDED = _T["SEEDED"]            # worker -> scheduler: its moved keys are re-seeded
    RESUME = _T["RESUME"]            # scheduler -> workers: every worker has seeded; go on
    STREAM_LOST = _T["STREAM_LOST"]  # worker -> scheduler: its data streams to a server closed
    REPORT = _T["REPORT"]            # node -> scheduler: periodic telemetry (a worker's
    #                                  progress, a server's traffic and straggler report)
    # data plane (worker <-> server)
    PUSH = _T["PUSH"]
    PUSH_ACK = _T["PUSH_ACK"]
    PULL = _T["PULL"]
    PULL_RESP = _T["PULL_RESP"]
    HELLO = _T["HELLO"]              # native data plane only: a stream's first message
    # server-held embedding tables (docs/sparse.md; server/sparse.py): key = the table's id
    SPARSE_CREATE = _T["SPARSE_CREATE"]  # worker -> server: meta declares the table's shard
    SPARSE_PULL = _T["SPARSE_PULL"]      # worker -> server: int64 row ids; round = the step
    SPARSE_ROWS = _T["SPARSE_ROWS"]      # server -> worker: the float32 rows of a SPARSE_PULL
    SPARSE_PUSH = _T["SPARSE_PUSH"]      # worker -> server: uint8 [ids int64][grads float32]
    SPARSE_ACK = _T["SPARSE_ACK"]        # server -> worker: a create, push, save or load done
    SPARSE_SAVE = _T["SPARSE_SAVE"]      # worker -> server: meta names a checkpoint to write
    SPARSE_LOAD = _T["SPARSE_LOAD"]      # worker -> server: meta names a checkpoint to read
    # either
    ERROR = _T["ERROR"]
    # local reduction among the worker processes of one machine (see byteps_like.local)
    LOCAL_READY = _T["LOCAL_READY"]
    LOCAL_REDUCE = _T["LOCAL_REDUCE"]
    LOCAL_REDUCED = _T["LOCAL_REDUCED"]
    LOCAL_DONE = _T["LOCAL_DONE"]


class Role(enum.IntEnum):
    SCHEDULER = _SPEC["roles"]["SCHEDULER"]
    SERVER = _SPEC["roles"]["SERVER"]
    WORKER = _SPEC["roles"]["WORKER"]

    @classmethod
    def parse(cls, name: str) -> Role:
        return cls[name.upper()]

    @property
    def label(self) -> str:
        return self.name.lower()


# Flags (csrc/wire.h)
_F: dict[str, int] = _SPEC["flags"]
FLAG_META: int = _F["FLAG_META"]            # a JSON meta frame follows the payload
FLAG_DECLARE: int = _F["FLAG_DECLARE"]      # first round of a key: meta carries name, shape, dtype
FLAG_ASYNC: int = _F["FLAG_ASYNC"]          # asynchronous mode push (delta applied at once)
FLAG_PULL: int = _F["FLAG_PULL"]            # a push that also asks for the round's result
FLAG_COMPRESSED: int = _F["FLAG_COMPRESSED"]  # the payload is a compressor's encoding (uint8)
FLAG_AUTH: int = _F["FLAG_AUTH"]            # the native data plane's authenticated HELLO
FLAG_CONTRIB: int = _F["FLAG_CONTRIB"]      # PULL_RESP of a round fewer workers pushed (some
CONTRIB_SHIFT: int = _SPEC["contrib_shift"]  # had joined): the pushes summed are in
#                                              flags >> CONTRIB_SHIFT; averages divide by it
FLAG_SEED: int = _F["FLAG_SEED"]            # a PUSH carrying its round's completed sum (failover)
FLAG_RETRY: int = _F["FLAG_RETRY"]          # a push re-sent to a key's new server (failover)
FLAG_TABLE: int = _F["FLAG_TABLE"]          # a HELLO that opens a table stream (server-held tables)


def contrib_flags(pushes: int, num_workers: int) -> int:
    """The PULL_RESP flags telling how many pushes a round summed (0 when all did)."""
    return 0 if pushes >= num_workers else FLAG_CONTRIB | (pushes << CONTRIB_SHIFT)


def generation_flags(generation: int) -> int:
    """A table request's (or its answer's) flags carrying the rollback generation of its worker
    (server/sparse_survival.py): in the bits a PULL_RESP's contributors use."""
    return generation << CONTRIB_SHIFT


def generation(flags: int) -> int:
    """The rollback generation in a table message's flags."""
    return flags >> CONTRIB_SHIFT


def contributors(flags: int) -> int:
    """The pushes a PULL_RESP's round summed when fewer than all (0: all of them)."""
    return flags >> CONTRIB_SHIFT if flags & FLAG_CONTRIB else 0

# Error kinds carried in ERROR meta["kind"]
ERR_MISMATCH = "mismatch"
ERR_PROTOCOL = "protocol"
ERR_PEER_LOST = "peer_lost"
ERR_REGISTER = "register"
ERR_INTERNAL = "internal"
ERR_PEER_LEFT = "peer_left"   # a rank finished without join(): the round can never complete
ERR_EPOCH = "epoch"           # elastic: the round's membership epoch ended; it was dropped
ERR_REJOIN = "rejoin"          # a restarted scheduler: register again (not an error of the node)
ERR_TOO_FEW = "too_few_workers"  # elastic: below the minimum of workers for too long
ERR_ROLLBACK = "rolled_back"  # tables: a lost server rolled them back to a snapshot
ERR_BEHIND = "behind"          # backup workers: a worker asked for a round no longer kept

#: Elastic jobs carry the membership epoch in a data message's round: the high 32 bits hold
#: epoch - 1, the low 32 the round within the epoch; so a push or pull of an older epoch is out
#: of round at every server (no sum mixes two epochs). Epoch 1 (and every non-elastic job)
#: counts rounds from 0 as before.
EPOCH_SHIFT = 32
ROUND_MASK = (1 << EPOCH_SHIFT) - 1


def epoch_round_base(epoch: int) -> int:
    """The first round of membership epoch ``epoch`` (>= 1)."""
    return max(0, epoch - 1) << EPOCH_SHIFT


def round_epoch(rnd: int) -> int:
    """The membership epoch a round belongs to."""
    return (rnd >> EPOCH_SHIFT) + 1


def first_round(rnd: int) -> bool:
    """Whether ``rnd`` is the first round of its epoch: the one whose pushes declare their key
    (round 0 of every non-elastic job)."""
    return rnd & ROUND_MASK == 0

# dtypes in code order (csrc/wire.h): name, itemsize, whether the servers sum it
DTYPES: tuple[str, ...] = tuple(name for name, _size, _summable in _SPEC["dtypes"])
DTYPE_CODE = {name: i for i, name in enumerate(DTYPES)}
ITEMSIZE: dict[str, int] = {name: size for name, size, _summable in _SPEC["dtypes"]}
# numpy dtype used to hold each wire dtype (bfloat16 travels as raw uint16)
NUMPY_DTYPE = {"float32": np.float32, "float64": np.float64, "float16": np.float16,
               "bfloat16": np.uint16, "int32": np.int32, "int64": np.int64, "uint8": np.uint8,
               "int8": np.int8}
SUMMABLE = frozenset(name for name, _size, summable in _SPEC["dtypes"] if summable)


def _check_names() -> None:
    """Every name of the C++ definition has its Python twin and the other way round."""
    pairs = [("message type", set(_T), set(MsgType.__members__)),
             ("flag", set(_F), {n for n in globals() if n.startswith("FLAG_")}),
             ("role", set(_SPEC["roles"]), set(Role.__members__)),
             ("dtype", set(DTYPES) - {"none"}, set(NUMPY_DTYPE))]
    for what, cpp, py in pairs:
        if cpp != py:
            raise ImportError(f"byteps_like.wire: the {what}s of _core (csrc/wire.h) and of "
                              f"wire.py differ: only in _core {sorted(cpp - py)}, only in "
                              f"wire.py {sorted(py - cpp)}; rebuild _core or add the name")


_check_names()

_DATA_TYPES = {MsgType.PUSH, MsgType.PULL_RESP, MsgType.SPARSE_PULL, MsgType.SPARSE_ROWS,
               MsgType.SPARSE_PUSH}
#: the messages of server-held tables, worker to server and back (docs/sparse.md)
SPARSE_REQUESTS = frozenset({MsgType.SPARSE_CREATE, MsgType.SPARSE_PULL, MsgType.SPARSE_PUSH,
                             MsgType.SPARSE_SAVE, MsgType.SPARSE_LOAD})
SPARSE_ANSWERS = frozenset({MsgType.SPARSE_ROWS, MsgType.SPARSE_ACK})
#: the message types that carry a payload frame (count x dtype in nbytes)
PAYLOAD_TYPES = frozenset(_DATA_TYPES)
_MSG_TYPES = {int(t): t for t in MsgType}   # dict lookups: much cheaper than Enum calls
_ROLES = {int(r): r for r in Role}


def dtype_name(dtype: Any) -> str:
    """Map a numpy dtype (or a name) to its wire name; raise TypeError for unsupported ones."""
    if isinstance(dtype, str) and dtype in DTYPE_CODE and dtype != "none":
        return dtype
    try:
        name = np.dtype(dtype).name
    except TypeError as exc:
        raise TypeError(f"unsupported dtype {dtype!r}") from exc
    if name == "bfloat16":
        return name
    if name not in DTYPE_CODE or name == "none":
        raise TypeError(f"unsupported dtype {name!r}: byteps_like sums "
                        f"{', '.join(sorted(SUMMABLE))}")
    return name


@dataclass(frozen=True)
class Header:
    type: MsgType
    dtype: str = "none"
    role: Role = Role.WORKER
    rank: int = -1
    flags: int = 0
    job: int = 0
    key: int = 0
    round: int = 0
    count: int = 0
    nbytes: int = 0

    def pack(self) -> bytes:
        return _HEADER.pack(MAGIC, VERSION, int(self.type), DTYPE_CODE[self.dtype], int(self.role),
                            self.rank, self.flags, self.job, self.key, self.round, self.count,
                            self.nbytes)

    @property
    def sender(self) -> str:
        return f"{self.role.label} {self.rank}" if self.rank >= 0 else self.role.label


@dataclass
class Message:
    header: Header
    payload: Any = None          # a buffer (bytes, memoryview, zmq.Frame buffer) or None
    meta: dict | None = None


def job_hash(job_id: str) -> int:
    """A stable 32-bit tag of a job id, carried in every header."""
    h = 2166136261
    for b in job_id.encode():
        h = ((h ^ b) * 16777619) & 0xFFFFFFFF
    return h


def encode_meta(meta: dict) -> bytes:
    data = json.dumps(meta, separators=(",", ":"), allow_nan=False).encode()
    if len(data) > MAX_META_BYTES:
        raise ProtocolError(f"control message of {len(data)} bytes exceeds {MAX_META_BYTES}")
    return data


def encode(header: Header, payload: Any = None, meta: dict | None = None) -> list:
    """Frames of one message. The payload buffer is passed through untouched (zero-copy)."""
    flags = header.flags | (FLAG_META if meta is not None else 0)
    if flags != header.flags:
        header = Header(**{**header.__dict__, "flags": flags})
    frames: list = [header.pack()]
    if header.type in _DATA_TYPES:
        if payload is None:
            raise ProtocolError(f"{header.type.name} needs a payload")
        frames.append(payload)
    if meta is not None:
        frames.append(encode_meta(meta))
    return frames


def as_buffer(frame: Any) -> Any:
    """The bytes of a received frame as a buffer: a zmq.Frame's memoryview, else the frame
    itself (bytes, memoryview)."""
    return getattr(frame, "buffer", frame)


def _buf_len(frame: Any) -> int:
    if isinstance(frame, (bytes, bytearray)):
        return len(frame)
    return memoryview(as_buffer(frame)).nbytes


def _as_bytes(frame: Any) -> bytes:
    if isinstance(frame, bytes):
        return frame
    return getattr(frame, "bytes", None) or bytes(memoryview(frame))


def decode_header(raw: Any) -> Header:
    n = _buf_len(raw)
    if n != HEADER_SIZE:
        raise ProtocolError(f"bad header: {n} bytes, expected {HEADER_SIZE}")
    (magic, version, mtype, dcode, role, rank, flags, job, key, rnd, count,
     nbytes) = _HEADER.unpack(_as_bytes(raw))
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}: not a byteps_like peer (expected {MAGIC!r})")
    if version != VERSION:
        raise ProtocolError(f"protocol version {version} from peer, this side speaks {VERSION}: "
                            "run the same byteps_like release on every node")
    mt = _MSG_TYPES.get(mtype)
    if mt is None:
        raise ProtocolError(f"unknown message type {mtype}")
    if dcode >= len(DTYPES):
        raise ProtocolError(f"unknown dtype code {dcode}")
    rl = _ROLES.get(role)
    if rl is None:
        raise ProtocolError(f"unknown sender role {role}")
    mtype, role = mt, rl
    dtype = DTYPES[dcode]
    if mtype in _DATA_TYPES:
        if dtype == "none":
            raise ProtocolError(f"{mtype.name} without a dtype")
        if count * ITEMSIZE[dtype] != nbytes:
            raise ProtocolError(f"{mtype.name} key {key}: {count} x {dtype} is "
                                f"{count * ITEMSIZE[dtype]} bytes, header says {nbytes}")
    return Header(mtype, dtype, role, rank, flags, job, key, rnd, count, nbytes)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def decode(frames: Sequence[Any], max_bytes: int | None = None) -> Message:
    """Decode and validate one message; raise ProtocolError on anything malformed."""
    if not frames:
        raise ProtocolError("empty message")
    return _decode(decode_header(frames[0]), frames, max_bytes)


def _decode(header: Header, frames: Sequence[Any], max_bytes: int | None) -> Message:
    """:func:`decode` of frames whose first, ``header``, is decoded already."""
    want = 1 + (header.type in _DATA_TYPES) + bool(header.flags & FLAG_META)
    if len(frames) != want:
        raise ProtocolError(f"{header.type.name} from {header.sender}: {len(frames)} frames, "
                            f"expected {want}")
    payload = None
    idx = 1
    if header.type in _DATA_TYPES:
        payload = frames[1]
        n = _buf_len(payload)
        if n != header.nbytes:
            raise ProtocolError(f"{header.type.name} key {header.key} from {header.sender}: "
                                f"payload is {n} bytes, header says {header.nbytes}")
        if max_bytes is not None and n > max_bytes:
            raise ProtocolError(f"{header.type.name} key {header.key}: payload of {n} bytes "
                                f"exceeds the limit of {max_bytes} (BYTEPS_MAX_MESSAGE_BYTES)")
        idx = 2
    meta = None
    if header.flags & FLAG_META:
        raw = frames[idx]
        if _buf_len(raw) > MAX_META_BYTES:
            raise ProtocolError(f"{header.type.name} meta frame exceeds {MAX_META_BYTES} bytes")
        try:
            meta = json.loads(_as_bytes(raw).decode("utf-8"), parse_constant=_reject_constant)
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise ProtocolError(f"{header.type.name} from {header.sender}: meta frame is not "
                                f"UTF-8 JSON ({exc})") from None
        if not isinstance(meta, dict):
            raise ProtocolError(f"{header.type.name}: meta frame is not a JSON object")
    return Message(header, payload, meta)


def split_frames(frames: Sequence[Any]) -> tuple[Any, Any, Any]:
    """An encoded message's (header, meta or None, payload or None): what a table stream
    (csrc/dataplane_tables.h) sends of the frames :func:`encode` made."""
    has_payload = decode_header(frames[0]).type in _DATA_TYPES
    payload = frames[1] if has_payload else None
    rest = frames[1 + has_payload:]
    return frames[0], (rest[0] if rest else None), payload


def decode_parts(header: bytes, meta: bytes, payload: bytes,
                 max_bytes: int | None = None) -> Message:
    """:func:`decode` of a message that came as its parts (a table stream's: empty meta for
    none)."""
    h = decode_header(header)
    frames = [header, *([payload] if h.type in _DATA_TYPES else []),
              *([meta] if h.flags & FLAG_META else [])]
    return _decode(h, frames, max_bytes)


# -- declarations (csrc/decl.h) -------------------------------------------------------------------
# A key's declaration, what the first push of a key tells its server on the native data plane,
# is a fixed binary layout defined once in csrc/decl.h and exported by _core.decl_spec(): a head
# (magic, version, dtype code, ndim, ncodec, part, nparts, count, name_len, backup, spec_len),
# then the shape (int64 each), the built-in codec's parameters (uint64 each), the name (UTF-8)
# and a compressor's spec (JSON: the one part a registered compressor's Python server codec
# reads). tests/unit/test_decl.py packs and parses it both ways.
_DECL, _DECL_HEAD, DECL_FIELDS = _load_spec("decl_spec", "decl.h", "declaration head")
DECL_MAGIC: bytes = _DECL["magic"]
DECL_VERSION: int = _DECL["version"]
DECL_MAX_DIMS: int = _DECL["max_dims"]
DECL_MAX_CODEC: int = _DECL["max_codec"]
DECL_MAX_NAME: int = _DECL["max_name"]
DECL_MAX_SPEC: int = _DECL["max_spec"]
DECL_MAX_BYTES: int = _DECL["max_bytes"]  # the largest (a server refuses a longer meta unread)
if DECL_FIELDS != ("magic", "version", "dtype", "ndim", "ncodec", "part", "nparts", "count",
                   "name_len", "backup", "spec_len"):
    raise ImportError(f"byteps_like.wire: _core's declaration head has the fields "
                      f"{DECL_FIELDS}, not the ones wire.py packs: rebuild _core")


@dataclass(frozen=True)
class Declaration:
    """A key's declaration as the native data plane carries it (csrc/decl.h)."""
    name: str
    shape: tuple[int, ...]
    dtype: str
    part: int
    nparts: int
    count: int                       # elements of the partition, in dtype
    native_codec: tuple[int, ...] = ()  # a built-in codec's parameters (native_params)
    compressor: dict | None = None   # a compressor's spec (a registered one's server codec)
    backup: int = 0                  # backup workers b of an averaged key; 0: none


def pack_decl(name: str, shape: Sequence[int], dtype: str, part: int, nparts: int, count: int,
              native_codec: Sequence[int] | None = None, compressor: dict | None = None,
              backup: int = 0, **unknown: Any) -> bytes:
    """The bytes of a declaration, the same on every worker for the same tensor (the servers
    compare them). Raises ValueError past a limit of csrc/decl.h."""
    if unknown:
        raise ValueError(f"pack_decl: fields no declaration has: {sorted(unknown)}")
    raw_name = name.encode("utf-8")
    spec = (b"" if compressor is None else
            json.dumps(compressor, separators=(",", ":"), allow_nan=False).encode())
    codec = tuple(native_codec or ())
    if dtype not in DTYPE_CODE or dtype == "none":
        raise ValueError(f"pack_decl: tensor {name!r} of dtype {dtype!r}, not a wire dtype")
    for what, n, limit in (("dims", len(shape), DECL_MAX_DIMS),
                           ("codec parameters", len(codec), DECL_MAX_CODEC),
                           ("name bytes", len(raw_name), DECL_MAX_NAME),
                           ("compressor spec bytes", len(spec), DECL_MAX_SPEC),
                           ("backup workers", backup, 0xFFFF)):
        if n > limit:
            raise ValueError(f"tensor {name[:80]!r}: a declaration of {n} {what}, over the "
                             f"data plane's limit of {limit} (csrc/decl.h)")
    head = _DECL_HEAD.pack(DECL_MAGIC, DECL_VERSION, DTYPE_CODE[dtype], len(shape), len(codec),
                           part, nparts, count, len(raw_name), backup, len(spec))
    return b"".join((head, struct.pack(f"<{len(shape)}q", *shape),
                     struct.pack(f"<{len(codec)}Q", *codec), raw_name, spec))


def parse_decl(raw: bytes) -> Declaration:
    """A declaration the native data plane's server holds (its stall reports, a registered
    compressor's codec factory), with every length checked; ProtocolError saying what is
    wrong (the server refuses such a declaration before it keeps one)."""
    raw = bytes(raw)
    if len(raw) < _DECL_HEAD.size:
        raise ProtocolError(f"a declaration of {len(raw)} bytes, shorter than its "
                            f"{_DECL_HEAD.size}-byte head")
    (magic, version, code, ndim, ncodec, part, nparts, count, name_len, backup,
     spec_len) = _DECL_HEAD.unpack_from(raw)
    if magic != DECL_MAGIC or version != DECL_VERSION:
        raise ProtocolError(f"not a declaration of this version (magic {magic!r}, version "
                            f"{version}; this side's {DECL_MAGIC!r}, {DECL_VERSION})")
    want = _DECL_HEAD.size + 8 * (ndim + ncodec) + name_len + spec_len
    if (ndim > DECL_MAX_DIMS or ncodec > DECL_MAX_CODEC or name_len > DECL_MAX_NAME
            or spec_len > DECL_MAX_SPEC or len(raw) != want):
        raise ProtocolError(f"a malformed declaration: {len(raw)} bytes for {ndim} dims, "
                            f"{ncodec} codec parameters, a name of {name_len} and a spec of "
                            f"{spec_len} bytes")
    if not 0 < code < len(DTYPES) or part >= nparts:
        raise ProtocolError(f"a malformed declaration: dtype code {code}, part {part} of "
                            f"{nparts}")
    at = _DECL_HEAD.size
    shape = struct.unpack_from(f"<{ndim}q", raw, at)
    at += 8 * ndim
    codec = struct.unpack_from(f"<{ncodec}Q", raw, at)
    at += 8 * ncodec
    try:
        name = raw[at:at + name_len].decode("utf-8")
        spec = json.loads(raw[at + name_len:]) if spec_len else None
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(f"a malformed declaration: its name or spec ({exc})") from None
    if spec is not None and not isinstance(spec, dict):
        raise ProtocolError("a malformed declaration: its compressor spec is not an object")
    return Declaration(name, shape, DTYPES[code], part, nparts, count, codec, spec, backup)
