"""Registered compressors' server codecs on the native data plane.

The compiled server (csrc/dataplane_server.cc) keeps every rule of a compressed key (rounds,
declarations, bounds, the memory budget, membership, epochs, errors) and runs the built-in
codecs itself (csrc/codec.cc). A compressor a user registered (``compression.register("mine",
factory)``) has its codec math in Python: for such a key's first push the server calls
:func:`make_server_codec` (given to it with ``DataServer.set_codec_factory``), then calls the
codec's ``decode``/``decode_add``/``encode`` with the GIL taken, one call at a time per key.
"""
from __future__ import annotations

from typing import Any

from ..compression import Codec, CompressionError, codec_bytes, from_spec, registered
from ..errors import ProtocolError
from ..wire import parse_decl

#: what the error of an unknown compressor tells the user to do
REGISTER_HINT = ("call byteps_like.compression.register({name!r}, factory) in every server "
                 "process too, as on the workers: in a module the server imports at start, "
                 "e.g. through sitecustomize or a .pth file on its PYTHONPATH "
                 "(docs/compression.md, 'Adding a compressor')")


def make_server_codec(key: int, n: int, decl: bytes) -> tuple[Codec, int]:
    """The server codec of compressed key ``key`` (``n`` elements, checked by the caller
    against BYTEPS_PARTITION_BYTES) that the declaration's compressor spec describes, and the
    bytes it holds (for the memory budget). The declaration is untrusted: the spec is validated
    field by field (``compression.from_spec``); the declaration's layout (csrc/decl.h) by
    ``wire.parse_decl``. Raises :class:`CompressionError` saying why
    there is none, e.g. for a compressor this server process has not registered."""
    try:
        spec: Any = parse_decl(decl).compressor
    except ProtocolError as exc:
        raise CompressionError(str(exc)) from None
    if not isinstance(spec, dict):
        raise CompressionError("the declaration carries no compressor spec")
    name = spec.get("name")
    if isinstance(name, str) and name not in registered():
        raise CompressionError(
            f"compressor {name[:64]!r} is not registered in this server process (it knows "
            f"{', '.join(registered())}); " + REGISTER_HINT.format(name=name[:64]))
    codec = from_spec(spec).make_codec(n, role="server", key=key)
    if not isinstance(codec, Codec):
        raise CompressionError(f"compressor {name!r}: make_codec returned {codec!r}, not a Codec")
    if getattr(codec, "n", None) != n:
        raise CompressionError(f"compressor {name!r}: its server codec is of "
                               f"{getattr(codec, 'n', None)!r} elements, not {n}")
    return codec, codec_bytes(codec)
