"""One worker of ``python -m byteps_like.bench sparse`` (started by :mod:`.sparse`):

``python -m byteps_like.bench._sparse_worker MODE [options]`` with MODE

- ``sparse``: the DLRM-shaped model's tables are ``byteps_like.torch.SparseEmbedding`` (held and
  updated on the servers: a step pulls the batch's unique rows and pushes their gradients);
- ``dense``: the same tables as ``nn.Embedding``, every row's gradient through
  ``DistributedOptimizer`` (push_pull), as a job without server-held tables has to;
- ``ddp``: the dense model under ``torch.nn.parallel.DistributedDataParallel`` with gloo
  (rendezvous through MASTER_ADDR/MASTER_PORT; its bytes are the ring all-reduce's,
  computed: 2 (W-1)/W of the gradient bytes each way);
- ``local``: the same model and batch with no communication at all (the tables as
  ``nn.Embedding`` with sparse gradients, plain SGD): each of the workers trains its own copy,
  so the step is the model's compute on the same share of the machine.

The model (:func:`table_rows`, :class:`DLRM`): ``--tables`` tables of ``--rows``, rows/10,
rows/100, ... rows (Criteo-like skew) of ``--dim`` float32, one id per table per sample drawn
from a Zipf distribution (``--zipf``), 13 dense features through a linear layer, an MLP on the
concatenation, a logistic loss. The dense parameters go through ``DistributedOptimizer`` (SGD)
in both modes. It runs ``--warmup`` untimed and ``--steps`` timed steps and prints one
``BENCH_RESULT`` line: the step times, the wire bytes of the timed steps (tables: what the
table requests and answers carried, headers included; push_pull: payload bytes) and the floor
(each table's unique ids x (2 x row bytes + 8 bytes of id)).
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..embedding import Phases
from .links import SlowCompute, straggler_arg
from .report import emit, end_torch_distributed, progress

DENSE_FEATURES = 13


def table_rows(rows: int, tables: int) -> list[int]:
    """Criteo-like skew: rows, rows/10, rows/100, ... (at least 10 each)."""
    return [max(10, rows // 10 ** i) for i in range(tables)]


def batch_ids(rank: int, step: int, sizes: list[int], batch: int, zipf: float) -> np.ndarray:
    """(batch, tables) int64 ids; Zipf-distributed, the hot rows spread by a fixed odd
    multiplier so that they are not all the smallest ids."""
    rng = np.random.default_rng([rank, step, 31])
    cols = [((rng.zipf(zipf, batch).astype(np.int64) - 1) * 2654435761) % n for n in sizes]
    return np.stack(cols, axis=1)


def table_phases(rt: Any) -> dict:
    """Where this worker's table time went so far (byteps_like.embedding.Phases)."""
    if rt is None or rt.sparse is None:
        return {}
    return {**rt.sparse.phases.snapshot(), **rt.sparse.io_phases.snapshot()}


