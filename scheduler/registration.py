"""Registration: every node registers with its role and address; once all have joined, ranks
are assigned deterministically (:func:`assign_ranks`) and the node table is sent to everyone.
While registration is open, the scheduler's tick reports who it still waits for
(:meth:`Registration.not_seen`) and, past BYTEPS_REGISTER_TIMEOUT_SECONDS, why the job could not
form (:meth:`Registration.report`)."""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

from ..errors import EXIT_PEER_FAILED
from ..transport import Route
from ..wire import ERR_REGISTER, MsgType, Role
from .elastic import Epochs
from .nodes import BadField, Host, NodeInfo, checked, show, workers

log = logging.getLogger("byteps_like.scheduler")


def assign_ranks(nodes: list[NodeInfo], local_size: int) -> None:
    """Deterministic ranks: a worker with DMLC_WORKER_ID gets worker_id*local_size+local_rank;
    the others fill the free ranks in (host, pid, local_rank) order; servers rank by
    BYTEPS_SERVER_ID when every one gives a distinct one of 0..n-1, else by (host, port)."""
    everyone = [n for n in nodes if n.role is Role.WORKER]
    taken = set()
    for n in everyone:
        if n.worker_id is not None:
            n.rank = n.worker_id * local_size + n.local_rank
            taken.add(n.rank)
    free = iter(r for r in range(len(everyone)) if r not in taken)
    for n in sorted((n for n in everyone if n.worker_id is None),
                    key=lambda n: (n.host, n.pid, n.local_rank)):
        n.rank = next(free)
    servers = sorted((n for n in nodes if n.role is Role.SERVER), key=lambda n: (n.host, n.port))
    ids = [-1 if n.server_id is None else n.server_id for n in servers]
    if sorted(ids) == list(range(len(servers))):  # BYTEPS_SERVER_ID, as its launcher named it
        servers = [n for _, n in sorted(zip(ids, servers), key=lambda p: p[0])]
    for i, n in enumerate(servers):
        n.rank = i


