"""Processes of the emulated-cluster benchmark (``python -m byteps_like.bench cluster``), each
started by the driver inside one host's network namespace:

``python -m byteps_like.bench._cluster_worker KIND [options]`` with KIND one of

- ``tcp-recv`` / ``tcp-send``: a plain TCP stream, to measure the achieved link rate;
- ``bps``: a byteps_like worker timing push_pull of a model-sized list of tensors, optionally
  with a gradient compressor (``--compressor``, one of :data:`COMPRESSORS`); it reports the wire
  bytes it pushed and pulled (the runtime's counters) over the timed rounds;
- ``gloo``: torch.distributed all_reduce (gloo) of the same tensors;
- ``horovod`` / ``hvd-rendezvous``: Horovod (gloo) allreduce of the same tensors, and the HTTP
  rendezvous server it needs (run with the Horovod virtualenv's python);
- ``step``: the training-step benchmark of priority scheduling (see :mod:`.priority`).

Each prints one ``BENCH_RESULT {json}`` line on stdout and progress on stderr. Nothing here runs
on import.
"""
from __future__ import annotations

import argparse
import json
import socket
import statistics
import time
from collections.abc import Callable, Sequence

from .report import emit, end_torch_distributed, progress
from .vgg16 import model_tensors


# ---------------------------------------------------------------------------------- TCP stream
def tcp_recv(host: str, port: int) -> int:
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((host, port))
    srv.listen(1)
    srv.settimeout(60)
    conn, _ = srv.accept()
    conn.settimeout(60)
    buf = bytearray(1 << 20)
    view = memoryview(buf)
    got, t0 = 0, 0.0
    marks: list[tuple[float, int]] = []
    while True:
        n = conn.recv_into(view)
        if not n:
            break
        now = time.perf_counter()
        if not marks:
            t0 = now
        got += n
        marks.append((now, got))
    conn.close()
    srv.close()
    # ignore the first 0.5 s (TCP slow start, the bucket's initial burst)
    start = next(((t, b) for t, b in marks if t - t0 >= 0.5), marks[0])
    end = marks[-1]
    rate = (end[1] - start[1]) * 8 / max(1e-9, end[0] - start[0])
    emit({"bytes": got, "seconds": end[0] - t0, "bits_per_second": rate})
    return 0


def tcp_send(host: str, port: int, seconds: float) -> int:
    end = time.monotonic() + 30
    while True:
        try:
            s = socket.create_connection((host, port), timeout=5)
            break
        except OSError:
            if time.monotonic() > end:
                raise
            time.sleep(0.1)
    chunk = b"\0" * (1 << 20)
    stop = time.monotonic() + seconds
    while time.monotonic() < stop:
        s.sendall(chunk)
    s.shutdown(socket.SHUT_WR)
    s.recv(1)
    s.close()
    return 0


# ------------------------------------------------------------------------------ all-reduce runs
def _times_summary(times: list[float]) -> str:
    return f"median {statistics.median(times) * 1e3:.0f} ms" if times else "done"


# the compressor settings of the compression benchmark (``bench cluster --compressors``):
# name -> (label with its settings, factory)
def _compressors() -> dict:
    from byteps_like.compression import Compression
    return {
        "none": ("none (float32)", lambda: Compression.none),
        "fp16": ("fp16 cast", lambda: Compression.fp16),
        "bf16": ("bf16 cast", lambda: Compression.bf16),
        "onebit": ("onebit scaled +EF", lambda: Compression.onebit(True, error_feedback=True)),
        "topk": ("topk k=0.01 +EF", lambda: Compression.topk(0.01, error_feedback=True)),
        "randomk": ("randomk k=0.01 +EF",
                    lambda: Compression.randomk(0.01, error_feedback=True)),
        "dithering": ("dithering 16 lin max",
                      lambda: Compression.dithering(16, "linear", "max")),
        "auto": ("auto of none,fp16,onebit+EF", lambda: Compression.auto(("fp16", "onebit"))),
    }


COMPRESSORS = ("none", "fp16", "bf16", "onebit", "topk", "randomk", "dithering", "auto")


def compressor_label(name: str) -> str:
    return _compressors()[name][0]


def make_compressor(name: str):
    return _compressors()[name][1]()


def _check_sum(rank: int, name: str, comp: str, out, expect) -> None:
    import numpy as np
    if comp == "none":
        ok = np.allclose(out, expect, rtol=1e-6, atol=0)
    elif comp in ("fp16", "bf16"):   # one rounding per push, one sum in the narrow dtype
        ok = np.allclose(out, expect, rtol=0.05, atol=0.05)
    else:                            # lossy codecs: only shape and finiteness can be checked
        ok = bool(np.isfinite(out).all())
    if not ok:
        raise AssertionError(f"worker {rank}: wrong push_pull result for {name} ({comp})")


