"""join(): worker ranks that run out of data (Horovod's ``hvd.join()``; docs/architecture.md,
"Membership within a job").

The scheduler owns the set: a worker's JOIN (carrying the rounds its tensors reached) makes it
tell every server which worker machines are joined and which finished without joining
(MEMBERS, a membership epoch of its own); once every worker has joined it sends that (the
rounds still open complete with the pushes they have), then the empty membership, waits for
each server's acknowledgement of it, and only then releases the workers (JOIN_DONE, with each
tensor's highest round), so no round of the next epoch completes short.
"""
from __future__ import annotations

import logging

from ..wire import MsgType
from .nodes import Host, NodeInfo, servers, workers

log = logging.getLogger("byteps_like.scheduler")


class Joins:
    """The join() state of one scheduler."""

    def __init__(self, host: Host):
        self.host = host
        # worker ranks waiting in join(), machines that finished without joining (why), and
        # the membership epoch the servers last acknowledged (see members)
        self.joined: dict[int, NodeInfo] = {}
        self.last_joined = -1
        self.left: dict[int, str] = {}
        self.members_epoch = 0
        # servers yet to ack the post-join reset
        self.release_acks: set[bytes | None] | None = None
        self.release_epoch = 0
        self.joined_all: dict[int, NodeInfo] = {}     # the ranks released by that ack
        self.join_rounds: dict[str, int] = {}         # tensor -> most rounds a joiner pushed
        # asynchronous mode with a staleness bound: worker machines gone (finished or lost)
        self.departed: dict[int, str] = {}

    def members(self) -> None:
        """Tell every server which worker machines are joined or left (a new epoch)."""
        self.members_epoch += 1
        ls = self.host.cfg.cluster.local_size
        meta = {"joined": sorted({r // ls for r in self.joined}),
                "left": {str(m): why for m, why in {**self.departed, **self.left}.items()}}
        for n in servers(self.host):
            self.host.send(n, MsgType.MEMBERS, meta, key=self.members_epoch)

    def join(self, node: NodeInfo, rounds: object) -> None:
        """A worker ran out of data: later rounds need no push from it. Once every worker has
        joined, the servers go back to expecting all of them (acknowledged) before the workers
        are released, so no round of the next epoch completes short."""
        if self.left:
            self.host.send(node, MsgType.JOIN_DONE, {"error": "; ".join(self.left.values())})
            return
        self.joined[node.rank] = node
        self.last_joined = node.rank
        # per tensor, the most rounds any worker pushed: where every worker continues
        if isinstance(rounds, dict):
            for name, rnd in list(rounds.items())[:100_000]:
                if isinstance(name, str) and type(rnd) is int and rnd >= 0:
                    self.join_rounds[name] = max(rnd, self.join_rounds.get(name, 0))
        everyone = workers(self.host)
        log.info("scheduler: worker rank %d joined (%d of %d)", node.rank, len(self.joined),
                 len(everyone))
        self.members()
        if len(self.joined) < len(everyone):
            return
        # everyone joined (sent above): the rounds left open complete with the pushes they
        # have (a rank a round behind will not push its last one: the server-held tables'
        # pipelined pushes, or a rollback); then the reset to expecting every worker
        self.joined_all = dict(self.joined)
        self.joined = {}
        self.members()
        acks = {n.route.ident for n in servers(self.host)}
        self.release_acks = acks
        self.release_epoch = self.members_epoch
        if not acks:
            self.release()

    def members_ack(self, node: NodeInfo, epoch: int) -> None:
        if self.release_acks is None or epoch != self.release_epoch:
            return
        self.release_acks.discard(node.route.ident)
        if not self.release_acks:
            self.release()

    def release(self) -> None:
        self.release_acks = None
        for n in self.joined_all.values():
            self.host.send(n, MsgType.JOIN_DONE, {"last": self.last_joined,
                                                  "rounds": self.join_rounds})
        self.joined_all = {}
        self.join_rounds = {}

    def leave(self, node: NodeInfo) -> None:
        """A worker finished without join() while others may still push: rounds it has not
        pushed can never complete. The servers fail them with PeerLeftError naming it; ranks
        waiting in join() get the same error."""
        why = (f"worker rank {node.rank} on {node.host} (pid {node.pid}) has finished (its "
               "script ended without join()) and pushes no more")
        log.info("scheduler: %s while other workers still run", why)
        self.left[node.rank // self.host.cfg.cluster.local_size] = why
        self.members()
        for n in list(self.joined.values()):
            self.host.send(n, MsgType.JOIN_DONE, {"error": why})
        self.joined = {}
        # nothing needs it any more: it leaves now instead of waiting in shutdown() for the
        # others (which fail with PeerLeftError naming it, or finish: it pushed their rounds)
        self.host.send(node, MsgType.SHUTDOWN)

    def depart(self, node: NodeInfo, why: str) -> None:
        """Asynchronous mode with a staleness bound (BYTEPS_ASYNC_STALENESS): once every worker
        of ``node``'s machine finished or was lost, the servers hold no other worker back for
        it (it is "left" in their membership; an asynchronous server fails nothing for that).
        Without a bound nothing waits for anyone, so nothing is sent, as before."""
        if not self.host.cfg.server.async_staleness:
            return
        ls = self.host.cfg.cluster.local_size
        machine = node.rank // ls
        if machine in self.departed or not all(
                n.finished or n.lost for n in workers(self.host) if n.rank // ls == machine):
            return
        self.departed[machine] = why[:1000]
        log.info("scheduler: %s; the servers' staleness bound waits for it no more", why)
        self.members()
