"""Native kernels of byteps_like: summation, averaging, conversion, compression (C++, csrc/).

Buffers are any object exporting a C-contiguous buffer (numpy arrays, bytes, bytearray,
memoryview, a pyzmq ``Frame``); they are read as raw bytes whose element type is named by a
dtype string. Alignment does not matter. Every call releases the GIL while it works.

dtype strings: ``"float32"``, ``"float64"``, ``"float16"`` (IEEE half), ``"bfloat16"``
(no numpy dtype: hold it as ``uint16``), ``"int32"``, ``"int64"``.

Errors: a dtype outside that list, a length mismatch, a read-only or non-contiguous
destination raise ``ValueError``; an object without the buffer protocol raises ``TypeError``.

``nthreads > 1`` splits large buffers over that many threads (the caller's included) from a
small persistent pool, but only as many as give each thread at least 256 KiB; ``nthreads <= 1``
runs on the calling thread. Results do not depend on ``nthreads``.
"""
from collections.abc import Callable
from typing import Any, Final, Literal, TypeAlias, TypedDict

import numpy as np
from typing_extensions import Buffer

DType: TypeAlias = Literal["float32", "float64", "float16", "bfloat16", "int32", "int64"]
IsaLevel: TypeAlias = Literal["scalar", "avx2", "avx512"]

DTYPES: Final[tuple[str, ...]]
"""The dtype names accepted by the kernels, in a fixed order."""

class CpuFeatures(TypedDict):
    x86_64: bool
    sse2: bool
    avx: bool
    avx2: bool
    fma: bool
    f16c: bool
    avx512f: bool
    avx512bw: bool
    avx512vl: bool
    detected_isa: IsaLevel
    isa: IsaLevel
    kernel_fp16: Literal["f16c-avx512", "f16c-avx2", "scalar"]
    kernel_bf16: IsaLevel
    kernel_float32: IsaLevel
    max_threads: int
    min_bytes_per_thread: int

def add_into(dst: Buffer, src: Buffer, dtype: DType | str, nthreads: int = 1) -> None:
    """``dst += src`` elementwise, both read as raw bytes of ``dtype``.

    dst must be writable; both must have the same byte length, a multiple of the dtype's
    itemsize (ValueError naming both lengths and the dtype otherwise). src may overlap dst.

    Semantics match numpy: floats add in their own precision; float16 adds in float32 and
    rounds to nearest even (bit-identical to numpy's float16 add, NaN payloads aside);
    bfloat16 likewise (NaN stays NaN); int32/int64 wrap around on overflow.
    """

def copy_into(dst: Buffer, src: Buffer, nthreads: int = 1) -> None:
    """Copy src's bytes into dst; the byte lengths must be equal (ValueError otherwise)."""

def scale_into(buf: Buffer, dtype: DType | str, divisor: int, *, nthreads: int = 1) -> None:
    """Divide every element of ``buf`` by ``divisor`` in place (averaging a sum).

    divisor must be >= 1 (ValueError otherwise). float32/float64 use true division in their
    own precision (as numpy's ``a / divisor``); float16 and bfloat16 divide in float32 and
    round to nearest even; int32/int64 use floor division (numpy's ``floor_divide``).
    """

def convert(dst: Buffer, dst_dtype: DType | str, src: Buffer, src_dtype: DType | str,
            *, nthreads: int = 1) -> None:
    """``dst[i] = src[i]`` converted from src_dtype to dst_dtype.

    Supported pairs: float32 -> float16, float16 -> float32, float32 -> bfloat16,
    bfloat16 -> float32 (ValueError for others). Narrowing rounds to nearest even (float16:
    overflow gives inf, subnormals are kept; NaN stays NaN). dst and src must hold the same
    number of elements (ValueError naming both lengths otherwise).
    """

def cpu_features() -> CpuFeatures:
    """CPU features seen at run time and the kernel level in use.

    ``detected_isa`` is the best level this CPU supports, ``isa`` the level in use (lower only
    after ``_set_isa``); ``kernel_fp16`` names the float16 path.
    """

