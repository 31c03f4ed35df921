"""Server-held embedding tables: what a table is, how it is sharded, initialised and updated.

Shared by the servers (``server/sparse.py`` serves the shards) and by a worker that runs alone
(its one shard lives in the process). The per-row work (summing a round's pushes, making rows
from their initial values, gathering a pull's rows, the optimizer step) runs in the compiled
kernels of ``csrc/table_kernels.cc`` without the GIL; the numpy code they replace stays here as
their reference (:func:`reference_sum_rows`, :func:`reference_initial_rows`,
:class:`NumpyTableShard`), which they match bit for bit (tests/unit/test_table_kernels.py).

* **Spec.** :class:`TableSpec`: name, ``rows`` x ``dim`` of float32, an initializer (``zeros``,
  ``uniform(low, high)``, ``normal(mean, std)``) with a seed, and a server-side optimizer
  (``sgd``, ``adagrad``, ``adam``). It travels as JSON in the table's SPARSE_CREATE and is
  validated field by field (:meth:`TableSpec.from_json`): a peer's declaration is untrusted.
* **Sharding.** Cyclic by row: row ``i`` lives on server ``i % S`` at local row ``i // S``.
  Ids drawn from a skewed (Zipf) distribution are hot at the small ids; a cyclic layout spreads
  them over every server, where ranges would put them all on the first.
* **Initial values** come from ``(seed, row, column)`` alone through a counter-based hash
  (splitmix64), so a table has the same values whatever the number of servers, and a row is
  made the first time it is read or updated (a 10M-row table is created at once, and its
  memory is touched as its rows are).
* **Optimizers** update only the rows a round touched (lazy): SGD ``w -= lr * g``; Adagrad
  ``a += g*g; w -= lr * g / (sqrt(a) + eps)``; Adam with moments and a step count per row (a
  row's bias correction counts the rounds that touched it).
"""
from __future__ import annotations

import collections
import contextlib
import json
import logging
import math
import os
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import _core, shardfile
from .shardfile import TableError

log = logging.getLogger(__name__)

#: initializers and their parameters (name -> defaults)
INITIALIZERS: dict[str, dict[str, float]] = {
    "zeros": {},
    "uniform": {"low": -0.05, "high": 0.05},
    "normal": {"mean": 0.0, "std": 0.01},
}
#: optimizers and their parameters (name -> defaults)
OPTIMIZERS: dict[str, dict[str, float]] = {
    "sgd": {"lr": 0.01},
    "adagrad": {"lr": 0.01, "eps": 1e-10, "initial_accumulator_value": 0.0},
    "adam": {"lr": 0.001, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8},
}
#: a table's own memory beyond its arrays, charged to the server budget with them
TABLE_OVERHEAD = 4096
#: rows generated at once by the initializer (bounds its temporary arrays)
_INIT_CHUNK_ELEMS = 1 << 20
_MAX_NAME = 200



