"""A worker's native data plane (csrc/dataplane_client.cc) against a foreign or forged server
on a TCP socket: what it reads is checked before it is believed. Over TCP only (the module has
no `stream` fixture): the checks are the same code over UCX streams, and a UCX endpoint cannot
be played by a plain socket."""
from __future__ import annotations

import socket
import struct

import numpy as np
import pytest

from byteps_like import _core
from byteps_like.transport.native import WIRE_CODE

from ..native_stream import HDR, recv_exact
from .test_native_dataplane import JOB, MAXMSG


def _foreign_server() -> tuple[socket.socket, int]:
    """A TCP listener on loopback that plays a foreign server, and its port."""
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(1)
    return lst, lst.getsockname()[1]


def test_client_refuses_a_peer_that_is_not_a_server(cleanup):
    lst, port = _foreign_server()
    cli = _core.DataClient(0, JOB, 1, 0, MAXMSG)
    cleanup.append(cli)
    import threading

    def answer():
        c, _ = lst.accept()
        c.recv(HDR.size)
        c.sendall(b"HTTP/1.1 200 OK\r\n" + b" " * 60)
        try:
            c.recv(1)  # until the client hangs up
        except OSError:
            pass
        c.close()
    th = threading.Thread(target=answer)
    th.start()
    with pytest.raises(RuntimeError, match="not that of a byteps_like server"):
        cli.connect(0, "127.0.0.1", port, 1, 5.0)
    th.join()
    lst.close()


def test_a_pull_resp_whose_count_overflows_fails_the_operation(cleanup):
    """A forged server answers a push of 1,000 float64 with a PULL_RESP of 2^61 + 1000
    float64 in 8,000 bytes (count * 8 wraps to 8,000): the client closes the stream as
    malformed and fails the operation instead of completing it."""
    import threading
    lst, port = _foreign_server()
    cli = _core.DataClient(0, JOB, 1, 1 << 20, MAXMSG)
    cleanup.append(cli)

    def forge():
        c, _ = lst.accept()
        h = HDR.unpack(recv_exact(c, HDR.size))            # the worker's hello
        c.sendall(HDR.pack(b"BPSL", 1, 24, 0, 1, 0, 0, JOB, h[8], 0, 0, 0))
        try:
            p = HDR.unpack(recv_exact(c, HDR.size))        # its push: meta, then payload
            if p[6] & 1:
                (n,) = struct.unpack("<I", recv_exact(c, 4))
                recv_exact(c, n)
            recv_exact(c, p[11])
            c.sendall(HDR.pack(b"BPSL", 1, 21, 0, 1, 0, 0, JOB, p[8], p[9], 0, 0))
            c.sendall(HDR.pack(b"BPSL", 1, 23, WIRE_CODE["float64"], 1, 0, 0, JOB, p[8], p[9],
                               (1 << 61) + 1000, 8000) + b"\0" * 8000)
            c.recv(1)   # until the client hangs up
        except (OSError, AssertionError):   # the client hung up early (recv_exact asserts)
            pass
        c.close()
    th = threading.Thread(target=forge)
    th.start()
    try:
        cli.connect(0, "127.0.0.1", port, 1, 5.0)
        x = np.ones(1000, np.float64)
        y = np.empty_like(x)
        cli.submit(1, 0, x.view(np.uint8), y.view(np.uint8), WIRE_CODE["float64"], 1, 0,
                   [(7, 0, 0, 0, x.nbytes, b'{"name":"t","part":0,"nparts":1}')])
        assert cli.wait(1, 10.0)
        c = cli.take(1)
        assert not c[1], c
        assert b"PULL_RESP with an inconsistent or oversized length" in c[4], c
    finally:
        cli.close()
        th.join(10)
        lst.close()
