"""The machine's topology and where each local process should run (docs/topology.md).

:func:`discover` reads a sysfs tree (``/sys`` by default, a fake one in tests): online CPUs,
NUMA nodes, hyper-thread siblings, NVIDIA GPUs, network interfaces, and which devices sit behind
the same PCIe switch. :func:`place` is a pure function of a :class:`Topology` and a few
numbers: which CPUs each local rank runs on, which CPUs a colocated server's engine threads use,
and on which NUMA node each rank keeps its host staging buffers.

Standard library only, and no framework: the launcher imports this module on machines that have
neither numpy nor torch. A plugin that knows CUDA's device order passes it in as
``gpu_bus_ids``. Run ``python -m byteps_like.topology`` to see what was found and decided.
"""
from __future__ import annotations

import json
import os
import re
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

# the CPU-list syntax lives in its own module, which config.py reads too (no import circle)
from .cpulist import CpuListError, format_cpu_list, parse_cpu_list

__all__ = ["Topology", "NumaNode", "Gpu", "Nic", "Placement", "RankPlacement", "CpuListError",
           "discover", "place", "parse_cpu_list", "format_cpu_list", "normalize_bus_id",
           "format_bus_id", "allowed_cpus", "cuda_visible"]

NVIDIA_VENDOR = 0x10DE
#: PCI base class of display controllers (VGA 0x0300xx and 3D controllers 0x0302xx).
DISPLAY_CLASS = 0x03
_BDF_RE = re.compile(r"[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")
_BUS_ID_RE = re.compile(r"(?:([0-9a-f]{1,8}):)?([0-9a-f]{1,2}):([0-9a-f]{1,2})\.([0-7])")


# ------------------------------------------------------------------------------ CPU lists
def allowed_cpus() -> tuple[int, ...] | None:
    """The CPUs this process may run on (its affinity mask, which a container's cpuset or a
    ``taskset`` of the caller narrows), or None where the platform cannot tell."""
    getaffinity = getattr(os, "sched_getaffinity", None)
    if getaffinity is None:
        return None
    try:
        return tuple(sorted(getaffinity(0)))
    except OSError:
        return None


# ------------------------------------------------------------------------------ PCI bus ids
def normalize_bus_id(text: str) -> str:
    """A PCI bus id in sysfs form, ``0000:3b:00.0``. Accepts nvidia-smi's ``00000000:3B:00.0``,
    CUDA's ``0000:3B:00.0`` and a bare ``3b:00.0`` (domain 0). Raises ValueError."""
    m = _BUS_ID_RE.fullmatch(text.strip().lower())
    if m is None:
        raise ValueError(f"{text!r} is not a PCI bus id (expected e.g. 0000:3b:00.0)")
    return format_bus_id(int(m[1] or "0", 16), int(m[2], 16), int(m[3], 16), int(m[4]))


def format_bus_id(domain: int, bus: int, device: int, function: int = 0) -> str:
    """The sysfs bus id of numbers such as torch's ``pci_domain_id``, ``pci_bus_id`` and
    ``pci_device_id`` device properties: ``format_bus_id(0, 0x3b, 0)`` -> ``0000:3b:00.0``."""
    return f"{domain:04x}:{bus:02x}:{device:02x}.{function}"


# ------------------------------------------------------------------------------ the topology
@dataclass(frozen=True)
class NumaNode:
    """One NUMA node: its id, its online CPUs and whether it has memory of its own."""

    id: int
    cpus: tuple[int, ...]
    has_memory: bool = True


@dataclass(frozen=True)
class Gpu:
    """An NVIDIA GPU. ``index`` is its CUDA device number when the caller gave CUDA's order
    (``gpu_bus_ids``), else its rank in PCI bus order (CUDA_DEVICE_ORDER=PCI_BUS_ID)."""

    index: int
    bus_id: str
    numa_node: int | None = None
    #: Bus id of the PCIe switch it sits behind (the first bridge below the root port), or
    #: None when it hangs off a root port or the root bus directly, or is unknown.
    switch: str | None = None
    #: Bus ids from the root port down to the device itself, as sysfs nests them.
    pci_path: tuple[str, ...] = ()


