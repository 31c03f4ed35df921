"""An emulated cluster on one Linux machine: one network namespace per host, joined through a
bridge, every host's NIC capped with ``tc`` in both directions.

Layout (all names carry the prefix ``bpsl-<pid>-``, so runs never collide and a crashed run's
leftovers are recognisable)::

    namespace bpsl-<pid>-sw          bridge br0, one port p-<host> per host (tbf: host ingress)
    namespace bpsl-<pid>-<host>      lo, eth0 = 10.231.0.<i>/24 (tbf: host egress)
    /etc/netns/bpsl-<pid>-<host>/hosts   this host's /etc/hosts inside ``ip netns exec``

Nothing is created or changed in the root namespace: no link, no address, no route. The bridge
has no uplink, so no packet can leave the namespaces. :class:`NetnsCluster` is a context manager
whose teardown (kill every process inside the namespaces, delete the namespaces, which destroys
their links) runs on normal exit, on an exception, on SIGINT/SIGTERM/SIGHUP (the handlers turn
them into exceptions) and from ``atexit``; :func:`sweep` removes what a run killed with SIGKILL
left behind. Needs root (CAP_SYS_ADMIN + CAP_NET_ADMIN) and ``ip``/``tc`` from iproute2.
"""
from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

PREFIX = "bpsl-"
SUBNET = "10.231.0"            # private /24 that exists only inside the namespaces
_NAME_RE = re.compile(r"^bpsl-(\d+)-")


class NetnsError(RuntimeError):
    """The emulated cluster cannot be built here (not root, no iproute2, no namespaces...)."""


def _run(argv: Sequence[str], check: bool = True,
         timeout: float = 30.0) -> subprocess.CompletedProcess:
    p = subprocess.run(list(argv), stdin=subprocess.DEVNULL, capture_output=True, text=True,
                       timeout=timeout)
    if check and p.returncode != 0:
        raise NetnsError(f"`{' '.join(argv)}` failed ({p.returncode}): "
                         f"{(p.stderr or p.stdout).strip()}")
    return p


def why_unavailable() -> str | None:
    """None when namespaces can be built here, else the reason (for skips and messages)."""
    if sys.platform != "linux":
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "the emulated cluster needs root (network namespaces, veth, tc); run it as root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        _run(["ip", "netns", "add", probe])
        try:
            _run(["ip", "-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1"])
            _run(["ip", "-n", probe, "link", "add", "br0", "type", "bridge"])
            _run(["ip", "-n", probe, "link", "set", "p0", "up"])
            _run(["tc", "-n", probe, "qdisc", "add", "dev", "p0", "root", "tbf", "rate",
                  "1gbit", "burst", "256kb", "latency", "20ms"])
        finally:
            _run(["ip", "netns", "del", probe], check=False)
    except (NetnsError, OSError, subprocess.TimeoutExpired) as exc:
        return f"network namespaces / veth / bridge / tc do not work here: {exc}"
    return None


def list_namespaces() -> list[str]:
    p = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in p.stdout.splitlines() if line.strip()]


def _kill_pids_in(ns: str, log: TextIO | None = None) -> None:
    """SIGTERM, then SIGKILL, every process whose network namespace is ``ns``."""
    for sig, wait in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 2.0)):
        pids = _pids_in(ns)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        end = time.monotonic() + wait
        while time.monotonic() < end and _pids_in(ns):
            time.sleep(0.05)
    left = _pids_in(ns)
    if left and log is not None:
        print(f"netns: processes {left} in {ns} survived SIGKILL", file=log, flush=True)


def _pids_in(ns: str) -> list[int]:
    p = _run(["ip", "netns", "pids", ns], check=False)
    return [int(x) for x in p.stdout.split() if x.isdigit() and int(x) != os.getpid()]


ETC_NETNS = "/etc/netns"


def delete_namespace(ns: str, log: TextIO | None = None) -> None:
    _kill_pids_in(ns, log)
    _run(["ip", "netns", "del", ns], check=False)
    shutil.rmtree(os.path.join(ETC_NETNS, ns), ignore_errors=True)


