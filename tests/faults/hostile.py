"""A hostile test client: connects to a running scheduler or server like any peer and sends
malformed or unauthorised messages. Each case is (label, frames, expect_reply)."""
from __future__ import annotations

import os
import time

import zmq

from byteps_like.wire import FLAG_COMPRESSED, FLAG_DECLARE, Header, MsgType, Role, encode, job_hash

from ..native_stream import recv_exact
from .cluster import WorkerGroup

JOB = job_hash("default")


def _push(key, count=1, dtype="float32", rank=0, rnd=0, job=JOB, flags=0, meta=None, payload=None,
          itemsize=4):
    nbytes = count * itemsize
    h = Header(MsgType.PUSH, dtype, Role.WORKER, rank, flags, job, key, rnd, count, nbytes)
    return encode(h, payload if payload is not None else b"\0" * nbytes, meta)


def _compressed(key, spec, count=1000, payload=None, declare=True):
    """A push that says its payload is compressed (FLAG_COMPRESSED, uint8)."""
    payload = payload if payload is not None else b"\0" * 64
    meta = {"name": f"evil.{key}", "shape": [count], "dtype": "float32", "part": 0, "nparts": 1,
            "compressor": spec, "count": count} if declare else None
    flags = FLAG_COMPRESSED | (FLAG_DECLARE if declare else 0)
    h = Header(MsgType.PUSH, "uint8", Role.WORKER, 0, flags, JOB, key, 0, len(payload),
               len(payload))
    return encode(h, payload, meta)


def server_cases(real_key: int, max_message_bytes: int) -> list[tuple[str, list, bool]]:
    """Every kind of hostile input of issue 8, against a server that serves ``real_key``."""
    return [
        ("random bytes", [os.urandom(61)], True),
        ("random multipart", [os.urandom(7), os.urandom(300), os.urandom(2)], True),
        ("truncated header", [Header(MsgType.PUSH, "float32").pack()[:20]], True),
        ("empty frame", [b""], True),
        ("wrong magic", [b"XXXX" + Header(MsgType.PUSH, "float32").pack()[4:], b"\0" * 0], True),
        ("wrong version", [b"BPSL\x63" + Header(MsgType.PULL).pack()[5:]], True),
        ("length disagrees with count",
         [Header(MsgType.PUSH, "float32", Role.WORKER, 0, 0, JOB, 1, 0, 1000, 4000).pack(),
          b"abc"], True),
        ("payload longer than header says",
         [Header(MsgType.PUSH, "float32", Role.WORKER, 0, 0, JOB, 1, 0, 1, 4).pack(),
          b"\0" * 40], True),
        ("missing payload frame",
         [Header(MsgType.PUSH, "float32", Role.WORKER, 0, 0, JOB, 1, 0, 1, 4).pack()], True),
        ("meta that is not JSON",
         [Header(MsgType.PULL, flags=1, job=JOB, key=1).pack(), b"\xff{not json"], True),
        ("unknown message type", [b"BPSL\x01\xee" + Header(MsgType.PULL).pack()[6:]],
         True),
        ("control type sent to a server", encode(Header(MsgType.REGISTER, job=JOB, rank=0),
                                                 meta={"role": "worker"}), True),
        ("rank outside the job", _push(1, rank=99), True),
        ("another job's tag", _push(1, job=JOB ^ 1), True),
        ("push of an undeclared key", _push(987654), True),
        ("pull of an undeclared key", encode(Header(MsgType.PULL, "none", Role.WORKER, 0, 0, JOB,
                                                    987655, 0)), True),
        ("declared key, non-summable dtype", _push(987656, dtype="uint8", itemsize=1,
                                                   flags=FLAG_DECLARE, meta={"name": "evil"}),
         True),
        ("wrong dtype for the real key", _push(real_key, count=3, dtype="int64", itemsize=8),
         True),
        ("push for a future round of the real key", _push(real_key, rnd=10 ** 6), True),
        # compressed pushes: the declaration's compressor spec and every payload are untrusted
        ("compressed push, invalid spec", _compressed(987660, {"name": "topk", "k": -1}), True),
        ("compressed push, unknown compressor", _compressed(987661, {"name": "pickle"}), True),
        ("compressed push, spec that is not an object", _compressed(987662, "onebit"), True),
        ("compressed push, absurd element count",
         _compressed(987663, {"name": "onebit", "scaling": True}, count=1 << 60), True),
        ("compressed push, garbage payload",
         _compressed(987664, {"name": "topk", "k": 3}, payload=os.urandom(44)), True),
        ("compressed push to an uncompressed key", _compressed(real_key, {"name": "onebit"},
                                                              declare=False), True),
        # ZMQ_MAXMSGSIZE: ZeroMQ drops the frame (and the connection) before buffering it
        ("oversized frame", [os.urandom(max_message_bytes + 1)], False),
    ]