@dataclass(frozen=True)
class Nic:
    """A network interface backed by a device (virtual ones such as ``lo`` are left out)."""

    name: str
    bus_id: str | None = None
    numa_node: int | None = None
    switch: str | None = None


@dataclass(frozen=True)
class Topology:
    """What :func:`discover` found. Every CPU of ``cpus`` belongs to one node and one core."""

    cpus: tuple[int, ...]
    numa_nodes: tuple[NumaNode, ...]
    #: Hyper-thread sibling groups (one per physical core), ordered by their first CPU.
    cores: tuple[tuple[int, ...], ...]
    gpus: tuple[Gpu, ...] = ()
    nics: tuple[Nic, ...] = ()
    #: False when sysfs had no NUMA information and one node was assumed.
    numa_known: bool = True

    @classmethod
    def flat(cls, cpus: int | Iterable[int], gpus: Sequence[Gpu] = ()) -> Topology:
        """One NUMA node, no hyper-threads: ``Topology.flat(4)`` has CPUs 0-3."""
        cpu_ids = tuple(range(cpus)) if isinstance(cpus, int) else tuple(sorted(set(cpus)))
        return cls(cpu_ids, (NumaNode(0, cpu_ids),), tuple((c,) for c in cpu_ids), tuple(gpus),
                   (), numa_known=False)

    def node_of(self, cpu: int) -> int | None:
        """The NUMA node of ``cpu``, None if it is not online."""
        for node in self.numa_nodes:
            if cpu in node.cpus:
                return node.id
        return None

    def siblings_of(self, cpu: int) -> tuple[int, ...]:
        """The hyper-threads of ``cpu``'s core, itself included."""
        for core in self.cores:
            if cpu in core:
                return core
        return ()

    def switch_groups(self) -> tuple[tuple[int, ...], ...]:
        """GPU indices grouped by the PCIe switch they sit behind, ordered by their first GPU;
        a GPU behind no (known) switch is a group of its own."""
        groups: dict[object, list[int]] = {}
        for gpu in sorted(self.gpus, key=lambda g: g.index):
            groups.setdefault(gpu.switch or ("alone", gpu.index), []).append(gpu.index)
        return tuple(tuple(g) for g in groups.values())

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        """A few lines for people: nodes, cores, GPUs with their switches, NICs."""
        threads = max((len(c) for c in self.cores), default=1)
        lines = [f"CPUs {format_cpu_list(self.cpus)} ({len(self.cpus)} online, "
                 f"{len(self.cores)} cores, {threads} thread(s) per core)"]
        for node in self.numa_nodes:
            memory = "" if node.has_memory else ", no memory"
            lines.append(f"NUMA node {node.id}: CPUs {format_cpu_list(node.cpus) or '-'}"
                         f"{memory}" + ("" if self.numa_known else " (assumed: sysfs has no "
                                                                   "NUMA information)"))
        for gpu in self.gpus:
            lines.append(f"GPU {gpu.index}: {gpu.bus_id}, NUMA node {_node_text(gpu.numa_node)},"
                         f" switch {gpu.switch or '-'}")
        for nic in self.nics:
            lines.append(f"NIC {nic.name}: {nic.bus_id or '-'}, NUMA node "
                         f"{_node_text(nic.numa_node)}, switch {nic.switch or '-'}")
        return "\n".join(lines)


def _node_text(node: int | None) -> str:
    return "unknown" if node is None else str(node)


# ------------------------------------------------------------------------------ discovery
def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _read_cpus(path: Path) -> tuple[int, ...] | None:
    text = _read(path)
    if text is None:
        return None
    try:
        return parse_cpu_list(text)
    except CpuListError:
        return None


def _read_hex(path: Path) -> int | None:
    text = _read(path)
    try:
        return int(text, 16) if text else None
    except ValueError:
        return None


def _read_node(path: Path) -> int | None:
    """A ``numa_node`` file: -1 (no affinity reported) and unreadable files are None."""
    text = _read(path)
    try:
        value = int(text) if text else -1
    except ValueError:
        return None
    return value if value >= 0 else None