def _go_on(bps, until: float, rep: int, warmup: int, repeats: int) -> bool:
    """Another round? ``until`` (a time.time() deadline, bench/links.py's rate schedules): rank
    0 says, for every worker alike (a push_pull of its answer); else ``repeats`` rounds."""
    if not until:
        return rep < warmup + repeats
    import numpy as np
    flag = np.array([int(rep < warmup or time.time() < until) if bps.rank() == 0 else 0],
                    np.int32)
    return bool(bps.push_pull(flag, name="bench.go", average=False)[0])


_AUTO_WARMUP_S = 60.0   # auto's warm-up waits this long at most for its first decision


def _auto_pending(bps, rt, deadline: float) -> bool:
    """Auto compression's first decision is not in force yet (rank 0 says, for every worker
    alike) and the warm-up may still wait for it: the timed rounds measure the choice, not the
    uncompressed rounds before it (measuring the codecs and the first windows take seconds,
    longer than a 25 Gbit/s run's rounds)."""
    import numpy as np

    from byteps_like.worker.autocompress import first_decision_in_force
    flag = np.array([int(bps.rank() == 0 and not first_decision_in_force(rt)
                         and time.monotonic() < deadline)], np.int32)
    return bool(bps.push_pull(flag, name="bench.auto-warm", average=False)[0])


def bps_worker(sizes: list[int], repeats: int, warmup: int, compressor: str = "",
               until: float = 0.0) -> int:
    """push_pull of the model-sized tensor list. Without ``compressor``: every worker pushes
    constants and checks the exact sum. With one (``none`` included): the gradients are a
    seeded standard-normal array times (rank + 1), the same on every worker up to that factor,
    so the expected sum is known; the compressor is passed to push_pull_async. ``until`` (a
    rate schedule's end, time.time()): timed rounds until then instead of ``repeats``, each
    with its start time (``rounds``); rank 0 reports auto compression's decisions."""
    import numpy as np

    import byteps_like as bps
    from byteps_like.worker.runtime import default_runtime
    bps.init()
    rank, n = bps.rank(), bps.size()
    expect = n * (n + 1) / 2
    comp = make_compressor(compressor) if compressor else None
    kw = {} if comp is None else {"compression": comp}
    rt = default_runtime()
    result: dict[str, list[float]] = {}
    wire: dict[str, dict[str, int]] = {}
    windows: dict[str, list[tuple[float, float]]] = {}  # the servers' CPU window (servercpu)
    starts_by: dict[str, list[float]] = {}
    for total in sizes:
        specs = model_tensors(total)
        if comp is None:
            arrs = [np.full(cnt, rank + 1, dtype=np.float32) for _nm, cnt, _l in specs]
            bases = None
        else:
            rng = np.random.default_rng(total)
            bases = [rng.standard_normal(cnt, dtype=np.float32) for _nm, cnt, _l in specs]
            arrs = [b * np.float32(rank + 1) for b in bases]
        outs = [np.empty_like(a) for a in arrs]
        tag = f"{compressor}." if compressor else ""
        names = [f"{tag}{total}.{nm}" for nm, _c, _l in specs]
        times, starts = [], []
        spans = windows[str(total)] = []
        pushed0 = pulled0 = 0
        rep = -1
        warm, deadline = warmup, time.monotonic() + _AUTO_WARMUP_S
        while _go_on(bps, until, rep := rep + 1, warm, repeats):
            for o in outs:
                o.fill(0)
            bps.barrier()
            if rep == warm:
                pushed0, pulled0 = rt.bytes_pushed, rt.bytes_pulled
                if warm > warmup and rank == 0:
                    progress(f"auto: its first decision in force after {warm} warm-up rounds")
            m0, t0 = time.monotonic(), time.perf_counter()
            hs = [bps.push_pull_async(a, name=nm, average=False, out=o, **kw)
                  for a, nm, o in zip(arrs, names, outs)]
            for h in hs:
                h.wait()
            dt = time.perf_counter() - t0
            if (rep == warm - 1 and compressor == "auto" and not until
                    and _auto_pending(bps, rt, deadline)):
                warm += 1
            if rep >= warm:
                times.append(dt)
                spans.append((m0, time.monotonic()))
                starts.append(time.time() - dt)
        rounds_done = len(times)
        wire[str(total)] = {"pushed": rt.bytes_pushed - pushed0,
                            "pulled": rt.bytes_pulled - pulled0, "rounds": rounds_done}
        starts_by[str(total)] = starts
        for i, (o, nm) in enumerate(zip(outs, names)):
            if bases is None:
                if not (o == expect).all():
                    raise AssertionError(f"worker {rank}: wrong push_pull result for {nm}")
            else:
                _check_sum(rank, nm, compressor, o, bases[i] * np.float32(expect))
        result[str(total)] = times
        if rank == 0:
            w = wire[str(total)]
            per = (w["pushed"] + w["pulled"]) / max(1, rounds_done) / (1 << 20)
            progress(f"{total >> 20} MiB{' ' + compressor if compressor else ''}: "
                      f"{_times_summary(times)}, {per:.1f} MiB pushed+pulled per round "
                      f"on worker 0")
        del arrs, outs, bases
    from byteps_like.worker.autocompress import decisions
    auto = decisions(rt)
    bps.shutdown()
    emit({"rank": rank, "times": result, "wire": wire, "compressor": compressor or None,
          "windows": windows, "starts": starts_by, "auto_decisions": auto})
    return 0


