"""Strangers at a live job's doors (issue 41), as a tool and for the tests: a peer on the same
machine that knows the protocol, the job's tag and a server's data port, but not the job's
secret, tries to push forged values into a running job; and what a job listens on.

    .venv/bin/python -m tests.faults.strangers ucx --tries 10000
    .venv/bin/python -m tests.faults.strangers torchrun --tries 10000

start a job (a ``bpslaunch --local`` job over UCX with ``UCX_TLS=tcp``, or a single-node
torchrun job), attack it while it runs rounds of an exact int64 sum
(tests/faults/workers/target.py), and print one JSON line: tries, accepted (streams the
server answered past the hello), the job's rounds and whether every sum was exact, the job's
listening sockets that are not on loopback, and whether a plain ZeroMQ client gets through
the scheduler's handshake (``scheduler``: "refused" under CURVE).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from byteps_like.wire import DTYPE_CODE, FLAG_AUTH

from ..native_stream import HDR, RawUcx
from ..support import FAST_ENV, clean_env, kill_group, spawn, watch
from .hostile import NATIVE_HELLO, NATIVE_PUSH, native_msg

TARGET = str(Path(__file__).parent / "workers" / "target.py")
N = 5000   # target.py's tensor


def _stream(kind: str, port: int):
    if kind == "ucx":
        return RawUcx(port, timeout=5.0)
    s = socket.create_connection(("127.0.0.1", port), timeout=5.0)
    return s


def _recv(s, n: int) -> bytes:
    """Up to n bytes, b"" when the server closed the stream (or said nothing in time)."""
    try:
        return s.recv(n, socket.MSG_WAITALL)
    except (TimeoutError, ConnectionResetError, OSError):
        return b""


def forged_push(kind: str, port: int, job: int, attempt: int) -> bool:
    """One try: a stream that says hello as worker 0 of the job, without the secret (a plain
    hello on even tries; on odd ones an authenticated hello whose proof is made up), then
    pushes forged values for a key and round. True when the server accepted the stream (it
    answered anything past the hello: the push was taken)."""
    key, rnd = attempt % 64, attempt % 1000
    push = native_msg(NATIVE_PUSH, 0, job, key=key, rnd=rnd, dtype=DTYPE_CODE["int64"],
                      count=N, nbytes=8 * N,
                      payload=np.full(N, -10 ** 12, np.int64).tobytes())
    s = _stream(kind, port)
    try:
        return _try(s, job, push, attempt)
    except (RuntimeError, OSError):   # the server closed the stream under a send: refused
        return False
    finally:
        s.close()


def _try(s, job: int, push: bytes, attempt: int) -> bool:
    if attempt % 2 == 0:   # a plain hello: a server with a secret closes the stream
        s.sendall(native_msg(NATIVE_HELLO, 0, job))
        s.sendall(push)
        return bool(_recv(s, HDR.size))
    s.sendall(native_msg(NATIVE_HELLO, 0, job, flags=FLAG_AUTH, nbytes=32) + os.urandom(32))
    reply = _recv(s, HDR.size + 64)   # the server's nonce and proof
    if len(reply) < HDR.size + 64:
        return False
    s.sendall(native_msg(NATIVE_HELLO, 0, job, flags=FLAG_AUTH, nbytes=32) + os.urandom(32))
    s.sendall(push)
    return bool(_recv(s, HDR.size))


def control_handshake(address: str, timeout: float = 20.0) -> str:
    """A plain ZeroMQ client (no CURVE keys) at a job's ZeroMQ socket (the scheduler's):
    "refused" when the handshake fails (a CURVE server refuses a client without the keys, so
    none of its messages reaches the application), "open" when it succeeds (its messages
    would be read). Waits for the handshake's event, ``timeout`` at most ("no answer")."""
    import zmq
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    mon = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                  | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                                  | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                                  | zmq.EVENT_HANDSHAKE_SUCCEEDED)
    try:
        sock.connect(f"tcp://{address}")
        if not mon.poll(int(timeout * 1000)):
            return "no answer"
        from zmq.utils.monitor import recv_monitor_message
        event = recv_monitor_message(mon)["event"]
        return "open" if event == zmq.EVENT_HANDSHAKE_SUCCEEDED else "refused"
    finally:
        sock.disable_monitor()
        mon.close(0)
        sock.close(0)
        ctx.term()


