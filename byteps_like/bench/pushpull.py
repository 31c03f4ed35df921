"""push_pull bandwidth of byteps_like against raw pyzmq and torch.distributed (gloo).

``python -m byteps_like.bench pushpull [--workers 2] [--servers 2] [--sizes 1M,4M,16M,64M,256M]``
runs, in one invocation and on loopback, three measurements of the same traffic:

1. byteps_like: a real local job (scheduler, M servers, N worker processes); each worker
   push_pulls one float32 tensor of each size (``average=False``, into a preallocated ``out``).
2. raw pyzmq: N client and M echo-server processes with plain DEALER/ROUTER sockets; each client
   sends its tensor cut into the same partitions, to the same servers byteps_like would pick,
   zero-copy, and every server echoes each partition straight back; the client copies each echoed
   partition into its output array (the copy any consumer of the result needs). No summation.
3. torch.distributed ``all_reduce`` over gloo with N processes (unless ``--skip-gloo``).

With ``--transport zmq,ucx`` the byteps_like job runs once per transport, and UCX's own ceiling
is measured with the wheel's ``ucx_perftest -t tag_bw`` (one server/client pair per run, a fresh
free port each, the client started only once the server is seen listening, hard time limits,
both process groups killed afterwards); if it cannot run, the table says "ceiling unavailable:
<reason>" and the benchmark carries on.

Every timed repetition starts after a barrier of the N workers; its time is the slowest worker's,
and the table shows the median over repetitions. Algorithm bandwidth = tensor bytes / time.
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable, Sequence

from .harness import (
    Case,
    ChildFailed,
    Job,
    base_env,
    collect,
    decode_cases,
    encode_cases,
    free_port,
    free_ports,
    local_job,
    summarize,
)
from .report import (
    OthersMeter,
    emit,
    end_torch_distributed,
    exit_on_signals,
    fmt_size,
    machine_info,
    markdown_table,
    noisy_note,
    num,
    print_before_start,
    progress,
    report_header,
    size_arg,
    size_list,
)
from .servercpu import CpuSampler, core_seconds_per_gb, server_pids
from .shapes import MODELS, shapes_worker, summarize_shapes

PROG = "python -m byteps_like.bench pushpull"
DEFAULT_SIZES = "1M,4M,16M,64M,256M"
DEFAULT_QUEUE_DEPTH = 64  # BYTEPS_PIPELINE_QUEUE_DEPTH's default
LARGE_BYTES = 128 << 20   # sizes from here on run at most --large-repeats repetitions


# ---------------------------------------------------------------------------------------------
# Worker entry points (run in child processes: python -m byteps_like.bench.pushpull --_worker ..)
# ---------------------------------------------------------------------------------------------

def _bps_worker(cases: list[Case]) -> int:
    import numpy as np

    import byteps_like as bps
    from byteps_like.worker.runtime import default_runtime
    bps.init()
    rank, n = bps.rank(), bps.size()
    expect = n * (n + 1) / 2
    asynchronous = default_runtime().config.server.enable_async
    out_times: dict[str, list[float]] = {}
    windows: dict[str, list[tuple[float, float]]] = {}  # the servers' CPU window (servercpu)
    for case in cases:
        arr = np.full(case.nbytes // 4, rank + 1, dtype=np.float32)
        out = np.empty_like(arr)
        name = f"bench.pushpull.{case.nbytes}"
        for _ in range(case.warmup):
            bps.barrier()
            bps.push_pull(arr, name=name, average=False, out=out)
        times = []
        spans = windows[str(case.nbytes)] = []
        for _ in range(case.repeats):
            out.fill(0)  # untimed: the result of the timed round must be its own
            bps.barrier()
            m0, t0 = time.monotonic(), time.perf_counter()
            bps.push_pull(arr, name=name, average=False, out=out)
            times.append(time.perf_counter() - t0)
            spans.append((m0, time.monotonic()))
        if case.repeats and asynchronous:
            # asynchronous mode (BYTEPS_ENABLE_ASYNC): the server adds every push to the value,
            # so once every worker has pushed, a push of zeros pulls all of them
            bps.barrier()
            bps.push_pull(np.zeros_like(arr), name=name, average=False, out=out)
            want = expect * (case.warmup + case.repeats)
        else:
            want = expect
        if case.repeats and not (out == want).all():
            bad = int(np.flatnonzero(out != want)[0])
            raise AssertionError(f"worker {rank}: wrong push_pull result for {name}: "
                                 f"out[{bad}] = {out[bad]}, expected {want}")
        out_times[str(case.nbytes)] = times
        if rank == 0:
            progress(f"{fmt_size(case.nbytes)}: median {statistics.median(times) * 1e3:.1f} ms "
                      f"on worker 0 ({case.repeats} repeats)" if times else
                      f"{fmt_size(case.nbytes)}: done")
        del arr, out
    bps.shutdown()
    emit({"rank": rank, "times": out_times, "windows": windows})
    return 0


def _plan_raw(cases: list[Case], partition_bytes: int, num_servers: int) -> list[list]:
    """The (offset, nbytes, server) partitions of each case, exactly as byteps_like cuts the
    tensors and assigns them to servers when they are declared in this order."""
    from ..partition import ServerAssigner, make_key, partition_bounds
    assigner = ServerAssigner(num_servers)
    plans = []
    for decl_id, case in enumerate(cases):
        parts = []
        for part, (off, n) in enumerate(partition_bounds(case.nbytes, 4, partition_bytes)):
            parts.append((off, n, assigner.assign(make_key(decl_id, part), n)))
        plans.append(parts)
    return plans


class _ZmqBarrier:
    """N processes: rank 0 binds a ROUTER, the others connect DEALERs and wait for its go."""

    def __init__(self, ctx, rank: int, size: int, port: int):
        import zmq
        self.rank, self.size = rank, size
        if rank == 0:
            self.sock = ctx.socket(zmq.ROUTER)
            self.sock.bind(f"tcp://127.0.0.1:{port}")
        else:
            self.sock = ctx.socket(zmq.DEALER)
            self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.sock.setsockopt(zmq.LINGER, 1000)

    def wait(self, timeout_ms: int = 600_000) -> None:
        if self.size == 1:
            return
        if self.rank == 0:
            idents: list[bytes] = []
            while len(idents) < self.size - 1:
                if not self.sock.poll(timeout_ms):
                    raise TimeoutError("raw barrier: a client did not arrive")
                ident, _ = self.sock.recv_multipart()
                idents.append(ident)
            for ident in idents:
                self.sock.send_multipart([ident, b"G"])
        else:
            self.sock.send(b"B")
            if not self.sock.poll(timeout_ms):
                raise TimeoutError("raw barrier: no go from client 0")
            self.sock.recv()

    def close(self) -> None:
        self.sock.close()


def _raw_client(cases: list[Case], rank: int, nworkers: int, server_ports: list[int],
                barrier_port: int, partition_bytes: int, window: int) -> int:
    import struct

    import numpy as np
    import zmq
    ctx = zmq.Context()
    socks = []
    for port in server_ports:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.SNDHWM, 0)
        s.setsockopt(zmq.RCVHWM, 0)
        s.setsockopt(zmq.LINGER, 1000)
        s.connect(f"tcp://127.0.0.1:{port}")
        socks.append(s)
    poller = zmq.Poller()
    for s in socks:
        poller.register(s, zmq.POLLIN)
    barrier = _ZmqBarrier(ctx, rank, nworkers, barrier_port)
    plans = _plan_raw(cases, partition_bytes, len(socks))
    pack = struct.Struct("<Q")
    out_times: dict[str, list[float]] = {}

    def one_round(src: memoryview, dst, parts: list) -> None:
        # at most `window` partitions out at a time (0: all at once), like byteps_like's credit
        nxt, left = 0, len(parts)
        limit = window or len(parts)
        while left:
            while nxt < len(parts) and nxt - (len(parts) - left) < limit:
                off, n, srv = parts[nxt]
                socks[srv].send(pack.pack(nxt), zmq.SNDMORE)
                socks[srv].send(src[off:off + n], copy=n < 65536)
                nxt += 1
            events = poller.poll(600_000)
            if not events:
                raise TimeoutError(f"raw client {rank}: no echo within 600 s")
            for sock, _ev in events:
                while left:
                    try:
                        hdr, payload = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    off, n, _srv = parts[pack.unpack(hdr.bytes)[0]]
                    dst[off:off + n] = np.frombuffer(payload.buffer, dtype=np.uint8)
                    left -= 1

    try:
        for case, parts in zip(cases, plans):
            arr = np.full(case.nbytes // 4, rank + 1, dtype=np.float32)
            out = np.empty_like(arr)
            src = memoryview(arr.view(np.uint8).data)
            dst = out.view(np.uint8)
            for _ in range(case.warmup):
                barrier.wait()
                one_round(src, dst, parts)
            times = []
            for _ in range(case.repeats):
                out.fill(0)
                barrier.wait()
                t0 = time.perf_counter()
                one_round(src, dst, parts)
                times.append(time.perf_counter() - t0)
            if case.repeats and not np.array_equal(out, arr):
                raise AssertionError(f"raw client {rank}: echoed data differs ({case.nbytes} B)")
            out_times[str(case.nbytes)] = times
            if rank == 0 and times:
                progress(f"{fmt_size(case.nbytes)}: median "
                          f"{statistics.median(times) * 1e3:.1f} ms on client 0")
            del src, arr, out, dst
        barrier.wait()
        for s in socks:
            s.send(b"Q")
    finally:
        barrier.close()
        for s in socks:
            s.close()
        ctx.term()
    emit({"rank": rank, "times": out_times})
    return 0


def _raw_server(port: int, nclients: int) -> int:
    import zmq
    ctx = zmq.Context()
    s = ctx.socket(zmq.ROUTER)
    s.setsockopt(zmq.SNDHWM, 0)
    s.setsockopt(zmq.RCVHWM, 0)
    s.setsockopt(zmq.LINGER, 1000)
    s.bind(f"tcp://127.0.0.1:{port}")
    done = 0
    try:
        while done < nclients:
            frames = s.recv_multipart(copy=False)
            if len(frames) == 2:   # [ident, b"Q"]: that client has finished
                done += 1
                continue
            s.send_multipart(frames, copy=False)
    finally:
        s.close()
        ctx.term()
    return 0


def _gloo_worker(cases: list[Case], rank: int, world: int, port: int) -> int:
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    expect = world * (world + 1) / 2
    out_times: dict[str, list[float]] = {}
    try:
        for case in cases:
            t = torch.empty(case.nbytes // 4, dtype=torch.float32)
            for _ in range(case.warmup):
                t.fill_(rank + 1)
                dist.barrier()
                dist.all_reduce(t)
            times = []
            for _ in range(case.repeats):
                t.fill_(rank + 1)
                dist.barrier()
                t0 = time.perf_counter()
                dist.all_reduce(t)
                times.append(time.perf_counter() - t0)
            if case.repeats and not bool((t == expect).all()):
                raise AssertionError(f"gloo rank {rank}: wrong all_reduce result")
            out_times[str(case.nbytes)] = times
            if rank == 0 and times:
                progress(f"{fmt_size(case.nbytes)}: median "
                          f"{statistics.median(times) * 1e3:.1f} ms on rank 0")
            del t
    except BaseException:
        dist.destroy_process_group()
        raise
    end_torch_distributed(dist, {"rank": rank, "times": out_times})


def _worker_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog=f"{PROG} --_worker")
    p.add_argument("kind", choices=("bps", "raw-client", "raw-server", "gloo", "shapes"))
    p.add_argument("--model", default="resnet50")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--cases", default="")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--server-ports", default="")
    p.add_argument("--partition-bytes", type=int, default=4096000)
    p.add_argument("--window", type=int, default=0)
    a = p.parse_args(argv)
    if a.kind == "shapes":
        emit(shapes_worker(a.model, a.repeats, a.warmup))
        return 0
    cases = decode_cases(a.cases)
    if a.kind == "bps":
        return _bps_worker(cases)
    if a.kind == "raw-client":
        return _raw_client(cases, a.rank, a.world, [int(x) for x in a.server_ports.split(",")],
                           a.port, a.partition_bytes, a.window)
    if a.kind == "raw-server":
        return _raw_server(a.port, a.world)
    return _gloo_worker(cases, a.rank, a.world, a.port)


# ---------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------

def _worker_argv(kind: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "byteps_like.bench.pushpull", "--_worker", kind, *extra]


def _transport_env(transport: str) -> dict[str, str]:
    """BYTEPS_TRANSPORT, and for UCX loopback TCP unless the user chose UCX_TLS/NET_DEVICES."""
    env = {"BYTEPS_TRANSPORT": transport}
    if transport == "ucx":
        base = base_env()
        env["UCX_TLS"] = base.get("UCX_TLS", "tcp")
        env["UCX_NET_DEVICES"] = base.get("UCX_NET_DEVICES", "lo")
        env["UCX_WARN_UNUSED_ENV_VARS"] = "n"
    return env


def ucx_perftest_path() -> str | None:
    spec = importlib.util.find_spec("libucx")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "bin", "ucx_perftest")
    return path if os.access(path, os.X_OK) else None


def ucx_perftest_env() -> dict[str, str]:
    """The environment ucx_perftest runs in: the benchmark's UCX settings, and the wheel's
    ``libucx/lib`` first on LD_LIBRARY_PATH. The binary's RPATH only names
    ``libucx_cu12.libs`` (its libgomp); libucp/libuct/libucs, which Python finds through
    ``libucx.load_library()``, a bare ``ucx_perftest`` cannot find without it."""
    env = {**base_env(), **_transport_env("ucx")}
    exe = ucx_perftest_path()
    if exe is not None:
        lib = os.path.join(os.path.dirname(os.path.dirname(exe)), "lib")
        old = env.get("LD_LIBRARY_PATH", "")
        env["LD_LIBRARY_PATH"] = lib + (os.pathsep + old if old else "")
    return env


def _listening(pid: int, port: int) -> bool:
    """Whether process ``pid`` holds a TCP socket listening on ``port`` (Linux /proc). Looking
    beats probing: ucx_perftest's server accepts exactly one connection, so a test connect()
    would use it up, and a connect() to a port someone else took would prove nothing."""
    try:
        inodes = set()
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
        for table in ("tcp", "tcp6"):
            try:
                with open(f"/proc/{pid}/net/{table}", encoding="ascii") as f:
                    next(f)
                    for line in f:
                        cols = line.split()
                        # local_address is HEX_IP:HEX_PORT; state 0A is LISTEN; col 9 the inode
                        if (cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port
                                and cols[9] in inodes):
                            return True
            except FileNotFoundError:
                continue
    except OSError:
        return False
    return False


PERFTEST_LISTEN_TIMEOUT = 10.0   # seconds a ucx_perftest server may take to listen
PERFTEST_MIN_MBPS = 10.0         # a run's time limit assumes at least this rate (MB/s) ...
PERFTEST_RUN_SLACK = 30.0        # ... plus this much start-up and wire-up time


def _perftest_once(exe: str, env: dict[str, str], nbytes: int, iters: int, warmup: int,
                   deadline: float) -> float:
    """One ``ucx_perftest -t tag_bw`` run between a fresh server and client on loopback; the
    overall bandwidth of its "Final:" line in GB/s (1e9 B).

    The server gets a port free a moment ago; the client starts only once the server is seen
    listening on it (a server that exits first, e.g. because the port was taken meanwhile, gets
    a new port, 3 attempts). Both run in their own sessions with stdin from /dev/null and
    their output read as it comes (no pipe to fill); the run has a hard time limit, and
    leaving the Job kills both process groups whatever happened."""
    limit = PERFTEST_RUN_SLACK + nbytes * (iters + warmup) / (PERFTEST_MIN_MBPS * 1e6)
    for attempt in range(3):
        with Job(f"ucx_perftest-{fmt_size(nbytes)}") as pg:
            port = free_port()
            srv = pg.spawn("server", [exe, "-p", str(port)], env, service=True)
            listen_by = min(deadline, time.monotonic() + PERFTEST_LISTEN_TIMEOUT)
            while not _listening(srv.pid, port):
                if srv.poll() is not None:
                    break
                if time.monotonic() > listen_by:
                    raise ChildFailed(f"the ucx_perftest server did not listen on port {port} "
                                      f"within {PERFTEST_LISTEN_TIMEOUT:g} s; its stderr: "
                                      f"{srv.stderr_tail(600).strip() or '(empty)'}")
                time.sleep(0.02)
            if srv.poll() is not None:
                why = (f"the ucx_perftest server exited with status {srv.poll()} "
                       f"before listening on port {port}: "
                       f"{srv.stderr_tail(600).strip() or '(no output)'}")
                if attempt < 2 and "error while loading shared libraries" not in why:
                    continue   # most likely the port was taken meanwhile: a new one
                raise ChildFailed(why)
            cli = pg.spawn("client", [exe, "127.0.0.1", "-p", str(port), "-t", "tag_bw",
                                      "-s", str(nbytes), "-n", str(iters), "-w", str(warmup)],
                           env)
            left = deadline - time.monotonic()
            if left <= 0:
                raise ChildFailed("the ucx_perftest phase ran out of time (--timeout)")
            pg.wait(min(limit, left), service_grace=5.0)
            final = [ln for ln in cli.stdout().splitlines() if ln.startswith("Final:")]
            if not final:
                raise ChildFailed("ucx_perftest printed no 'Final:' line; its output: "
                                  f"{cli.stdout()[-600:]}{cli.stderr_tail(600)}".strip())
            # Final: iters, overhead 50%ile/avg/overall (us), bandwidth avg/overall (MB/s), ...
            return float(final[0].split()[6]) * 1e6 / 1e9
    raise AssertionError("unreachable")


def run_ucx_perftest(cases: list[Case], timeout: float, runs: int = 3
                     ) -> tuple[dict[int, float], str | None]:
    """UCX's own ceiling: ``ucx_perftest -t tag_bw`` between two processes on loopback, per
    size; GB/s (1e9 B) of the "Final" overall bandwidth, median of ``runs`` runs.

    Never raises for a perftest problem: returns what it measured and, if something went wrong,
    why the rest is missing (the benchmark then says "ceiling unavailable: <reason>")."""
    exe = ucx_perftest_path()
    if exe is None:
        return {}, "ucx_perftest not found (pip install 'byteps_like[ucx]')"
    if not os.path.isdir("/proc/self/net"):
        return {}, "needs Linux /proc to see when the ucx_perftest server listens"
    env = ucx_perftest_env()
    deadline = time.monotonic() + timeout
    out: dict[int, float] = {}
    for case in cases:
        iters = max(5, min(200, (256 << 20) // case.nbytes))
        warmup = max(1, iters // 10)
        got = []
        try:
            for _ in range(runs):
                got.append(_perftest_once(exe, env, case.nbytes, iters, warmup, deadline))
        except ChildFailed as exc:
            reason = " ".join(str(exc).split())
            return out, (f"{fmt_size(case.nbytes)}: {reason[:400]}"
                         + ("..." if len(reason) > 400 else ""))
        out[case.nbytes] = statistics.median(got)
    return out, None


def format_transports(rows: list[dict], ceiling: dict[int, float] | None) -> str:
    cols = ("size", "zmq GB/s", "ucx GB/s", "ucx/zmq", "ucx_perftest GB/s", "ucx/perftest")
    cells = []
    for r in rows:
        z = r["transports"].get("zmq")
        u = r["transports"].get("ucx")
        c = (ceiling or {}).get(r["nbytes"])
        cells.append((fmt_size(r["nbytes"]), num(z and z["gbps"], ".3f"),
                      num(u and u["gbps"], ".3f"),
                      num(u["gbps"] / z["gbps"] if u and z else None, ".2f"), num(c, ".3f"),
                      num(u["gbps"] / c if u and c else None, ".2f")))
    return markdown_table(cols, cells)


def run_bps(cases: list[Case], workers: int, servers: int, partition_bytes: int,
            timeout: float, queue_depth: int | None = None, transport: str | None = None
            ) -> list[dict]:
    env = base_env()
    if transport is not None:
        env.update(_transport_env(transport))
    env["BYTEPS_PARTITION_BYTES"] = str(partition_bytes)
    if queue_depth is not None:
        env["BYTEPS_PIPELINE_QUEUE_DEPTH"] = str(queue_depth)
    specs = local_job(_worker_argv("bps", "--cases", encode_cases(cases)), free_port(),
                      workers=workers, servers=servers)
    with Job("byteps_like") as g:
        ws = g.start(specs, env)
        with CpuSampler(server_pids(g.procs.values())) as sampler:
            g.wait(timeout, relay=ws[0], relay_prefix="[pushpull] byteps_like ")
        got = collect(ws, "byteps_like")
        for w in got:   # every worker's record carries the servers' CPU sampler
            w["server_cpu"] = sampler
        return got


def run_shapes(model: str, workers: int, servers: int, partition_bytes: int, repeats: int,
               warmup: int, timeout: float) -> dict:
    """``--shapes``: the model's gradient shapes against one flat tensor (shapes.py), in a job
    started as bpslaunch --local starts it (its thread shares included)."""
    env = base_env()
    env["BYTEPS_PARTITION_BYTES"] = str(partition_bytes)
    specs = local_job(_worker_argv("shapes", "--model", model, "--repeats", str(repeats),
                                   "--warmup", str(warmup)), free_port(),
                      workers=workers, servers=servers)
    with Job("shapes") as g:
        ws = g.start(specs, env)
        for line in g.plan:
            print(f"plan: {line}")
        g.wait(timeout, relay=ws[0], relay_prefix="[pushpull] shapes ")
        return summarize_shapes(collect(ws, "shapes"))


def run_raw(cases: list[Case], workers: int, servers: int, partition_bytes: int,
            timeout: float, window: int = 0) -> list[dict]:
    ports = free_ports(servers + 1)
    sports, bport = ports[:servers], ports[servers]
    env = base_env()
    with Job("raw-zmq") as g:
        for i, p in enumerate(sports):
            g.spawn(f"echo-server-{i}", _worker_argv("raw-server", "--port", str(p),
                                                     "--world", str(workers)), env,
                    service=True)
        cs = [g.spawn(f"client-{r}", _worker_argv(
                  "raw-client", "--cases", encode_cases(cases), "--rank", str(r),
                  "--world", str(workers), "--port", str(bport),
                  "--server-ports", ",".join(map(str, sports)),
                  "--partition-bytes", str(partition_bytes), "--window", str(window)), env)
              for r in range(workers)]
        g.wait(timeout, relay=cs[0], relay_prefix="[pushpull] raw zmq ")
        return collect(cs, "raw zmq")


def run_gloo(cases: list[Case], workers: int, timeout: float) -> list[dict]:
    port = free_port()
    env = base_env()
    with Job("gloo") as g:
        ws = [g.spawn(f"gloo-{r}", _worker_argv("gloo", "--cases", encode_cases(cases),
                                                 "--rank", str(r), "--world", str(workers),
                                                 "--port", str(port)), env)
              for r in range(workers)]
        g.wait(timeout, relay=ws[0], relay_prefix="[pushpull] gloo ")
        return collect(ws, "gloo")


COLUMNS = ("size", "bps time ms", "bps GB/s", "server core-s/GB", "raw zmq GB/s", "bps/raw",
           "gloo GB/s", "bps/gloo")


def server_cost(per_worker: list[dict], case: Case) -> float | None:
    """The servers' core-seconds per GB received over the timed repetitions (servercpu.py):
    each repetition every worker pushes the tensor's bytes to the servers."""
    sampler = per_worker[0].get("server_cpu") if per_worker else None
    return core_seconds_per_gb(sampler, per_worker, case.nbytes, len(per_worker) * case.nbytes)