def _numbered(folder: Path, prefix: str) -> list[tuple[int, Path]]:
    """``folder/<prefix><N>`` entries, sorted by N."""
    try:
        entries = list(folder.iterdir())
    except OSError:
        return []
    out = []
    for entry in entries:
        suffix = entry.name[len(prefix):]
        if entry.name.startswith(prefix) and suffix.isdigit():
            out.append((int(suffix), entry))
    return sorted(out)


def _pci_chain(path: str) -> tuple[str, ...]:
    """Bus ids in a resolved sysfs device path, from the root port down."""
    return tuple(part for part in Path(path).parts if _BDF_RE.fullmatch(part))


def _switch_of(chain: Sequence[str]) -> str | None:
    """The first bridge below the root port, when the device sits below one: in
    ``root port / switch upstream port / switch downstream port / device`` that is the
    upstream port, shared by every device behind the same switch (the top one, if switches
    are nested)."""
    return chain[1] if len(chain) >= 3 else None


def _discover_cpus(root: Path) -> tuple[tuple[int, ...], tuple[NumaNode, ...], bool]:
    cpu_dir = root / "devices" / "system" / "cpu"
    online = _read_cpus(cpu_dir / "online")
    if online is None:
        online = tuple(n for n, _ in _numbered(cpu_dir, "cpu"))
    if not online:
        online = tuple(range(os.cpu_count() or 1))
    node_dir = root / "devices" / "system" / "node"
    with_memory = _read_cpus(node_dir / "has_memory")  # node ids, same list syntax
    nodes: list[NumaNode] = []
    seen: set[int] = set()
    for node_id, path in _numbered(node_dir, "node"):
        cpus = tuple(c for c in (_read_cpus(path / "cpulist") or ()) if c in online
                     and c not in seen)
        seen.update(cpus)
        nodes.append(NumaNode(node_id, cpus, with_memory is None or node_id in with_memory))
    if not nodes:
        return online, (NumaNode(0, online),), False
    stray = tuple(c for c in online if c not in seen)
    if stray:  # online but in no node's list: count them in the first node with CPUs
        first = next((i for i, n in enumerate(nodes) if n.cpus), 0)
        n = nodes[first]
        nodes[first] = NumaNode(n.id, tuple(sorted(n.cpus + stray)), n.has_memory)
    return online, tuple(nodes), True