def kill_server(rt: Any, rank: int) -> None:
    """SIGKILL server ``rank`` of this job (bench sparse --kill)."""
    import os
    import signal
    pid = [p.pid for p in rt.members.controller.peers if p.role == "server" and p.rank == rank]
    os.kill(pid[0], signal.SIGKILL)
    progress(f"killed server {rank} (pid {pid[0]})")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m byteps_like.bench._sparse_worker")
    p.add_argument("mode", choices=("sparse", "dense", "ddp", "local", "replicate", "snapshot"),
                   help="replicate, snapshot: sparse, with BYTEPS_SPARSE_SURVIVAL set so")
    p.add_argument("--kill", default="", metavar="SERVER:STEP",
                   help="rank 0 SIGKILLs server rank SERVER as step STEP begins")
    p.add_argument("--sample-out", default="", help="rank 0 writes the first 512 rows of "
                   "every table here at the end (.npy)")
    p.add_argument("--rank", type=int, default=0, help="ddp, local")
    p.add_argument("--world", type=int, default=1, help="ddp")
    p.add_argument("--rows", type=int, required=True)
    p.add_argument("--tables", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--zipf", type=float, default=1.2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=0,
                   help="torch CPU threads; 0 = torch's own")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--optimizer", default="sgd", help="the sparse tables' (server side)")
    p.add_argument("--prefetch", action="store_true",
                   help="prefetch every table's rows first (default: each in its forward)")
    p.add_argument("--straggler", type=straggler_arg, default=None, metavar="RANK:FACTOR",
                   help="worker RANK's compute FACTOR times as long (bench/links.py)")
    a = p.parse_args(argv)

    import torch

    import byteps_like.torch as bps
    from byteps_like.worker.runtime import default_runtime
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    if a.mode == "ddp":
        import torch.distributed as dist
        dist.init_process_group("gloo", rank=a.rank, world_size=a.world)
        rank, rt = a.rank, None
    elif a.mode == "local":
        rank, rt = a.rank, None
    else:
        bps.init()
        rank, rt = bps.rank(), default_runtime()
    sizes = table_rows(a.rows, a.tables)
    if a.mode in ("sparse", "replicate", "snapshot"):
        embs: list[torch.nn.Module] = [
            bps.SparseEmbedding(n, a.dim, name=f"table{i}", init="uniform", seed=i,
                               optimizer=a.optimizer, lr=a.lr)
            for i, n in enumerate(sizes)]
    else:   # local: sparse gradients, as a one-process model of this size would have
        embs = [torch.nn.Embedding(n, a.dim, sparse=a.mode == "local") for n in sizes]

    class DLRM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embs = torch.nn.ModuleList(embs)
            self.bottom = torch.nn.Linear(DENSE_FEATURES, a.dim)
            self.top = torch.nn.Sequential(torch.nn.Linear(a.dim * (len(embs) + 1), 128),
                                           torch.nn.ReLU(), torch.nn.Linear(128, 1))

        def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
            if a.prefetch:   # every table's pull in flight at once: one wait
                for i, e in enumerate(self.embs):
                    if isinstance(e, bps.SparseEmbedding):
                        e.prefetch(ids[:, i])
            parts = [self.bottom(dense)] + [e(ids[:, i]) for i, e in enumerate(self.embs)]
            return self.top(torch.cat(parts, dim=1)).squeeze(1)

    model: torch.nn.Module = DLRM()
    dense_bytes = sum(p.numel() * 4 for p in model.parameters())
    ring = 0
    if a.mode == "local":
        opt: Any = torch.optim.SGD(model.parameters(), lr=a.lr)
    elif rt is None:   # ddp: the ring all-reduce's bytes, both ways, computed
        model = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(model.parameters(), lr=a.lr)
        ring = 4 * (a.world - 1) * dense_bytes // a.world
    else:
        opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=a.lr),
                                       named_parameters=model.named_parameters())
        bps.broadcast_parameters(model.state_dict(), root_rank=0)
    stats = [e.table.stats for e in embs if isinstance(e, bps.SparseEmbedding)]
    rng = np.random.default_rng(rank)
    steps: list[float] = []
    step_phase = (rt.sparse.phases.add if rt is not None and rt.sparse is not None
                  else lambda _phase, _t0: time.perf_counter())
    slow = SlowCompute(a.straggler, rank)
    floor = 0
    base_tables = base_pp = 0
    phases0: dict = {}
    losses = []
    for step in range(a.warmup + a.steps):
        if step == a.warmup:
            base_tables = sum(st.bytes_sent + st.bytes_received for st in stats)
            base_pp = 0 if rt is None else rt.bytes_pushed + rt.bytes_pulled
            phases0 = table_phases(rt)
        if a.kill and rank == 0 and step == int(a.kill.split(":")[1]):
            kill_server(rt, int(a.kill.split(":")[0]))
        ids_np = batch_ids(rank, step, sizes, a.batch, a.zipf)
        ids = torch.from_numpy(ids_np)
        dense = torch.from_numpy(rng.normal(size=(a.batch, DENSE_FEATURES)).astype(np.float32))
        label = torch.from_numpy((rng.random(a.batch) < 0.25).astype(np.float32))
        t0 = time.perf_counter()
        slow.start()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(dense, ids), label)
        t = step_phase("step: forward (with the tables' pulls)", t0)
        opt.zero_grad()
        slow.delay()     # --straggler: this rank's gradients come FACTOR times later
        loss.backward()
        slow.stop()
        t = step_phase("step: backward (with the tables' pushes)", t)
        opt.step()
        step_phase("step: optimizer (the dense push_pull)", t)
        dt = time.perf_counter() - t0
        losses.append(float(loss))
        if step >= a.warmup:
            steps.append(dt)
            floor += sum(len(np.unique(ids_np[:, i])) * (2 * 4 * a.dim + 8)
                         for i in range(len(sizes)))
        progress(f"{a.mode} step {step + 1}/{a.warmup + a.steps}: {dt * 1e3:.1f} ms")
    tables = sum(st.bytes_sent + st.bytes_received for st in stats) - base_tables
    phases = Phases.since(table_phases(rt), phases0)
    pushpull = (ring * a.steps if rt is None
                else rt.bytes_pushed + rt.bytes_pulled - base_pp)
    if a.sample_out and rank == 0:   # before the result: the bench reads it after
        np.save(a.sample_out, np.concatenate([e.table.pull(np.arange(min(512, e.table.rows)))
                                              for e in embs
                                              if isinstance(e, bps.SparseEmbedding)]))
    result = {"mode": a.mode, "rank": rank, "step_times_s": steps, "table_bytes": tables,
              "rolled_back": max((st.rolled_back for st in stats), default=0),
              "pushpull_bytes": pushpull, "floor_bytes": floor, "steps": a.steps,
              "dense_param_bytes": dense_bytes, "table_rows": sizes, "loss": losses[-1],
              "table_phases": phases, "threads": torch.get_num_threads()}
    if a.mode == "ddp":
        end_torch_distributed(torch.distributed, result)
    emit(result)
    if rt is not None:
        bps.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