def format_table(rows: list[dict]) -> str:
    return markdown_table(COLUMNS, [
        (fmt_size(r["nbytes"]), num(r["bps"]["median_s"] * 1e3, ".2f"),
         num(r["bps"]["gbps"], ".3f"), num(r["bps"].get("server_core_s_per_gb"), ".3f"),
         num(r["raw"]["gbps"] if r["raw"] else None, ".3f"),
         num(r["bps"]["gbps"] / r["raw"]["gbps"] if r["raw"] else None, ".2f"),
         num(r["gloo"]["gbps"] if r["gloo"] else None, ".3f"),
         num(r["bps"]["gbps"] / r["gloo"]["gbps"] if r["gloo"] else None, ".2f"))
        for r in rows])


def _configured_queue_depth() -> int:
    """The queue depth the workers would get from the environment handed to them."""
    import warnings

    from ..config import load
    from ..errors import ConfigError
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the workers report bad settings themselves
            return load(env=base_env()).scheduling.queue_depth
    except ConfigError:
        return DEFAULT_QUEUE_DEPTH


def tensor_size(text: str) -> int:
    """A size option of one float32 tensor: a positive multiple of 4 bytes."""
    return size_arg(text, multiple=4)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--_worker"]:
        return _worker_main(argv[1:])
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--workers", type=int, default=2, help="worker processes (N)")
    p.add_argument("--servers", type=int, default=2, help="server processes (M)")
    p.add_argument("--sizes", default=DEFAULT_SIZES,
                   help="comma-separated bytes of one float32 tensor (K/M/G are binary, "
                        "KB/MB/GB decimal)")
    p.add_argument("--repeats", type=int, default=5, help="timed repetitions per size")
    p.add_argument("--warmup", type=int, default=2, help="untimed repetitions per size")
    p.add_argument("--large-repeats", type=int, default=0,
                   help=f"at most this many repetitions (and 1 warm-up) for sizes of "
                        f"{fmt_size(LARGE_BYTES)} and more; 0 = no cap")
    p.add_argument("--partition-bytes", type=tensor_size, default=4096000,
                   help="BYTEPS_PARTITION_BYTES of the job, and the raw zmq chunk size")
    p.add_argument("--raw-window", type=int, default=0,
                   help="partitions each raw zmq client keeps in flight; 0 = the whole tensor "
                        "at once")
    p.add_argument("--skip-gloo", action="store_true", help="do not run the gloo all_reduce")
    p.add_argument("--skip-raw", action="store_true", help="do not run the raw pyzmq baseline")
    p.add_argument("--queue-depth", type=int, default=None,
                   help="BYTEPS_PIPELINE_QUEUE_DEPTH of the workers (default: the "
                        "environment's value, or the built-in default)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="watchdog per phase, seconds: on expiry every child is killed")
    p.add_argument("--json", metavar="PATH", help="also write every measurement here")
    p.add_argument("--shapes", choices=sorted(MODELS),
                   help="instead of --sizes: push_pull this model's gradient shapes (CPU torch "
                        "tensors; numpy without torch) and one flat tensor of the same bytes, "
                        "alternately, and print flat time / shapes time")
    p.add_argument("--transport", default="zmq",
                   help="comma-separated transports byteps_like runs over, side by side "
                        "(zmq, ucx); with ucx, ucx_perftest tag_bw is measured as its ceiling "
                        "(UCX_TLS=tcp UCX_NET_DEVICES=lo unless set)")
    a = p.parse_args(argv)
    try:
        sizes = size_list(a.sizes, multiple=4)
    except argparse.ArgumentTypeError as exc:
        p.error(str(exc))
    if not sizes:
        p.error("--sizes is empty")
    if a.workers < 1 or a.servers < 1:
        p.error("--workers and --servers must be >= 1")
    if a.repeats < 1 or a.warmup < 0 or a.large_repeats < 0 or a.raw_window < 0:
        p.error("--repeats must be >= 1; --warmup, --large-repeats and --raw-window >= 0")
    cases = []
    capped = []
    for n in sizes:
        reps, warm = a.repeats, a.warmup
        if a.large_repeats and n >= LARGE_BYTES:
            reps, warm = min(reps, a.large_repeats), min(warm, 1)
            if (reps, warm) != (a.repeats, a.warmup):
                capped.append(fmt_size(n))
        cases.append(Case(n, reps, warm))

    if a.shapes:
        report_header("pushpull", argv, machine_info())
        print(f"job: {a.workers} workers, {a.servers} servers, partition {a.partition_bytes} B, "
              f"{a.shapes}'s gradient shapes vs one flat tensor of the same bytes, "
              f"{a.repeats} repeats + {a.warmup} warm-up, thread shares as bpslaunch's defaults")
        exit_on_signals()
        try:
            r = run_shapes(a.shapes, a.workers, a.servers, a.partition_bytes, a.repeats,
                           a.warmup, a.timeout)
        except ChildFailed as exc:
            print(f"[pushpull] shapes failed:\n{exc}", file=sys.stderr, flush=True)
            return 1
        print(markdown_table(("model", "tensors", "bytes", "shapes ms", "flat ms", "flat/shapes"),
                             [(a.shapes, str(r["tensors"]), f"{r['nbytes'] / 2**20:.1f} MiB",
                               f"{r['shapes'] * 1e3:.1f}", f"{r['flat'] * 1e3:.1f}",
                               f"{r['ratio']:.2f}")]))
        print("\ntimes: median over repetitions of the slowest worker; flat/shapes = 1.00 when "
              "the many tensors cost no more than their bytes")
        if a.json:
            with open(a.json, "w", encoding="utf-8") as f:
                json.dump({"command": argv, "shapes": a.shapes, "workers": a.workers,
                           "servers": a.servers, "result": r}, f, indent=1)
        return 0
    queue_depth = a.queue_depth
    depth_note = f"pipeline queue depth {queue_depth if queue_depth else _configured_queue_depth()}"

    info = machine_info()
    gloo = not a.skip_gloo and importlib.util.find_spec("torch") is not None
    command = report_header("pushpull", argv, info)
    print(f"job: {a.workers} workers, {a.servers} servers, partition {a.partition_bytes} B, "
          f"float32, average=False, loopback tcp, {depth_note}; raw zmq window "
          f"{a.raw_window or 'whole tensor'}")
    print("repeats: " + ", ".join(f"{fmt_size(c.nbytes)} {c.repeats}+{c.warmup} warm-up"
                                   for c in cases)
          + (f" (capped by --large-repeats for {', '.join(capped)})" if capped else ""))
    if not a.skip_gloo and not gloo:
        print("gloo: torch is not importable here; skipped")
    load_before, busy = print_before_start()

    transports = [t.strip() for t in a.transport.split(",") if t.strip()]
    if not transports or set(transports) - {"zmq", "ucx"}:
        p.error("--transport takes zmq, ucx or zmq,ucx")
    phases: list[tuple[str, Callable[[], list[dict]]]] = []
    for t in transports:   # the first one is the "bps" column of the main table
        name = "byteps_like" if t == transports[0] else f"byteps_like/{t}"
        phases.append((name, functools.partial(
            run_bps, cases, a.workers, a.servers, a.partition_bytes, a.timeout, queue_depth,
            None if t == "zmq" and len(transports) == 1 else t)))
    ceiling = None
    ceiling_note = None
    if "ucx" in transports:
        def _ceiling() -> list[dict]:
            nonlocal ceiling, ceiling_note
            ceiling, ceiling_note = run_ucx_perftest(cases, a.timeout)
            if ceiling_note:
                ceiling_note = f"ceiling unavailable: {ceiling_note}"
                print(f"[pushpull] ucx_perftest: {ceiling_note}", file=sys.stderr, flush=True)
            return []
        phases.append(("ucx_perftest", _ceiling))
    if not a.skip_raw:
        phases.append(("raw zmq", lambda: run_raw(cases, a.workers, a.servers,
                                                   a.partition_bytes, a.timeout, a.raw_window)))
    if gloo:
        phases.append(("gloo", lambda: run_gloo(cases, a.workers, a.timeout)))
    measured: dict[str, list[dict]] = {}
    exit_on_signals()
    cpu: dict[str, dict] = {}
    for name, fn in phases:
        r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        print(f"[pushpull] {name}: starting", file=sys.stderr, flush=True)
        try:
            with OthersMeter() as meter:
                measured[name] = fn()
        except ChildFailed as exc:
            print(f"[pushpull] {name} failed:\n{exc}", file=sys.stderr, flush=True)
            return 1
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu[name] = {"wall_s": meter.wall, "user_s": r1.ru_utime - r0.ru_utime,
                     "sys_s": r1.ru_stime - r0.ru_stime, "others_share": meter.others}
        print(f"[pushpull] {name}: done in {cpu[name]['wall_s']:.1f} s (all its processes, "
              f"start-up included: {cpu[name]['user_s']:.1f} s user + "
              f"{cpu[name]['sys_s']:.1f} s system CPU)", file=sys.stderr, flush=True)

    rows = []
    for case in cases:
        bps_row = summarize(measured["byteps_like"], case)
        bps_row["server_core_s_per_gb"] = server_cost(measured["byteps_like"], case)
        rows.append({"nbytes": case.nbytes, "repeats": case.repeats, "warmup": case.warmup,
                     "bps": bps_row,
                     "raw": summarize(measured["raw zmq"], case) if "raw zmq" in measured
                     else None,
                     "gloo": summarize(measured["gloo"], case) if "gloo" in measured else None,
                     "transports": {t: summarize(measured["byteps_like" if t == transports[0]
                                                          else f"byteps_like/{t}"], case)
                                    for t in transports}})
    print()
    print(format_table(rows))
    if len(transports) > 1 or transports != ["zmq"]:
        print(f"\nbyteps_like per transport ({', '.join(transports)}); ceiling: ucx_perftest "
              "-t tag_bw, one process pair, median of 3")
        print(format_transports(rows, ceiling))
        if ceiling_note:
            print(ceiling_note)
    print("\nGB/s = tensor bytes / (median over repetitions of the slowest worker's time), 1e9 B;"
          " server core-s/GB = the servers' CPU time (every thread, /proc) over the timed "
          "repetitions / the GB they received (workers x tensor bytes a repetition)")
    note = noisy_note({n: c["others_share"] for n, c in cpu.items()}, "phase")
    if note:
        print(note)
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump({"command": command, "machine": info, "workers": a.workers,
                       "servers": a.servers, "partition_bytes": a.partition_bytes,
                       "queue_depth": queue_depth, "raw_window": a.raw_window,
                       "load_before": load_before, "busy_before": busy, "cpu": cpu,
                       "transports": transports, "ucx_perftest_gbps": ceiling,
                       "ucx_perftest_note": ceiling_note,
                       "results": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
