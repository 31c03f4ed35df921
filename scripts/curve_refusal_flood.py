"""The log cost of CURVE refusals (issue 41, item 7; docs/reliability.md).

Run from the repository root with the worktree's Python:

    .venv/bin/python scripts/curve_refusal_flood.py [SECONDS] 2> flood.log; wc -l flood.log

A ZmqEndpoint bound on loopback with a job's CURVE keys (as a server or the scheduler is) and
one client that knows the server's public key but not the job's client key: for SECONDS
(default 30) it opens a DEALER connection with a fresh key pair, sends, and closes, as fast as
it can; every connection is a handshake the ZAP handler refuses. The endpoint's log lines go to
stderr; the last line (also stderr) says how many connections were made and refused. Before
issue 41 each refusal was a WARNING line (18,200 in 30 s); now a few lines with counts.
"""
from __future__ import annotations

import logging
import sys
import time

import zmq

from byteps_like.transport import derive_curve_keys
from byteps_like.transport.zmq_transport import ZmqEndpoint


def main() -> int:
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 30.0
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    keys = derive_curve_keys("flood-" + "s" * 40)
    ctx = zmq.Context()
    ep = ZmqEndpoint("server", context=ctx, curve=keys)
    address = ep.bind("tcp://127.0.0.1:0")
    ep.start()
    auth = ep.auth
    assert auth is not None
    pub, sec = zmq.curve_keypair()
    end, n = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        s = ctx.socket(zmq.DEALER)
        s.curve_serverkey, s.curve_publickey, s.curve_secretkey = keys.server_public, pub, sec
        s.linger = 0
        s.connect(address)
        try:   # not blocking: a handshake refused before this send leaves no pipe to send on
            s.send(b"x", zmq.NOBLOCK)   # (it hung so under load)
        except zmq.Again:
            pass
        s.poll(5)
        s.close(0)
        n += 1
    ep.close(linger=0)
    ctx.term()
    print(f"{n} connections in {seconds:g} s, {auth.denied} refused", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
