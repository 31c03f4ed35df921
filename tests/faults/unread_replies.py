"""The unread-replies attack on the native data plane (issue 29), as a tool and for the tests.

A native server of a job without a secret (``--no-auth``) is started in a process of its own;
``conns`` connections each say a valid hello and send ``pulls`` pulls of undeclared keys, and
never read the error replies. The server's resident memory is measured before, at the peak
and after the connections close:

    .venv/bin/python -m tests.faults.unread_replies --conns 150 --pulls 65000

prints one JSON line (bytes): ``base``, ``peak``, ``after`` and the server's counters.
"""
from __future__ import annotations

import argparse
import json
import os
import select
import socket
import subprocess
import sys
import time

from ..native_stream import recv_exact
from .hostile import NATIVE_HELLO, NATIVE_PULL, native_msg, proc_rss_bytes

JOB = 0xC0FFEE

# the server: one process holding a DataServer, answering "stats" / "rejected" on stdin
_SERVER = r"""
import json, sys
JOB = int(sys.argv[1])
from byteps_like import _core
srv = _core.DataServer(2, 0, JOB, 2, 1 << 28, 1 << 30, 4096)
print(srv.listen("127.0.0.1", 0), flush=True)
srv.start()
for line in sys.stdin:
    cmd = line.strip()
    if cmd == "stats":
        print(json.dumps(srv.stats()), flush=True)
    elif cmd == "rejected":
        print(json.dumps(srv.rejected()), flush=True)
    else:
        break
srv.close()
"""


class Server:
    """A native data plane server in a child process (no secret)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVER, str(JOB)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.port = int(self.proc.stdout.readline())

    def ask(self, cmd: str) -> dict:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def rss(self) -> int:
        return proc_rss_bytes(self.proc.pid)

    def close(self) -> None:
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()


def attack(port: int, conns: int, pulls: int, stall: float = 1.0) -> list[socket.socket]:
    """``conns`` streams that said hello, each sent as many of ``pulls`` pulls of undeclared
    keys as the server took (it stops reading a stream that leaves its replies unread: then
    the rest stays here, and sending stops after ``stall`` seconds without progress). The
    streams are returned open, their replies unread."""
    socks = []
    for i in range(conns):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(native_msg(NATIVE_HELLO, 0, JOB, key=i))
        recv_exact(s, 52)
        s.setblocking(False)
        socks.append(s)
    # undeclared keys, 1,000,000 + i: one error reply each
    pending = {s: memoryview(b"".join(native_msg(NATIVE_PULL, 0, JOB, key=1_000_000 + k)
                                      for k in range(pulls))) for s in socks}
    last = time.monotonic()
    while pending and time.monotonic() - last < stall:
        _, writable, _ = select.select([], list(pending), [], stall)
        for s in writable:
            try:
                n = s.send(pending[s][:1 << 20])
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:  # closed by the server
                del pending[s]
                continue
            if n:
                last = time.monotonic()
            pending[s] = pending[s][n:]
            if not len(pending[s]):
                del pending[s]
    return socks


def settle(server: Server, key: str, timeout: float = 10.0) -> dict:
    """The server's stats once ``key`` stopped changing for half a second."""
    deadline = time.monotonic() + timeout
    prev = server.ask("stats")
    while time.monotonic() < deadline:
        time.sleep(0.5)
        cur = server.ask("stats")
        if cur[key] == prev[key]:
            return cur
        prev = cur
    return prev


def measure(conns: int, pulls: int) -> dict:
    server = Server()
    try:
        base = server.rss()
        socks = attack(server.port, conns, pulls)
        stats = settle(server, "rejected")
        peak = server.rss()
        for s in socks:
            s.close()
        deadline = time.monotonic() + 10
        while server.ask("stats").get("live_connections", 0) > 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.5)  # the I/O loops' tick gives freed memory back
        return {"conns": conns, "pulls": pulls, "base": base, "peak": peak,
                "after": server.rss(), "stats": stats, "rejected": server.ask("rejected")}
    finally:
        server.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conns", type=int, default=150)
    ap.add_argument("--pulls", type=int, default=65000)
    a = ap.parse_args(argv)
    r = measure(a.conns, a.pulls)
    print(json.dumps(r))
    mb = 1 << 20
    print(f"server RSS {r['base'] / mb:.0f} MB -> {r['peak'] / mb:.0f} MB under {a.conns} "
          f"connections x {a.pulls} unread pulls (+{(r['peak'] - r['base']) / mb:.0f} MB), "
          f"{r['after'] / mb:.0f} MB after they closed", file=sys.stderr)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
