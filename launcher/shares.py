"""Processes that share a host share its cores (docs/topology.md, "Thread shares").

When bpslaunch starts more than one worker or server on a host (``--local``, a worker machine
of several local ranks, a SLURM node, the benchmarks' local clusters), each child would
otherwise see every CPU, and every BLAS/OpenMP pool in it (torch's intra-op threads, MKL,
OpenBLAS, TensorFlow) would start as many threads as the host has cores. Two workers and two
servers on a 16-core host then run 64 compute threads on 16 cores: measured 1611-1684 ms a step
against 72.7 ms with ``OMP_NUM_THREADS=4``. torchrun sets ``OMP_NUM_THREADS=1`` when it starts
several processes on a host; bpslaunch gives each process its share instead:

* **Workers: CPU sets of their own** (unless ``--no-bind``). The host's usable CPUs (online,
  narrowed by ``BYTEPS_VISIBLE_CPU_CORES`` and bpslaunch's own affinity mask, minus
  ``BYTEPS_CPU_BLACKLIST``), in whole cores, are split among the workers: CPU workers each a
  set of their own (:func:`byteps_like.topology.place` with one slot per worker, the NUMA nodes
  in turn); GPU workers by local rank, on their GPU's node, a local rank's CPUs split among the
  workers that have it (``--local``'s emulated machines), unless those are too few to split.
  With fewer CPUs than workers, the per-local-rank binding of :func:`.binding.bind_workers`,
  sharing a CPU where they must.
* **Servers and the scheduler float** over every usable CPU (bound to the usable set, which they
  share with everyone), not a block of their own. A server's work is I/O and summation in the
  native data plane's own threads (several streams each way, plus the kernel's loopback TCP work
  on the same CPUs), and they use whichever cores are free as the push and pull phases
  alternate. Measured on the 16-core GPU machine (``python3 -m byteps_like.bench pushpull
  --workers 1 --servers 1 --sizes 256M --repeats 5 --skip-gloo --skip-raw``, medians of 5):
  8.88 GB/s without thread shares, 6.72 and 5.60 GB/s when the server had a dedicated half of
  the cores and the worker the other half. ``BYTEPS_NUMA_ON=0``: the workers too may use every
  usable CPU; only the thread counts are shared.
* **The data plane's I/O threads count** (:func:`compute_threads`). Every worker and server
  runs the native data plane's I/O threads (``BYTEPS_IO_THREADS``, by default half the CPUs the
  process may use, between 2 and 8) besides its compute pools, and they move and sum bytes
  while the workers compute (push_pull overlaps backward). So the workers' compute threads
  together get the usable CPUs less those the plane's threads need: the sum of every local
  worker's and server's I/O threads, at most half the usable CPUs. Measured on the 16-core
  device (2 workers + 2 servers, ResNet-50's 161 gradient shapes as CPU tensors): 8 torch
  threads a worker, the plane's threads on top, made push_pull of the shapes 2.65x slower than
  of one flat tensor of the same bytes (186.7 against 70.4 ms); 4 threads a worker, 1.00x.
* **Thread counts**: ``OMP_NUM_THREADS``, ``MKL_NUM_THREADS``, ``OPENBLAS_NUM_THREADS`` and
  ``TF_NUM_INTRAOP_THREADS`` are a worker's compute share (its number of CPUs, or a fair
  ``usable CPUs / n`` when workers share CPUs or are not bound, less its part of the data
  plane's reserve above), a server's the fair ``usable CPUs / n`` of the ``n``
  workers and servers (its intra-op pools must not multiply over the host even though its CPUs
  are not confined), the scheduler's 1; ``TF_NUM_INTEROP_THREADS`` at most 2. torch reads
  ``OMP_NUM_THREADS`` when it starts. A variable the user set is never changed; a user's
  ``OMP_NUM_THREADS`` is also what the other variables get, as the libraries themselves fall
  back to it. A server's ``BYTEPS_SERVER_ENGINE_THREAD`` is left alone, even where its share is
  1: the engines sum the ZeroMQ path's keys in ``_core`` with the GIL released and run only
  when data arrives (no spinning pool), and a floating server has every usable CPU to run them
  on; fewer engines would only serialise its keys.

A host with one worker or server (a server machine, a worker machine of one process) is left
alone, as torchrun leaves ``--nproc-per-node 1``. ``BYTEPS_THREAD_SHARE=0`` (``bpslaunch
--no-thread-share``) turns all of this off: then only the local workers are bound, by local
rank, and no variable is set.

Standard library, byteps_like.config, byteps_like.errors and byteps_like.topology only.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from byteps_like.topology import format_cpu_list, place

from .binding import AFFINITY, NUMACTL, Binding, Machine, NoBinding, bind_workers
from .plan import ChildSpec, child_environment

#: Intra-op thread counts: OpenMP (torch reads it at start; MXNet too), MKL, OpenBLAS (numpy),
#: TensorFlow's intra-op pool. Each gets the process's share unless the user set it.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                    "TF_NUM_INTRAOP_THREADS")
#: TensorFlow's pool for independent ops: kept small, at most INTEROP_MAX.
INTEROP_VARIABLE = "TF_NUM_INTEROP_THREADS"
INTEROP_MAX = 2
#: The roles that get a share of the cores; the scheduler gets SCHEDULER_THREADS.
CONSUMERS = ("worker", "server")
SCHEDULER_THREADS = 1
#: A process's native data plane I/O threads when BYTEPS_IO_THREADS is 0 (the default): half
#: the CPUs it may use, between these bounds (byteps_like/transport/native.py, io_threads: the
#: launcher may not import it; tests/unit/test_thread_share.py checks that the two agree).
IO_THREADS_MIN, IO_THREADS_MAX = 2, 8


def io_threads(cpus: int, configured: int = 0) -> int:
    """The data plane's I/O threads of a process that may use ``cpus`` CPUs (``configured``:
    BYTEPS_IO_THREADS, 0 for its default)."""
    if configured > 0:
        return configured
    return max(IO_THREADS_MIN, min(IO_THREADS_MAX, cpus // 2))


def compute_threads(usable: int, worker_cpus: Sequence[int], server_cpus: Sequence[int],
                    configured_io: int = 0) -> tuple[list[int], int]:
    """Each worker's compute threads, and the CPUs left to the data plane (the reserve), on a
    host of ``usable`` CPUs whose workers and servers may each use ``worker_cpus[i]`` and
    ``server_cpus[j]`` CPUs. Pure.

    The reserve is the I/O threads of every worker and server (:func:`io_threads`), at most half
    the usable CPUs; the workers split the rest (the first ones of an uneven split one more),
    each at least 1 and at most its own CPUs."""
    plane = sum(io_threads(c, configured_io) for c in (*worker_cpus, *server_cpus))
    reserve = min(usable // 2, plane)
    split = _split(usable - reserve, len(worker_cpus)) if worker_cpus else []
    return [max(1, min(t, c)) for t, c in zip(split, worker_cpus)], reserve


@dataclass(frozen=True)
class ShareSettings:
    """What the split depends on besides the machine (from byteps_like.config)."""

    local_size: int = 1
    numa_on: bool = True
    visible_cpus: tuple[int, ...] = ()
    blacklist: tuple[int, ...] = ()
    #: BYTEPS_IO_THREADS (0: each process's default, :func:`io_threads`)
    io_threads: int = 0

    @classmethod
    def from_config(cls, cfg) -> ShareSettings:
        """From a loaded :class:`byteps_like.config.Config` (any child's: they share these)."""
        p = cfg.placement
        return cls(cfg.cluster.local_size, p.numa_on, tuple(p.visible_cpu_cores),
                   tuple(p.cpu_blacklist), cfg.transport.io_threads)


@dataclass(frozen=True)
class Share:
    """One process's share of the host: where it runs and how many threads it may start."""

    threads: int
    binding: Binding | None = None
    #: Whether another worker or server may run on the same CPUs (then ``threads`` is the fair
    #: count, not the size of the set).
    shared: bool = False
    #: A server or the scheduler: bound to every usable CPU, shared with everyone (``shared``).
    floating: bool = False


def sharing(specs: Sequence[ChildSpec]) -> bool:
    """Whether these processes of one host share it: more than one worker or server."""
    return sum(s.role in CONSUMERS for s in specs) > 1


def _split(n: int, k: int) -> list[int]:
    """``n`` items into ``k`` shares, the first ``n % k`` one larger."""
    return [n // k + (1 if i < n % k else 0) for i in range(k)]


def _chunks(items: Sequence, k: int) -> list[Sequence]:
    out, start = [], 0
    for size in _split(len(items), k):
        out.append(items[start:start + size])
        start += size
    return out


def _flat(cores: Sequence[Sequence[int]]) -> tuple[int, ...]:
    return tuple(sorted(c for core in cores for c in core))


def plan_shares(specs: Sequence[ChildSpec], machine: Machine, settings: ShareSettings, *,
                bind: bool = True) -> tuple[list[Share | None], list[str]]:
    """Each spec's :class:`Share` (None for every spec when the host is not shared) and notes
    for people: :func:`_place` (where each process runs), then each worker's thread count cut
    to its compute share (:func:`compute_threads`: the data plane's I/O threads of every local
    worker and server count). Pure: depends only on the arguments."""
    shares, notes, usable = _place(specs, machine, settings, bind=bind)
    workers = [i for i, s in enumerate(specs) if s.role == "worker"]
    servers = [i for i, s in enumerate(specs) if s.role == "server"]
    if not workers or shares[workers[0]] is None:
        return shares, notes

    def cpus(i: int) -> int:
        share = shares[i]
        assert share is not None
        if share.binding is None or share.shared or share.floating:
            return usable
        return len(share.binding.cpus)

    threads, reserve = compute_threads(usable, [cpus(i) for i in workers],
                                       [usable] * len(servers), settings.io_threads)
    cut = False
    for i, t in zip(workers, threads):
        share = shares[i]
        assert share is not None
        if t < share.threads:
            shares[i], cut = dataclasses.replace(share, threads=t), True
    if cut:
        notes.append(f"the native data plane's I/O threads of the {len(workers)} worker(s) and "
                     f"{len(servers)} server(s) here get {reserve} of the {usable} usable "
                     f"CPUs: the workers' compute threads share the other {usable - reserve} "
                     "(BYTEPS_IO_THREADS sets the plane's threads; OMP_NUM_THREADS overrides)")
    return shares, notes


def _place(specs: Sequence[ChildSpec], machine: Machine, settings: ShareSettings, *,
           bind: bool = True) -> tuple[list[Share | None], list[str], int]:
    """Each spec's :class:`Share` (None for every spec when the host is not shared), notes
    for people and the number of usable CPUs. Pure: depends only on the arguments.

    Workers get disjoint CPU sets of all usable CPUs (when there are enough) and as many
    threads as CPUs; servers and the scheduler float over all usable CPUs (``floating``,
    ``shared``) with the fair thread count. ``bind`` False: no CPU sets, only the fair thread
    counts (``usable CPUs / n``, the first ones one more). Raises ValueError when no CPU is
    usable or the workers cannot be placed (:func:`byteps_like.topology.place`), NoBinding
    when the platform cannot bind.
    """
    if not sharing(specs):
        return [None] * len(specs), [], 0
    topo = machine.topology
    visible: set[int] | None = set(settings.visible_cpus) or None
    if machine.allowed is not None:
        visible = set(machine.allowed) if visible is None else visible & set(machine.allowed)
    # place() of one rank without NUMA is the usable CPUs, or the ValueError that says why not
    usable = place(topo, local_size=1, visible_cpus=visible, blacklist=settings.blacklist,
                   numa_on=False)[0].cpus
    consumers = [i for i, s in enumerate(specs) if s.role in CONSUMERS]
    workers = [i for i in consumers if specs[i].role == "worker"]
    servers = [i for i in consumers if specs[i].role == "server"]
    order = workers + servers  # the first ones of an uneven split are workers
    fair = dict(zip(order, (max(1, t) for t in _split(len(usable), len(order)))))
    shares: list[Share | None] = [None] * len(specs)
    notes: list[str] = []
    if not bind:
        for i in range(len(specs)):
            shares[i] = Share(fair.get(i, SCHEDULER_THREADS), None, True)
        return shares, notes, len(usable)

    use_numactl = bool(machine.numactl) and settings.numa_on and topo.numa_known
    if not use_numactl and not machine.can_set_affinity:
        raise NoBinding("this platform has neither numactl nor sched_setaffinity")
    method = NUMACTL if use_numactl else AFFINITY
    numactl = machine.numactl or NUMACTL

    def binding(cpus: Sequence[int], node: int | None = None,
                memory: int | None = None) -> Binding:
        """CPUs on one node name it. A floating process's memory is not bound (a server's
        stores may outgrow a node: the kernel's first-touch policy keeps them local without
        failing)."""
        if node is None and settings.numa_on:
            nodes = {topo.node_of(c) for c in cpus}
            node = nodes.pop() if len(nodes) == 1 else None
        return Binding(tuple(sorted(cpus)), node, method, memory, numactl)

    # Servers and the scheduler: every usable CPU, whatever the workers get. The native data
    # plane's I/O threads of a server use whichever cores are free as push and pull alternate.
    everywhere = binding(usable)
    for i, spec in enumerate(specs):
        if spec.role != "worker":
            shares[i] = Share(fair.get(i, SCHEDULER_THREADS), everywhere, True, True)

    if not settings.numa_on:  # every process may use every usable CPU: only thread counts
        for i in workers:
            shares[i] = Share(fair[i], everywhere, True)
        return shares, notes, len(usable)

    usable_set = set(usable)
    cores = [kept for kept in (tuple(c for c in core if c in usable_set) for core in topo.cores)
             if kept]
    cores += [(c,) for c in usable if not any(c in core for core in cores)]
    cores.sort()

    # The workers: their own CPUs when there are enough, else by local rank.
    if workers:
        worker_specs = [specs[i] for i in workers]
        n_gpus = len(topo.gpus)
        placed: list[Share] | None = None
        if (n_gpus > 0 and n_gpus >= settings.local_size) or len(usable) < len(workers):
            # GPU workers (local rank l drives cuda:l, its CPUs on that GPU's node), or too
            # few CPUs for one each: the per-local-rank placement, each rank's CPUs split
            # among the workers of that local rank (the emulated machines of --local)
            placed, more = _by_local_rank(worker_specs, machine, settings, usable, cores)
            if any(share.shared for share in placed) and len(usable) >= len(workers):
                placed = None  # the GPUs' nodes are too small to split: CPUs come first
            else:
                notes += more
        if placed is None:
            # each worker a slot of its own (the NUMA nodes in turn)
            placement = place(topo, local_size=len(workers), gpus_per_rank=0,
                              visible_cpus=usable, numa_on=True)
            if 0 < n_gpus:
                notes.append(f"{len(workers)} worker process(es) and {n_gpus} GPU(s) "
                             f"({settings.local_size} local rank(s) a machine): placing them "
                             "without regard to GPUs")
            notes += placement.notes
            placed = [Share(len(rank.cpus), binding(rank.cpus, rank.numa_node, rank.memory_node))
                      for rank in placement.ranks]
        # workers on overlapping sets (too few CPUs): the fair count, not the set's size. The
        # floating servers are not counted: their threads are I/O, not the workers' compute.
        sets = {i: set(placed_share.binding.cpus) for i, placed_share in zip(workers, placed)
                if placed_share.binding is not None}
        for i, placed_share in zip(workers, placed):
            if placed_share.shared or any(sets[i] & cpus for j, cpus in sets.items() if j != i):
                shares[i] = dataclasses.replace(placed_share, threads=fair[i], shared=True)
            else:
                shares[i] = placed_share
    notes += list(machine.notes)
    return shares, notes, len(usable)


def _by_local_rank(workers: Sequence[ChildSpec], machine: Machine, settings: ShareSettings,
                   pool: Sequence[int], cores: Sequence[tuple[int, ...]]
                   ) -> tuple[list[Share], list[str]]:
    """The workers placed by local rank (:func:`.binding.bind_workers` on ``pool``), the CPUs
    of a local rank split in whole cores among the workers that have it (``--local``'s emulated
    machines); where they are too few to split, those workers share them (``shared``, with 0
    threads for the caller to fill in)."""
    bound, lines = bind_workers(workers, dataclasses.replace(machine, allowed=None, notes=()),
                                local_size=settings.local_size, numa_on=True,
                                visible_cpus=pool)
    notes = [line[len("note: "):] for line in lines if line.startswith("note: ")]
    groups: dict[tuple[int, ...], list[int]] = {}
    for k, spec in enumerate(bound):
        assert spec.binding is not None
        groups.setdefault(spec.binding.cpus, []).append(k)
    out: list[Share | None] = [None] * len(workers)
    for group_cpus, members in groups.items():
        template = bound[members[0]].binding
        assert template is not None
        group_cores = [kept for kept in (tuple(c for c in core if c in group_cpus)
                                         for core in cores) if kept]
        units = group_cores if len(group_cores) >= len(members) else \
            [(c,) for c in group_cpus] if len(group_cpus) >= len(members) else None
        for n, k in enumerate(members):
            if units is None:
                out[k] = Share(0, template, True)
            else:
                cpus = _flat(_chunks(units, len(members))[n])
                out[k] = Share(len(cpus), dataclasses.replace(template, cpus=cpus))
    return [share for share in out if share is not None], notes


def thread_env(spec: ChildSpec, share: Share, env: Mapping[str, str]
               ) -> tuple[dict[str, str], dict[str, str]]:
    """The variables to set in this child's environment, and those the user set (kept).

    ``env`` is the launcher's environment, the base of every child's (a spec's own changes
    apply on top). A user's ``OMP_NUM_THREADS`` is also the value of the variables they left
    unset: MKL and OpenBLAS fall back to it by themselves."""
    child = child_environment(env, spec.env)
    given = {name: child[name] for name in (*THREAD_VARIABLES, INTEROP_VARIABLE)
             if child.get(name, "").strip()}
    count = share.threads
    omp = given.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) > 0:
        count = int(omp)
    out = {name: str(count) for name in THREAD_VARIABLES if name not in given}
    if INTEROP_VARIABLE not in given:
        out[INTEROP_VARIABLE] = str(min(INTEROP_MAX, count))
    return out, given


def describe(spec: ChildSpec, share: Share, settings: ShareSettings, changes: Mapping[str, str],
             given: Mapping[str, str]) -> str:
    """``worker 0 (local rank 0) -> CPUs 0-7, NUMA node 0 (sched_setaffinity); 8 threads
    (OMP_NUM_THREADS)`` or ``server 0 -> floating over CPUs 0-15 (sched_setaffinity); 4
    threads (OMP_NUM_THREADS)``: one line of the launch plan."""
    who = spec.name if spec.role != "worker" or spec.rank is None \
        else f"{spec.name} (local rank {spec.rank % settings.local_size})"
    if share.binding is None:
        where = "not bound"
    elif share.floating:
        where = (f"floating over CPUs {format_cpu_list(share.binding.cpus)} "
                 f"({share.binding.method})")
    else:
        where = share.binding.describe() + (", shared" if share.shared else "")
    if "OMP_NUM_THREADS" in given:
        threads = f"OMP_NUM_THREADS={given['OMP_NUM_THREADS']} (yours)"
    else:
        n = int(changes["OMP_NUM_THREADS"])
        threads = f"{n} thread{'' if n == 1 else 's'} (OMP_NUM_THREADS)"
    kept = [f"{k}={v}" for k, v in given.items() if k != "OMP_NUM_THREADS"]
    if kept:
        threads += f"; yours kept: {', '.join(kept)}"
    return f"{who} -> {where}; {threads}"


def share_host(specs: Sequence[ChildSpec], machine: Machine, env: Mapping[str, str],
               settings: ShareSettings, *, bind: bool = True
               ) -> tuple[list[ChildSpec], list[str]]:
    """Give the processes of one host their shares: each spec gets its Binding (when ``bind``)
    and the thread variables (:func:`thread_env`) in its env. Returns the specs and the lines
    of the launch plan, one per process and then ``note: ...`` lines.

    Specs of a host that is not shared come back unchanged, with no lines. When binding is
    impossible (too few CPUs, no way to bind), the processes are started unbound with the fair
    thread counts and a note says why; when the user's own ``BYTEPS_VISIBLE_CPU_CORES`` or
    ``BYTEPS_CPU_BLACKLIST`` is why, that is a ValueError instead (their request cannot be
    met)."""
    if not sharing(specs):
        return list(specs), []
    try:
        shares, notes = plan_shares(specs, machine, settings, bind=bind)
    except (ValueError, NoBinding) as exc:
        if isinstance(exc, ValueError) and (settings.visible_cpus or settings.blacklist):
            raise
        shares, _ = plan_shares(specs, machine, settings, bind=False)
        notes = [f"not binding the processes to CPUs: {exc}"]
    out: list[ChildSpec] = []
    lines: list[str] = []
    for spec, share in zip(specs, shares):
        assert share is not None
        changes, given = thread_env(spec, share, env)
        out.append(dataclasses.replace(spec, binding=share.binding,
                                       env={**spec.env, **changes}))
        lines.append(describe(spec, share, settings, changes, given))
    return out, lines + [f"note: {note}" for note in notes]