def sweep(log: TextIO | None = None, *, all_runs: bool = False) -> list[str]:
    """Remove the namespaces (and their processes and links) of earlier runs whose driver is
    gone (or of every run with ``all_runs``). Returns the names removed."""
    from ._role import locate
    locate("launcher")  # a bare source tree keeps it in <root>/launcher
    from byteps_like.launcher.procs import pid_alive
    removed = []
    try:
        etc = [d for d in os.listdir(ETC_NETNS) if _NAME_RE.match(d)]
    except OSError:
        etc = []
    for ns in sorted(set(list_namespaces()) | set(etc)):
        m = _NAME_RE.match(ns)
        if not m:
            continue
        pid = int(m.group(1))
        if not all_runs and (pid == os.getpid() or pid_alive(pid)):
            continue
        delete_namespace(ns, log)
        removed.append(ns)
    if removed and log is not None:
        print(f"netns: swept leftovers of earlier runs: {', '.join(removed)}", file=log,
              flush=True)
    return removed


def tbf_args(rate_bits: float, latency_ms: float = 20.0) -> list[str]:
    """tc arguments of a token bucket at ``rate_bits``/s. The bucket holds ~4 ms of traffic
    (at least 256 KiB: GSO packets of veth are up to 64 KiB)."""
    burst = max(256 * 1024, int(rate_bits / 8 * 0.004))
    return ["tbf", "rate", f"{int(rate_bits)}bit", "burst", str(burst),
            "latency", f"{latency_ms:g}ms"]