def itemsize(dtype: DType | str) -> int:
    """Bytes per element of ``dtype`` (ValueError for an unknown name)."""

def _set_isa(name: IsaLevel | Literal["auto"] | str) -> str:
    """Testing hook: cap the kernel level process-wide; ``"auto"`` removes the cap.

    Returns the level in use before the call. ValueError for an unknown name or a level this
    CPU lacks. Not for production use.
    """

# ---- compression kernels (csrc/compress.h) ------------------------------------------------------
# float32 buffers are raw bytes (a whole number of float32, any alignment); index buffers are
# little-endian uint32. Length mismatches raise ValueError naming the argument; malformed bodies
# raise ValueError and out-of-range indices IndexError, in both cases *before* anything is
# written. Every call releases the GIL. Randomness derives only from (seed, key, step):
# base = mix(mix(mix(mix(seed + G) ^ (key + 2G)) ^ (step + 3G)) ^ domain*G), with mix the
# splitmix64 finaliser, G = 0x9E3779B97F4A7C15, domain 1 for random-k and 2 for dithering.

def onebit_encode(x: Buffer, bits: Buffer, scaling: bool = True) -> float:
    """Pack the sign *bits* of float32 ``x`` (n elements) into ``bits`` ((n+7)//8 bytes, bit
    i%8 of byte i//8, padding zero; -0.0 and negative NaNs count as negative). Returns mean |x|
    (accumulated in double; NaN/inf propagate) when ``scaling``, else 1.0."""

def onebit_decode(bits: Buffer, scale: float, out: Buffer, add: bool = False) -> None:
    """``out[i] (+)= -scale if bit i else +scale`` (sign flip on the bit pattern)."""

def onebit_ef_encode(x: Buffer, r: Buffer, bits: Buffer, scaling: bool,
                     settle: float | None = None) -> float:
    """Error feedback's first pass of onebit: ``r = x + r``, then ``onebit_encode(r, bits,
    scaling)``, in one pass over x and r (the same bits and scale). With ``settle``, r is the
    last step's y whose residual was not taken: ``onebit_residual(r, settle)`` is applied
    first, in the same pass (the same bits as the two calls)."""

def onebit_residual(y: Buffer, scale: float) -> None:
    """Error feedback's residual of onebit in one pass: ``y -= d`` with d what onebit_decode
    gives for the bits onebit_encode packed from ``y`` (``scale`` with y's sign bit)."""

def topk_select(x: Buffer, idx: Buffer, val: Buffer) -> None:
    """The k = len(val)/4 entries of largest magnitude of float32 ``x``: their indices
    (uint32, increasing) into ``idx`` and values into ``val``. Magnitude is the float's bits
    without the sign, so NaN ranks above inf; ties go to the lower index. A sample guesses a
    threshold, one pass collects the entries at or above it and the exact k-th is found among
    them; when the guess fails, a histogram of the top 11 magnitude bits gives the threshold
    (the same result either way). ValueError when k > n."""

def topk_ef_encode(x: Buffer, r: Buffer, idx: Buffer, val: Buffer) -> None:
    """Error feedback around top-k: ``r = x + r``, ``topk_select(r, idx, val)``, then
    ``r[idx] -= val``, in two streaming passes over x and r; the same idx, val and r, bit for
    bit, as the three steps apart. ValueError when k = len(val)/4 > n = len(x)/4."""

def gather(x: Buffer, idx: Buffer, val: Buffer) -> None:
    """``val[j] = x[idx[j]]``; IndexError for an index >= len(x)."""

def scatter(idx: Buffer, val: Buffer, out: Buffer, add: bool = False) -> None:
    """``add``: ``out[idx[j]] += val[j]`` (duplicates add up); else ``out`` is zeroed and
    ``out[idx[j]] = val[j]`` (the last duplicate wins). IndexError for an index >= len(out)."""

def randomk_indices(n: int, seed: int, key: int, step: int, idx: Buffer) -> None:
    """Fill ``idx`` (k uint32) with k distinct indices of range(n), increasing, drawn uniformly
    without replacement: Floyd's algorithm over an n-bit bitmap (for k > n/2 the n-k complement
    is drawn), xoshiro256** seeded with four splitmix64 outputs of the random-k stream base,
    bounded draws by Lemire's multiply-shift with rejection. ValueError when k > n or n >= 2^32."""

