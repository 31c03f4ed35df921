"""The file of one shard of a server-held embedding table's checkpoint (docs/sparse.md).

A checkpoint file is data, not trust: it may be truncated, bit-flipped, empty, of another
format, crafted to make its reader allocate far more than it holds, or hold NaN rows and
repeated ids. So the format says everything its reader checks before it takes any memory, and
nothing in it is compressed:

    magic      8 bytes  b"BPSLSHRD"
    length     u32 LE   of the header, at most MAX_HEADER bytes
    header     JSON     {"format": 2, "table", "shard", "shards", "rows" (in this file), "dim",
                        "dtype": "float32", "spec" (the table's), "arrays": [[name, dtype,
                        shape], ...]}
    payload             the arrays, raw little-endian, in the header's order
    checksum   32 bytes SHA-256 of everything before it

The reader (:func:`read`) checks the magic, the header's fields against the table it loads
into, that the arrays are exactly the ones that table's optimizer keeps for ``rows`` rows, and
that the file's size is exactly what the header describes -- all before it allocates. Then it
charges the payload to the caller's budget (a server's BYTEPS_SERVER_MAX_BYTES), reads it in
bounded chunks while hashing, compares the checksum, and checks what the numbers may be: ids in
the table's range, of the file's shard, each once; finite weights and state. NaN/inf rows and
repeated ids are refused, or left out under ``repair="drop"``
(BYTEPS_SPARSE_CHECKPOINT_REPAIR): those rows start again from their initial values. Every
refusal is a :class:`~byteps_like.embedding.TableError` naming the file, the table and what
is wrong.

The writer (:func:`write`) makes the file 0600 in the tag's folder (0700), under a temporary
name in the same folder, fsyncs it, renames it into place and fsyncs the folder: it appears
whole or not at all, and survives a crash once written.

Files of the format before this one (``.npz``, a zip archive with no header or checksum) are
refused with what to do: ``python -m byteps_like.shardfile convert DIR`` rewrites a folder of
them in this format, trusting them once.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import numpy as np


class TableError(ValueError):
    """A server-held table's declaration, request or checkpoint file that cannot be served
    (the text says why); byteps_like.embedding re-exports it."""

MAGIC = b"BPSLSHRD"
FORMAT = 2
SUFFIX = ".bpst"
OLD_SUFFIX = ".npz"
MAX_HEADER = 1 << 20
_LEN = struct.Struct("<I")
_DIGEST = 32
_CHUNK = 8 << 20
#: the optimizer state a shard may hold, by array name, and its dtype (per row: dim values, or
#: one for the step count)
STATE_DTYPES = {"acc": "float32", "m": "float32", "v": "float32", "t": "int32"}
REPAIRS = ("refuse", "drop")


def _error(path: str, table: str, what: str) -> Exception:
    return TableError(f"checkpoint file {path} (table {table!r}): {what}")


def expected_arrays(names: list[str], rows: int, dim: int) -> list[list[Any]]:
    """The header's "arrays" for a shard of ``rows`` rows whose optimizer keeps ``names``."""
    out: list[list[Any]] = [["ids", "int64", [rows]], ["weights", "float32", [rows, dim]]]
    for name in names:
        out.append([name, STATE_DTYPES[name], [rows] if name == "t" else [rows, dim]])
    return out


def _nbytes(arrays: list[list[Any]]) -> int:
    return sum(int(np.dtype(dt).itemsize) * int(np.prod(shape, dtype=np.int64))
               for _name, dt, shape in arrays)


# -- writing --------------------------------------------------------------------------------------

def write_checksummed(path: str, magic: bytes, head: bytes, parts: Any) -> int:
    """Write ``magic``, the little-endian u32 length of ``head``, ``head``, the byte buffers
    ``parts`` and a SHA-256 of all of it at ``path``: 0600, through a temporary file in the same
    folder, fsynced, renamed, the folder fsynced (the shard files, and asynchronous mode's
    snapshots: server/async_snapshots.py). Returns the bytes written."""
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, mode=0o700, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix="." + os.path.basename(path) + ".",
                               suffix=".tmp")  # mkstemp: 0600
    written = 0
    try:
        with os.fdopen(fd, "wb") as f:
            h = hashlib.sha256()
            for part in (magic, _LEN.pack(len(head)), head, *parts):
                h.update(part)
                f.write(part)
                written += memoryview(part).nbytes
            f.write(h.digest())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    dfd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return written + h.digest_size


def write(path: str, spec_json: dict, shard: int, shards: int,
          state: dict[str, np.ndarray]) -> str:
    """Write ``state`` (ids, weights, optimizer state) as shard ``shard`` of ``shards`` of the
    table ``spec_json`` describes, at ``path``, atomically and 0600. Returns ``path``."""
    names = [n for n in STATE_DTYPES if n in state]
    rows, dim = len(state["ids"]), int(spec_json["dim"])
    header = {"format": FORMAT, "table": spec_json["name"], "shard": shard, "shards": shards,
              "rows": rows, "dim": dim, "dtype": "float32", "spec": spec_json,
              "arrays": expected_arrays(names, rows, dim)}
    head = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    arrays = (memoryview(np.ascontiguousarray(state[name], dtype=np.dtype(dt).newbyteorder("<"))
                         .reshape(-1).view(np.uint8))
              for name, dt, _shape in header["arrays"])
    write_checksummed(path, MAGIC, head, arrays)
    return path