def _discover_cores(root: Path, online: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    cpu_dir = root / "devices" / "system" / "cpu"
    online_set = set(online)
    assigned: set[int] = set()
    cores = []
    for cpu in online:
        if cpu in assigned:
            continue
        topo = cpu_dir / f"cpu{cpu}" / "topology"
        siblings = _read_cpus(topo / "thread_siblings_list")
        if siblings is None:
            siblings = _read_cpus(topo / "core_cpus_list") or ()
        core = tuple(sorted(({cpu} | (set(siblings) & online_set)) - assigned))
        assigned.update(core)
        cores.append(core)
    return tuple(cores)


def _discover_gpus(root: Path, gpu_bus_ids: Sequence[str] | None) -> tuple[Gpu, ...]:
    pci_dir = root / "bus" / "pci" / "devices"
    found: dict[str, Gpu] = {}
    try:
        entries = sorted(pci_dir.iterdir(), key=lambda p: p.name)
    except OSError:
        entries = []
    for entry in entries:
        if _read_hex(entry / "vendor") != NVIDIA_VENDOR:
            continue
        klass = _read_hex(entry / "class")
        if klass is None or klass >> 16 != DISPLAY_CLASS:
            continue
        try:
            bus_id = normalize_bus_id(entry.name)
        except ValueError:
            continue
        chain = _pci_chain(os.path.realpath(entry)) or (bus_id,)
        found[bus_id] = Gpu(0, bus_id, _read_node(entry / "numa_node"), _switch_of(chain),
                            chain)
    if gpu_bus_ids is None:
        order = sorted(found)
    else:
        order = [normalize_bus_id(b) for b in gpu_bus_ids]
        duplicates = sorted(b for b, n in Counter(order).items() if n > 1)
        if duplicates:
            raise ValueError(f"gpu_bus_ids names {', '.join(duplicates)} more than once")
    gpus = []
    for index, bus_id in enumerate(order):
        gpu = found.get(bus_id, Gpu(0, bus_id))  # not in sysfs: position unknown
        gpus.append(Gpu(index, bus_id, gpu.numa_node, gpu.switch, gpu.pci_path))
    return tuple(gpus)


def _discover_nics(root: Path) -> tuple[Nic, ...]:
    net_dir = root / "class" / "net"
    try:
        entries = sorted(net_dir.iterdir(), key=lambda p: p.name)
    except OSError:
        return ()
    nics = []
    for entry in entries:
        device = entry / "device"
        if not device.exists():  # lo, bridges, veth, tun...: no device behind them
            continue
        resolved = os.path.realpath(device)
        chain = _pci_chain(resolved)
        if chain:  # the nearest PCI device (a virtio NIC sits one level below its PCI device)
            parts = Path(resolved).parts
            pci_dev = Path(*parts[:len(parts) - parts[::-1].index(chain[-1])])
            nics.append(Nic(entry.name, chain[-1], _read_node(pci_dev / "numa_node"),
                            _switch_of(chain)))
        else:
            nics.append(Nic(entry.name, None, _read_node(Path(resolved) / "numa_node")))
    return tuple(nics)


def discover(root: str | os.PathLike = "/sys", *,
             gpu_bus_ids: Sequence[str] | None = None) -> Topology:
    """Read the topology from the sysfs tree at ``root``.

    ``gpu_bus_ids`` lists PCI bus ids in CUDA device order (what
    ``torch.cuda.get_device_properties(i)`` or ``nvidia-smi --query-gpu=pci.bus_id`` report);
    the GPUs are then exactly those, in that order. Without it, every NVIDIA GPU in sysfs is
    listed in PCI bus order. Missing or unreadable files degrade: no NUMA folder gives one node
    with every online CPU, no sibling list makes each CPU its own core, an unknown
    ``numa_node`` is None.
    """
    root = Path(root)
    online, nodes, numa_known = _discover_cpus(root)
    return Topology(cpus=online, numa_nodes=nodes, cores=_discover_cores(root, online),
                    gpus=_discover_gpus(root, gpu_bus_ids), nics=_discover_nics(root),
                    numa_known=numa_known)


def cuda_visible(topology: Topology, cuda_visible_devices: str) -> tuple[Topology, str | None]:
    """The topology as seen by a process with ``CUDA_VISIBLE_DEVICES`` set: only the listed
    GPUs, renumbered from 0 in the listed order. As CUDA does, the list ends at the first entry
    that is not a valid index. GPUs named by UUID (``GPU-...``, ``MIG-...``) cannot be matched
    with sysfs: the result then has no GPUs, and the second value says so."""
    chosen: list[int] = []
    for item in cuda_visible_devices.split(",") if cuda_visible_devices.strip() else []:
        item = item.strip()
        if item.upper().startswith(("GPU-", "MIG-")):
            return (Topology(topology.cpus, topology.numa_nodes, topology.cores, (),
                             topology.nics, topology.numa_known),
                    f"CUDA_VISIBLE_DEVICES={cuda_visible_devices!r} names GPUs by UUID, which "
                    "sysfs cannot match: placing the ranks without regard to GPUs")
        if not item.isdigit() or int(item) >= len(topology.gpus) or int(item) in chosen:
            break
        chosen.append(int(item))
    gpus = tuple(Gpu(i, g.bus_id, g.numa_node, g.switch, g.pci_path)
                 for i, g in enumerate(topology.gpus[c] for c in chosen))
    return Topology(topology.cpus, topology.numa_nodes, topology.cores, gpus, topology.nics,
                    topology.numa_known), None


# ------------------------------------------------------------------------------ placement
@dataclass(frozen=True)
class RankPlacement:
    """Where one local rank runs."""

    local_rank: int
    cpus: tuple[int, ...]
    #: The NUMA node of its CPUs; None without a NUMA preference (``numa_on=False``).
    numa_node: int | None
    #: Indices into ``Topology.gpus`` (CUDA device numbers) it drives; empty for a CPU rank.
    gpus: tuple[int, ...] = ()
    #: The NUMA node for its pinned host staging buffers: its GPU's node, else ``numa_node``.
    buffer_node: int | None = None
    #: The node to bind its memory to: ``numa_node`` unless that node has no memory.
    memory_node: int | None = None

    @property
    def gpu(self) -> int | None:
        return self.gpus[0] if self.gpus else None

    def describe(self) -> str:
        """``CPUs 0-1, NUMA node 0`` or ``CPUs 0-7, no NUMA preference``."""
        node = "no NUMA preference" if self.numa_node is None else f"NUMA node {self.numa_node}"
        return f"CPUs {format_cpu_list(self.cpus)}, {node}"


@dataclass(frozen=True)
class Placement:
    """The result of :func:`place`: one entry per local rank, in local-rank order."""

    ranks: tuple[RankPlacement, ...]
    #: CPUs for the engine threads of a server sharing the machine (empty when none does).
    server_cpus: tuple[int, ...] = ()
    numa_on: bool = True
    #: Fallbacks taken, for people (e.g. "GPU 3's NUMA node has no usable CPU").
    notes: tuple[str, ...] = field(default=(), compare=False)

    def __getitem__(self, local_rank: int) -> RankPlacement:
        return self.ranks[local_rank]

    def __len__(self) -> int:
        return len(self.ranks)

    def to_dict(self) -> dict:
        return asdict(self)


def _split(n: int, k: int) -> list[int]:
    """``n`` items into ``k`` contiguous shares, the first ``n % k`` one larger."""
    return [n // k + (1 if i < n % k else 0) for i in range(k)]


def _slices(items: Sequence, sizes: Sequence[int]) -> list[Sequence]:
    out, start = [], 0
    for size in sizes:
        out.append(items[start:start + size])
        start += size
    return out


def _gpus_node(topology: Topology, indices: Sequence[int]) -> int | None:
    """The NUMA node most of these GPUs sit on (the lowest on a tie); None if unknown."""
    nodes = Counter(topology.gpus[i].numa_node for i in indices
                    if topology.gpus[i].numa_node is not None)
    if not nodes:
        return None
    return min(nodes, key=lambda n: (-nodes[n], n))


def place(topology: Topology, *, local_size: int, gpus_per_rank: int | None = None,
          server_engine_threads: int = 0, visible_cpus: Iterable[int] | None = None,
          blacklist: Iterable[int] = (), numa_on: bool = True) -> Placement:
    """Decide where each of ``local_size`` local ranks runs; pure and deterministic.

    * GPUs: local rank ``i`` drives GPUs ``i*g .. i*g+g-1`` (``g = gpus_per_rank``; by default
      1 when there are at least ``local_size`` GPUs, else 0: CPU ranks).
    * NUMA node of a rank: its GPUs' node; without GPUs (or when that node is unknown or has
      no usable CPU) the nodes with usable CPUs in turn, rank ``i`` on the ``i % n``-th. A
      node with fewer usable CPUs than ranks hands its highest ranks to the node with the most
      spare CPUs.
    * CPUs: ``visible_cpus`` (None: all online) minus ``blacklist``. A node's CPUs are split
      among its ranks in contiguous blocks of whole cores (hyper-thread siblings stay
      together); only when a node has fewer cores than ranks are siblings split up.
    * ``server_engine_threads`` > 0: a server shares the machine and gets that many cores of
      its own (at most ``cores // (local_size + 1)``; the highest-numbered cores of the node
      with the most cores to spare), never leaving a rank without a core. If nothing can be
      spared the server shares all usable CPUs.
    * ``numa_on=False``: every rank (and the server) gets all usable CPUs, no NUMA preference.

    Raises ValueError for a bad argument, when no CPU is usable, when ``numa_on`` and there are
    fewer usable CPUs than ranks, or when the ranks need more GPUs than there are.
    """
    if local_size < 1:
        raise ValueError(f"local_size must be at least 1, not {local_size}")
    if server_engine_threads < 0:
        raise ValueError(f"server_engine_threads must be >= 0, not {server_engine_threads}")
    notes: list[str] = []
    usable = set(topology.cpus)
    visible = None if visible_cpus is None else set(visible_cpus)
    if visible is not None:
        usable &= visible
    usable -= set(blacklist)
    if not usable:
        raise ValueError(
            f"no usable CPU: online {format_cpu_list(topology.cpus) or 'none'}"
            + ("" if visible is None else f", visible {format_cpu_list(visible) or 'none'}")
            + f", blacklisted {format_cpu_list(blacklist) or 'none'}")

    n_gpus = len(topology.gpus)
    if gpus_per_rank is None:
        gpus_per_rank = 1 if n_gpus >= local_size else 0
        if 0 < n_gpus < local_size:
            notes.append(f"{local_size} local ranks but {n_gpus} GPU(s): placing the ranks "
                         "without regard to GPUs")
    elif gpus_per_rank < 0:
        raise ValueError(f"gpus_per_rank must be >= 0, not {gpus_per_rank}")
    elif gpus_per_rank * local_size > n_gpus:
        raise ValueError(f"{local_size} local ranks with {gpus_per_rank} GPU(s) each need "
                         f"{gpus_per_rank * local_size} GPUs; this machine has {n_gpus}")
    rank_gpus = [tuple(range(i * gpus_per_rank, (i + 1) * gpus_per_rank))
                 for i in range(local_size)]
    gpu_nodes = [_gpus_node(topology, g) for g in rank_gpus]

    if not numa_on:
        cpus = tuple(sorted(usable))
        ranks = tuple(RankPlacement(i, cpus, None, rank_gpus[i]) for i in range(local_size))
        return Placement(ranks, cpus if server_engine_threads else (), False, tuple(notes))

    if len(usable) < local_size:
        raise ValueError(f"{local_size} local ranks need at least {local_size} usable CPUs; "
                         f"there are {len(usable)} ({format_cpu_list(usable)})")

    node_cpus = {n.id: [c for c in n.cpus if c in usable] for n in topology.numa_nodes}
    live = [nid for nid in sorted(node_cpus) if node_cpus[nid]]
    home: list[int] = []
    for i, gnode in enumerate(gpu_nodes):
        if gnode is not None and gnode in live:
            home.append(gnode)
            continue
        if gnode is not None:
            notes.append(f"local rank {i}: its GPU's NUMA node {gnode} has no usable CPU")
        home.append(live[i % len(live)])

    count = Counter(home)
    while True:
        over = [nid for nid in live if count[nid] > len(node_cpus[nid])]
        if not over:
            break
        nid = over[0]
        rank = max(r for r in range(local_size) if home[r] == nid)
        target = max(live, key=lambda n: (len(node_cpus[n]) - count[n], -n))
        home[rank] = target
        count[nid] -= 1
        count[target] += 1
        notes.append(f"local rank {rank}: NUMA node {nid} has too few usable CPUs; "
                     f"moved to node {target}")

    # Whole cores of each node, restricted to the usable CPUs, in order of their first CPU.
    node_of = {c: nid for nid, cpus in node_cpus.items() for c in cpus}
    cores: dict[int, list[tuple[int, ...]]] = {nid: [] for nid in live}
    for core in topology.cores:
        kept = tuple(c for c in core if c in usable)
        if kept:
            cores[node_of[kept[0]]].append(kept)

    server_cpus: tuple[int, ...] = ()
    if server_engine_threads:
        total = sum(len(c) for c in cores.values())
        reserved: list[tuple[int, ...]] = []
        for _ in range(min(server_engine_threads, total // (local_size + 1))):
            spare = [n for n in live if len(cores[n]) - count[n] >= 1]
            if not spare:
                break
            nid = max(spare, key=lambda n: (len(cores[n]) - count[n], -n))
            reserved.append(cores[nid].pop())
        if reserved:
            server_cpus = tuple(sorted(c for core in reserved for c in core))
        else:
            server_cpus = tuple(sorted(usable))
            notes.append(f"no core to spare for {server_engine_threads} server engine "
                         "thread(s): the server shares the ranks' CPUs")

    placed: dict[int, RankPlacement] = {}
    has_memory = {n.id: n.has_memory for n in topology.numa_nodes}
    for nid in live:
        ranks_here = [r for r in range(local_size) if home[r] == nid]
        if not ranks_here:
            continue
        node_cores = cores[nid]
        if len(node_cores) >= len(ranks_here):
            shares = [tuple(c for core in s for c in core)
                      for s in _slices(node_cores, _split(len(node_cores), len(ranks_here)))]
        else:  # fewer cores than ranks: split the hyper-threads, siblings adjacent
            flat = [c for core in node_cores for c in core]
            shares = [tuple(s) for s in _slices(flat, _split(len(flat), len(ranks_here)))]
        for rank, share in zip(ranks_here, shares):
            buffer_node = gpu_nodes[rank] if gpu_nodes[rank] is not None else nid
            placed[rank] = RankPlacement(rank, tuple(sorted(share)), nid, rank_gpus[rank],
                                         buffer_node, nid if has_memory[nid] else None)
    return Placement(tuple(placed[r] for r in range(local_size)), server_cpus, True,
                     tuple(notes))


# ------------------------------------------------------------------------------ command line
def main(argv: Sequence[str] | None = None) -> int:
    """``python -m byteps_like.topology``: what this machine looks like and where bpslaunch
    would put ``--local-size`` ranks under the current BYTEPS_* settings."""
    import argparse

    from .config import load
    from .errors import ConfigError

    parser = argparse.ArgumentParser(prog="python -m byteps_like.topology",
                                     description="Show the machine topology and the placement "
                                                 "of local ranks (docs/topology.md).")
    parser.add_argument("--sysfs", default="/sys", help="sysfs root (default /sys)")
    parser.add_argument("--local-size", type=int, default=None,
                        help="local ranks to place (default BYTEPS_LOCAL_SIZE)")
    parser.add_argument("--server-threads", type=int, default=0,
                        help="engine threads of a server sharing the machine (default 0)")
    parser.add_argument("--gpu-bus-ids", default=None,
                        help="comma-separated PCI bus ids in CUDA order")
    parser.add_argument("--cuda-visible-devices", default=None, metavar="LIST",
                        help="place as bpslaunch does for children with this "
                             "CUDA_VISIBLE_DEVICES")
    parser.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args(argv)
    try:
        cfg = load()
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    bus_ids = args.gpu_bus_ids.split(",") if args.gpu_bus_ids else None
    topo = discover(args.sysfs, gpu_bus_ids=bus_ids)
    visible_note = None
    if args.cuda_visible_devices is not None:
        topo, visible_note = cuda_visible(topo, args.cuda_visible_devices)
    p = cfg.placement
    visible = set(p.visible_cpu_cores) if p.visible_cpu_cores else None
    allowed = allowed_cpus() if args.sysfs == "/sys" else None
    if allowed is not None:
        visible = set(allowed) if visible is None else visible & set(allowed)
    local_size = args.local_size or cfg.cluster.local_size
    try:
        placement = place(topo, local_size=local_size, visible_cpus=visible,
                          blacklist=p.cpu_blacklist, numa_on=p.numa_on,
                          server_engine_threads=args.server_threads)
        error = None
    except ValueError as exc:
        placement, error = None, str(exc)
    if args.json:
        print(json.dumps({"topology": topo.to_dict(),
                          "placement": placement.to_dict() if placement else None,
                          "error": error}, indent=2))
        return 0 if error is None else 1
    print(topo.describe())
    if error is not None or placement is None:
        print(f"placement of {local_size} local rank(s): impossible: {error}")
        return 1
    print(f"placement of {local_size} local rank(s):")
    for r in placement.ranks:
        gpu = "" if r.gpu is None else f", GPU {','.join(map(str, r.gpus))}"
        buffer = "" if r.buffer_node is None else f", buffers on node {r.buffer_node}"
        print(f"  local rank {r.local_rank} -> {r.describe()}{gpu}{buffer}")
    if placement.server_cpus:
        print(f"  server engine threads -> CPUs {format_cpu_list(placement.server_cpus)}")
    for note in ([visible_note] if visible_note else []) + list(placement.notes):
        print(f"  note: {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
