"""What the scheduler and server entry points share: loading the configuration of a role and
running a node in a ZeroMQ context of its own; and the exit status of a worker whose script dies
because another node failed."""
from __future__ import annotations

import atexit
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

from .config import Config
from .errors import EXIT_PEER_FAILED, PeerLostError

_ROLE_HELP = """usage: python -m byteps_like.{role} [-h]

Run a byteps_like {role} of the job described by the environment (the BytePS contract:
DMLC_PS_ROOT_URI, DMLC_PS_ROOT_PORT, DMLC_NUM_WORKER, DMLC_NUM_SERVER, BYTEPS_* settings; see
`python -m byteps_like.config --describe`). It takes no arguments. bpslaunch starts it for you:
`bpslaunch --local ...`, or `DMLC_ROLE={role} bpslaunch` on the {role}'s machine.
"""


def role_main(role: str, run: Callable[[Config], int], argv: list[str] | None = None) -> int:
    """``python -m byteps_like.<role>``: ``-h``/``--help`` prints usage, any other argument is a
    usage error (exit 2) rather than joining a job; else load the settings (exit 2 with the
    message on a bad one), set up logging, run."""
    from .config import load, report_unknown_settings, resolve_root
    from .errors import ConfigError
    from .log import setup_logging
    argv = sys.argv[1:] if argv is None else argv
    if argv:
        if argv[0] in ("-h", "--help"):
            print(_ROLE_HELP.format(role=role))
            return 0
        print(_ROLE_HELP.format(role=role).splitlines()[0], file=sys.stderr)
        print(f"byteps_like {role}: error: unexpected arguments {' '.join(argv)!r}; settings "
              "come from the environment", file=sys.stderr)
        return 2
    try:
        cfg = load(overrides={"cluster.role": role})
        resolve_root(cfg)  # now, not after the registration timeout
    except ConfigError as exc:
        print(f"byteps_like {role}: {exc}", file=sys.stderr)
        return 2
    setup_logging(cfg.log.level, role)
    report_unknown_settings(cfg)  # one line, unless bpslaunch said it (BYTEPS_REPORT_...)
    if role == "scheduler":
        warn_if_open(cfg)
    try:
        return run(cfg)
    except ConfigError as exc:  # a setting that fails only when used: the port is taken, ...
        print(f"byteps_like {role}: {exc}", file=sys.stderr)
        return 2


def warn_if_open(cfg: Config) -> bool:
    """Warn once (the scheduler does, at start) that a job without a secret reachable beyond
    this machine can be joined by any host that reaches its ports. True when it warned."""
    import ipaddress
    import logging

    from .transport import auth_secret
    if auth_secret(cfg):
        return False
    host = cfg.cluster.root_uri
    try:
        if ipaddress.ip_address(host).is_loopback:
            return False
    except ValueError:
        if host == "localhost":
            return False
    logging.getLogger("byteps_like.scheduler").warning(
        "authentication is off (no BYTEPS_AUTH_SECRET): any host that reaches %s:%d and the "
        "servers' ports can join this job, read its tensors and change them; give every node "
        "the same secret (BYTEPS_AUTH_SECRET or BYTEPS_AUTH_SECRET_FILE, docs/reliability.md)",
        host, cfg.cluster.root_port)
    return True


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


def caused_by_peer(exc: BaseException | None) -> bool:
    """Whether ``exc``, or an exception it was raised from or while handling, is a
    ``PeerLostError``: the process fails because another node of the job did."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, PeerLostError):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def exit_if_peer_failed(exc: BaseException) -> None:
    """Called by the worker runtime's ``sys.excepthook`` after the traceback is printed: a
    script that dies of an uncaught ``PeerLostError`` exits with ``EXIT_PEER_FAILED``, not
    Python's 1, so that bpslaunch blames the node that failed rather than this one.

    Python offers no way to change the status of an exit by an uncaught exception, so the exit
    is finished here much as the interpreter would: the ``atexit`` handlers run (the runtime's
    shutdown, logging, the script's own), the standard streams are flushed, then ``os._exit``.
    Unlike the interpreter it does not wait for non-daemon threads: the job is over.
    Only when the interpreter itself is reporting the exception on its way out (the hook has no
    Python caller, in the main thread, not interactive): a REPL that shows a traceback through
    the hook goes on."""
    hook_frame = sys._getframe(1)
    if (not caused_by_peer(exc) or hook_frame.f_back is not None
            or threading.current_thread() is not threading.main_thread()
            or sys.flags.interactive or hasattr(sys, "ps1")):
        return
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed or broken stream: exit regardless
            pass
    os._exit(EXIT_PEER_FAILED)