def dither_bytes(n: int, levels: int) -> int:
    """Body bytes of n dithered elements: ceil(n * (1 + levels.bit_length()) / 8)."""

def dither_encode(x: Buffer, out: Buffer, levels: int, natural: bool, l2: bool, seed: int,
                  key: int, step: int) -> float:
    """Stochastic quantisation of float32 ``x`` into ``out`` (dither_bytes(n, levels) bytes);
    returns the norm (max |x|, or the L2 norm accumulated in double). Per element, in float32:
    a = min(|x|/norm, 1); u = (mix(base + (i+1)*G) >> 40) / 2^24; linear: t = a*s,
    q = floor(t) + (u < t - floor(t)); natural (levels 0, 2^(q-s)): a = m*2^e (frexp),
    q = e-1+s + (u < 2m-1) when e-1+s >= 1, else q = (u < a*2^(s-1)), q = s when a == 1.
    Codes (q << 1 | sign bit), sign 0 when q == 0, packed LSB first at 1 + bit_length(s) bits.
    A zero or non-finite norm encodes all codes 0. levels: linear 1..65535, natural 1..127."""

def dither_decode(body: Buffer, norm: float, out: Buffer, levels: int, natural: bool,
                  add: bool = False) -> None:
    """``out[i] (+)= ±table[q]`` with linear table[q] = float32(float64(norm) * q / s), natural
    table[0] = norm * 0 (NaN for a non-finite norm), table[q] = ldexp(norm, q - s). ValueError
    for a wrong body length, a level above ``levels`` or nonzero padding bits."""

# ---- the native data plane (csrc/dataplane.cc; docs/architecture.md) ----------------------
# A completion: (op, ok, kind, server, message, t_first_send, t_last_done, bytes, times,
# contrib).
# kind is "" on success, else "remote" (message: the server's ERROR JSON), "peer_lost",
# "protocol", "internal" or "closed"; times holds (sent, acknowledged, received) per partition
# in CLOCK_MONOTONIC seconds (time.monotonic()), 0 where it did not happen.
# contrib: the pushes the server's round summed when fewer than all workers (join()), else 0.
Completion: TypeAlias = tuple[int, bool, str, int, bytes, float, float, int,
                              list[tuple[float, float, float]], int]

class NativeCast:
    """A float32 partition of ``n`` elements cast to ``wire`` (float16, bfloat16) by the native
    client in a coded operation (``DataClient.submit(codecs=...)``): narrowed before its push,
    the servers' sum divided and widened after its pull; ValueError for another dtype."""
    n: int
    wire_bytes: int
    def __init__(self, n: int, wire: str) -> None: ...

class NativeCodec:
    """The native server's codec of one partition (csrc/codec.h): the payloads of
    compression.py's framed codecs, byte for byte. ``params`` is
    :func:`byteps_like.compression.native_params`'s list; raises ValueError naming a bad field."""
    n: int
    max_bytes: int
    held_bytes: int
    def __init__(self, params: list[int], key: int, n: int) -> None: ...
    def encode(self, x: Buffer, step: int, out: Buffer) -> None:
        """Encode float32 x (n elements) into out (max_bytes), with error feedback if set."""
    def decode(self, payload: Buffer, out: Buffer, add: bool = False) -> int:
        """out (+)= the payload's values; returns its step. Every field and the length are
        checked first, and the numbers a peer's payload may carry (a finite scale / norm >= 0,
        finite values, distinct top-k indices): ValueError naming the field; out untouched."""

