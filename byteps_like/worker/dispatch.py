"""Message dispatch: every message the worker's endpoint receives, on its I/O thread.

:meth:`Dispatcher.on_message` decodes a message and routes it by who may send it:

* the scheduler's messages go to the control client (:class:`byteps_like.control.
  ControlClient`: the node table, barriers, join, peer failures, shutdown);
* the local-reduction messages of this machine's ranks go to :mod:`.local_reduce`, once
  :meth:`~.local_reduce.LocalReduction.sender_problem` finds the sender entitled to send them;
* a dense tensor's pushes and pulls and a server-held table's requests travel on the native
  data plane (:mod:`.dataplane`, the table streams of :mod:`.sparse`), so no answer of
  theirs comes here.

Anything else is dropped and counted (``Membership.dropped``, docs/reliability.md), never
raised: a hostile or confused peer cannot stop the I/O thread.

Who calls it: the endpoint's I/O thread (``Membership.open`` installs :meth:`Dispatcher.
on_message`); :mod:`.dataplane` uses :func:`server_error` for the native plane's error replies.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ..errors import MismatchError, PeerLeftError, ProtocolError, RemoteError
from ..transport import Route
from ..wire import (
    ERR_MISMATCH,
    ERR_PEER_LEFT,
    decode,
)
from .local_reduce import LOCAL_TYPES

if TYPE_CHECKING:
    from .inflight import InFlight
    from .local_reduce import LocalReduction
    from .membership import Membership

log = logging.getLogger("byteps_like.worker")
#: local-reduction messages a local root holds while its own node table is not in yet (a local
#: rank that met its peers first says LOCAL_READY at once), replayed once it is: at most this
#: many, of at most EARLY_BYTES each; the rest is dropped and counted as before
EARLY_LIMIT = 64
EARLY_BYTES = 4096


def server_error(what: str, kind: str | None, text: str, server: int,
                 meta: dict[str, Any] | None = None) -> Exception:
    """A server's error reply (either data path) as the exception users get."""
    if kind == ERR_MISMATCH:
        return MismatchError(f"{what}: {text}")
    if kind == ERR_PEER_LEFT:
        meta = meta or {}
        rank, last = meta.get("rank"), meta.get("last_round")
        return PeerLeftError(f"{what}: {text}",
                             rank=rank if isinstance(rank, int) else None,
                             last_round=last if isinstance(last, int) else None)
    return RemoteError(f"{what}: {text}", role="server", rank=server)


class Dispatcher:
    """Routes the messages of one runtime's endpoint."""

    def __init__(self, members: Membership, flight: InFlight, local: LocalReduction):
        self.members = members
        self.flight = flight
        self.local = local
        self._early: list[tuple[Route, list]] = []   # EARLY_LIMIT


    def replay_early(self) -> None:
        """The local-reduction messages held before the node table, once it is in (the I/O
        thread: a timer of the endpoint, or the next message), checked as any other."""
        if not self.members.peers_ready or not self._early:
            return
        early, self._early = self._early, []
        for route, frames in early:
            self.on_message(route, frames)

    def on_message(self, route: Route, frames: list) -> None:
        m = self.members
        try:
            msg = decode(frames, m.config.transport.max_message_bytes)
        except ProtocolError as exc:
            m.dropped("malformed", f"from {route}: {exc}")
            return
        if route.peer == "scheduler":
            m.controller.handle(msg)
            return
        h = msg.header
        if not m.peers_ready:  # before the node table nobody may talk to it
            if (h.type in LOCAL_TYPES and len(self._early) < EARLY_LIMIT
                    and sum(len(f) for f in frames) <= EARLY_BYTES):
                self._early.append((route, frames))  # checked when replayed (replay_early)
                return
            m.dropped("message before the node table", f"{h.type.name} from {route}")
            return
        if self._early:
            self.replay_early()
        if h.type in LOCAL_TYPES:
            why = self.local.sender_problem(route, h)
            if why:
                m.dropped(why, f"{h.type.name} key {h.key} round {h.round} from {route}")
                return
            self.local.on_message(route, h)
            return
        # pushes, pulls and the tables' requests travel on the native data plane: no answer
        # of a dense tensor or a table comes over ZeroMQ
        m.dropped("answer that matches no push in flight",
                  f"{h.type.name} key {h.key} round {h.round} from {route}")
