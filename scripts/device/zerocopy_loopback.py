"""Does MSG_ZEROCOPY cut a sender's CPU per GB on this machine's loopback TCP?

``python3 scripts/device/zerocopy_loopback.py [--gb 4] [--size 4M] [--runs 3]`` sends ``--gb``
GB over one loopback TCP connection in messages of ``--size`` bytes (the server's pull answers
are one partition, 4 MB by default), once with plain ``send`` and once with ``MSG_ZEROCOPY``
(``SO_ZEROCOPY``; completions read from the error queue, as a real sender must before it reuses
a buffer), alternating ``--runs`` times, and prints each side's CPU seconds per GB (the sending
and the receiving process, getrusage, every thread) and the wall rate. Standard library only
(runs with the device's Python 3.12); Linux >= 4.14.

Why it is a question (docs/performance.md, "Server CPU"): the server's largest single cost is
the kernel's copy of a pull answer from the store into socket buffers (about a quarter of its
CPU on loopback). MSG_ZEROCOPY pins the pages instead, but a packet delivered to a local socket
(loopback, veth into a namespace) has its pinned pages copied anyway (the "deferred copy" of
the kernel's msg_zerocopy.rst), and the sender also pays for pinning and for the completions;
so the native data plane keeps plain sends unless this measures a gain.
"""
from __future__ import annotations

import argparse
import os
import resource
import socket
import statistics
import sys
import time

SO_ZEROCOPY = getattr(socket, "SO_ZEROCOPY", 60)
MSG_ZEROCOPY = getattr(socket, "MSG_ZEROCOPY", 0x4000000)
MSG_ERRQUEUE = getattr(socket, "MSG_ERRQUEUE", 0x2000)


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _receiver(sock: socket.socket, total: int, wfd: int) -> None:
    conn, _ = sock.accept()
    buf = bytearray(1 << 20)
    view = memoryview(buf)
    c0 = _cpu()
    got = 0
    while got < total:
        n = conn.recv_into(view)
        if n == 0:
            break
        got += n
    os.write(wfd, f"{_cpu() - c0:.6f} {got}\n".encode())
    conn.close()


def _drain_completions(s: socket.socket) -> int:
    """Completions waiting on the error queue (each acknowledges a range of sends)."""
    n = 0
    while True:
        try:
            s.recvmsg(0, 256, MSG_ERRQUEUE | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return n
        n += 1


def one_run(total: int, size: int, zerocopy: bool) -> dict:
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(1)
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:   # the receiving process
        try:
            os.close(rfd)
            _receiver(lsock, total, wfd)
        finally:
            os._exit(0)
    os.close(wfd)
    s = socket.create_connection(lsock.getsockname())
    lsock.close()
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    flags = 0
    if zerocopy:
        s.setsockopt(socket.SOL_SOCKET, SO_ZEROCOPY, 1)
        flags = MSG_ZEROCOPY
    payload = memoryview(bytearray(os.urandom(1 << 16)) * (size >> 16))
    completions = 0
    t0, c0 = time.perf_counter(), _cpu()
    sent = 0
    while sent < total:
        view = payload[: min(size, total - sent)]
        while view:
            n = s.send(view, flags)
            view = view[n:]
            sent += n
        if zerocopy:
            completions += _drain_completions(s)
    s.shutdown(socket.SHUT_WR)
    reply = b""
    while not reply.endswith(b"\n"):
        reply += os.read(rfd, 100)
    wall = time.perf_counter() - t0
    if zerocopy:
        completions += _drain_completions(s)
    send_cpu = _cpu() - c0
    s.close()
    os.close(rfd)
    os.waitpid(pid, 0)
    recv_cpu, got = reply.split()
    gb = total / 1e9
    return {"zerocopy": zerocopy, "send_core_s_per_gb": send_cpu / gb,
            "recv_core_s_per_gb": float(recv_cpu) / gb, "gbps": int(got) / wall / 1e9,
            "completions": completions}


def _size(text: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * mult[text[-1].upper()] if text[-1].upper() in mult else int(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gb", type=float, default=4.0, help="GB (1e9 B) sent per run")
    p.add_argument("--size", type=_size, default=4 << 20, help="bytes per send (multiple of 64K)")
    p.add_argument("--runs", type=int, default=3, help="runs of each, alternating")
    a = p.parse_args(argv)
    if a.size % (1 << 16) or a.size <= 0:
        p.error("--size must be a positive multiple of 64K")
    total = int(a.gb * 1e9)
    rows: dict[bool, list[dict]] = {False: [], True: []}
    for _ in range(a.runs):
        for zc in (False, True):
            try:
                rows[zc].append(one_run(total, a.size, zc))
            except OSError as exc:
                print(f"MSG_ZEROCOPY unavailable: {exc}", file=sys.stderr)
                return 1
    print(f"loopback TCP, {a.gb:g} GB a run in sends of {a.size} B, medians of {a.runs}:")
    print("| send | sender core-s/GB | receiver core-s/GB | GB/s | completions |")
    print("|---|---:|---:|---:|---:|")
    for zc in (False, True):
        med = {k: statistics.median(r[k] for r in rows[zc])
               for k in ("send_core_s_per_gb", "recv_core_s_per_gb", "gbps", "completions")}
        print(f"| {'MSG_ZEROCOPY' if zc else 'plain'} | {med['send_core_s_per_gb']:.3f} | "
              f"{med['recv_core_s_per_gb']:.3f} | {med['gbps']:.2f} | {med['completions']:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