class DataServer:
    """A server's half: an acceptor and ``io_threads`` epoll threads; pushes are summed into
    each key's store in 512 KiB chunks as they arrive, pulls answered zero-copy. Every length
    is checked before memory is taken; bad streams are closed and counted by reason.
    ``async_mode`` (BYTEPS_ENABLE_ASYNC): one buffer per key holding the value, every push
    added at once, a pull answered with the value once no push of the key is in flight."""
    def __init__(self, num_workers: int, server_rank: int, job: int, io_threads: int,
                 max_message_bytes: int, max_store_bytes: int, max_connections: int,
                 auth_key: bytes = b"", async_mode: bool = False) -> None: ...
    def listen(self, host: str, port: int) -> int:
        """Bind (port 0: ephemeral); returns the port. RuntimeError naming host:port."""
    def listen_ucx(self, host: str, port: int) -> int:
        """Listen for UCX streams instead (a UCP listener; ucx_load first); returns the port.
        Their connection requests pass the same admission as accepted sockets."""
    def start(self) -> None: ...
    def close(self) -> None: ...
    def set_rank(self, rank: int) -> None: ...
    def set_partition_bytes(self, nbytes: int) -> None:
        """BYTEPS_PARTITION_BYTES: a compressed key's element count is at most one partition of
        its declared dtype; until set, compressed pushes are refused."""
    def set_backup_max_lag(self, rounds: int) -> None:
        """BYTEPS_BACKUP_MAX_LAG: a key declared with backup workers keeps its newest completed
        round and at most this many before it for a worker that fell behind (default 64)."""
    def set_codec_factory(self, factory: Callable[[int, int, bytes], tuple[Any, int]],
                          malformed: type[BaseException]) -> None:
        """Registered compressors: a compressed key's first push whose declaration carries a
        compressor spec and no ``native_codec`` gets the codec ``factory(key, n, decl)``
        returns with the bytes it holds (server/codecs.py); its decode/decode_add/encode run
        with the GIL taken, one call at a time per key, payloads of 1..max_bytes bytes. What
        the factory raises is the error reply's reason; a codec raising ``malformed`` has a
        malformed payload (refused as a built-in codec's would be), anything else fails the
        key."""
    def set_members(self, joined: list[int], left: dict[int, str]) -> None:
        """join(): rounds need pushes from every worker machine not in ``joined``; a round a
        machine in ``left`` (text: who) has not pushed fails with a peer_left error."""
    def reset_epoch(self, round_base: int, required: int) -> None:
        """Elastic jobs: a new membership epoch; open rounds dropped (waiting pulls get an
        "epoch" error), every key restarts at ``round_base``, a round needs ``required``."""
    def set_staleness(self, rounds: int) -> None:
        """BYTEPS_ASYNC_STALENESS (``async_mode`` only): a pull of round r is answered once
        every worker rank not joined or left has pushed round r - ``rounds`` of the key (its
        answer waits until then; ``stats()["stale_holds"]`` counts the pulls held); 0: unbounded.
        ValueError for a negative bound or one on a synchronous server."""
    def reserve(self, bytes: int) -> bool:
        """Charge ``bytes`` of a server-held table (server/sparse.py) to the same budget as the
        stores (``max_store_bytes``; negative gives back); False, charging nothing, when over
        it."""
    def stats(self) -> dict[str, int]:
        """Counters: traffic, pushes, rounds, keys, store_bytes, connections (accepted) and
        live_connections, closed_since_trim (streams closed whose memory the I/O loops'
        tick, at most once a second, has not given back yet), queued_bytes (replies queued
        unwritten, all streams: each stream's share is 32 MiB over the streams open, at least
        16 KiB), paused (streams not read while
        their replies wait), unread_closed (streams closed for leaving them unread),
        meta_bytes (large meta frames being read, all streams: at most 16 MiB), rejected
        (total), stale_holds (asynchronous pulls a staleness bound held back, each once)."""
    def async_values(self) -> list[tuple[int, int, bytes]]:
        """Asynchronous mode: every key's value between two pushes, (key, wire dtype code,
        bytes), for a snapshot (server/async_snapshots.py)."""
    def adopt_async(self, key: int, value: bytes) -> bool:
        """Asynchronous mode: a lost server's value of ``key``, which the store a moved key's
        first (retried) push makes here starts from instead of zero; charged to the memory
        budget until then (False, keeping nothing, when it does not fit)."""
    def table_requests(self, timeout: float) -> list[tuple[int, bytes, bytes, bytes]]:
        """Server-held tables (csrc/dataplane_tables.h): the requests the table streams
        received, (stream, header, meta or b"", payload) each, once one is, after ``timeout``
        seconds, or at once after table_wake() or close(); taking them lets their streams be
        read again."""
    def table_send(self, stream: int, header: bytes, meta: Any, payload: Any) -> bool:
        """An answer on table stream ``stream`` (meta, payload: buffers or None); False when
        the stream is closed; ValueError when the header's nbytes or FLAG_META lie."""
    def table_wake(self) -> None:
        """Make the thread waiting in table_requests return."""
    def table_serve(self, key: int, kernels: TableKernels) -> None:
        """Let the I/O threads answer the pulls of table key ``key`` from ``kernels``' shard,
        by the rules its serve() sets (closed until then)."""
    def rejected(self) -> dict[str, int]:
        """Rejected messages and streams by reason."""
    def stalls(self, min_age: float) -> list[tuple[int, int, float, list[int], bytes]]:
        """Open rounds older than ``min_age`` s: (key, round, age, pushed ranks, declaration)."""
    def straggle(self) -> list[tuple[float, int, float]]:
        """Per worker rank, since the start: (seconds the other ranks waited for it, rounds of
        any key it pushed last with others waiting, seconds it waited for the last pusher); the
        intervals of parallel keys merged, not summed (csrc/dataplane_straggle.h)."""