def scheduler_cases() -> list[tuple[str, list, bool]]:
    return [
        ("random bytes", [os.urandom(50)], True),
        ("truncated header", [Header(MsgType.REGISTER).pack()[:9]], True),
        ("wrong magic", [b"NOPE" + Header(MsgType.REGISTER).pack()[4:]], True),
        ("unknown message type", [b"BPSL\x01\x77" + Header(MsgType.PULL).pack()[6:]],
         True),
        ("heartbeat from an unregistered node", encode(Header(MsgType.HEARTBEAT, job=JOB)), True),
        ("barrier from an unregistered node", encode(Header(MsgType.BARRIER, job=JOB),
                                                     meta={"group": "all"}), True),
        ("stall report from an unregistered node", encode(Header(MsgType.STALL, job=JOB),
                                                          meta={"stalls": []}), True),
        ("registration after the job is complete",
         encode(Header(MsgType.REGISTER, job=JOB), meta={"role": "worker", "host": "evil",
                                                         "port": 1, "pid": 1}), True),
        ("registration with garbage fields",
         encode(Header(MsgType.REGISTER, job=JOB), meta={"role": "emperor"}), True),
        ("another job's tag", encode(Header(MsgType.REGISTER, job=JOB ^ 7),
                                     meta={"role": "worker", "host": "x"}), True),
    ]


class HostileClient:
    def __init__(self, address: str, *, ctx: zmq.Context | None = None, timeout_ms: int = 3000,
                 curve: tuple[bytes, bytes, bytes] | None = None):
        self.ctx = ctx or zmq.Context.instance()
        self.address = address
        self.timeout_ms = timeout_ms
        self.curve = curve
        self.sock = self._connect()

    def _connect(self) -> zmq.Socket:
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVTIMEO, self.timeout_ms)
        if self.curve is not None:
            server_pub, pub, sec = self.curve
            s.curve_serverkey, s.curve_publickey, s.curve_secretkey = server_pub, pub, sec
        s.connect(self.address)
        return s

    def send(self, frames: list, expect_reply: bool) -> list | None:
        """Send one message; the reply frames, or None when nothing came back in time."""
        try:
            self.sock.send_multipart(frames, flags=zmq.DONTWAIT)
        except zmq.Again:  # no connection was ever accepted (e.g. an authentication failure)
            return None
        if self.sock.poll(self.timeout_ms if expect_reply else 500, zmq.POLLIN):
            return self.sock.recv_multipart()
        else:
            if not expect_reply:  # the connection was dropped by ZeroMQ: reconnect
                self.sock.close(0)
                self.sock = self._connect()
            return None

    def close(self) -> None:
        self.sock.close(0)


# ---- server-side resource attacks (issue 19; tests/faults/test_hostile_server.py) -------------

def topk_payload(n: int, k: int = 1, step: int = 0) -> bytes:
    """A well-formed top-k payload (byteps_like/compression.py) of ``n`` elements: the header
    and k (index, value) pairs; 28 bytes for k = 1."""
    import struct
    head = struct.pack("<2sBBIQI", b"BC", 1, 2, n & 0xFFFFFFFF, step, k)
    return head + struct.pack(f"<{k}I", *range(k)) + struct.pack(f"<{k}f", *([1.0] * k))


