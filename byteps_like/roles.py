"""What the scheduler and server entry points share: loading the configuration of a role and
running a node in a ZeroMQ context of its own."""
from __future__ import annotations

import sys
from typing import Any, Callable

from .config import Config


def role_main(role: str, run: Callable[[Config], int]) -> int:
    """``python -m byteps_like.<role>``: load the settings (exit 2 with the message on a bad
    one), set up logging, run."""
    from .config import load
    from .errors import ConfigError
    from .log import setup_logging
    try:
        cfg = load(overrides={"cluster.role": role})
    except ConfigError as exc:
        print(f"byteps_like {role}: {exc}", file=sys.stderr)
        return 2
    setup_logging(cfg.log.level, role)
    return run(cfg)


def run_node(factory: Callable[..., Any], cfg: Config) -> int:
    """Run ``factory(cfg, context=ctx).run()`` until the job ends; returns its exit status.

    The context is terminated only when the node closed its sockets: termination flushes
    what is still queued (bounded by each socket's linger) and would block otherwise."""
    import zmq
    ctx = zmq.Context()
    node = factory(cfg, context=ctx)
    code = node.run()
    if getattr(node, "closed_cleanly", True):
        ctx.term()
    return code