class TableClient:
    """A worker process's table streams (csrc/dataplane_tables.h), one to each server: its
    SPARSE_* requests out, their answers back, on an I/O thread of its own."""
    def __init__(self, rank: int, job: int, max_message_bytes: int,
                 auth_key: bytes = ..., answer_budget: int = ...) -> None:
        """``answer_budget``: bytes of answers held for answers() at most (256 MiB), besides
        one answer; past it the client reads nothing until they are taken."""
    def connect(self, server: int, host: str, port: int, timeout: float,
                ucx: bool = False) -> None:
        """Open the table stream to server index ``server`` (a hello with FLAG_TABLE and the
        process rank); RuntimeError naming the reason when it cannot within ``timeout``."""
    def send(self, server: int, header: bytes, meta: Any, payload: Any) -> bool:
        """Queue a request; False when there is no stream to ``server`` (closed: its lost
        notice said why)."""
    def answers(self, timeout: float) -> list[tuple[int, bytes, bytes, bytes, str]]:
        """Every answer waiting, (server, header, meta or b"", payload, "") each, and for a
        stream that closed (server, b"", b"", b"", why); once there is one or after
        ``timeout``; none once closed."""
    def close(self) -> None: ...
    def stats(self) -> dict[str, int]:
        """The streams' counters, and ``answers_held``: bytes of answers not taken yet."""

