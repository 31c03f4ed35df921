"""The scheduler's stall inspector: servers report synchronous rounds that some workers pushed
and others did not (STALL); the scheduler logs each stalled round once, in worker ranks, and
fails the job past BYTEPS_STALL_SHUTDOWN_TIME_SECONDS. ``host`` is the scheduler (its
``stalls`` and ``stall_log``, ``cfg``, ``phase`` and nodes)."""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from .nodes import NodeInfo, workers

log = logging.getLogger("byteps_like.scheduler")


def worker_ranks(host: Any, machines: list[int]) -> list[int]:
    """Worker ranks of worker machine indices (servers count pushes per machine)."""
    ls = host.cfg.cluster.local_size
    return [m * ls + i for m in machines for i in range(ls)]


def report_stalls(host: Any, server: NodeInfo, stalls: Any,
                  lose: Callable[..., None]) -> None:
    """The stall inspector: a server reports synchronous rounds that some workers pushed and
    others did not; log them, aggregated, and fail the job past the shutdown limit."""
    if not isinstance(stalls, list) or host.phase != "running":
        return
    fresh, oldest = [], None
    for st in stalls[:1000]:
        try:
            ident = (server.rank, int(st["key"]), int(st["round"]))
            age = float(st["age"])
            missing = worker_ranks(host, [int(m) for m in st["missing"]])
            name = str(st["name"])[:200]
        except (KeyError, TypeError, ValueError):
            continue
        if ident not in host.stalls:
            fresh.append(f"{name!r} (key {ident[1]}, round {ident[2]}, server {server.rank}, "
                         f"{age:.0f} s) is missing worker ranks {missing}")
        host.stalls[ident] = {"name": name, "age": age, "missing": missing}
        if oldest is None or age > oldest[0]:
            oldest = (age, name, missing)
    if fresh:
        text = (f"stall inspector: {len(fresh)} tensor round(s) pushed by some workers but "
                f"not all for over {host.cfg.timeouts.stall_check_time:g} s "
                f"(BYTEPS_STALL_CHECK_TIME_SECONDS): " + "; ".join(fresh[:20])
                + (f"; and {len(fresh) - 20} more" if len(fresh) > 20 else ""))
        host.stall_log.append(text)
        log.warning("scheduler: %s", text)
    limit = host.cfg.timeouts.stall_shutdown_time
    if limit > 0 and oldest is not None and oldest[0] >= limit:
        age, name, missing = oldest
        names = sorted({v["name"] for v in host.stalls.values()})
        by_rank = {n.rank: n for n in workers(host)}
        first = by_rank.get(missing[0]) if missing else None
        why = (f"stall inspector: tensor {name!r} has waited {age:.0f} s for worker ranks "
               f"{missing} (stalled tensors: {', '.join(repr(n) for n in names[:20])}); "
               f"BYTEPS_STALL_SHUTDOWN_TIME_SECONDS={limit:g} reached, failing the job")
        if first is None:
            first = server
        lose(first, why, tell_lost=True, code=1)  # the scheduler's own verdict