class Registration:
    """The registration of one scheduler's nodes, and the node table it ends with."""

    def __init__(self, host: Host, epochs: Epochs):
        self.host = host
        self.epochs = epochs
        # a server registering while the job runs: whether it took a lost server's place
        self.replacement: Callable[[Route, NodeInfo], bool] | None = None
        # a restarted scheduler (rejoin): since when its nodes come back (0: not a restart),
        # the servers they say were lost, and who hears of the job's state and the recovery
        self.recovering = 0.0
        self.servers_gone = 0
        self.on_rejoin_state: Callable[[int, list[int]], None] | None = None
        self.on_recovered: Callable[[], None] | None = None
        # servers that did not come back to a restart: True when they may be taken as lost
        self.on_missing: Callable[[list[int]], bool] | None = None
        # phase "refused" (cannot_form): the PEER_LOST notice, who was told, how many refused
        self.refused: dict = {}
        self.told: set[bytes | None] = set()
        self.refusals = 0

    def register(self, route: Route, meta: dict) -> None:
        host = self.host
        c = host.cfg.cluster
        if host.phase == "refused":  # the job cannot form: a node that comes now is told why
            self.tell_refused(route)
            self.refused_tick(time.monotonic())
            return
        try:  # every field of its type and in range: a registration becomes the node table
            role_name = checked(meta, "role", str)
            if role_name not in ("worker", "server"):
                raise BadField(f"role {show(role_name)} is not 'worker' or 'server'")
            role = Role.parse(role_name)
            name = checked(meta, "host", str)
            if not 0 < len(name) <= 255:
                raise BadField(f"host of {len(name)} characters (1 to 255)")
            local_size = checked(meta, "local_size", int, c.local_size, lo=1, hi=1 << 16)
            # DMLC_WORKER_ID's upper bound and BYTEPS_LOCAL_SIZE against the job's are
            # checked below, with messages that name both sides
            worker_id = checked(meta, "worker_id", int, None, lo=0, what="DMLC_WORKER_ID")
            local_rank = checked(meta, "local_rank", int, 0, lo=0,
                                 hi=local_size - 1 if role is Role.WORKER else None,
                                 what="BYTEPS_LOCAL_RANK")
            info = NodeInfo(route, role, name, checked(meta, "port", int, 0, lo=0, hi=65535),
                            checked(meta, "pid", int, 0, lo=0, hi=(1 << 31) - 1), worker_id,
                            local_rank)
            info.data_port = checked(meta, "data_port", int, 0, lo=0, hi=65535)
            info.pgid = checked(meta, "pgid", int, 0, lo=0, hi=(1 << 31) - 1)
            info.server_id = checked(meta, "server_id", int, None, lo=0, hi=1 << 20,
                                     what="BYTEPS_SERVER_ID")
            # the job size this node was told (absent from nodes of older releases)
            sizes = {"DMLC_NUM_WORKER": checked(meta, "num_worker", int, None, lo=1,
                                                hi=1 << 20, what="DMLC_NUM_WORKER"),
                     "DMLC_NUM_SERVER": checked(meta, "num_server", int, None, lo=0,
                                                hi=1 << 20, what="DMLC_NUM_SERVER")}
            if host.elastic:  # ranks come from the epochs, not DMLC_WORKER_ID
                info.worker_id = None
        except BadField as exc:
            host.reject(route, "bad registration", f"bad registration: {exc}", ERR_REGISTER)
            return
        rejoin = meta.get("rejoin")
        if rejoin is not None and self.size_mismatch(info, sizes) is None:
            self.rejoin(route, info, rejoin)
            return
        err = self.size_mismatch(info, sizes)
        if err is None and (host.elastic and role is Role.WORKER and host.phase == "running"
                            and local_size == c.local_size):
            self.epochs.register_joiner(route, info)
            return
        if err is None and role is Role.SERVER and host.phase == "running" \
                and self.replacement is not None and self.replacement(route, info):
            return  # takes a lost server's place (scheduler/failover.py)
        if err is None:  # the job size first: a node told another size may trip these too
            err = self.refusal(info, local_size)
        if err:
            host.reject(route, "registration refused", err, ERR_REGISTER,
                        log_as=f"a {role.label} from {info.host}: {err}")
            if host.phase == "register":
                self.cannot_form(info, err)
            return
        host.nodes[route.ident] = info
        log.info("scheduler: %s joined from %s:%d (%s)", role.label, info.host, info.port,
                 host.counts())
        if all(sum(n.role is r for n in host.nodes.values()) == k
               for r, k in host.expected.items()):
            self.publish_table()

    def rejoin(self, route: Route, info: NodeInfo, rejoin: object) -> None:
        """A node of a running job registering again, with its rank: its scheduler lost the
        connection and this one may be a restart (issue 37). A scheduler that is still
        forming its job takes it as the job's membership coming back (a restart knows nothing
        else of it); one that runs the job already knows it and ignores it."""
        host = self.host
        if not isinstance(rejoin, dict):
            host.reject(route, "bad registration", "bad registration: rejoin is not an object",
                        ERR_REGISTER)
            return
        try:
            info.rank = checked(rejoin, "rank", int, lo=0, hi=1 << 20)
            gone = rejoin.get("servers_gone", [])
            gone = [checked({"r": r}, "r", int, lo=0, hi=1 << 20) for r in gone] \
                if isinstance(gone, list) else []
            number = checked(rejoin, "failover", int, 0, lo=0, hi=1 << 30)
        except BadField as exc:
            host.reject(route, "bad registration", f"bad rejoin: {exc}", ERR_REGISTER)
            return
        if host.phase != "register" or host.elastic:
            return  # the scheduler never went away (a blip of the connection), or elastic
        if not self.recovering:
            self.recovering = time.monotonic()
            log.warning("scheduler: a node of a running job registers again: this scheduler "
                        "is a restart; rebuilding the job's membership from its nodes")
        host.nodes[route.ident] = info
        if self.on_rejoin_state is not None and info.role is Role.WORKER:
            self.on_rejoin_state(number, gone)
        self.servers_gone = max(self.servers_gone, len(gone))
        have = {r: sum(n.role is r for n in host.nodes.values()) for r in host.expected}
        if have[Role.WORKER] == host.expected[Role.WORKER] and \
                have[Role.SERVER] + self.servers_gone >= host.expected[Role.SERVER]:
            self.publish_recovered()

    @property
    def restarted(self) -> bool:
        """This scheduler is a restart (bpslaunch's BYTEPS_SCHEDULER_RESTART, or a node of a
        running job came back to it): the job formed long ago, and a node that does not come
        back is its recovery's to decide (recovery_tick), not a job that cannot form."""
        return bool(self.recovering or self.host.cfg.cluster.scheduler_restart)

    def recovery_tick(self, now: float) -> None:
        """A restart whose nodes come back (the scheduler's tick): heartbeats to those that
        have, so they wait; once every worker is back, a server that has not come back within
        the heartbeat timeout is taken as lost (a failover, when the job can lose one)."""
        host = self.host
        for n in host.nodes.values():
            host.send(n, MsgType.HEARTBEAT)
        back = [n for n in host.nodes.values() if n.role is Role.SERVER]
        if (sum(n.role is Role.WORKER for n in host.nodes.values())
                < host.expected[Role.WORKER] or not back
                or now - self.recovering < host.cfg.timeouts.heartbeat_timeout):
            return
        ranks = {n.rank for n in back}
        missing = [r for r in range(host.expected[Role.SERVER]) if r not in ranks]
        if self.on_missing is not None and self.on_missing(missing):
            self.servers_gone = host.expected[Role.SERVER] - len(back)
            self.publish_recovered()

    def publish_recovered(self) -> None:
        """Every node of the job is back: the node table again (ranks kept), and the job
        runs on."""
        host = self.host
        c = host.cfg.cluster
        me = {"role": "scheduler", "rank": 0, "host": c.root_uri, "port": c.root_port,
              "pid": os.getpid()}
        host.table = [me] + sorted((n.public() for n in host.nodes.values()),
                                   key=lambda d: (d["role"], d["rank"]))
        now = time.monotonic()
        for n in host.nodes.values():
            n.last_seen = now
            host.send(n, MsgType.NODE_TABLE, {"rank": n.rank, "nodes": host.table,
                      "num_worker": c.num_worker, "local_size": c.local_size})
        host.phase = "running"
        log.warning("scheduler: restarted: all %d nodes of the job re-registered in %.2f s; the "
                    "job goes on", len(host.nodes), now - self.recovering)
        if self.on_recovered is not None:
            self.on_recovered()

    def refusal(self, info: NodeInfo, local_size: int) -> str | None:
        """Why a node whose job size is right cannot register (None: it can)."""
        host, c, role = self.host, self.host.cfg.cluster, info.role
        err = None
        if host.phase != "register":
            err = "registration is closed: every node of this job has already joined"
        elif role is Role.SCHEDULER:
            err = "a second scheduler tried to register"
        elif sum(n.role is role for n in host.nodes.values()) >= host.expected[role]:
            err = (f"too many {role.label}s: this job expects {host.expected[role]} "
                   f"(DMLC_NUM_WORKER x BYTEPS_LOCAL_SIZE workers, DMLC_NUM_SERVER servers)")
        elif role is Role.WORKER and local_size != c.local_size:
            err = (f"worker on {info.host} has BYTEPS_LOCAL_SIZE={local_size}, the scheduler "
                   f"expects {c.local_size}")
        elif role is Role.WORKER and info.worker_id is not None and not host.elastic:
            if info.worker_id >= c.num_worker:
                err = (f"DMLC_WORKER_ID={info.worker_id} is out of range for "
                       f"DMLC_NUM_WORKER={c.num_worker}")
            for n in host.nodes.values():
                if (n.role is Role.WORKER and n.worker_id == info.worker_id
                        and n.local_rank == info.local_rank):
                    err = (f"DMLC_WORKER_ID={info.worker_id} BYTEPS_LOCAL_RANK={info.local_rank} "
                           f"is already taken by {n.host} pid {n.pid}")
        return err

    def size_mismatch(self, info: NodeInfo, sizes: dict[str, int | None]) -> str | None:
        """Why a node told another job size than the scheduler cannot join (None: it can)."""
        c = self.host.cfg.cluster
        mine = {"DMLC_NUM_WORKER": c.num_worker, "DMLC_NUM_SERVER": c.num_server}
        wrong = [f"{name}={value} but the scheduler has {name}={mine[name]}"
                 for name, value in sizes.items() if value is not None and value != mine[name]]
        if not wrong:
            return None
        who = f"{info.role.label} on {info.host} (pid {info.pid}"
        who += f", DMLC_WORKER_ID={info.worker_id})" if info.worker_id is not None else ")"
        return (f"{who} has {' and '.join(wrong)}: every process of a job needs the same "
                "DMLC_NUM_WORKER and DMLC_NUM_SERVER")

    def cannot_form(self, info: NodeInfo, err: str) -> None:
        """A node of the forming job was refused: the job can never form as it was started
        (the refused process exits on its ConfigError). Every registered node, and every node
        that registers from now on, is told at once (PeerLostError naming the refused node and
        why) instead of waiting out BYTEPS_REGISTER_TIMEOUT_SECONDS for a node that is not
        coming; the scheduler ends once every node of the job was told (phase ``refused``),
        at the latest when the registration would have timed out (:meth:`refused_tick`)."""
        host = self.host
        self.refusals += 1
        if host.phase != "refused":
            who = f"{info.role.label} on {info.host} (pid {info.pid}"
            self.refused = {"role": info.role.label, "rank": -1, "host": info.host,
                            "port": info.port, "pid": info.pid,
                            "reason": (f"the job cannot form: the scheduler refused {err}"
                                       if err.startswith(who) else
                                       f"the job cannot form: the scheduler refused {who}): "
                                       f"{err}")}
            log.error("scheduler: %s", self.refused["reason"])
            host.phase = "refused"
            for n in host.nodes.values():
                self.tell_refused(n)
        self.refused_tick(time.monotonic())

    def tell_refused(self, node: NodeInfo | Route) -> None:
        self.host.send(node, MsgType.PEER_LOST, self.refused)
        self.told.add(node.route.ident if isinstance(node, NodeInfo) else node.ident)

    def refused_tick(self, now: float) -> None:
        """Phase ``refused``: end once every node the job expects was told, or when the
        registration would have timed out."""
        host = self.host
        everyone = sum(host.expected.values())
        timeout = host.cfg.timeouts.register_timeout
        if len(self.told) + self.refusals >= everyone or now - host.started > timeout:
            host.finish(EXIT_PEER_FAILED, self.refused["reason"])

    def publish_table(self) -> None:
        host = self.host
        c = host.cfg.cluster
        assign_ranks(list(host.nodes.values()), c.local_size)
        me = {"role": "scheduler", "rank": 0, "host": c.root_uri, "port": c.root_port,
              "pid": os.getpid()}
        table = [me] + sorted((n.public() for n in host.nodes.values()),
                              key=lambda d: (d["role"], d["rank"]))
        now = time.monotonic()
        host.table = table
        for n in host.nodes.values():
            n.last_seen = now
            if host.elastic and n.role is Role.WORKER:
                continue  # once the servers have reset for epoch 1 (Epochs.ack)
            host.send(n, MsgType.NODE_TABLE, {"rank": n.rank, "nodes": table,
                      "num_worker": c.num_worker, "local_size": c.local_size})
        host.phase = "running"
        if host.elastic:
            self.epochs.members = sorted(workers(host), key=lambda n: n.rank)
            self.epochs.begin([], initial=True)
        log.info("scheduler: all %d nodes joined; node table sent", len(host.nodes))

    # -- while the job forms ----------------------------------------------------------------
    def not_seen(self, most: int = 20) -> str:
        """The nodes registration still waits for: the DMLC_WORKER_IDs (with BYTEPS_LOCAL_RANK
        when several per machine) while every worker so far gave one, else how many workers;
        how many servers (they have no id before the table)."""
        host = self.host
        c = host.cfg.cluster
        everyone = workers(host)
        parts = []
        if len(everyone) < host.expected[Role.WORKER]:
            if all(n.worker_id is not None for n in everyone):
                seen = {(n.worker_id, n.local_rank) for n in everyone}
                ids = [(w, lr) for w in range(c.num_worker) for lr in range(c.local_size)
                       if (w, lr) not in seen]
                names = [str(w) if c.local_size == 1 else f"{w}.{lr}" for w, lr in ids]
                shown = ", ".join(names[:most]) + (f", ... ({len(names) - most} more)"
                                                   if len(names) > most else "")
                parts.append(f"worker ids [{shown}] (DMLC_WORKER_ID)" if c.local_size == 1 else
                             f"worker processes [{shown}] (DMLC_WORKER_ID.BYTEPS_LOCAL_RANK)")
            else:
                missing = host.expected[Role.WORKER] - len(everyone)
                parts.append(f"{missing} worker{'s' if missing > 1 else ''}")
        servers = sum(n.role is Role.SERVER for n in host.nodes.values())
        if servers < host.expected[Role.SERVER]:
            missing = host.expected[Role.SERVER] - servers
            parts.append(f"{missing} server{'s' if missing > 1 else ''}")
        return ", ".join(parts)

    def report(self) -> str:
        """Why registration timed out."""
        host = self.host
        c = host.cfg.cluster
        everyone = workers(host)
        missing = sorted(set(range(c.num_worker)) - {n.worker_id for n in everyone
                                                     if n.worker_id is not None})
        hint = (f" (worker ids not seen: {missing})"
                if missing and len(everyone) < host.expected[Role.WORKER] else "")
        return (f"registration timed out after {host.cfg.timeouts.register_timeout:g} s: "
                f"{host.counts()} joined{hint}; check that every node runs with "
                f"DMLC_PS_ROOT_URI={c.root_uri} DMLC_PS_ROOT_PORT={c.root_port} and the same "
                f"DMLC_NUM_WORKER/DMLC_NUM_SERVER")
