"""Runs a scheduler or server with an in-process fault. Usage: role_fault.py ROLE [POINT]

POINT rendezvous: the process dies of an unhandled exception before it registers (every server
for ROLE server). Otherwise an unhandled exception on its I/O thread: server rank 0 raises once
its native data plane completed 5 rounds; the scheduler raises on the first barrier."""
import sys

role = sys.argv[1]
if len(sys.argv) > 2 and sys.argv[2] == "rendezvous":
    raise RuntimeError(f"injected fault: the {role} died before registering")
if role == "server":
    from byteps_like.server import core

    orig = core.Server.start

    def start(self):
        # a tick on the server's I/O thread (its ZeroMQ loop) that raises once the native data
        # plane completed round 5 of some key on server 0
        def tick():
            if self.rank == 0 and self.native.stats()["rounds"] >= 5:
                raise RuntimeError("injected fault: unhandled exception in server 0")
        self.ep.add_timer(0.02, tick)
        return orig(self)
    core.Server.start = start
    from byteps_like.server.__main__ import main
else:
    from byteps_like.scheduler import core

    orig = core.Scheduler._barrier

    def barrier(self, node, group, seq):
        raise RuntimeError("injected fault: unhandled exception in the scheduler")
    core.Scheduler._barrier = barrier
    from byteps_like.scheduler.__main__ import main
sys.exit(main([]))  # this wrapper's own arguments are not the role's
