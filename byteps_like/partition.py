"""Cutting tensors into partitions and mapping partition keys to servers.

Pure functions, no I/O: unit-tested directly.
"""
from __future__ import annotations

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


@dataclass
class ServerAssigner:
    """Maps each partition key to a server, spreading bytes evenly.

    Each new partition goes to the server with the fewest bytes assigned so far (ties to the
    lowest rank). Every worker sees the same sequence of (key, nbytes) — tensors are declared in
    the same order everywhere, which the servers check — so every worker computes the same map.
    """
    num_servers: int

    def __post_init__(self) -> None:
        if self.num_servers < 1:
            raise ValueError("at least one server is needed")
        self.load = [0] * self.num_servers
        self.assigned: dict[int, int] = {}

    def assign(self, key: int, nbytes: int) -> int:
        srv = self.assigned.get(key)
        if srv is None:
            srv = min(range(self.num_servers), key=lambda s: (self.load[s], s))
            self.load[srv] += nbytes
            self.assigned[key] = srv
        return srv

    def imbalance(self) -> float:
        """max/mean of the bytes per server (1.0 is perfect)."""
        mean = sum(self.load) / len(self.load)
        return max(self.load) / mean if mean else 1.0