# -- reading --------------------------------------------------------------------------------------

class Expect:
    """What a file must be to load into a table: its spec (as JSON, the optimizer's parameters
    aside), dim, total rows, and the optimizer state names."""

    def __init__(self, spec_json: dict, state_names: list[str]):
        self.spec = {k: v for k, v in spec_json.items() if k != "optimizer_args"}
        self.name, self.dim, self.rows = spec_json["name"], spec_json["dim"], spec_json["rows"]
        self.names = state_names


def read(path: str, shard: int, shards: int, expect: Expect, *,
         charge: Callable[[int], bool] | None = None,
         repair: str = "refuse") -> tuple[dict[str, np.ndarray], int, int]:
    """The arrays of shard ``shard`` of ``shards`` at ``path``, checked (module docstring);
    (arrays, payload bytes charged, rows left out by the repair). The caller gives the charge
    back (``charge(-bytes)``) once it has taken the rows."""
    table = expect.name

    def bad(what: str) -> Exception:
        return _error(path, table, what)

    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            header, head_bytes = _header(f, size, bad)
            arrays = _check_header(header, shard, shards, expect, bad)
            payload = _nbytes(arrays)
            want = len(MAGIC) + _LEN.size + len(head_bytes) + payload + _DIGEST
            if size != want:
                raise bad(f"{'truncated: ' if size < want else ''}the file has {size} bytes, its "
                          f"header describes {want} ({header['rows']} rows of dim "
                          f"{expect.dim}); the file is damaged")
            if charge is not None and not charge(payload):
                raise bad(f"its {payload} bytes of rows do not fit in the server's memory "
                          "budget (BYTEPS_SERVER_MAX_BYTES)")
            try:
                data = _payload(f, arrays, head_bytes, bad)
            except BaseException:
                if charge is not None:
                    charge(-payload)
                raise
    except OSError as exc:
        raise bad(f"cannot be read ({exc.strerror or exc})") from None
    try:
        dropped = _check_rows(data, shard, shards, expect.rows, repair, bad)
    except BaseException:
        if charge is not None:
            charge(-payload)
        raise
    return data, payload, dropped


def _header(f: Any, size: int, bad: Callable[[str], Exception]) -> tuple[dict, bytes]:
    if size == 0:
        raise bad("the file is empty (0 bytes); it was not written whole")
    first = f.read(len(MAGIC) + _LEN.size)
    if first[:4] == b"PK\x03\x04":
        raise bad("written by an older byteps_like (an .npz archive, with no header or "
                  "checksum), which this version does not read: convert the checkpoint once, "
                  "trusting it, with `python -m byteps_like.shardfile convert "
                  f"{os.path.dirname(f.name) or '.'}`, or save it again from a job")
    if len(first) < len(MAGIC) + _LEN.size and MAGIC.startswith(first[:len(MAGIC)]):
        raise bad(f"truncated: {size} bytes, not even its header; the file is damaged")
    if len(first) < len(MAGIC) + _LEN.size or first[:len(MAGIC)] != MAGIC:
        raise bad(f"not a table checkpoint shard (it starts with {first[:8]!r}, not {MAGIC!r})")
    (hlen,) = _LEN.unpack_from(first, len(MAGIC))
    if hlen > MAX_HEADER or len(first) + hlen > size:
        limit = f"over {MAX_HEADER}" if hlen > MAX_HEADER else "more than the file holds"
        raise bad(f"its header claims {hlen} bytes, {limit}; the file is damaged")
    head = f.read(hlen)
    try:
        header = json.loads(head.decode())
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise bad("its header is not readable JSON; the file is damaged") from None
    if not isinstance(header, dict):
        raise bad("its header is not a JSON object; the file is damaged")
    return header, head


def _check_header(header: dict, shard: int, shards: int, expect: Expect,
                  bad: Callable[[str], Exception]) -> list[list[Any]]:
    version = header.get("format")
    if version != FORMAT:
        raise bad(f"format version {version!r}; this byteps_like reads version {FORMAT}")
    spec = header.get("spec")
    got = {k: v for k, v in spec.items() if k != "optimizer_args"} if isinstance(spec, dict) \
        else spec
    if header.get("table") != expect.name or got != expect.spec:
        raise bad(f"it holds table {header.get('table')!r} {got}, not the table being loaded "
                  f"{expect.spec}")
    if (header.get("shard"), header.get("shards")) != (shard, shards):
        raise bad(f"it says it is shard {header.get('shard')!r} of {header.get('shards')!r}, "
                  f"but its name says shard {shard} of {shards}")
    rows = header.get("rows")
    if type(rows) is not int or not 0 <= rows <= expect.rows:
        raise bad(f"row count {rows!r} is not in 0..{expect.rows}, the table's rows")
    if header.get("dim") != expect.dim or header.get("dtype") != "float32":
        raise bad(f"dim {header.get('dim')!r} / dtype {header.get('dtype')!r}; the table is "
                  f"float32 of dim {expect.dim}")
    arrays = expected_arrays(expect.names, rows, expect.dim)
    if header.get("arrays") != arrays:
        raise bad(f"its arrays are {header.get('arrays')!r}; a shard of {rows} rows of this "
                  f"table holds {arrays}")
    return arrays


