"""One server-held table shard as a server keeps it: the shard, its open round, what waits for
it (server/sparse.py serves it; server/sparse_survival.py keeps it)."""
from __future__ import annotations

from collections.abc import Container, Iterable
from dataclasses import dataclass, field

from ..embedding import TableShard, TableSpec
from ..transport import native
from ..wire import ERR_MISMATCH, decode_header


@dataclass
class Table:
    spec: TableSpec
    shard: TableShard
    shards: int
    decl_rank: int
    charged: int
    applied: int = 0                        # rounds applied: the open round is this one
    pushes: dict = field(default_factory=dict)   # rank -> (ids, grads) of the open round
    pending: list = field(default_factory=list)  # (route, msg, ids) waiting for the round
    failed: str | None = None
    failed_kind: str = ERR_MISMATCH
    failed_extra: dict = field(default_factory=dict)   # peer_left: rank, last_round
    average: bool | None = None                  # the open round's pushes: averaged or summed
    done: dict = field(default_factory=dict)     # (type, tag) -> round of a save/load done
    saving: dict = field(default_factory=dict)   # (type, tag) -> (round, [(route, header)])
    round_started: float | None = None           # monotonic time of the open round's 1st push
    key: int = -1                                # the table's id

    # what the stall inspector reads of a store (server/stalls.py)
    @property
    def round(self) -> int:
        return self.applied

    @property
    def pushed(self) -> dict:
        return self.pushes

    @property
    def decl(self) -> dict:
        return {"name": f"table {self.spec.name}"}


def waiting_headers(table: Table, late: list) -> list[tuple]:
    """(route, header) of every request waiting for the table's open round: those this thread
    holds and ``late``, the pulls the plane had parked (SparseService.closed)."""
    out: list[tuple] = [(route, msg.header) for route, msg, _ids in table.pending]
    out += [(native.table_route(stream), decode_header(header)) for stream, header, *_ in late]
    return out


#: worker processes per machine a table job may declare (BYTEPS_LOCAL_SIZE)
MAX_LOCAL_SIZE = 256


class Pushers:
    """Who pushes the tables' rounds: every worker process. A machine of L processes pushes
    L times a round, as process ranks m*L .. m*L+L-1 (the ranks of the job: the same sums in
    the same order as L machines of one process); join() and leaving the job are by machine.
    L comes with the first table's declaration and is the same for every table."""

    def __init__(self, machines: int):
        self.machines = machines
        self.per_machine = 0             # L; 0: no table declared yet
        self.joined: frozenset = frozenset()   # machines in join()
        self.left: dict[int, str] = {}         # machines gone without it -> why

    def limit(self) -> int:
        """Ranks below this may ask for a table (before the first declaration: any L)."""
        return self.machines * (self.per_machine or MAX_LOCAL_SIZE)

    def declare(self, per_machine: object, rank: int) -> str | None:
        """A declaration's L from worker rank ``rank``: None when it fits, else why not."""
        if type(per_machine) is not int or not 1 <= per_machine <= MAX_LOCAL_SIZE:
            return f"local size {per_machine!r} is not 1..{MAX_LOCAL_SIZE}"
        if self.per_machine and per_machine != self.per_machine:
            return (f"declared with {per_machine} worker processes per machine, the tables "
                    f"have {self.per_machine} (BYTEPS_LOCAL_SIZE must be the same everywhere)")
        if rank >= self.machines * per_machine:
            return (f"rank {rank} is not below {self.machines} machines x {per_machine} "
                    "processes")
        self.per_machine = per_machine
        return None

    def _ranks(self, machine: int) -> range:
        n = self.per_machine or 1
        return range(machine * n, (machine + 1) * n)

    def joined_ranks(self) -> frozenset:
        return frozenset(r for m in self.joined for r in self._ranks(m))

    def left_ranks(self) -> dict[int, str]:
        return {r: why for m, why in self.left.items() for r in self._ranks(m)}

    def of(self, machines: Iterable[int]) -> int:
        """How many process ranks the machines hold."""
        return sum(len(self._ranks(m)) for m in machines)

    def missing(self, pushed: Container[int], machines: int) -> list[int]:
        """The process ranks of the first ``machines`` machines that a round with the pushes of
        ``pushed`` still waits for: those that neither pushed it nor are in join(). A rank that
        pushed and then joined counts for the round and stands in for no other (counted
        against the ranks not joined, such a push completed a round before a rank that had
        not pushed yet: its push then came to a closed round)."""
        joined = self.joined_ranks()
        return [r for r in range(self.of(range(machines)))
                if r not in pushed and r not in joined]
