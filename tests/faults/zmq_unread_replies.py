"""The unread-replies attack on a server's ZeroMQ socket (issue 29), as a tool and for the tests.

A job (2 workers in this process, a scheduler and a server as processes, one float32
partition of 64,000 bytes on the native data plane, and a server-held table "big" of 16 rows
of 4,000 bytes on the table streams) runs two rounds; then ``clients`` ZeroMQ clients each send
``pulls`` pulls of the table's 16 rows to the server's ZeroMQ socket and never read a reply.
Since issue 39 the tables' requests travel on the native plane only, so each is refused with an
error ("data over ZeroMQ"), and the replies past a client's high-water mark are dropped and
counted. The server's resident memory is measured before, at its peak while the clients stay
connected (``hold`` seconds), and after they close:

    .venv/bin/python -m tests.faults.zmq_unread_replies --clients 50 --pulls 15000

prints one JSON line (bytes): ``base``, ``peak``, ``after``, and what the server logged it
dropped or closed.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import threading
import time

import numpy as np
import zmq

from byteps_like.wire import Header, MsgType, Role, encode, job_hash

from .hostile import ProcCluster, proc_rss_bytes, settle

MIB = 1 << 20
EXTRA = {"BYTEPS_PARTITION_BYTES": "65536"}
# the table whose pulls the clients leave unread: 64,000-byte answers to 128-byte requests (a
# request as small as the dense pull it replaces: what is measured is the replies)
ROWS, DIM = 16, 1000


class PeakRss:
    """Samples the resident memory of a process every 50 ms; its peak."""

    def __init__(self, pid: int):
        self.pid = pid
        self.base = self.peak = proc_rss_bytes(pid)
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, proc_rss_bytes(self.pid))

    def stop(self) -> None:
        self._stop.set()
        self._t.join(5)


def float_rounds(c: ProcCluster, rounds: int, first: int, n: int = 16000) -> None:
    """The real job: a float32 tensor of one 64,000-byte partition, exact every round (and,
    before the first, the table "big" made)."""
    if "big" not in c.workers[0].sparse.tables:
        made = c.run_all(lambda w: w.sparse.create("big", ROWS, DIM, init="zeros"))
        assert all(not isinstance(t, BaseException) for t in made), made
    for r in range(first, first + rounds):
        outs = c.push_pull(lambda k: np.full(n, k + 1 + r, np.float32), "real.w", timeout=60)
        for o in outs:
            assert isinstance(o, np.ndarray), o
            assert np.array_equal(o, np.full(n, 3 + 2 * r, np.float32)), o[:3]


def unread_clients(ctx: zmq.Context, c: ProcCluster, clients: int, pulls: int) -> list:
    """``clients`` DEALERs that each queued ``pulls`` pulls of every row of the table "big"
    toward the server's ZeroMQ socket (refused there) and never read (a receive queue of one message, no reconnection once
    the server closed one)."""
    p = c.server_peers()[0]
    table = c.workers[0].sparse.tables["big"]
    ids = np.arange(ROWS, dtype=np.int64)
    pull = encode(Header(MsgType.SPARSE_PULL, "int64", Role.WORKER, 0, 0, job_hash("default"),
                         table.table_id, table.step, ROWS, ids.nbytes), ids)
    socks = []
    for _ in range(clients):
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.setsockopt(zmq.RCVHWM, 1)
        # a fixed, small kernel receive buffer (no autotuning): what the client leaves unread
        # backs up at the server whatever the machine's TCP buffers grow to, so the server's
        # queue to it reaches its high-water mark (its error replies, about 4 MB for 15,000
        # pulls, fitted in the kernel's buffers on a loaded machine, and nothing was dropped)
        d.setsockopt(zmq.RCVBUF, 4096)
        d.setsockopt(zmq.SNDHWM, 0)
        d.setsockopt(zmq.RECONNECT_IVL, -1)   # once the server closes it, it stays closed
        d.connect(f"tcp://{p.host}:{p.port}")
        socks.append(d)
    for _ in range(pulls):
        for d in socks:
            d.send_multipart(pull)
    return socks


def server_log(c: ProcCluster) -> str:
    with open(c.logs[1], errors="replace") as f:
        return f.read()


def measure(clients: int, pulls: int, hold: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        c = ProcCluster(pathlib.Path(tmp), machines=2, extra=EXTRA)
        ctx = zmq.Context()
        try:
            float_rounds(c, 2, 0)
            srv = c.servers[0].pid
            settle(srv)
            rss = PeakRss(srv)
            t0 = time.monotonic()
            socks = unread_clients(ctx, c, clients, pulls)
            settle(srv)
            held = proc_rss_bytes(srv)
            time.sleep(max(0.0, hold - (time.monotonic() - t0)))
            float_rounds(c, 1, 2)   # the job meanwhile
            for d in socks:
                d.close(0)
            settle(srv)
            time.sleep(2.0)   # freed memory goes back within a second
            rss.stop()
            after = proc_rss_bytes(srv)
            float_rounds(c, 1, 3)
            log = [ln.split(": ", 1)[-1][:120] for ln in server_log(c).splitlines()
                   if "does not read" in ln or "unread" in ln]
            return {"clients": clients, "pulls": pulls, "base": rss.base, "peak": rss.peak,  # noqa
                    "held": held, "after": after, "log": log}
        finally:
            c.close()
            ctx.term()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--pulls", type=int, default=15000)
    ap.add_argument("--hold", type=float, default=15.0,
                    help="seconds the clients stay connected, their replies unread")
    a = ap.parse_args(argv)
    r = measure(a.clients, a.pulls, a.hold)
    print(json.dumps(r))
    print(f"server RSS {r['base'] / MIB:.0f} MB -> {r['peak'] / MIB:.0f} MB at the peak under "
          f"{a.clients} clients x {a.pulls} unread pulls (+{(r['peak'] - r['base']) / MIB:.0f}"
          f" MB), {r['held'] / MIB:.0f} MB settled, {r['after'] / MIB:.0f} MB after they "
          "closed", file=sys.stderr)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
