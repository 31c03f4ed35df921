"""The server's stall inspector: synchronous rounds some workers pushed and others did not,
open longer than BYTEPS_STALL_CHECK_TIME_SECONDS, as the scheduler's stall report reads them
(docs/reliability.md): the native data plane's keys and the server-held tables. Also the one
rule for a round that can never complete: a machine that left the job without pushing it
(:func:`fail_if_left`, for the dense keys and the tables alike)."""
from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from collections.abc import Set as AbstractSet
from typing import Any

from ..errors import ProtocolError
from ..wire import parse_decl


def stall_entry(decl: dict, key: int, rnd: int, age: float, pushed: list, required: int,
                joined: AbstractSet[int]) -> dict:
    """One stalled round as the scheduler's stall report reads it."""
    return {"name": str(decl.get("name")), "key": key, "round": rnd,
            "part": decl.get("part"), "age": round(age, 3), "pushed": pushed,
            "missing": sorted(set(range(required)) - set(pushed) - joined)}


def stalled_rounds(native: Any, now: float, limit: float, required: int,
                   joined: AbstractSet[int], tables: Iterable[Any] = (),
                   table_ranks: tuple[int, AbstractSet[int]] | None = None) -> list[dict]:
    """The rounds of the ``native`` data server's keys and of ``tables`` (the server-held
    tables: round, round_started, pushed, failed, decl, key) open for at least ``limit``
    seconds with some pushes in. A table is read from the I/O thread while its thread runs,
    so every field is read once into a local (a round may complete meanwhile; then it is
    skipped). ``table_ranks``: the tables' (required, joined) when they count worker
    processes rather than machines (several processes per machine)."""
    t_required, t_joined = table_ranks or (required, joined)
    out = []
    for store in tables:
        started, rnd = store.round_started, store.round
        if started is None or now - started < limit or store.failed is not None:
            continue
        try:
            pushed = sorted(store.pushed)
        except RuntimeError:  # changed size while copying: the round is moving
            continue
        if not pushed or store.round != rnd:
            continue
        out.append(stall_entry(store.decl, store.key, rnd, now - started, pushed, t_required,
                               t_joined))
    for key, rnd, age, pushed, raw in native.stalls(limit):
        try:
            d = parse_decl(raw)
            decl = {"name": d.name, "part": d.part}
        except ProtocolError:  # the server keeps only declarations it parsed: not expected
            decl = {}
        out.append(stall_entry(decl, key, rnd, age, pushed, required, joined))
    return out


def fail_if_left(left: dict[int, str], pushed: Collection[int], waiting: bool, rnd: int,
                 what: str, fail: Callable[[str, dict], None]) -> bool:
    """A round that a machine which left the job (``left``: rank -> why) has not pushed can
    never complete: call ``fail(text, fields)`` naming the first such machine and return True;
    False (nothing called) when there is none or the round is not open (nothing pushed and
    nobody ``waiting`` on it). ``what`` names the round's key or table for the text."""
    if not left or (not pushed and not waiting):
        return False
    done = set(pushed)
    for machine, why in sorted(left.items()):
        if machine in done:
            continue
        last = rnd - 1
        fail(f"{why}; round {rnd} of {what} can never complete (the last round it pushed was "
             f"{last}). Ranks that run fewer steps must call join() when they are done",
             {"rank": machine, "last_round": last})
        return True
    return False