class DataClient:
    """A worker's half: ``streams`` TCP connections (or UCX endpoints) per server, a priority
    queue with byte credits, pull responses received into the destination and divided in
    place."""
    def __init__(self, rank: int, job: int, io_threads: int, credit_bytes: int,
                 max_message_bytes: int, auth_key: bytes = b"",
                 codec_threads: int = 1) -> None: ...
    def connect(self, server: int, host: str, port: int, streams: int, timeout: float,
                ucx: bool = False) -> None:
        """Open and greet ``streams`` connections (authenticated with ``auth_key``), UCX
        endpoints to a ``listen_ucx`` server when ``ucx``; RuntimeError saying why on
        failure."""
    def submit(self, op: int, priority: int, src: Buffer, dst: Buffer, wire_dtype: int,
               divisor: int, round: int,
               parts: list[tuple[int, int, int, int, int, bytes | None]],
               compressed: bool = False,
               codecs: list[NativeCodec] | list[NativeCast] | None = None) -> None:
        """Queue one operation: parts are (key, server, stream, offset, nbytes, declaration).
        Holds the GIL and only queues. ``src``/``dst`` must stay alive until its completion.
        ``compressed``: the parts are codec payloads (uint8, divisor 1) the server decodes and
        answers with its encoded sum (FLAG_COMPRESSED), which lands in ``dst`` as it came.
        ``codecs`` (one per part): a coded operation: ``src``/``dst`` are float32 and the parts'
        offsets and sizes theirs; each part is encoded (step = ``round``) on the client's codec
        threads and travels as its codec's payload (NativeCodec: with ``compressed``, wire
        dtype float32) or its cast (NativeCast: wire dtype its float16/bfloat16, summed as
        such), and the server's answer is decoded into ``dst`` there and divided by
        ``divisor``."""
    def wait(self, op: int, timeout: float) -> bool:
        """Wait (GIL released) until ``op`` completes; the completion is left for ``take``."""
    def take(self, op: int) -> Completion | None: ...
    def completions(self, timeout: float) -> list[Completion]:
        """Every completion nobody waits on, waiting up to ``timeout`` s for the first."""
    def set_paused(self, paused: bool) -> None:
        """Hold queued partitions, or release them in priority order (for tests)."""
    def hold_landed(self, on: bool) -> None:
        """Testing hook: while on, an answer landed in dst waits before it completes its
        partition (the window in which a failover may come); ``stats()["landed_held"]``
        counts those waiting."""
    def set_failover(self, on: bool) -> None:
        """Losing a server: a lost stream parks its server's parts (and completes a
        ``server_lost`` notice, op id 2**63 + server) instead of failing them; answers are
        received into a per-key shadow and copied out."""
    def failover(self, lost: list[int], hold: bool) -> None:
        """Move the keys of the ``lost`` server indices to the others (rendezvous hashing);
        with ``hold``, seed each moved key on its new server with the last round this client
        completed and hold its pushes until :meth:`resume`."""
    def wait_seeds(self, timeout: float) -> str:
        """"" once every seed was acknowledged, else why not (within ``timeout`` s)."""
    def resume(self) -> None:
        """Send the parts held since :meth:`failover` to the keys' new servers."""
    def take_dispatch_log(self) -> list[int]:
        """Keys in the order they were sent since the last call (the first 4096)."""
    def close(self) -> None: ...
    def stats(self) -> dict[str, int]: ...

def monotonic() -> float: ...
def hmac_sha256(key: bytes, msg: bytes) -> bytes:
    """HMAC-SHA256 of the data plane's handshake, computed by OpenSSL's libcrypto (loaded at
    run time, csrc/crypto.cc); RuntimeError naming the package to install when it cannot be
    loaded."""
def crypto_available() -> tuple[bool, str]:
    """(whether libcrypto is loaded, loading it now; the error when it cannot be)."""
def _crypto_set_names(names: str) -> str:
    """Testing hook: forget libcrypto and load it from these ':'-separated sonames or paths
    from now on ("" restores the default list); returns the previous list."""

# ---- UCX streams of the data plane (csrc/dataplane_ucx.cc; byteps_like/transport/ucx_native)
def failover_owner(key: int, alive: list[int]) -> int:
    """The server of a key whose first server is lost, among ``alive`` (rendezvous hashing,
    as the native client routes it); -1 when none is alive."""
def ucx_built() -> bool:
    """Whether this _core was built with UCX's headers (it can load libucp at run time)."""
def ucx_load(path: str, settings: dict[str, str] = ...) -> str:
    """Open libucp at ``path`` and make the process's UCP context, ``settings`` (UCX names
    without ``UCX_``) over the UCX_* environment: "" when UCX streams are usable, else why
    not. The first call's answer holds for the process."""
def ucx_unavailable() -> str:
    """"" when UCX streams are usable (ucx_load succeeded), else why not."""

class UcxRawStream:
    """A bare UCX stream to a listen_ucx server, bytes as they are (no hello, no framing): for
    tests that play a hostile peer, as a raw socket does over TCP."""
    def __init__(self, host: str, port: int) -> None: ...
    def send(self, data: bytes, timeout: float, rndv: bool = False) -> None:
        """``data`` as one active message of the stream: eager, or with rendezvous
        (``rndv``); RuntimeError when it cannot or the peer refuses it."""
    def recv(self, n: int, timeout: float, all: bool = False) -> bytes:
        """Up to n bytes (all n with ``all``) once some came; b"" when the peer closed;
        RuntimeError('timed out') after ``timeout`` seconds."""
    def close(self) -> None: ...

