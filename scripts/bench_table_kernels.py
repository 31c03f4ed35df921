"""The table kernels (csrc/table_kernels.cc) against the numpy code they replaced, one server's
round of `bench sparse` at a time (docs/performance.md, "The table kernels").

    python scripts/bench_table_kernels.py [--rows 1000000] [--workers 2] [--servers 2]
        [--optimizer sgd|adagrad|adam|all] [--batch 4096] [--dim 64] [--rounds 20] [--repeat 3]
        [--threads 1]

builds the model of `bench sparse` (tables of rows, rows/10, rows/100 and rows/1000 x dim, each
worker's batch of Zipf(1.2) ids spread by the same multiplier as its workers), and times on
server 0's shard of every table: summing the workers' pushes of a round per row (sum_rows),
the optimizer step on the summed rows (apply), and the next round's pulls (rows, one per
worker), on a shard the earlier rounds made rows of (a round's ids not seen before are made on
the way, as in a job) and, for apply and rows, on a cold one too (every row made on the way:
the initializer). Prints milliseconds per
round (median over --rounds, the least of --repeat runs) for numpy and the kernels, and checks
the two give the same bits.
One process, one thread: the kernels' own time, no network.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from byteps_like import embedding as E


def batch_ids(rank: int, step: int, sizes: list[int], batch: int, zipf: float) -> np.ndarray:
    """A worker's (batch, tables) ids, as byteps_like/bench/_sparse_worker.py draws them."""
    rng = np.random.default_rng([rank, step, 31])
    cols = [((rng.zipf(zipf, batch).astype(np.int64) - 1) * 2654435761) % n for n in sizes]
    return np.stack(cols, axis=1)


def rounds(a: argparse.Namespace, sizes: list[int]) -> list[list[list[np.ndarray]]]:
    """Per round, per table, each worker's unique ids of server 0's shard (its push and pull)."""
    out = []
    for step in range(a.rounds + 1):
        per_table: list[list[np.ndarray]] = [[] for _ in sizes]
        for w in range(a.workers):
            ids = batch_ids(w, step, sizes, a.batch, 1.2)
            for t in range(len(sizes)):
                u = np.unique(ids[:, t])
                per_table[t].append(u[u % a.servers == 0])
        out.append(per_table)
    return out


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def run(a: argparse.Namespace, optimizer: str) -> dict[str, tuple[float, float]]:
    sizes = [max(1, a.rows // 10 ** i) for i in range(a.tables)]
    specs = [E.TableSpec.make(f"t{i}", n, a.dim, optimizer=optimizer, seed=i)
             for i, n in enumerate(sizes)]
    data = rounds(a, sizes)
    times: dict[str, list[list[float]]] = {}
    for impl, shard_cls, summer in (("numpy", E.NumpyTableShard, E.reference_sum_rows),
                                    ("kernels", E.TableShard, E.sum_rows)):
        rng = np.random.default_rng(0)   # the same gradients for both
        threads = {"threads": a.threads} if impl == "kernels" else {}
        shards = [shard_cls(s, 0, a.servers, **threads) for s in specs]
        cold = [shard_cls(s, 0, a.servers, **threads) for s in specs]
        for r in range(a.rounds):
            row = {"sum_rows": 0.0, "apply": 0.0, "rows": 0.0, "apply (cold)": 0.0,
                   "rows (cold)": 0.0}
            for t, shard in enumerate(shards):
                pushes = data[r][t]
                grads = [rng.standard_normal((len(p), a.dim)).astype(np.float32)
                         for p in pushes]
                box: list = []
                row["sum_rows"] += timed(lambda: box.extend(summer(pushes, grads, a.dim)))
                ids, sums = box
                row["apply"] += timed(lambda: shard.apply(ids, sums))
                for p in data[r + 1][t]:
                    row["rows"] += timed(lambda: shard.rows(p))
                cold[t].forget()
                row["apply (cold)"] += timed(lambda: cold[t].apply(ids, sums))
                cold[t].forget()
                for p in data[r + 1][t]:
                    row["rows (cold)"] += timed(lambda: cold[t].rows(p))
            for k, v in row.items():
                times.setdefault(k, [[], []])[impl == "kernels"].append(v)
        if impl == "numpy":
            reference = [s.weights.copy() for s in shards]
        else:
            same = all(np.array_equal(x.view(np.uint32), s.weights.view(np.uint32))
                       for x, s in zip(reference, shards))
            assert same, "the kernels and numpy differ"
    return {k: (statistics.median(v[0]), statistics.median(v[1])) for k, v in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--tables", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--optimizer", default="all", choices=["sgd", "adagrad", "adam", "all"])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--threads", type=int, default=1,
                   help="threads the kernels make new rows on (TableShard(threads=))")
    p.add_argument("--repeat", type=int, default=3,
                   help="runs of the whole measurement; each figure is the least of their "
                        "medians (a shared machine's load only adds time)")
    a = p.parse_args()
    if min(a.rows, a.tables, a.dim, a.batch, a.workers, a.servers, a.rounds, a.repeat,
           a.threads) < 1:
        p.error("every size and count must be >= 1")
    print(f"one server's round: {a.tables} tables of {a.rows:,} rows and down x {a.dim}, "
          f"{a.workers} workers x batch {a.batch}, server 0 of {a.servers}; median of "
          f"{a.rounds} rounds, least of {a.repeat} runs, kernels on {a.threads} thread(s); ms")
    print("| optimizer | step | numpy ms | kernels ms | numpy / kernels |")
    print("|---|---|--:|--:|--:|")
    for opt in (["sgd", "adagrad", "adam"] if a.optimizer == "all" else [a.optimizer]):
        runs = [run(a, opt) for _ in range(a.repeat)]
        for step in runs[0]:
            np_ms, k_ms = (min(r[step][i] for r in runs) for i in (0, 1))
            print(f"| {opt} | {step} | {np_ms:.3f} | {k_ms:.3f} | {np_ms / k_ms:.1f} |")


if __name__ == "__main__":
    main()
