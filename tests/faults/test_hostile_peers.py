"""Hostile peers and exhausted resources (issue 19), against live processes: forged answers to a
local root, clients that flood or never read, connection floods at the descriptor limit, and a
scheduler fed fields of the wrong type or range. Each attack is bounded and the real job keeps
getting exact sums while it happens."""
from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest
import zmq

from byteps_like.config import load
from byteps_like.scheduler import Scheduler
from byteps_like.server import Server
from byteps_like.wire import FLAG_TABLE, Header, MsgType, Role, decode, encode, job_hash
from byteps_like.worker.runtime import Runtime

from ..native_stream import HDR, recv_exact
from ..support import wait_until
from .cluster import cluster_env, free_port
from .hostile import HostileClient, ProcCluster, proc_cpu_seconds, proc_fds, proc_rss_bytes, settle

pytestmark = pytest.mark.integration
MIB = 1 << 20


def _int_rounds(c, rounds: int, first: int = 0, n: int = 5000) -> None:
    """The real job: an int64 tensor of several partitions, exact every round."""
    size = len(c.workers)
    for r in range(first, first + rounds):
        outs = c.push_pull(lambda k: np.full(n, 10 ** 12 + 1000 * r + k, np.int64), "real.i",
                           timeout=20)
        want = np.full(n, size * (10 ** 12 + 1000 * r) + size * (size - 1) // 2, np.int64)
        for o in outs:
            assert isinstance(o, np.ndarray), o
            assert np.array_equal(o, want), (r, o[:3], want[:3])


# -- 2: forged answers to a local root -----------------------------------------------------------

def test_forged_pull_responses_and_local_messages_to_a_local_root_change_no_sum(tmp_path):
    # the data moves on the native data plane: a forged PULL_RESP on the local root's ZeroMQ
    # socket matches nothing and is dropped
    c = ProcCluster(tmp_path, machines=2, local_size=2,
                    extra={"BYTEPS_PARTITION_BYTES": "16384"})
    try:
        _int_rounds(c, 1)           # declares the real keys
        root = c.workers[0]         # machine 0's local root: its port is in the node table
        job = job_hash("default")
        keys = [key for _off, _n, key, _srv in root.tensors()["real.i"].parts]
        nbytes = [n for _off, n, _key, _srv in root.tensors()["real.i"].parts]
        stop = threading.Event()
        sent = [0]

        def flood() -> None:  # every real key, the rounds to come, as the server and rank 1
            ctx = zmq.Context()
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(c.local_root_address(0))
            msgs = []
            for rnd in range(1, 8):
                for key, n in zip(keys, nbytes):
                    msgs.append(encode(Header(MsgType.PULL_RESP, "int64", Role.SERVER, 0, 0, job,
                                              key, rnd, n // 8, n),
                                       np.full(n // 8, 4242, np.int64)))
                    for t in (MsgType.LOCAL_READY, MsgType.LOCAL_REDUCED, MsgType.LOCAL_DONE):
                        msgs.append(encode(Header(t, role=Role.WORKER, rank=1, job=job, key=key,
                                                  round=rnd)))
            try:
                while not stop.is_set():
                    for m in msgs:
                        try:
                            s.send_multipart(m, flags=zmq.NOBLOCK)
                            sent[0] += 1
                        except zmq.Again:
                            time.sleep(0.001)
            finally:
                s.close(0)
                ctx.term()
        t = threading.Thread(target=flood, daemon=True)
        t.start()
        try:
            while sent[0] < 1000:
                time.sleep(0.01)
            _int_rounds(c, 6, first=1)
        finally:
            stop.set()
            t.join(10)
        counts = root.dropped.counts
        print(f"{sent[0]} forged messages; the local root dropped {counts}")
        assert counts.get("local-reduction message from no local rank's connection", 0) > 0
        assert counts.get("local-reduction message a local root never takes", 0) > 0
        assert counts.get("answer that matches no push in flight", 0) > 0
        _int_rounds(c, 1, first=7)
    finally:
        codes = c.close()
    assert codes == [0, 0], c.log_tail()


# -- 3: clients that do not read, clients that flood ----------------------------------------------

class _PeakRss:
    """Samples the resident memory of some processes every 50 ms; the peaks."""

    def __init__(self, pids: list[int]):
        self.pids = pids
        self.peak = {p: proc_rss_bytes(p) for p in pids}
        self.base = dict(self.peak)
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            for p in self.pids:
                self.peak[p] = max(self.peak[p], proc_rss_bytes(p))

    def growth(self, pid: int) -> int:
        return self.peak[pid] - self.base[pid]

    def stop(self) -> None:
        self._stop.set()
        self._t.join(5)


def _close(c, ctx: zmq.Context, rss: _PeakRss | None) -> list:
    """A test's end: the sampler stopped, the cluster closed (its exit codes), ZeroMQ ended."""
    if rss is not None:
        rss.stop()
    codes = c.close()
    ctx.term()
    return codes


def _float_rounds(c, rounds: int, first: int, n: int = 16000) -> None:
    """A float32 tensor of one 64000-byte partition, exact every round."""
    for r in range(first, first + rounds):
        outs = c.push_pull(lambda k: np.full(n, k + 1 + r, np.float32), "real.w", timeout=20)
        for o in outs:
            assert isinstance(o, np.ndarray), o
            assert np.array_equal(o, np.full(n, 3 + 2 * r, np.float32)), o[:3]


def test_clients_that_flood_or_never_read_cost_bounded_memory(tmp_path):
    from .zmq_unread_replies import EXTRA, float_rounds, unread_clients
    c = ProcCluster(tmp_path, machines=2, extra=EXTRA)
    ctx = zmq.Context()
    try:
        float_rounds(c, 2, 0)   # and the table whose pulls are answered with 64000 bytes
        srv, sch = c.servers[0].pid, c.sched.pid
        p = c.server_peers()[0]
        server_addr = f"tcp://{p.host}:{p.port}"
        rss = _PeakRss([srv, sch])
        # 15,000 pulls of a table's rows over the server's ZeroMQ socket, never read
        (d,) = unread_clients(ctx, c, 1, 15000)
        settle(srv, 20.0)   # served
        pulled = rss.growth(srv)
        # floods of junk at the server and the scheduler, as fast as they take it
        stop = threading.Event()
        sent = {"server": 0, "scheduler": 0}

        def flood(label: str, addr: str) -> None:
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.RCVHWM, 1)
            s.connect(addr)
            junk = [b"\x01" * 4096]
            while not stop.is_set():
                try:
                    s.send_multipart(junk, flags=zmq.NOBLOCK)
                    sent[label] += 1
                except zmq.Again:
                    time.sleep(0.001)
            s.close(0)
        ts = [threading.Thread(target=flood, args=a, daemon=True)
              for a in (("server", server_addr), ("scheduler", c.scheduler_address))]
        for t in ts:
            t.start()
        try:
            _float_rounds(c, 4, 2)           # the job, meanwhile
            time.sleep(4)
            _float_rounds(c, 2, 6)
        finally:
            stop.set()
            for t in ts:
                t.join(10)
            rss.stop()
        d.close(0)
        print(f"RSS growth: server {pulled / MIB:.0f} MiB after the pull flood; junk sent "
              f"{sent}; then server {rss.growth(srv) / MIB:.0f} MiB, scheduler "
              f"{rss.growth(sch) / MIB:.0f} MiB")
        assert rss.growth(srv) < 300 * MIB, rss.growth(srv) / MIB
        assert rss.growth(sch) < 300 * MIB, rss.growth(sch) / MIB
        _float_rounds(c, 1, 8)
    finally:
        codes = c.close()
        ctx.term()
    assert codes == [0, 0], c.log_tail()
    with open(c.logs[1]) as f:   # the server counted and logged the replies it dropped
        assert "does not read" in f.read(), c.log_tail()


def _logged_count(path: str, reason: str) -> int:
    """How many times a node's Drops logged ``reason``, from its log lines."""
    n = 0
    with open(path, errors="replace") as f:
        for line in f:
            if reason in line:
                n += int(line.split(" message", 1)[0].rsplit(" ", 1)[1])
    return n


def _table_stream(p, rank: int = 0) -> socket.socket:
    """A raw table stream to a server's data port: the hello (FLAG_TABLE, process ``rank``)
    said and answered (the job has no secret)."""
    s = socket.create_connection((p.host, p.data_port), timeout=10)
    s.sendall(Header(MsgType.HELLO, "none", Role.WORKER, rank, FLAG_TABLE,
                     job_hash("default")).pack())
    assert HDR.unpack(recv_exact(s, HDR.size))[2] == MsgType.HELLO
    return s


def test_table_streams_that_never_read_are_bounded_and_closed(tmp_path):
    """Issue 29's unread-replies attack on the tables, now on the native plane: 20 table
    streams each ask 500 valid pulls of 64,000-byte answers (32 MB each) and never read. A
    stream stops being read once the answers queued for it are over its share of the server's
    32 MiB reply budget, and is closed after 10 s without taking a byte (the rest of its
    requests are never read); the server's memory stays bounded and comes back, and the job's
    rounds stay exact meanwhile. The tables' thread takes at most 8 requests of a stream at a
    time (kTableStreamBatch): taking up to 256, it answered 16 MiB a stream over a 1.5 MiB
    share, +231 to +251 MiB at the server's peak (the bound here was 250); +37 MiB since."""
    from .zmq_unread_replies import EXTRA, ROWS, float_rounds
    c = ProcCluster(tmp_path, machines=2, extra=EXTRA)
    ctx = zmq.Context()
    clients, pulls = 20, 500
    rss = None
    socks: list[socket.socket] = []
    try:
        float_rounds(c, 2, 0)   # and the table "big": 16 rows of 4,000 bytes
        srv = c.servers[0].pid
        settle(srv)
        rss = _PeakRss([srv])
        p = c.server_peers()[0]
        table = c.workers[0].sparse.tables["big"]
        ids = np.arange(ROWS, dtype=np.int64)
        pull = b"".join(bytes(memoryview(f)) for f in encode(
            Header(MsgType.SPARSE_PULL, "int64", Role.WORKER, 0, 0, job_hash("default"),
                   table.table_id, table.step, ROWS, ids.nbytes), ids))
        base = _established(p.data_port)
        for _ in range(clients):
            s = _table_stream(p)
            s.sendall(pull * pulls)   # 90 KB: in the kernel's buffers, whatever is read
            socks.append(s)
        assert wait_until(lambda: _established(p.data_port) >= base + clients, 20.0)
        _int_rounds(c, 3)   # the job meanwhile, on another tensor
        # closed by the server (without reading them here: that would be reading)
        assert wait_until(lambda: _established(p.data_port) <= base, 120.0), c.log_tail()
        peak = rss.growth(srv)
        deadline = time.monotonic() + 60   # given back once they are gone
        while proc_rss_bytes(srv) - rss.base[srv] > 64 * MIB and time.monotonic() < deadline:
            time.sleep(0.5)
        rss.stop()
        after = proc_rss_bytes(srv) - rss.base[srv]
        print(f"server RSS: +{peak / MIB:.0f} MiB at the peak under {clients} table streams "
              f"that never read, +{after / MIB:.0f} MiB after they left")
        assert peak < 100 * MIB, peak / MIB   # the budget, 20 x 8 answers, the Python
        assert after < 64 * MIB, after / MIB
        _int_rounds(c, 1, first=3)
        float_rounds(c, 1, 2)
    finally:
        for s in socks:
            s.close()
        codes = _close(c, ctx, rss)
    assert codes == [0, 0], c.log_tail()


def test_a_flood_of_table_requests_is_held_back_by_tcp_not_queued_on_the_server(tmp_path):
    """A table stream that sends embedding-table pulls faster than the server answers them
    (100 valid pulls of 2^20 ids, 8 MiB each, answered with 16 MiB; it reads every answer):
    the server stops reading the stream while its requests waiting for the tables' thread, or
    its answers waiting to be written, are over its share of the reply budget
    (csrc/dataplane_tables.h); the rest waits at the sender and in TCP. Before issue 29 the
    server took them all (+548 MiB for 60 pulls). Every pull is answered and the job's tensors
    and tables stay exact."""
    from byteps_like import _core
    from byteps_like.wire import decode_parts, split_frames

    from .zmq_unread_replies import EXTRA, float_rounds
    pulls, n, dim = 100, 1 << 20, 4
    c = ProcCluster(tmp_path, machines=2, extra=EXTRA)
    ctx = zmq.Context()
    rss = None
    cli = None
    try:
        float_rounds(c, 2, 0)
        made = c.run_all(lambda w: w.sparse.create("wide", n, dim, init="zeros"))
        assert all(not isinstance(t, BaseException) for t in made), made
        table = c.workers[0].sparse.tables["wide"]
        srv = c.servers[0].pid
        settle(srv)
        rss = _PeakRss([srv])
        ids = np.arange(n, dtype=np.int64)
        pull = encode(Header(MsgType.SPARSE_PULL, "int64", Role.WORKER, 0, 0,
                             job_hash("default"), table.table_id, table.step, n, ids.nbytes),
                      ids)
        p = c.server_peers()[0]
        cli = _core.TableClient(0, job_hash("default"), 1 << 30)
        cli.connect(0, p.host, p.data_port, 10.0)
        for _ in range(pulls):
            assert cli.send(0, *split_frames(pull))
        answers: list = []

        def read() -> None:   # every answer, as it comes
            deadline = time.monotonic() + 120
            while len(answers) < pulls and time.monotonic() < deadline:
                answers.extend(decode_parts(h, m, q, 1 << 30).header.type
                               for _s, h, m, q, _lost in cli.answers(0.5))
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        float_rounds(c, 1, 2)   # the job meanwhile: its data plane is not held
        reader.join(130)
        assert len(answers) == pulls and set(answers) == {MsgType.SPARSE_ROWS}, \
            (len(answers), set(answers), c.log_tail())
        rss.stop()
        grew = rss.growth(srv)
        print(f"server RSS: +{grew / MIB:.0f} MiB at the peak under {pulls} pulls of "
              f"{ids.nbytes >> 10} KiB")
        assert grew < 320 * MIB, grew / MIB
        got = c.run_all(lambda w: w.sparse.tables["wide"].pull(np.arange(8)))
        for g in got:
            assert isinstance(g, np.ndarray) and not g.any(), g
        float_rounds(c, 1, 3)
    finally:
        if cli is not None:
            cli.close()
        codes = _close(c, ctx, rss)
    assert codes == [0, 0], c.log_tail()


def test_many_small_tensors_in_flight_lose_no_reply_at_the_high_water_mark(tmp_path):
    """The legitimate traffic next to the bounded ZeroMQ sockets: far more partitions in flight
    than BYTEPS_SOCKET_HWM, every reply arrives (the data plane's streams do not share the
    ZeroMQ sockets' high-water mark)."""
    c = ProcCluster(tmp_path, machines=2, extra={"BYTEPS_SOCKET_HWM": "50"})
    try:
        for r in range(2):
            def many(w, r=r):
                hs = [w.push_pull_async(np.full(2, w.rank() + 10 * i + r, np.int64),
                                        name=f"small.{i}", average=False) for i in range(1500)]
                return [h.wait(30) for h in hs]
            for outs in c.run_all(many, timeout=90):
                assert isinstance(outs, list), outs
                for i, o in enumerate(outs):
                    assert np.array_equal(o, np.full(2, 1 + 20 * i + 2 * r)), (i, o)
    finally:
        codes = c.close()
    assert codes == [0, 0], c.log_tail()
    with open(c.logs[1]) as f:
        assert "dropped" not in f.read(), c.log_tail()


# -- 6: connection floods at the descriptor limit -------------------------------------------------

def _cpu_rate(pid: int, seconds: float = 3.0) -> float:
    a, t = proc_cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)
    return (proc_cpu_seconds(pid) - a) / (time.monotonic() - t)


def _idle_connections(port: int, n: int) -> list[socket.socket]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.setblocking(False)
        try:
            s.connect(("127.0.0.1", port))
        except BlockingIOError:
            pass
        socks.append(s)
    return socks


def _established(port: int) -> int:
    """Established TCP connections whose local port is ``port`` (the server's side)."""
    n = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in list(f)[1:]:
                fields = line.split()
                if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "01":
                    n += 1
    return n


def _closed(s: socket.socket) -> bool:
    """Whether the server closed a flood connection (what it sent before, e.g. ZeroMQ's
    greeting, is read and discarded)."""
    try:
        while True:
            if not s.recv(4096):
                return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def test_connection_floods_at_the_descriptor_limit_leave_the_server_idle(tmp_path):
    c = ProcCluster(tmp_path, machines=2, nofile=1024)   # as with `ulimit -n 1024`
    socks: list[socket.socket] = []
    try:
        _int_rounds(c, 1)
        srv = c.servers[0].pid
        p = c.server_peers()[0]
        assert p.data_port, "the native data plane listens next to the ZeroMQ socket"
        # 1,500 idle connections to each listening port: past both caps and the limit
        socks = _idle_connections(p.port, 1500) + _idle_connections(p.data_port, 1500)
        time.sleep(1.5)
        rate = _cpu_rate(srv)
        fds = proc_fds(srv)
        print(f"server under the flood: {rate:.3f} CPU-s/s, {fds} descriptors")
        assert fds < 1000, fds
        assert rate < 0.15, rate
        t = time.monotonic()
        _int_rounds(c, 3, first=1)
        assert time.monotonic() - t < 20
        # the excess was closed at once, not held: what stays established on the ZeroMQ port
        # is the cap (a quarter of 960 here) and the kernel's queue of unaccepted connections
        held = _established(p.port)
        closed = sum(map(_closed, socks[:1500]))
        print(f"ZeroMQ port: {held} connections established, {closed} of 1500 closed by the "
              "server")
        assert held < 600, held
    finally:
        for s in socks:
            s.close()
        codes = c.close()
    assert codes == [0, 0], c.log_tail()


# -- 11, 12: the scheduler's fields and replies ---------------------------------------------------

JOB_ID = "job-19-secret"
TAG = job_hash(JOB_ID)


def _register(meta: dict) -> list:
    base = {"role": "worker", "host": "127.0.0.1", "port": 1, "pid": 1, "worker_id": None,
            "local_rank": 0, "local_size": 1, "data_port": 0}
    return encode(Header(MsgType.REGISTER, role=Role.WORKER, job=TAG), meta={**base, **meta})


BAD_REGISTRATIONS = [
    ("local_rank >= local_size", {"local_rank": 1}, "BYTEPS_LOCAL_RANK"),
    ("negative worker_id", {"worker_id": -1}, "DMLC_WORKER_ID"),
    ("worker_id that is a bool", {"worker_id": True}, "worker_id"),
    ("port that is a string", {"port": "80"}, "port"),
    ("port out of range", {"port": 70000}, "port"),
    ("negative pid", {"pid": -5}, "pid"),
    ("host that is a number", {"host": 5}, "host"),
    ("host of 1000 characters", {"host": "h" * 1000}, "host"),
    ("role that is a list", {"role": ["worker"]}, "role"),
    ("local_size that is a float", {"local_size": 1.0}, "local_size"),
]


def test_scheduler_validates_every_field_and_its_replies_carry_no_job_id():
    port = free_port()
    env = cluster_env(port, workers=2, servers=1, BYTEPS_JOB_ID=JOB_ID)
    sched = Scheduler(load(env={**env, "DMLC_ROLE": "scheduler"}))
    sched.start()
    hc = HostileClient(sched.address)
    servers: list = []
    workers: list = []
    try:
        # 11: registrations with a field of the wrong type or range, before the real nodes
        for label, meta, names in BAD_REGISTRATIONS:
            reply = hc.send(_register(meta), True)
            assert reply is not None, label
            msg = decode(reply)
            assert msg.header.type is MsgType.ERROR, label
            assert "bad registration" in msg.meta["message"], (label, msg.meta)
            assert names in msg.meta["message"], (label, msg.meta)
            assert msg.header.job == 0, label
        assert not sched.nodes
        assert sched.rejections.counts["bad registration"] == len(BAD_REGISTRATIONS)
        # 12: another job's tag, an unregistered node, a malformed message: no job id, no tag
        for label, frames in [
                ("another job", encode(Header(MsgType.REGISTER, job=TAG ^ 1),
                                       meta={"role": "worker", "host": "x"})),
                ("unregistered", encode(Header(MsgType.HEARTBEAT, job=TAG))),
                ("malformed", [b"BPSL" + b"\x01" * 40])]:
            msg = decode(hc.send(frames, True))
            assert msg.header.type is MsgType.ERROR, label
            assert JOB_ID not in msg.meta["message"], (label, msg.meta)
            assert msg.header.job == 0, label
            if label == "another job":
                assert "another job" in msg.meta["message"]
                assert "BYTEPS_JOB_ID" in msg.meta["message"]
        # the real job registers after all that
        servers = [Server(load(env={**env, "DMLC_ROLE": "server"}))]
        st = threading.Thread(target=servers[0].run, daemon=True)
        st.start()
        workers = [Runtime(load(env={**env, "DMLC_ROLE": "worker", "DMLC_WORKER_ID": str(i)}))
                   for i in range(2)]
        ts = [threading.Thread(target=w.init, daemon=True) for w in workers]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
        assert all(w.initialized for w in workers)
        # 11: a registered node's barrier with fields of the wrong type: an ERROR, and the
        # scheduler's I/O thread goes on (a list as group killed it)
        w = workers[0]
        got: list = []
        real_handle = w.control.handle

        def capture(msg):
            if msg.header.type is MsgType.ERROR:
                got.append(msg.meta["message"])
            else:
                real_handle(msg)
        w.control.handle = capture
        bad = [{"group": [1, 2]}, {"group": {"a": 1}}, {"group": 7}, {"group": "server"}]
        for i, meta in enumerate(bad):
            w.control._send(MsgType.BARRIER, meta, key=1000 + i)
        deadline = time.monotonic() + 10
        while len(got) < len(bad) and time.monotonic() < deadline:
            time.sleep(0.02)
        w.control.handle = real_handle
        assert len(got) == len(bad), got
        assert all("group" in text for text in got), got
        assert sched.rejections.counts["bad field"] == len(bad)
        assert sched.exit_code is None
        # the job goes on: a real barrier and exact sums
        outs = [None, None]

        def step(i: int) -> None:
            wk = workers[i]
            wk.barrier(10)
            outs[i] = wk.push_pull_async(np.full(3, 10 ** 12 + i, np.int64), name="t",
                                         average=False).wait(20)
        ts = [threading.Thread(target=step, args=(i,), daemon=True) for i in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(30)
        for o in outs:
            assert np.array_equal(o, np.full(3, 2 * 10 ** 12 + 1)), outs
    finally:
        hc.close()
        ts = [threading.Thread(target=wk.shutdown, daemon=True) for wk in workers]
        for t in ts:
            t.start()
        for t in ts:
            t.join(30)
        code = sched.wait(30 if workers else 0)
        sched.close()
    assert code == 0, sched.failure