def _timed_sums(what: str, op: str, sizes: list[int], repeats: int, warmup: int, rank: int,
                world: int, barrier: Callable[[], object],
                sum_all: Callable[[int, list, list], object]) -> dict[str, list[float]]:
    """The baselines' measurement: for each total size, the model's float32 tensors, every
    element ``rank + 1``, summed over the ``world`` ranks by ``sum_all(total, specs, tensors)``
    (in place; it returns once all are done) ``warmup + repeats`` times, each timed from a
    barrier; the results checked exactly (else "``what`` rank r: wrong ``op`` result"). The
    seconds of the timed repetitions, by size."""
    import torch
    expect = world * (world + 1) / 2
    result: dict[str, list[float]] = {}
    for total in sizes:
        specs = model_tensors(total)
        ts = [torch.empty(cnt, dtype=torch.float32) for _nm, cnt, _l in specs]
        times = []
        for rep in range(warmup + repeats):
            for t in ts:
                t.fill_(rank + 1)
            barrier()
            t0 = time.perf_counter()
            sum_all(total, specs, ts)
            dt = time.perf_counter() - t0
            if rep >= warmup:
                times.append(dt)
        if not all(bool((t == expect).all()) for t in ts):
            raise AssertionError(f"{what} rank {rank}: wrong {op} result")
        result[str(total)] = times
        if rank == 0:
            progress(f"{total >> 20} MiB: {_times_summary(times)} on rank 0")
        del ts
    return result


def gloo_worker(sizes: list[int], repeats: int, warmup: int, rank: int, world: int,
                master: str, port: int) -> int:
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rank,
                            world_size=world)

    def sum_all(_total, _specs, ts):
        for w in [dist.all_reduce(t, async_op=True) for t in ts]:
            w.wait()
    try:
        result = _timed_sums("gloo", "all_reduce", sizes, repeats, warmup, rank, world,
                             dist.barrier, sum_all)
    except BaseException:
        dist.destroy_process_group()
        raise
    end_torch_distributed(dist, {"rank": rank, "times": result})


def horovod_worker(sizes: list[int], repeats: int, warmup: int) -> int:
    import horovod.torch as hvd
    hvd.init()
    rank, world = hvd.rank(), hvd.size()

    def sum_all(total, specs, ts):
        hs = [hvd.allreduce_async_(t, name=f"{total}.{nm}", op=hvd.Sum)
              for t, (nm, _c, _l) in zip(ts, specs)]
        for h in hs:
            hvd.synchronize(h)
    result = _timed_sums("horovod", "allreduce", sizes, repeats, warmup, rank, world,
                         hvd.barrier, sum_all)
    hvd.shutdown()
    emit({"rank": rank, "times": result})
    return 0


def hvd_rendezvous(hosts: str, size: int, port_file: str) -> int:
    """Horovod's HTTP rendezvous (what horovodrun starts), serving until killed."""
    import os

    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
    from horovod.runner.http.http_server import RendezvousServer
    server = RendezvousServer(verbose=0)
    port = server.start()
    server.init(get_host_assignments(parse_hosts(hosts), size))
    tmp = port_file + ".tmp"
    with open(tmp, "w", encoding="ascii") as f:
        f.write(str(port))
    os.replace(tmp, port_file)
    while True:
        time.sleep(3600)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m byteps_like.bench._cluster_worker")
    p.add_argument("kind", choices=("tcp-recv", "tcp-send", "bps", "gloo", "horovod",
                                    "hvd-rendezvous", "step"))
    p.add_argument("--host", default="")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--sizes", default="")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--hosts", default="")
    p.add_argument("--port-file", default="")
    p.add_argument("--step", default="", help="JSON parameters of the step benchmark")
    p.add_argument("--until", type=float, default=0.0,
                   help="bps: timed rounds until this time.time() (a rate schedule's end)")
    p.add_argument("--compressor", default="", choices=("",) + COMPRESSORS,
                   help="bps: gradient compressor of every push_pull (fixed settings, see "
                        "COMPRESSORS); empty = the plain benchmark")
    a = p.parse_args(argv)
    sizes = [int(x) for x in a.sizes.split(",") if x]
    if a.kind == "tcp-recv":
        return tcp_recv(a.host, a.port)
    if a.kind == "tcp-send":
        return tcp_send(a.host, a.port, a.seconds)
    if a.kind == "bps":
        return bps_worker(sizes, a.repeats, a.warmup, a.compressor, a.until)
    if a.kind == "gloo":
        return gloo_worker(sizes, a.repeats, a.warmup, a.rank, a.world, a.host, a.port)
    if a.kind == "horovod":
        return horovod_worker(sizes, a.repeats, a.warmup)
    if a.kind == "hvd-rendezvous":
        return hvd_rendezvous(a.hosts, a.world, a.port_file)
    from .priority import step_worker
    return step_worker(json.loads(a.step))


if __name__ == "__main__":
    raise SystemExit(main())