def _payload(f: Any, arrays: list[list[Any]], head: bytes,
             bad: Callable[[str], Exception]) -> dict[str, np.ndarray]:
    h = hashlib.sha256()
    h.update(MAGIC + _LEN.pack(len(head)) + head)
    out: dict[str, np.ndarray] = {}
    for name, dt, shape in arrays:
        arr = np.empty(shape, np.dtype(dt).newbyteorder("<"))
        view = memoryview(arr.reshape(-1).view(np.uint8))
        at = 0
        while at < len(view):
            n = f.readinto(view[at:at + _CHUNK])
            if not n:
                raise bad("truncated while it was read; the file is damaged")
            at += n
        h.update(view)
        out[name] = arr.astype(dt, copy=False)
    digest = f.read(_DIGEST)
    if digest != h.digest():
        raise bad("its SHA-256 checksum does not match its contents; the file is damaged "
                  "(a flipped bit, a partial copy): restore it from a copy, or load another tag")
    return out


def _check_rows(data: dict[str, np.ndarray], shard: int, shards: int, rows: int, repair: str,
                bad: Callable[[str], Exception]) -> int:
    """What the numbers may be; NaN/inf rows and repeated ids refused, or left out ("drop").
    Returns how many rows were left out."""
    ids = data["ids"]
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= rows):
        raise bad(f"a row id out of the table's range 0..{rows - 1}")
    if len(ids) and shards > 1 and bool((ids % shards != shard).any()):
        raise bad(f"a row id that is not of shard {shard} of {shards}")
    keep = np.ones(len(ids), np.bool_)
    uniq, counts = np.unique(ids, return_counts=True)
    repeated = uniq[counts > 1]
    if len(repeated):
        if repair != "drop":
            raise bad(f"{len(repeated)} row id(s) appear more than once (the first: "
                      f"{int(repeated[0])}); set BYTEPS_SPARSE_CHECKPOINT_REPAIR=drop to load "
                      "it without them (those rows start again from their initial values)")
        keep &= ~np.isin(ids, repeated)
    finite = np.ones(len(ids), np.bool_)
    for name, arr in data.items():
        if name != "ids" and arr.dtype.kind == "f":
            finite &= np.isfinite(arr.reshape(len(ids), -1)).all(axis=1)
    if not finite.all():
        if repair != "drop":
            first = int(ids[np.argmin(finite)])
            raise bad(f"{int((~finite).sum())} row(s) hold NaN or inf (the first: row "
                      f"{first}); set BYTEPS_SPARSE_CHECKPOINT_REPAIR=drop to load it without "
                      "them (those rows start again from their initial values)")
        keep &= finite
    if "t" in data and len(ids) and int(data["t"].min()) < 0:
        raise bad("a negative Adam step count")
    if keep.all():
        return 0
    for name in list(data):
        data[name] = data[name][keep]
    return int((~keep).sum())


# -- converting files of the previous format ----------------------------------------------------

def convert(folder: str) -> list[str]:
    """Rewrite every ``.npz`` shard file of a checkpoint folder in this format (trusting them:
    they are read with numpy, whose zip reader decompresses a member whole). The old files are
    left in place. Returns the new paths."""
    out = []
    for name in sorted(os.listdir(folder)):
        if not name.endswith(OLD_SUFFIX) or ".shard" not in name:
            continue
        stem, s_of = name[:-len(OLD_SUFFIX)].rsplit(".shard", 1)
        shard, shards = (int(x) for x in s_of.split("of"))
        path = os.path.join(folder, name)
        with np.load(path, allow_pickle=False) as f:
            data = {k: f[k] for k in f.files}
        try:
            spec = json.loads(data.pop("spec").tobytes().decode())
        except (KeyError, ValueError, UnicodeDecodeError):
            raise TableError(f"{path}: not a table checkpoint (no readable spec)") from None
        dest = os.path.join(folder, f"{stem}.shard{shard}of{shards}{SUFFIX}")
        out.append(write(dest, spec, shard, shards, data))
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] != "convert":
        print("usage: python -m byteps_like.shardfile convert CHECKPOINT_DIR/TAG",
              file=sys.stderr)
        return 2
    try:
        paths = convert(args[1])
    except (OSError, ValueError) as exc:
        print(f"convert: {exc}", file=sys.stderr)
        return 1
    for p in paths:
        print(p)
    if not paths:
        print(f"convert: no .npz shard files in {args[1]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
