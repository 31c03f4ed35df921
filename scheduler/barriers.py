"""The scheduler's barriers: a group's barrier of sequence number ``seq`` completes when every
node of the group that is neither lost nor still waiting to join an elastic job has arrived."""
from __future__ import annotations

from collections.abc import Callable

from ..wire import MsgType
from .nodes import Host, NodeInfo


class Barriers:
    """The barriers in progress of one scheduler."""

    def __init__(self, host: Host, waiting_to_join: Callable[[], list[NodeInfo]]):
        self.host = host
        self.waiting_to_join = waiting_to_join   # elastic: joiners not admitted yet
        self.arrived: dict[tuple[str, int], set[bytes | None]] = {}

    def arrive(self, node: NodeInfo, group: str, seq: int) -> None:
        self.arrived.setdefault((group, seq), set()).add(node.route.ident)
        self.check(group, seq)

    def check(self, group: str, seq: int) -> None:
        if self.host.phase == "register":  # a restarted scheduler's nodes still coming back
            return
        pending = self.waiting_to_join()
        members = [n for n in self.host.nodes.values()
                   if (group == "all" or n.role.label == group) and not n.lost
                   and n not in pending]
        arrived = self.arrived.get((group, seq), set())
        if {n.route.ident for n in members} <= arrived:
            del self.arrived[(group, seq)]
            for n in members:
                self.host.send(n, MsgType.BARRIER_DONE, {"group": group}, key=seq)

    def check_all(self) -> None:
        """A node left: the barriers that waited only for it complete."""
        for group, seq in list(self.arrived):
            self.check(group, seq)

    def clear(self) -> None:
        """A new elastic epoch: the barriers of the old one are void."""
        self.arrived.clear()
