"""A hostile test client: connects to a running scheduler or server like any peer and sends
malformed or unauthorised messages. Each case is (label, frames, expect_reply)."""
from __future__ import annotations

import os

import zmq

from byteps_like.wire import (FLAG_COMPRESSED, FLAG_DECLARE, Header, MsgType, Role, encode,
                              job_hash)

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
        ("unknown message type", [bytes(b"BPSL\x01\xee") + Header(MsgType.PULL).pack()[6:]],
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
        ("unknown message type", [bytes(b"BPSL\x01\x77") + Header(MsgType.PULL).pack()[6:]],
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
