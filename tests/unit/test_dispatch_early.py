"""A local root's dispatcher holds the local-reduction messages that come before its own node
table (a local rank that met its peers first says LOCAL_READY at once) and hands them on once
the table is in; other early messages, and more than it may hold, are dropped and counted.
(A LOCAL_READY dropped this way left the local rank waiting until its 60 s timeout: seen once
in CI on 2 loaded cores, tests/integration/test_pushpull.py::test_one_machine_of_four_local_ranks.)"""
from __future__ import annotations

from types import SimpleNamespace

from byteps_like.transport import Route
from byteps_like.wire import Header, MsgType, Role, encode
from byteps_like.worker import dispatch
from byteps_like.worker.dispatch import Dispatcher


class _Local:
    def __init__(self):
        self.got = []

    def sender_problem(self, route, h):
        return ""

    def on_message(self, route, h):
        self.got.append((h.type, h.key, h.round))


def _members():
    drops = []
    m = SimpleNamespace(peers_ready=False, config=SimpleNamespace(
        transport=SimpleNamespace(max_message_bytes=1 << 20)))
    m.dropped = lambda why, what: drops.append(why)
    return m, drops


def _msg(mtype, key=7, rnd=0):
    return encode(Header(mtype, role=Role.WORKER, rank=3, key=key, round=rnd))


def test_local_messages_before_the_node_table_are_held_and_replayed_once_it_is_in():
    m, drops = _members()
    local = _Local()
    d = Dispatcher(m, None, local)
    route = Route("localroot", b"L3")
    d.on_message(route, _msg(MsgType.LOCAL_READY, 7, 0))
    d.on_message(route, _msg(MsgType.PUSH_ACK))          # not a local message: dropped
    d.replay_early()                                      # the table is not in yet: held
    assert local.got == [] and drops == ["message before the node table"]
    m.peers_ready = True
    d.replay_early()
    assert local.got == [(MsgType.LOCAL_READY, 7, 0)]
    d.replay_early()                                      # replayed once
    assert local.got == [(MsgType.LOCAL_READY, 7, 0)]


def test_what_a_root_holds_before_the_node_table_is_bounded():
    m, drops = _members()
    local = _Local()
    d = Dispatcher(m, None, local)
    route = Route("localroot", b"L3")
    for k in range(dispatch.EARLY_LIMIT + 5):
        d.on_message(route, _msg(MsgType.LOCAL_READY, k, 0))
    assert drops == ["message before the node table"] * 5
    m.peers_ready = True
    d.on_message(route, _msg(MsgType.LOCAL_READY, 999, 0))  # the next message replays first
    assert [g[1] for g in local.got] == list(range(dispatch.EARLY_LIMIT)) + [999]