# ---- the one definitions of the wire header, the codec frame and the declaration -----------
# (csrc/wire.h, csrc/codec.h, csrc/decl.h; bound in csrc/module_wire.cc)
def wire_spec() -> dict[str, Any]:
    """magic (bytes), version, header_size, header: [(field, offset, size, struct code)],
    msg_types / flags / roles: {Python name: value}, dtypes: [(name, itemsize, summable)] in
    code order, contrib_shift, max_meta."""
def codec_frame_spec() -> dict[str, Any]:
    """The codec frame's one definition (csrc/codec.h), read by byteps_like/compression.py:
    magic (bytes), version, header_size, header: [(field, offset, size, struct code)], codecs:
    [(name, id, the struct code of the header's 4-byte field: "f" or "I")]."""
def wire_pack_header(type: int, dtype: int, role: int, rank: int, flags: int, job: int,
                     key: int, round: int, count: int, nbytes: int) -> bytes:
    """A header packed by the native data plane's struct (tests)."""
def wire_parse_header(raw: bytes) -> dict[str, Any]:
    """A header's fields as the native data plane reads them, plus valid_data: whether it is a
    PUSH or PULL_RESP of a known dtype whose count fits nbytes (tests)."""
def decl_spec() -> dict[str, Any]:
    """The declaration's one definition (csrc/decl.h), read by byteps_like/wire.py: magic
    (bytes), version, header_size, header: [(field, offset, size, struct code)], max_dims,
    max_codec, max_name, max_spec, max_bytes."""
def decl_pack(dtype: int, shape: list[int], part: int, nparts: int, count: int,
              codec: list[int], name: bytes, spec: bytes) -> bytes:
    """A declaration packed by the native data plane's struct (tests); ValueError past a
    limit."""
def decl_parse(raw: bytes) -> dict[str, Any]:
    """A declaration's fields as the native data plane's server reads them (dtype code, shape,
    part, nparts, count, codec, name and spec as bytes) and ``text``, as errors show it;
    ValueError saying why the server would refuse it (tests)."""

