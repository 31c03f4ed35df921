"""The table pulls a server's I/O threads answer themselves (csrc/dataplane_table_pulls.h).

The tables' thread (server/sparse.py) registers each shard it holds with the native plane and
keeps telling it the rules: the round applied, the oldest rollback generation a request may
carry, the ranks and limits. While a shard is open the plane answers a pull of the applied
round at once, parks one of the next round until the tables' thread applies it (the optimizer
step publishes the new round in the same hold of the shard's lock), and hands anything else to
the tables' thread, which answers it as it always did. A shard is closed while this thread
rewrites its rows or its rounds (a load, a rollback, an elastic epoch) or once it failed; the
pulls the plane had parked then come back here.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..embedding import MAX_TABLES
from ..transport import native
from .table import Table

if TYPE_CHECKING:
    from .sparse import SparseService


class PlanePulls:
    """What the plane may answer of one server's tables (the tables' thread only)."""

    def __init__(self, service: SparseService):
        self.svc = service

    def add(self, table: Table, open_: bool = True) -> None:
        """Hold a table shard; the plane answers its pulls while it is open."""
        svc = self.svc
        svc.tables[table.key] = table
        if not svc.server.async_mode:   # asynchronous mode: every pull at once, here
            svc.server.native.table_serve(table.key, table.shard.kernels)
            self.publish(table, open_)

    def publish(self, table: Table, open_: bool = True) -> list:
        """Tell the plane the table's rules; returns the pulls it parked that may no longer wait
        there, as requests for the tables' thread."""
        svc = self.svc
        srv, limit = svc.server, svc.ranks.limit()
        return table.shard.kernels.serve(
            open=open_ and table.failed is None and not srv.async_mode, applied=table.applied,
            generation=svc.keep.generation.get(table.key % MAX_TABLES, 0),
            rows=table.spec.rows, rank_limit=limit, park_limit=2 * limit,
            max_ids=svc.max_ids, max_message=srv.cfg.transport.max_message_bytes)

    def closed(self, table: Table) -> list:
        """The plane answers none of the table's pulls (the tables' thread rewrites its rows or
        its rounds); the pulls it had parked, as requests."""
        return self.publish(table, open_=False)

    def reopen(self, table: Table, late: list | tuple = ()) -> None:
        """The plane may answer the table's pulls again; ``late`` (pulls :meth:`closed` gave
        back) and those it can no longer park are taken by the tables' thread now."""
        for stream, header, meta, payload in [*late, *self.publish(table)]:
            self.svc.request(native.table_route(stream), header, meta, payload)
