"""Runs a scheduler or server with an in-process fault. Usage: role_fault.py ROLE [POINT]

POINT rendezvous: the process dies of an unhandled exception before it registers (every server
for ROLE server). Otherwise an unhandled exception on its I/O thread: server rank 0 raises on
the first push of round 5; the scheduler raises on the first barrier."""
import sys

role = sys.argv[1]
if len(sys.argv) > 2 and sys.argv[2] == "rendezvous":
    raise RuntimeError(f"injected fault: the {role} died before registering")
if role == "server":
    from byteps_like.server import core

    orig = core.Server._on_message

    def on_message(self, route, frames):
        from byteps_like.wire import MsgType, decode_header
        try:
            h = decode_header(frames[0])
        except Exception:  # noqa: BLE001
            h = None
        if self.rank == 0 and h is not None and h.type is MsgType.PUSH and h.round >= 5:
            raise RuntimeError("injected fault: unhandled exception in server 0")
        return orig(self, route, frames)
    core.Server._on_message = on_message
    from byteps_like.server.__main__ import main
else:
    from byteps_like.scheduler import core

    orig = core.Scheduler._barrier

    def barrier(self, node, group, seq):
        raise RuntimeError("injected fault: unhandled exception in the scheduler")
    core.Scheduler._barrier = barrier
    from byteps_like.scheduler.__main__ import main
sys.exit(main([]))  # this wrapper's own arguments are not the role's
