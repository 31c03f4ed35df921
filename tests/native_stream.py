"""Raw streams of the native data plane for the tests that play a hostile or foreign peer
(tests/unit/test_native_dataplane.py, tests/faults/test_hostile.py)."""
from __future__ import annotations

import socket
import struct

#: the wire header (byteps_like/wire.py): magic, version, type, dtype, role, rank, flags, job,
#: key, round, count, nbytes
HDR = struct.Struct("<4sBBBBiIIQqQQ")


def closed_by_peer(s: socket.socket, timeout: float = 10.0) -> bool:
    """True when the other end closes the stream (an orderly close or a reset) within
    ``timeout``; closes ``s`` in any case."""
    s.settimeout(timeout)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True
    finally:
        s.close()


def recv_exact(s: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes from a socket (MSG_WAITALL may return less on a socket with a
    timeout); AssertionError when the peer closes first."""
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        assert chunk, f"stream closed after {len(buf)} of {n} bytes"
        buf += chunk
    return bytes(buf)
