"""What the scheduler's parts share: the nodes of the job, the checked message fields, and the
narrow view of the scheduler they work through (:class:`Host`).

The parts (:mod:`.barriers`, :mod:`.join`, :mod:`.elastic`, :mod:`.registration`) take a
:class:`Host` and the other parts they use, never the :class:`~.core.Scheduler` itself, so none
imports :mod:`.core` back.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ..transport import Route
from ..wire import ERR_PROTOCOL, MsgType, Role

if TYPE_CHECKING:
    from ..config import Config


@dataclass
class NodeInfo:
    route: Route
    role: Role
    host: str
    port: int
    pid: int
    worker_id: int | None = None
    local_rank: int = 0
    rank: int = -1
    last_seen: float = field(default_factory=time.monotonic)
    finished: bool = False
    lost: bool = False
    data_port: int = 0
    told_removed: bool = False   # elastic: a worker declared lost that spoke again was told
    pgid: int = 0                # its process group (bpslaunch's child: see _exited)
    server_id: int | None = None  # BYTEPS_SERVER_ID: a server's rank as its launcher named it

    def describe(self) -> str:
        return f"{self.role.label} rank {self.rank} on {self.host} (pid {self.pid})"

    def public(self) -> dict:
        return {"role": self.role.label, "rank": self.rank, "host": self.host, "port": self.port,
                "pid": self.pid, "data_port": self.data_port}


class Host(Protocol):
    """What the scheduler's parts use of the scheduler."""

    cfg: Config
    nodes: dict[bytes | None, NodeInfo]   # by the routing id of the node's connection
    expected: dict[Role, int]             # nodes the job needs, by role
    phase: str                            # register | running | done | refused
    started: float                        # time.monotonic() when it started
    elastic: bool                         # membership epochs (BYTEPS_ELASTIC)
    table: list[dict]                     # the node table, once published

    def send(self, node_or_route: NodeInfo | Route, mtype: MsgType, meta: dict | None = None,
             key: int = 0) -> None: ...

    def reject(self, route: Route, reason: str, text: str, kind: str = ERR_PROTOCOL, *,
               log_as: str | None = None) -> None: ...

    def finish(self, code: int, why: str | None = None) -> None: ...

    def shutdown_all(self) -> None: ...

    def counts(self) -> str: ...


def workers(host: Host) -> list[NodeInfo]:
    return [n for n in host.nodes.values() if n.role is Role.WORKER]


def servers(host: Host) -> list[NodeInfo]:
    """The servers not lost."""
    return [n for n in host.nodes.values() if n.role is Role.SERVER and not n.lost]


class BadField(ValueError):
    """A message field of the wrong type or out of range (answered with an ERROR)."""


def show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


_MISSING = object()


def checked(meta: dict, name: str, kind: type, default: Any = _MISSING, *,
            lo: int | None = None, hi: int | None = None, what: str | None = None) -> Any:
    """meta[name], checked: exactly of ``kind`` (a JSON number that is a bool or a float is
    no int), within [lo, hi]; ``default`` when absent (None allowed only as the default)."""
    value = meta.get(name, default)
    label = f"{name} ({what})" if what else name
    if value is _MISSING:
        raise BadField(f"{label} is missing")
    if value is None and default is None:
        return None
    if type(value) is not kind:
        raise BadField(f"{label} {show(value)} is not {'an' if kind is int else 'a'} "
                       f"{'integer' if kind is int else 'string'}")
    if isinstance(value, int) and (lo is not None and value < lo or hi is not None and value > hi):
        span = f"{lo if lo is not None else '-inf'}..{hi if hi is not None else 'inf'}"
        raise BadField(f"{label}={value} is out of range ({span})")
    return value