def _number(what: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TableError(f"{what} must be a finite number, not {value!r}")
    return float(value)


def _params(kind: str, name: Any, given: Any, table: dict[str, dict[str, float]]) -> dict:
    if not isinstance(name, str) or name not in table:
        raise TableError(f"unknown {kind} {name!r}: use one of {', '.join(table)}")
    if given is None:
        given = {}
    if not isinstance(given, dict):
        raise TableError(f"the {kind} parameters must be a mapping, not {type(given).__name__}")
    unknown = set(given) - set(table[name])
    if unknown:
        raise TableError(f"{kind} {name} takes {', '.join(table[name]) or 'no parameters'}, "
                         f"not {', '.join(sorted(map(str, unknown)))}")
    return {k: _number(f"{kind} {name} parameter {k}", given.get(k, v))
            for k, v in table[name].items()}


@dataclass(frozen=True)
class TableSpec:
    """One embedding table, as every worker declares it and every server holds its shard."""
    name: str
    rows: int
    dim: int
    dtype: str = "float32"
    init: str = "normal"
    init_args: dict = field(default_factory=dict)
    seed: int = 0
    optimizer: str = "sgd"
    optimizer_args: dict = field(default_factory=dict)

    @classmethod
    def make(cls, name: str, rows: int, dim: int, *, dtype: str = "float32",
             init: str = "normal", init_args: dict | None = None, seed: int = 0,
             optimizer: str = "sgd", **optimizer_args: Any) -> TableSpec:
        """A checked spec (TableError says what is wrong); optimizer parameters by keyword."""
        return cls.from_json({"name": name, "rows": rows, "dim": dim, "dtype": dtype,
                              "init": init, "init_args": init_args or {}, "seed": seed,
                              "optimizer": optimizer, "optimizer_args": optimizer_args})

    @classmethod
    def from_json(cls, meta: Any) -> TableSpec:
        """A spec from its JSON form, every field checked (a peer's declaration is untrusted)."""
        if not isinstance(meta, dict):
            raise TableError("a table declaration is a JSON object")
        name = meta.get("name")
        if not isinstance(name, str) or not 0 < len(name) <= _MAX_NAME:
            raise TableError(f"a table name is a string of 1 to {_MAX_NAME} characters")

        def count(key: str, top: int) -> int:
            v = meta.get(key)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= top:
                raise TableError(f"table {name!r}: {key} must be an integer in 1..{top}, "
                                 f"not {v!r}")
            return v
        rows, dim = count("rows", 1 << 40), count("dim", 1 << 16)
        dtype = meta.get("dtype", "float32")
        if dtype != "float32":
            raise TableError(f"table {name!r}: dtype {dtype!r} is not supported yet; server-held "
                             "tables are float32")
        seed = meta.get("seed", 0)
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 1 << 63:
            raise TableError(f"table {name!r}: the seed must be an integer in 0..2^63-1")
        try:
            init_args = _params("initializer", meta.get("init", "normal"),
                                meta.get("init_args"), INITIALIZERS)
            opt_args = _params("optimizer", meta.get("optimizer", "sgd"),
                               meta.get("optimizer_args"), OPTIMIZERS)
        except TableError as exc:
            raise TableError(f"table {name!r}: {exc}") from None
        if "lr" in opt_args and opt_args["lr"] < 0:
            raise TableError(f"table {name!r}: the learning rate must not be negative")
        return cls(name, rows, dim, dtype, meta.get("init", "normal"), init_args, seed,
                   meta.get("optimizer", "sgd"), opt_args)

    def to_json(self) -> dict:
        return {"name": self.name, "rows": self.rows, "dim": self.dim, "dtype": self.dtype,
                "init": self.init, "init_args": dict(self.init_args), "seed": self.seed,
                "optimizer": self.optimizer, "optimizer_args": dict(self.optimizer_args)}

    def describe(self) -> str:
        return (f"{self.name!r} ({self.rows} x {self.dim} {self.dtype}, {self.init} "
                f"{json.dumps(self.init_args)} seed {self.seed}, {self.optimizer} "
                f"{json.dumps(self.optimizer_args)})")

    @property
    def row_bytes(self) -> int:
        return 4 * self.dim


# -- sharding -------------------------------------------------------------------------------------
#: tables a job has at most (a table id is below this); a request names a table's shard s as
#: the key ``table id + MAX_TABLES * s`` (wire_key)
MAX_TABLES = 4096


def wire_key(table_id: int, shard: int) -> int:
    """The key of shard ``shard`` of table ``table_id`` in a request's header."""
    return table_id + MAX_TABLES * shard


def held_shards(rank: int, servers: int, survival: str) -> list[int]:
    """The shards of every table server ``rank`` of ``servers`` holds from the start: its own,
    and with replication the one of the server before it (docs/sparse.md, "Losing a
    server")."""
    if survival == "replicate" and servers > 1:
        return sorted({rank, (rank - 1) % servers})
    return [rank]


def shard_holders(shard: int, servers: int, survival: str, lost: frozenset | set = frozenset()
                  ) -> list[int]:
    """The servers that hold shard ``shard`` now, its primary first (it answers pulls): the
    server of its number, and with replication the next one, less the servers ``lost``; with
    snapshots, the first server left from its own on (which rebuilt it from its snapshots)."""
    if survival == "snapshot":
        return next(([c] for k in range(servers) if (c := (shard + k) % servers) not in lost),
                    [])
    first = [shard, (shard + 1) % servers] if survival == "replicate" and servers > 1 else [shard]
    return [s for s in first if s not in lost]


def shard_rows(rows: int, shard: int, shards: int) -> int:
    """Rows of shard ``shard`` of ``shards`` (cyclic: rows shard, shard + S, ...)."""
    return max(0, (rows - shard + shards - 1) // shards)


def split_by_shard(ids: np.ndarray, shards: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """``ids`` grouped by the shard that holds them: (order, ids of each shard) where
    ``ids[order]`` is the shards' lists concatenated (a stable order within each shard)."""
    if shards == 1:
        return np.arange(len(ids)), [ids]
    order, counts = _core.table_split(np.ascontiguousarray(ids, np.int64), shards)
    return order, np.split(ids[order], np.cumsum(counts)[:-1])


def state_bytes(spec: TableSpec, nrows: int) -> int:
    """What a shard of ``nrows`` rows holds, charged to the server's memory budget: the
    weights, the optimizer's state, two bytes per row (made yet; changed since the last
    snapshot) and the table's own overhead."""
    per_row = spec.row_bytes + 2
    if spec.optimizer == "adagrad":
        per_row += spec.row_bytes
    elif spec.optimizer == "adam":
        per_row += 2 * spec.row_bytes + 4
    return nrows * per_row + TABLE_OVERHEAD


#: a server's log line (INFO, as it exits) with its table service's phases (bench sparse reads it)
PHASES_TAG = "tables' phases:"


class Phases:
    """Where the tables' time goes, always on: seconds and calls per phase (two clock reads a
    phase). A worker keeps one for its tables, a server one for its table service; ``bench
    sparse`` prints them (docs/sparse.md, "Where a step's time goes"). A phase is added to by
    one thread (each thread has phases of its own)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def add(self, phase: str, t0: float) -> float:
        """Count ``now - t0`` to ``phase``; returns now (the next phase's start)."""
        t = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + (t - t0)
        self.calls[phase] = self.calls.get(phase, 0) + 1
        return t

    def snapshot(self) -> dict[str, list]:
        """phase -> [seconds, calls] so far."""
        return {k: [v, self.calls.get(k, 0)] for k, v in list(self.seconds.items())}

    @staticmethod
    def since(now: dict[str, list], before: dict[str, list]) -> dict[str, list]:
        """What two snapshots differ by."""
        zero = [0.0, 0]
        return {k: [v[0] - before.get(k, zero)[0], v[1] - before.get(k, zero)[1]]
                for k, v in now.items()}


class StepPhases(Phases):
    """:class:`Phases` kept per step too (the last ``keep`` steps, each with the CPU time of
    the thread that ends it and of the whole process): a server's table service, whose steps
    are the rounds of its first table."""

    def __init__(self, keep: int = 256) -> None:
        super().__init__()
        self.steps: collections.deque = collections.deque(maxlen=keep)
        self._mark: dict[str, list] = {}
        self._ends = 0

    def end_step(self) -> None:
        self._ends += 1            # the CPU rows' calls: one a step
        n = self._ends
        mark = {**self.snapshot(), "CPU: this thread": [time.thread_time(), n],
                "CPU: the whole process": [time.process_time(), n]}
        if self._mark:
            self.steps.append(Phases.since(mark, self._mark))
        self._mark = mark

    def report(self) -> dict:
        """Per phase, the median over the steps kept of [seconds, calls] (JSON)."""
        steps = list(self.steps)
        med = lambda k, i: statistics.median(st.get(k, [0.0, 0])[i] for st in steps)  # noqa: E731
        return {"steps": len(steps), "phases": {k: [med(k, 0), med(k, 1)]
                                                for k in sorted({k for st in steps for k in st})}}


# -- initial values -------------------------------------------------------------------------------
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_GOLDEN = 0x9E3779B97F4A7C15


def _splitmix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise on uint64 (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x *= _M1
    x ^= x >> np.uint64(27)
    x *= _M2
    x ^= x >> np.uint64(31)
    return x


def _init_args(spec: TableSpec) -> tuple[float, float]:
    """The initializer's two parameters as the kernels take them: (low, high) or (mean, std)."""
    a = spec.init_args
    if spec.init == "uniform":
        return a["low"], a["high"]
    if spec.init == "normal":
        return a["mean"], a["std"]
    return 0.0, 0.0


def initial_rows(spec: TableSpec, ids: np.ndarray) -> np.ndarray:
    """The initial values of the global rows ``ids`` (float32, ``len(ids) x dim``): a function
    of (seed, row, column) only (the compiled kernel; :func:`reference_initial_rows` is its
    numpy reference)."""
    a, b = _init_args(spec)
    return _core.table_initial_rows(np.ascontiguousarray(ids, np.int64), spec.dim, spec.init,
                                    a, b, spec.seed)


def reference_initial_rows(spec: TableSpec, ids: np.ndarray) -> np.ndarray:
    """numpy reference of :func:`initial_rows`: splitmix64 of (seed, row, column); uniform
    ``low + (high - low) * u`` and normal Box-Muller in float64, rounded to float32 once."""
    out = np.zeros((len(ids), spec.dim), np.float32)
    if spec.init == "zeros" or not len(ids):
        return out
    step = max(1, _INIT_CHUNK_ELEMS // spec.dim)
    base = np.uint64((spec.seed * _GOLDEN + 0x632BE59BD9B4E019) & (2**64 - 1))
    cols = np.arange(spec.dim, dtype=np.uint64)
    for a in range(0, len(ids), step):
        rows = ids[a:a + step].astype(np.uint64)
        x = _splitmix((rows[:, None] * np.uint64(spec.dim) + cols[None, :]) * np.uint64(_GOLDEN)
                      + base)
        hi = (x >> np.uint64(40)).astype(np.float64)                     # 24 bits
        if spec.init == "uniform":
            lo, top = spec.init_args["low"], spec.init_args["high"]
            out[a:a + step] = lo + (top - lo) * (hi * 2.0**-24)
        else:  # normal: Box-Muller on two 24-bit uniforms of one hash
            u1 = (hi + 1.0) * 2.0**-24                                      # (0, 1]
            u2 = ((x >> np.uint64(8)) & np.uint64(0xFFFFFF)).astype(np.float64) * 2.0**-24
            z = np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)
            out[a:a + step] = spec.init_args["mean"] + spec.init_args["std"] * z
    return out


# -- summing the pushes of a round ----------------------------------------------------------------
def sum_rows(ids: list[np.ndarray], grads: list[np.ndarray],
             dim: int) -> tuple[np.ndarray, np.ndarray]:
    """The pushes of one round summed per row: (unique ids ascending, float32 sums). The sums
    add the pushes in list order (the servers pass them in worker rank order), and within a
    push in its order, so the result is the same bits on every run. The compiled kernel
    (ValueError when a push's gradients are not ``len(ids) x dim``);
    :func:`reference_sum_rows` is its numpy reference."""
    return _core.table_sum_rows([np.ascontiguousarray(i, np.int64) for i in ids],
                                [_rows_of(g, dim) for g in grads], dim)


def _rows_of(g: np.ndarray, dim: int) -> np.ndarray:
    """A push's gradients as ``n x dim`` float32 rows (a flat array of whole rows reshaped; any
    other shape goes to the kernel as it is, which names it in its ValueError)."""
    g = np.ascontiguousarray(g, np.float32)
    return g.reshape(-1, dim) if g.ndim == 1 and dim > 0 and g.size % dim == 0 else g


def reference_sum_rows(ids: list[np.ndarray], grads: list[np.ndarray],
                       dim: int) -> tuple[np.ndarray, np.ndarray]:
    """numpy reference of :func:`sum_rows`."""
    if not ids:
        return np.zeros(0, np.int64), np.zeros((0, dim), np.float32)
    all_ids = np.concatenate(ids)
    uniq, inv = np.unique(all_ids, return_inverse=True)
    sums = np.zeros((len(uniq), dim), np.float32)
    # A push's ids are unique (workers send each row once), so each push is one fancy-indexed
    # add, in list order: the same additions in the same order as np.add.at over all of them,
    # at a fraction of its cost. A push that repeats an id takes np.add.at.
    start = 0
    for g in grads:
        g = g.reshape(-1, dim)
        idx = inv[start:start + len(g)]
        start += len(g)
        if len(idx) and np.bincount(idx, minlength=len(uniq)).max() > 1:
            np.add.at(sums, idx, g)
        else:
            sums[idx] += g
    return uniq, sums


# -- a shard --------------------------------------------------------------------------------------
#: the optimizer state a shard may hold, by attribute (and checkpoint array) name
_STATE = ("acc", "m", "v", "t")


class TableShard:
    """The rows of one table a server holds (shard ``shard`` of ``shards``) and their
    optimizer state. Rows are made from the initializer the first time they are touched, on up
    to ``threads`` threads (the calling one included; the same values whatever the number)."""

    def __init__(self, spec: TableSpec, shard: int = 0, shards: int = 1, threads: int = 1):
        self.spec, self.shard, self.shards = spec, shard, shards
        self.nrows = shard_rows(spec.rows, shard, shards)
        n, d = self.nrows, spec.dim
        # np.zeros: pages the kernel hands out when first written, so the resident memory
        # grows with the rows touched
        self.weights = np.zeros((n, d), np.float32)
        self.made = np.zeros(n, np.bool_)
        self.changed = np.zeros(n, np.bool_)   # rows updated since the last snapshot
        a = spec.optimizer_args
        self.acc = self.m = self.v = self.t = None
        if spec.optimizer == "adagrad":
            self.acc = np.zeros((n, d), np.float32)
        elif spec.optimizer == "adam":
            self.m = np.zeros((n, d), np.float32)
            self.v = np.zeros((n, d), np.float32)
            self.t = np.zeros(n, np.int32)
        self._lr = np.float32(a["lr"])
        self._eps = np.float32(a.get("eps", 0.0))
        # the compiled kernels, bound to these arrays (which are written in place, never
        # replaced: restore, forget and take_changes write into them)
        init_a, init_b = _init_args(spec)
        self._kernels = _core.TableKernels(
            self.weights, self.made, self.changed, self.acc, self.m, self.v, self.t,
            shard=shard, shards=shards,
            init={"init": spec.init, "a": init_a, "b": init_b, "seed": spec.seed},
            opt={"optimizer": spec.optimizer, "lr": a["lr"], "eps": a.get("eps", 0.0),
                 "beta1": a.get("beta1", 0.0), "beta2": a.get("beta2", 0.0),
                 "acc0": a.get("initial_accumulator_value", 0.0)}, threads=threads)

    @property
    def nbytes(self) -> int:
        return state_bytes(self.spec, self.nrows)

    def local(self, ids: np.ndarray) -> np.ndarray:
        """Local rows of global ids this shard holds (the caller checked them)."""
        return ids // self.shards if self.shards > 1 else ids

    # -- checkpoints ------------------------------------------------------------------------------
    @property
    def kernels(self):
        """The compiled kernels bound to these arrays (a server registers them so its I/O
        threads answer pulls: csrc/dataplane_table_pulls.h)."""
        return self._kernels

    @contextlib.contextmanager
    def locked(self):
        """Hold the shard's lock, which the kernels hold for every call: a server's I/O threads
        may gather rows from these arrays, so Python's own reads and writes hold it too."""
        self._kernels.lock()
        try:
            yield
        finally:
            self._kernels.unlock()

    def state(self, rows: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """The rows made so far (or the local ``rows``), by global id, and their optimizer
        state (what a checkpoint holds; rows never touched are their initial values, made again
        on a restore). A copy."""
        with self.locked():
            return self._state(rows)

    def _state(self, rows: np.ndarray | None) -> dict[str, np.ndarray]:
        local = np.flatnonzero(self.made) if rows is None else rows
        out: dict[str, np.ndarray] = {"ids": local * self.shards + self.shard,
                                      "weights": self.weights[local]}
        for name in _STATE:
            arr = getattr(self, name)
            if arr is not None:
                out[name] = arr[local]
        return out

    def restore(self, state: dict[str, np.ndarray]) -> int:
        """Take the rows of ``state`` (written by any number of servers) that this shard holds;
        returns how many. Call :meth:`forget` first to drop what the shard holds."""
        ids = state["ids"]
        mine = ids % self.shards == self.shard if self.shards > 1 else slice(None)
        local = ids[mine] // self.shards
        with self.locked():
            self.made[local] = True
            self.weights[local] = state["weights"][mine]
            for name in _STATE:
                arr = getattr(self, name)
                if arr is not None:
                    arr[local] = state[name][mine]
        return len(local)

    def forget(self) -> None:
        """Every row back to its initial value (made again when next touched)."""
        with self.locked():
            self.made[:] = False
            self.changed[:] = False

    def take_changes(self) -> dict[str, np.ndarray]:
        """The rows updated since the last call and their optimizer state (an incremental
        snapshot; a copy), and from now on none."""
        with self.locked():
            rows = np.flatnonzero(self.changed)
            self.changed[rows] = False
            return self._state(rows)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """The current rows of global ids (a new float32 array, ``len(ids) x dim``), made
        first where never touched (ValueError naming an id this shard does not hold)."""
        return self._kernels.gather(np.ascontiguousarray(ids, np.int64))

    def apply(self, ids: np.ndarray, grad: np.ndarray, applied: int = -1) -> None:
        """One optimizer step on the rows of the unique global ids ``ids`` with their summed
        gradients ``grad`` (float32, ``len(ids) x dim``); ValueError on another shape, a
        repeated id or an id this shard does not hold (the shard is then untouched).
        ``applied`` >= 0: the rounds applied after this step, told to the pulls the plane
        answers (its parked pulls of that round are answered)."""
        self._kernels.apply(np.ascontiguousarray(ids, np.int64), grad, applied)


class NumpyTableShard(TableShard):
    """A :class:`TableShard` whose per-row steps are the numpy code the compiled kernels
    replaced: their reference, which tests hold them to bit for bit."""

    def _make(self, local: np.ndarray) -> None:
        """Give rows never touched (or forgotten by a restore) their initial values and fresh
        optimizer state."""
        new = local[~self.made[local]]
        if not len(new):
            return
        new = np.unique(new)
        self.made[new] = True
        self.weights[new] = reference_initial_rows(self.spec, new * self.shards + self.shard)
        if self.acc is not None:
            self.acc[new] = np.float32(self.spec.optimizer_args["initial_accumulator_value"])
        for state in (self.m, self.v, self.t):
            if state is not None:
                state[new] = 0

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """The current rows of global ids (a new float32 array, ``len(ids) x dim``)."""
        local = self.local(ids)
        self._make(local)
        return self.weights[local]

    def apply(self, ids: np.ndarray, grad: np.ndarray, applied: int = -1) -> None:
        """One optimizer step on the rows of the unique global ids ``ids`` with their summed
        gradients ``grad`` (float32, ``len(ids) x dim``); ``applied`` is for a served shard's
        pulls, which this reference has none of."""
        if not len(ids):
            return
        u = self.local(ids)
        self._make(u)
        self.changed[u] = True
        w, lr = self.weights, self._lr
        opt = self.spec.optimizer
        if opt == "sgd":
            w[u] = w[u] - lr * grad
        elif opt == "adagrad":
            assert self.acc is not None
            acc = self.acc[u] + grad * grad
            self.acc[u] = acc
            w[u] = w[u] - lr * grad / (np.sqrt(acc) + self._eps)
        else:  # adam, lazy: moments and step count of the touched rows only
            assert self.m is not None and self.v is not None and self.t is not None
            a = self.spec.optimizer_args
            b1, b2 = np.float32(a["beta1"]), np.float32(a["beta2"])
            # 1 - beta in float64 first: 1 - float32(0.999) is off by 1.3e-5 relative
            c1, c2 = np.float32(1.0 - a["beta1"]), np.float32(1.0 - a["beta2"])
            t = self.t[u] + 1
            self.t[u] = t
            m = b1 * self.m[u] + c1 * grad
            v = b2 * self.v[u] + c2 * grad * grad
            self.m[u], self.v[u] = m, v
            bc1 = (1.0 - a["beta1"] ** t.astype(np.float64)).astype(np.float32)[:, None]
            bc2 = (1.0 - a["beta2"] ** t.astype(np.float64)).astype(np.float32)[:, None]
            w[u] = w[u] - lr * (m / bc1) / (np.sqrt(v / bc2) + self._eps)


# -- checkpoint files -----------------------------------------------------------------------------
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}")


def checkpoint_path(directory: str, tag: str, spec: TableSpec, shard: int, shards: int) -> str:
    """Where shard ``shard`` of ``shards`` of a table is written for checkpoint ``tag``:
    ``directory/tag/<table>.shard<s>of<S>.bpst`` (the table's name with every character but
    letters, digits, ``_``, ``.`` and ``-`` written as ``%xx``; the format: shardfile.py)."""
    if not directory:
        raise TableError("no checkpoint directory: set BYTEPS_SPARSE_CHECKPOINT_DIR on the "
                         "servers (on the worker for a job without servers)")
    if not isinstance(tag, str) or not _TAG.fullmatch(tag):
        raise TableError(f"checkpoint tag {tag!r}: use 1 to 100 letters, digits, '_', '.' or "
                         "'-', not starting with '.' or '-'")
    return os.path.join(directory, tag,
                        f"{file_name(spec)}.shard{shard}of{shards}{shardfile.SUFFIX}")


def file_name(spec: TableSpec) -> str:
    """The table's name as its files are named: every character but letters, digits, ``_``,
    ``.`` and ``-`` written as ``%xx`` (checkpoints and snapshots)."""
    return re.sub(r"[^A-Za-z0-9_.-]", lambda m: "".join(f"%{b:02x}" for b in
                                                        m.group().encode()), spec.name)


def save_shard(shard: TableShard, directory: str, tag: str) -> str:
    """Write ``shard`` (its spec, rows made and optimizer state) for checkpoint ``tag``: 0600,
    atomically and durably (shardfile.write). Returns its path."""
    path = checkpoint_path(directory, tag, shard.spec, shard.shard, shard.shards)
    return shardfile.write(path, shard.spec.to_json(), shard.shard, shard.shards, shard.state())


def load_shard(shard: TableShard, directory: str, tag: str, *,
               charge: Callable[[int], bool] | None = None, repair: str = "refuse") -> int:
    """Restore ``shard`` from checkpoint ``tag``, whatever the number of servers that wrote it
    (every one of their files is read and checked, the rows this shard holds taken); returns
    the rows taken. TableError naming the file, the table and what is wrong when the
    checkpoint is missing, incomplete, damaged or of another table (its rows, dim, initial
    values or optimizer; the optimizer's parameters may change); the shard is then untouched.
    ``charge``: the memory budget the files' rows are charged to while they are read (a
    server's), given back once they are taken. ``repair``: "refuse" NaN/inf rows and repeated
    ids, or "drop" them (BYTEPS_SPARSE_CHECKPOINT_REPAIR)."""
    folder = os.path.dirname(checkpoint_path(directory, tag, shard.spec, 0, 1))
    stem = file_name(shard.spec)
    found: dict[int, set[int]] = {}
    old = False
    try:
        names = os.listdir(folder)
    except OSError as exc:
        raise TableError(f"table {shard.spec.name!r}: checkpoint {tag!r} not found in "
                         f"{directory!r} ({exc.strerror})") from None
    for n in names:
        m = re.fullmatch(re.escape(stem) + r"\.shard(\d+)of(\d+)(\.bpst|\.npz)", n)
        if m and m.group(3) == shardfile.OLD_SUFFIX:
            old = True
        elif m:
            found.setdefault(int(m.group(2)), set()).add(int(m.group(1)))
    complete = [k for k, v in found.items() if v == set(range(k))]
    if len(complete) != 1:
        why = ("no complete set of shard files" if not complete else
               f"complete sets of shards for {sorted(complete)} servers")
        if old and not complete:
            why += (" of this format, only .npz files an older byteps_like wrote (no header or "
                    "checksum), which this version does not read: convert them once, trusting "
                    f"them, with `python -m byteps_like.shardfile convert {folder}`")
        raise TableError(f"table {shard.spec.name!r}: checkpoint {tag!r} in {directory!r} has "
                         f"{why} (found {sorted((k, sorted(v)) for k, v in found.items())})")
    shards = complete[0]
    expect = shardfile.Expect(shard.spec.to_json(),
                              [n for n in _STATE if getattr(shard, n) is not None])
    arrays, charged, dropped = [], 0, 0
    try:
        for s in range(shards):
            p = os.path.join(folder, f"{stem}.shard{s}of{shards}{shardfile.SUFFIX}")
            data, nbytes, left_out = shardfile.read(p, s, shards, expect, charge=charge,
                                                    repair=repair)
            charged += nbytes
            dropped += left_out
            arrays.append(data)
        shard.forget()
        taken = sum(shard.restore(a) for a in arrays)
    finally:
        arrays.clear()
        if charge is not None and charged:
            charge(-charged)
    if dropped:
        log.warning("table %r: checkpoint %r loaded without %d row(s) that held NaN/inf or a "
                    "repeated id (BYTEPS_SPARSE_CHECKPOINT_REPAIR=drop): they start again from "
                    "their initial values", shard.spec.name, tag, dropped)
    return taken