# ---- an embedding table's shard (csrc/table_kernels.cc; bound in csrc/module_tables.cc) -------
# byteps_like/embedding.py's TableShard, sum_rows and initial_rows run on these; its numpy
# reference (reference_sum_rows, reference_initial_rows, NumpyTableShard) gives the same bits.
# Arrays are numpy arrays of exactly the dtype named, C-contiguous (ValueError naming the
# argument, its shape or dtype otherwise); every call releases the GIL while it works.
class TableKernels:
    """The kernels of one shard (shard ``shard`` of ``shards``: global row ``i`` is its local
    row ``i // shards`` when ``i % shards == shard``), bound to the shard's own arrays, which
    it keeps alive and writes in place: ``weights`` (nrows x dim float32), ``made`` and
    ``changed`` (nrows bool), and the optimizer's state, None where the optimizer has none:
    ``acc`` (Adagrad), ``m``, ``v`` (nrows x dim float32) and ``t`` (nrows int32) (Adam).

    ``init``: {"init": "zeros" | "uniform" | "normal", "a": low or mean, "b": high or std,
    "seed": int}. ``opt``: {"optimizer": "sgd" | "adagrad" | "adam", "lr", "eps", "beta1",
    "beta2", "acc0" (Adagrad's initial accumulator value)}: floats, rounded to float32 as the
    numpy reference holds them (Adam's 1 - beta and bias corrections in float64 first).

    Ids are int64 global rows; one the shard does not hold (negative, another shard's, past its
    rows) raises ValueError naming it, before anything is changed. Every call holds the shard's
    lock, which a server's I/O threads hold to answer pulls from the arrays once the shard is
    registered (DataServer.table_serve; csrc/dataplane_table_pulls.h); Python's own reads and
    writes of the arrays hold it too (lock, unlock). ``threads``: how many threads
    (the caller's included, from the kernels' pool) make the new rows of one call, each row by
    one of them (the same bits whatever the number), and only as many as the work pays for."""
    def __init__(self, weights: np.ndarray, made: np.ndarray, changed: np.ndarray,
                 acc: np.ndarray | None, m: np.ndarray | None, v: np.ndarray | None,
                 t: np.ndarray | None, *, shard: int, shards: int, init: dict[str, Any],
                 opt: dict[str, Any], threads: int = 1) -> None: ...
    def gather(self, ids: np.ndarray) -> np.ndarray:
        """A new ``len(ids) x dim`` float32 array of the rows ``ids`` (repeats allowed), rows
        never made given their initial values and fresh optimizer state first."""
    def make(self, ids: np.ndarray) -> None:
        """Give the rows ``ids`` never made (or forgotten) their initial values and fresh
        state."""
    def apply(self, ids: np.ndarray, grad: np.ndarray, applied: int = -1) -> None:
        """One optimizer step on the rows ``ids`` (unique: ValueError on a repeat) with their
        summed gradients ``grad`` (``len(ids) x dim`` float32), made first where needed and
        marked changed: SGD ``w -= lr g``; Adagrad ``acc += g g; w -= lr g / (sqrt(acc) +
        eps)``; lazy Adam, the row's step count ``t`` and moments only. ``applied`` >= 0: the
        rounds applied with this step, set for the served pulls in the same hold of the lock
        (the pulls parked for that round are answered)."""
    def serve(self, *, open: bool, applied: int, generation: int, rows: int, rank_limit: int,
              park_limit: int, max_ids: int, max_message: int) -> list[tuple[int, bytes, bytes,
                                                                            bytes]]:
        """The rules by which a server's I/O threads answer this shard's SPARSE_PULLs: while
        ``open``, a pull of round ``applied`` at once and one of the next round parked (at most
        ``park_limit``), when its rank is below ``rank_limit``, its generation is at least
        ``generation``, it has at most ``max_ids`` int64 ids, all rows of this shard of a
        table of ``rows`` rows, and its reply fits ``max_message`` bytes. Returns the parked
        pulls that may no longer wait, as (stream, header, meta, payload) requests."""
    def lock(self) -> None:
        """Take the shard's lock (the GIL released while waiting)."""
    def unlock(self) -> None:
        """Give it back (the thread that took it)."""
    pulls: dict[str, int]
    """Pulls answered (``answered``) and parked (``parked``) by the I/O threads so far."""
    nrows: int
    """The shard's rows."""
    dim: int
    """Its row width."""

def table_sum_rows(ids: list[np.ndarray], grads: list[np.ndarray],
                   dim: int) -> tuple[np.ndarray, np.ndarray]:
    """One round's pushes summed per row: (unique ids ascending as int64, float32 sums of
    ``unique x dim``), each push's rows (``ids[p]``: int64, ``grads[p]``: ``len(ids[p]) x
    dim`` float32) added in list order, then row order (a push may repeat an id)."""
def table_split(ids: np.ndarray, shards: int) -> tuple[np.ndarray, np.ndarray]:
    """A worker's ids (int64, none negative: ValueError) by the shard that holds them (id %
    shards): (order, counts), order the positions shard by shard in their order within each
    shard (a stable counting sort), counts the ids of each shard (both int64)."""
def table_push_records(ids: np.ndarray, grads: np.ndarray, order: np.ndarray,
                       counts: np.ndarray) -> list[np.ndarray]:
    """A push's payload for each shard, from table_split's order and counts: a uint8 array of
    the shard's ids (int64, in order) then their gradient rows (``grads``: ``len(ids) x dim``
    float32), built in one pass. ValueError when the counts or the order do not fit the ids."""
def table_initial_rows(ids: np.ndarray, dim: int, init: str, a: float, b: float,
                       seed: int) -> np.ndarray:
    """The initial values of global rows ``ids`` (``len(ids) x dim`` float32): splitmix64 of
    (seed, row, column); ``uniform`` low ``a``, high ``b``; ``normal`` mean ``a``, std ``b``
    by Box-Muller, in float64 and rounded once; ``zeros``. ValueError on a negative id."""
