"""The unread-replies attack on the native data plane (issue 29), as a tool and for the tests.

A native server of a job without a secret (``--no-auth``) is started in a process of its own;
``conns`` connections each say a valid hello and send ``pulls`` pulls of undeclared keys, and
never read the error replies. The server's resident memory is measured before, at the peak
and after the connections close:

    .venv/bin/python -m tests.faults.unread_replies --conns 150 --pulls 65000
    .venv/bin/python -m tests.faults.unread_replies --conns 150 --pulls 65000 --one-by-one

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


def attack_one_by_one(server: Server, conns: int, pulls: int,
                      timeout: float = 20.0) -> tuple[list[socket.socket], int]:
    """The same streams opened one at a time (issue 41): each says hello and sends its pulls
    until the server has either answered them all or stopped reading it (its ``paused``
    count went up), before the next one opens, so the first streams are read while few are
    open. Returns the streams, open, their replies unread, and the highest resident memory
    the server had after each stream."""
    socks, peak = [], server.rss()
    for i in range(conns):
        before = server.ask("stats")
        s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        s.sendall(native_msg(NATIVE_HELLO, 0, JOB, key=i))
        recv_exact(s, 52)
        s.setblocking(False)
        socks.append(s)
        data = memoryview(b"".join(native_msg(NATIVE_PULL, 0, JOB, key=1_000_000 + k)
                                   for k in range(pulls)))
        deadline = time.monotonic() + timeout
        while True:
            if len(data):
                _, writable, _ = select.select([], [s], [], 0.05)
                if writable:
                    try:
                        data = data[s.send(data[:1 << 20]):]
                    except (BlockingIOError, InterruptedError):
                        pass
                    continue
            st = server.ask("stats")   # the server's answer to this stream's pulls so far
            if st["paused"] > before["paused"] or st["unread_closed"] > before["unread_closed"]:
                break                  # it stopped reading this stream: the rest waits here
            if not len(data) and st["rejected"] - before["rejected"] >= pulls:
                break                  # every pull read and answered
            if time.monotonic() > deadline:
                raise TimeoutError(f"stream {i}: the server neither answered its {pulls} pulls "
                                   f"nor stopped reading it in {timeout:g} s: {st}")
            if not len(data):
                time.sleep(0.01)
        peak = max(peak, server.rss())
    return socks, peak


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


def measure(conns: int, pulls: int, one_by_one: bool = False) -> dict:
    """``one_by_one``: each stream opens after the server answered or paused the one before
    (attack_one_by_one), else all open first and then send (attack); ``peak`` is the
    highest resident memory seen."""
    server = Server()
    try:
        base = server.rss()
        if one_by_one:
            socks, peak = attack_one_by_one(server, conns, pulls)
        else:
            socks, peak = attack(server.port, conns, pulls), 0
        stats = settle(server, "rejected")
        peak = max(peak, server.rss())
        for s in socks:
            s.close()
        # every stream closed and its memory given back by the I/O loops' tick (at most once
        # a second): the event "after" is measured at, not a time hoped to be enough
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            st = server.ask("stats")
            if st["live_connections"] == 0 and st["closed_since_trim"] == 0:
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"the server did not close every stream and give their "
                                 f"memory back within 60 s: {st}")
        return {"conns": conns, "pulls": pulls, "one_by_one": one_by_one, "base": base,
                "peak": peak,
                "after": server.rss(), "stats": stats, "rejected": server.ask("rejected")}
    finally:
        server.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conns", type=int, default=150)
    ap.add_argument("--pulls", type=int, default=65000)
    ap.add_argument("--one-by-one", action="store_true",
                    help="open each stream after the server answered or paused the one before")
    a = ap.parse_args(argv)
    r = measure(a.conns, a.pulls, a.one_by_one)
    print(json.dumps(r))
    mb = 1 << 20
    print(f"server RSS {r['base'] / mb:.0f} MB -> {r['peak'] / mb:.0f} MB under {a.conns} "
          f"connections x {a.pulls} unread pulls (+{(r['peak'] - r['base']) / mb:.0f} MB), "
          f"{r['after'] / mb:.0f} MB after they closed", file=sys.stderr)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
