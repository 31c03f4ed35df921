"""Cutting tensors into partitions and mapping partition keys to servers.

Pure functions, no I/O: unit-tested directly.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

PART_BITS = 16
MAX_PARTS = 1 << PART_BITS


def make_key(decl_id: int, part: int) -> int:
    """BytePS-style key: the tensor's declaration index in the high bits, the partition below."""
    return (decl_id << PART_BITS) | part


def split_key(key: int) -> tuple[int, int]:
    return key >> PART_BITS, key & (MAX_PARTS - 1)


def partition_bounds(nbytes: int, itemsize: int, partition_bytes: int) -> list[tuple[int, int]]:
    """(offset, length) in bytes of each partition of a tensor of ``nbytes``.

    Partitions hold whole elements: the size is ``partition_bytes`` rounded down to a multiple of
    ``itemsize``. A zero-byte tensor has no partitions."""
    if nbytes < 0 or itemsize <= 0 or nbytes % itemsize:
        raise ValueError(f"cannot partition {nbytes} bytes of {itemsize}-byte elements")
    step = max(itemsize, partition_bytes - partition_bytes % itemsize)
    bounds = [(off, min(step, nbytes - off)) for off in range(0, nbytes, step)]
    if len(bounds) > MAX_PARTS:
        raise ValueError(f"a tensor of {nbytes} bytes makes {len(bounds)} partitions of {step} "
                         f"bytes, more than {MAX_PARTS}: raise BYTEPS_PARTITION_BYTES")
    return bounds


class Assigner:
    """The shape every partition-to-server map shares: a key keeps the server
    :meth:`_choose` gave its first partition, ``load`` counts the bytes each server got, and
    :meth:`imbalance` compares that with the shares the servers should get. A subclass calls
    :meth:`_reset` with the servers that may get bytes and their shares, and picks a server in
    :meth:`_choose`."""
    num_servers: int

    def _reset(self, eligible: list[int], shares: Sequence[float]) -> None:
        """``eligible``: the servers that may get bytes; ``shares[s]``: the fraction of all
        bytes server ``s`` should get (used for :meth:`imbalance` only)."""
        self._eligible = eligible
        self._shares = tuple(shares)
        self.load = [0] * self.num_servers
        self.assigned: dict[int, int] = {}
        self.count = [0] * self.num_servers  # keys each server got so far
        self.slot: dict[int, int] = {}       # a key's place among its server's keys

    def _choose(self, key: int, nbytes: int) -> int:
        raise NotImplementedError

    def assign(self, key: int, nbytes: int) -> int:
        srv = self.assigned.get(key)
        if srv is None:
            srv = self._choose(key, nbytes)
            self.load[srv] += nbytes
            self.assigned[key] = srv
            self.slot[key] = self.count[srv]
            self.count[srv] += 1
        return srv

    def lane(self, key: int, lanes: int) -> int:
        """Which of ``lanes`` connections to its server carries ``key``: its server's keys in
        turn (the order they were assigned), so each server's keys use all its connections,
        and the server's I/O threads behind them share its work. ``key % lanes`` did not:
        partitions of a tensor alternate servers, so with 2 servers each saw only the even or
        the odd lanes. A key not assigned here gets ``key % lanes``."""
        slot = self.slot.get(key)
        return (key if slot is None else slot) % lanes

    def imbalance(self) -> float:
        """max over servers of (share of the bytes / share it should get); 1.0 is perfect."""
        total = sum(self.load)
        if not total:
            return 1.0
        return max((self.load[s] / total) / self._shares[s] for s in self._eligible)


@dataclass
class ServerAssigner(Assigner):
    """Maps each partition key to a server, spreading bytes evenly (or in proportion to weights).

    Each new partition goes to the server whose load after taking it, divided by its weight,
    is lowest (ties to the lowest rank); with equal weights that is the server with the fewest
    bytes so far. A server of weight 0 gets nothing. Every worker sees the same sequence of
    (key, nbytes) — tensors are declared in the same order everywhere, which the servers check —
    so every worker computes the same map.
    """
    num_servers: int
    weights: Sequence[float] | None = None

    def __post_init__(self) -> None:
        if self.num_servers < 1:
            raise ValueError("at least one server is needed")
        if self.weights is None:
            self.weights = (1.0,) * self.num_servers
        w = tuple(float(x) for x in self.weights)
        if len(w) != self.num_servers:
            raise ValueError(f"{len(w)} weights for {self.num_servers} servers")
        if any(not math.isfinite(x) or x < 0 for x in w) or not any(x > 0 for x in w):
            raise ValueError(f"server weights must be finite, >= 0 and not all 0: {w}")
        self.weights = w
        self._reset([s for s in range(self.num_servers) if w[s] > 0], [x / sum(w) for x in w])

    def _choose(self, key: int, nbytes: int) -> int:
        w = self.weights
        assert w is not None  # set by __post_init__
        return min(self._eligible, key=lambda s: ((self.load[s] + nbytes) / w[s], s))


def mixed_mode_fraction(num_workers: int, num_dedicated: int) -> float:
    """Share of the bytes BytePS's analysis gives the ``k`` dedicated server machines when every
    one of the ``n`` worker machines also runs a server: 2k(n-1) / (n^2 + kn - 2k).

    0 without dedicated servers, 1 when k = n (colocated servers then get nothing); capped at 1
    for k > n."""
    n, k = num_workers, num_dedicated
    if n < 1 or k < 0:
        raise ValueError(f"need n >= 1 workers and k >= 0 dedicated servers, got n={n}, k={k}")
    if k == 0 or n == 1:   # one worker: its colocated server costs its NIC nothing
        return 0.0
    return min(1.0, 2 * k * (n - 1) / (n * n + k * n - 2 * k))


def mixed_mode_weights(colocated: Sequence[bool], num_workers: int) -> list[float] | None:
    """Per-server weights for BytePS's mixed mode: servers that share a host with a worker
    (``colocated[s]``) split ``1 - f`` of the bytes, the others (dedicated) split ``f`` =
    :func:`mixed_mode_fraction`. None when the servers are all of one kind (plain balance)."""
    n_col = sum(1 for c in colocated if c)
    n_ded = len(colocated) - n_col
    if n_col == 0 or n_ded == 0:
        return None
    f = mixed_mode_fraction(num_workers, n_ded)
    return [(1.0 - f) / n_col if c else f / n_ded for c in colocated]
