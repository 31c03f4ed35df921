"""One server-held table shard as a server keeps it: the shard, its open round, what waits for
it (server/sparse.py serves it; server/sparse_survival.py keeps it)."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..embedding import TableShard, TableSpec
from ..wire import ERR_MISMATCH


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