def listening_sockets(pids: list[int]) -> list[str]:
    """``addr:port`` of every TCP socket the processes listen on (from /proc)."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except OSError:
            continue
    out = []
    for name, size in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        try:
            lines = Path(name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] != "0A" or f[9] not in inodes:   # 0A: LISTEN
                continue
            hexaddr, hexport = f[1].split(":")
            raw = bytes.fromhex(hexaddr)
            # /proc prints each 32-bit word in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            addr = socket.inet_ntop(socket.AF_INET if size == 4 else socket.AF_INET6, raw)
            out.append(f"{addr}:{int(hexport, 16)}")
    return out


def on_loopback(addr: str) -> bool:
    host = addr.rsplit(":", 1)[0]
    return host.startswith("127.") or host == "::1" or host == "::ffff:127.0.0.1"


def job_command(kind: str, info: str, stop: str,
                no_auth: bool = False) -> tuple[list[str], dict[str, str]]:
    """The job to attack: bpslaunch --local over UCX (UCX_TLS=tcp, its default
    authentication), or a single-node torchrun job of two processes (its default too);
    ``no_auth``: opted out by name (--no-auth, BYTEPS_AUTH_OFF=1), to show what a stranger
    gets from a job without a secret."""
    env = clean_env(**FAST_ENV)
    py = sys.executable
    if kind == "ucx":
        env.update({"BYTEPS_TRANSPORT": "ucx", "UCX_TLS": "tcp", "UCX_WARN_UNUSED_ENV_VARS": "n"})
        env.pop("UCX_NET_DEVICES", None)
        return ([py, "-m", "byteps_like.launcher", "--local", "--workers", "2", "--servers",
                 "1", *(["--no-auth"] if no_auth else []), "--", py, TARGET, info, stop], env)
    env = clean_env("MASTER_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_",
                    "ROLE_", "TORCHELASTIC_", **FAST_ENV)
    env["BYTEPS_FORCE_DISTRIBUTED"] = "1"   # one machine: push through the job's server
    if no_auth:
        env["BYTEPS_AUTH_OFF"] = "1"
    return ([py, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
             TARGET, info, stop], env)


def attack(kind: str, tries: int, timeout: float = 240.0, no_auth: bool = False) -> dict:
    """Start the job, wait for its info, attack it ``tries`` times, stop it, and report."""
    if kind == "ucx":   # the stranger's own UCX: TCP on loopback
        for k, v in {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo",
                     "UCX_WARN_UNUSED_ENV_VARS": "n"}.items():
            os.environ.setdefault(k, v)
        from byteps_like.transport import ucx_native
        why = ucx_native.load()
        if why:
            raise RuntimeError(f"UCX streams unavailable here: {why}")
    with tempfile.TemporaryDirectory(prefix="bpsl-stranger-") as tmp:
        info_path, stop = os.path.join(tmp, "info.json"), os.path.join(tmp, "stop")
        cmd, env = job_command(kind, info_path, stop, no_auth)
        proc = spawn(cmd, env)
        result: dict = {"kind": kind, "tries": 0, "accepted": 0}
        try:
            deadline = time.monotonic() + 120
            while not os.path.exists(info_path):
                if proc.poll() is not None or time.monotonic() > deadline:
                    kill_group(proc, signal.SIGKILL)
                    break
                time.sleep(0.05)
            if not os.path.exists(info_path):
                rc, out, err = watch(proc, 30, f"{kind} job")
                raise RuntimeError(f"the {kind} job did not come up (rc {rc}):\n"
                                   f"{out[-3000:]}\n{err[-3000:]}")
            info = json.loads(Path(info_path).read_text())
            server = info["servers"][0]
            sockets = listening_sockets(info["pids"])
            result.update(auth=info["auth"], listening=sockets,
                          non_loopback=[a for a in sockets if not on_loopback(a)],
                          scheduler=control_handshake(info["scheduler"]))
            t0 = time.monotonic()
            for i in range(tries):
                result["tries"] += 1
                result["accepted"] += forged_push(kind, server["data_port"], info["job"], i)
            result["attack_s"] = round(time.monotonic() - t0, 1)
            result["job_ran_throughout"] = proc.poll() is None   # every try met a live job
        finally:
            Path(stop).touch()
            if proc.returncode is None:
                rc, out, err = watch(proc, timeout, f"{kind} job", first=signal.SIGINT)
        result.update(rc=rc, exact=re.findall(r"EXACT \d+", out),
                      wrong=re.findall(r"WRONG round [^\n]*", out),
                      log=(out + err)[-4000:])
        return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kind", choices=("ucx", "torchrun"))
    ap.add_argument("--tries", type=int, default=10000)
    ap.add_argument("--no-auth", action="store_true",
                    help="attack a job that opted out of authentication (the 'before')")
    a = ap.parse_args(argv)
    r = attack(a.kind, a.tries, no_auth=a.no_auth)
    r.pop("log")
    print(json.dumps(r))
    return 0 if (r["accepted"] == 0 and r["rc"] == 0 and not r["wrong"]
                 and r["job_ran_throughout"]) else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