@dataclass
class NetnsCluster:
    """``hosts`` emulated machines behind one switch, each NIC capped at ``rate_bits``/s in
    both directions (0: no cap)."""
    hosts: Sequence[str]
    rate_bits: float = 1e9
    latency_ms: float = 20.0
    # caps that differ from rate_bits, by host (a straggler's NIC: bench/links.py)
    host_rates: dict[str, float] = field(default_factory=dict)
    log: TextIO = field(default_factory=lambda: sys.stderr)
    prefix: str = field(default_factory=lambda: f"{PREFIX}{os.getpid()}-")

    def __post_init__(self) -> None:
        if len(set(self.hosts)) != len(self.hosts) or not self.hosts:
            raise ValueError(f"host names must be distinct and non-empty: {self.hosts}")
        for h in self.hosts:
            if not re.fullmatch(r"[a-z0-9]{1,8}", h):
                raise ValueError(f"host name {h!r}: use 1-8 lower-case letters or digits")
        if len(self.hosts) > 250:
            raise ValueError("at most 250 hosts")
        self.switch = f"{self.prefix}sw"
        self._made: list[str] = []
        self._old_handlers: dict[int, Any] = {}
        self._closed = False
        self._made_etc = False

    # -- names ----------------------------------------------------------------------------------
    def ns(self, host: str) -> str:
        return f"{self.prefix}{host}"

    def ip(self, host: str) -> str:
        return f"{SUBNET}.{list(self.hosts).index(host) + 1}"

    def namespaces(self) -> list[str]:
        return [self.switch] + [self.ns(h) for h in self.hosts]

    def exec_argv(self, host: str, argv: Sequence[str]) -> list[str]:
        """The command line that runs ``argv`` inside ``host``'s namespace."""
        return ["ip", "netns", "exec", self.ns(host), *argv]

    # -- lifecycle ------------------------------------------------------------------------------
    def __enter__(self) -> NetnsCluster:
        reason = why_unavailable()
        if reason:
            raise NetnsError(reason)
        sweep(self.log)
        atexit.register(self.close)
        self._install_signal_handlers()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _install_signal_handlers(self) -> None:
        def stop(signum, _frame):
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise SystemExit(128 + signum)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            try:
                self._old_handlers[sig] = signal.signal(sig, stop)
            except ValueError:      # not the main thread: rely on atexit and the caller
                pass

    def _build(self) -> None:
        sw = self.switch
        _run(["ip", "netns", "add", sw])
        self._made.append(sw)
        _run(["ip", "-n", sw, "link", "set", "lo", "up"])
        _run(["ip", "-n", sw, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", sw, "link", "set", "br0", "up"])
        for h in self.hosts:
            ns = self.ns(h)
            _run(["ip", "netns", "add", ns])
            self._made.append(ns)
            port = f"p-{h}"
            # created inside the switch namespace, the peer straight into the host's: no link
            # ever exists in the root namespace
            _run(["ip", "-n", sw, "link", "add", port, "type", "veth", "peer", "name", "eth0",
                  "netns", ns])
            _run(["ip", "-n", sw, "link", "set", port, "master", "br0"])
            _run(["ip", "-n", sw, "link", "set", port, "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{self.ip(h)}/24", "dev", "eth0"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            self._write_hosts(h)
            rate = self.host_rates.get(h, self.rate_bits)
            if rate:
                tbf = tbf_args(rate, self.latency_ms)
                _run(["tc", "-n", ns, "qdisc", "add", "dev", "eth0", "root", *tbf])   # egress
                _run(["tc", "-n", sw, "qdisc", "add", "dev", port, "root", *tbf])     # ingress
        self._wait_reachable()

    def set_rate(self, host: str, rate_bits: float) -> None:
        """Change ``host``'s cap (both directions) while processes run (``tc qdisc change``):
        a rate schedule's switch. The cluster must have been built with a cap."""
        if not self.host_rates.get(host, self.rate_bits):
            raise NetnsError(f"host {host}: built without a cap, so there is none to change")
        tbf = tbf_args(rate_bits, self.latency_ms)
        _run(["tc", "-n", self.ns(host), "qdisc", "change", "dev", "eth0", "root", *tbf])
        _run(["tc", "-n", self.switch, "qdisc", "change", "dev", f"p-{host}", "root", *tbf])

    def _write_hosts(self, host: str) -> None:
        """``ip netns exec`` bind-mounts /etc/netns/<ns>/hosts over /etc/hosts: there the
        machine's hostname and every host name resolve to namespace addresses, so libraries that
        pick their address from the hostname (gloo inside Horovod) use eth0, not 127.0.0.1."""
        d = os.path.join(ETC_NETNS, self.ns(host))
        if not os.path.isdir(ETC_NETNS):
            self._made_etc = True
        os.makedirs(d, exist_ok=True)
        lines = ["127.0.0.1 localhost", f"{self.ip(host)} {socket.gethostname()}"]
        lines += [f"{self.ip(h)} {h}" for h in self.hosts]
        with open(os.path.join(d, "hosts"), "w", encoding="ascii") as f:
            f.write("\n".join(lines) + "\n")

    def _wait_reachable(self, timeout: float = 10.0) -> None:
        """Every host reaches the first one (bridge ports take a moment to forward)."""
        if len(self.hosts) < 2 or shutil.which("ping") is None:
            time.sleep(0.5)
            return
        first = self.ip(self.hosts[0])
        for h in self.hosts[1:]:
            end = time.monotonic() + timeout
            while True:
                p = _run(self.exec_argv(h, ["ping", "-c", "1", "-W", "1", first]), check=False)
                if p.returncode == 0:
                    break
                if time.monotonic() > end:
                    raise NetnsError(f"host {h} cannot reach {self.hosts[0]} ({first}) through "
                                     f"the bridge: {p.stdout.strip()} {p.stderr.strip()}")
                time.sleep(0.2)

    def close(self) -> None:
        """Kill every process in our namespaces and delete them (idempotent)."""
        if self._closed:
            return
        held = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
        old = signal.pthread_sigmask(signal.SIG_BLOCK, held)
        try:
            # host namespaces first (their processes), the switch last
            for ns in reversed(self._made):
                delete_namespace(ns, self.log)
            left = [ns for ns in list_namespaces() if ns.startswith(self.prefix)]
            for ns in left:
                delete_namespace(ns, self.log)
            self._made.clear()
            if self._made_etc:
                try:
                    os.rmdir(ETC_NETNS)
                except OSError:
                    pass
            self._closed = True
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
            for sig, h in self._old_handlers.items():
                try:
                    signal.signal(sig, h)
                except (ValueError, TypeError):
                    pass
            self._old_handlers.clear()
            try:
                atexit.unregister(self.close)
            except Exception:   # noqa: BLE001 - interpreter shutting down
                pass

    def leftovers(self) -> list[str]:
        """Our namespaces that still exist (empty after :meth:`close`)."""
        return [ns for ns in list_namespaces() if ns.startswith(self.prefix)]