def onebit_payload(n: int, step: int = 0) -> bytes:
    """A well-formed onebit payload of ``n`` elements (n / 8 bytes of signs)."""
    import struct
    return struct.pack("<2sBBIQf", b"BC", 1, 1, n, step, 1.0) + b"\x55" * ((n + 7) // 8)


def compressed_push(key: int, spec: dict, count: int, payload: bytes, *, dtype: str = "float32",
                    rnd: int = 0, rank: int = 0, job: int = JOB, declare: bool = True) -> list:
    """A compressed push that declares ``count`` elements of ``dtype`` (a worker's declaration
    of one partition)."""
    meta = ({"name": f"evil.{key}", "shape": [count], "dtype": dtype, "part": 0, "nparts": 1,
             "compressor": spec, "count": count} if declare else None)
    flags = FLAG_COMPRESSED | (FLAG_DECLARE if declare else 0)
    h = Header(MsgType.PUSH, "uint8", Role.WORKER, rank, flags, job, key, rnd, len(payload),
               len(payload))
    return encode(h, payload, meta)


def pull(key: int, rnd: int = 0, rank: int = 0, job: int = JOB) -> list:
    return encode(Header(MsgType.PULL, "none", Role.WORKER, rank, 0, job, key, rnd))


def declared_push(key: int, count: int, *, dtype: str = "float32", itemsize: int = 4,
                  rnd: int = 0, rank: int = 0, meta: dict | None = None) -> list:
    """A push that declares an uncompressed key (ZeroMQ path)."""
    meta = meta if meta is not None else {"name": f"evil.{key}", "shape": [count],
                                          "dtype": dtype, "part": 0, "nparts": 1}
    return _push(key, count=count, dtype=dtype, itemsize=itemsize, rank=rank, rnd=rnd,
                 flags=FLAG_DECLARE, meta=meta)


def send_burst(client: HostileClient, messages: list, window: int = 500,
               keep: bool = True) -> list:
    """Send many messages, ``window`` at a time, and collect one reply per message (the decoded
    replies in arrival order; with ``keep=False`` only their types, to hold little memory).
    Fails when a reply does not come within the client's timeout."""
    from byteps_like.wire import decode
    out: list = []
    for i in range(0, len(messages), window):
        chunk = messages[i:i + window]
        for frames in chunk:
            client.sock.send_multipart(frames)
        for _ in chunk:
            if not client.sock.poll(client.timeout_ms, zmq.POLLIN):
                raise AssertionError(f"no reply after {len(out)} of {len(messages)} messages")
            msg = decode(client.sock.recv_multipart())
            out.append(msg if keep else msg.header.type)
    return out


def rss_bytes(pid: int | None = None) -> int:
    """Resident memory of a process (default: this one) from /proc/<pid>/status."""
    with open(f"/proc/{pid or 'self'}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/status")


# raw streams of the native data plane (byteps_like/wire.py header; tests/native_stream.py)
NATIVE_PUSH, NATIVE_PULL, NATIVE_HELLO, NATIVE_ERROR = 20, 22, 24, 30


def native_msg(mtype: int, rank: int, job: int, key: int = 0, rnd: int = 0, dtype: int = 0,
               count: int = 0, nbytes: int = 0, flags: int = 0, meta: bytes = b"",
               payload: bytes = b"") -> bytes:
    import struct

    from ..native_stream import HDR
    head = HDR.pack(b"BPSL", 1, mtype, dtype, 2, rank, flags | (1 if meta else 0), job, key,
                    rnd, count, nbytes)
    return head + (struct.pack("<I", len(meta)) + meta if meta else b"") + payload


def native_stream(port: int, job: int, rank: int = 0):
    """A stream that said hello as worker ``rank`` of the job."""
    import socket

    from ..native_stream import HDR
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(native_msg(NATIVE_HELLO, rank, job))
    reply = recv_exact(s, HDR.size)
    assert HDR.unpack(reply)[2] == NATIVE_HELLO, reply
    return s


def native_reply(s) -> tuple:
    """The next message on a native stream: (header fields, meta JSON or None, payload)."""
    import json
    import struct

    from ..native_stream import HDR
    h = HDR.unpack(recv_exact(s, HDR.size))
    meta = None
    if h[6] & 1:
        (n,) = struct.unpack("<I", recv_exact(s, 4))
        meta = json.loads(recv_exact(s, n))
    payload = recv_exact(s, h[11]) if h[2] != NATIVE_ERROR and h[11] else b""
    return h, meta, payload


# -- live processes (issue 19): the scheduler and servers as processes of their own, so that
# -- their memory and CPU time can be measured while hostile peers work on them ---------------

def proc_cpu_seconds(pid: int) -> float:
    """User plus system CPU time of process ``pid`` so far (/proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_rss_bytes(pid: int) -> int:
    """Resident memory of process ``pid`` (VmRSS)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def settle(pid: int, most: float = 60.0) -> None:
    """Wait until process ``pid`` is idle (under 5% of a CPU over half a second), at most
    ``most`` seconds."""
    deadline = time.monotonic() + most
    last = proc_cpu_seconds(pid)
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = proc_cpu_seconds(pid)
        if now - last < 0.025:
            return
        last = now


def proc_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def spawn_role(role: str, env: dict, log_path: str, *, nofile: int | None = None):
    """``python -m byteps_like.<role>`` with ``env`` added to this environment, its output in
    ``log_path``; ``nofile`` limits its descriptors (``ulimit -n``)."""
    import resource
    import subprocess
    import sys

    def limit() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
    out = open(log_path, "ab")
    try:
        return subprocess.Popen([sys.executable, "-m", f"byteps_like.{role}"],
                                env={**os.environ, **env, "DMLC_ROLE": role}, stdout=out,
                                stderr=subprocess.STDOUT, preexec_fn=limit,
                                start_new_session=True)
    finally:
        out.close()


class ProcCluster(WorkerGroup):
    """A job of ``machines`` worker machines with ``local_size`` worker processes each (the
    workers are Runtimes in this process; several local ranks reduce through shared memory
    and the local root's socket as with bpslaunch --local-size), and a scheduler and
    ``servers`` servers as processes."""

    def __init__(self, tmp_path, *, machines: int = 2, local_size: int = 1, servers: int = 1,
                 nofile: int | None = None, extra: dict | None = None):
        import threading

        from byteps_like.config import load
        from byteps_like.worker.runtime import Runtime

        from .cluster import cluster_env, free_port
        self.port = free_port()
        self.env = cluster_env(self.port, workers=machines, servers=servers,
                               BYTEPS_LOCAL_SIZE=str(local_size), **(extra or {}))
        self.logs = [str(tmp_path / "scheduler.log")]
        self.sched = spawn_role("scheduler", self.env, self.logs[0])
        self.servers = []
        for i in range(servers):
            self.logs.append(str(tmp_path / f"server{i}.log"))
            self.servers.append(spawn_role("server", self.env, self.logs[-1], nofile=nofile))
        self.workers = [Runtime(load(env={**self.env, "DMLC_ROLE": "worker",
                                          "DMLC_WORKER_ID": str(m),
                                          "BYTEPS_LOCAL_RANK": str(lr)}))
                        for m in range(machines) for lr in range(local_size)]
        self._threading = threading
        outs = self.run_all(lambda w: w.init())
        if not all(w.initialized for w in self.workers):
            self.kill()
            raise RuntimeError(f"the job did not start: {outs}\n{self.log_tail()}")

    @property
    def scheduler_address(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def server_peers(self) -> list:
        """The servers of the node table (host, port, data_port), by rank."""
        return sorted((p for p in self.workers[0].control.peers if p.role == "server"),
                      key=lambda p: p.rank)

    def local_root_address(self, machine: int = 0) -> str:
        """The published address of a machine's local root (several local ranks)."""
        ls = self.workers[0].local_size_
        root = next(p for p in self.workers[0].control.peers
                    if p.role == "worker" and p.rank == machine * ls)
        return f"tcp://{root.host}:{root.port}"

    def log_tail(self, n: int = 3000) -> str:
        parts = []
        for path in self.logs:
            try:
                with open(path, errors="replace") as f:
                    parts.append(f"--- {os.path.basename(path)} ---\n{f.read()[-n:]}")
            except OSError:
                pass
        return "\n".join(parts)

    def kill(self) -> None:
        import signal
        for p in [self.sched, *self.servers]:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()

    def close(self) -> list[int | None]:
        """Shut the workers down and wait for the scheduler and servers; their exit codes."""
        import subprocess
        ts = [self._threading.Thread(target=w.shutdown, daemon=True) for w in self.workers]
        for t in ts:
            t.start()
        for t in ts:
            t.join(30)
        codes = []
        for p in [self.sched, *self.servers]:
            try:
                codes.append(p.wait(30))
            except subprocess.TimeoutExpired:
                codes.append(None)
        self.kill()
        return codes
