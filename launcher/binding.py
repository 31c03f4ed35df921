"""CPU and NUMA binding of the local worker processes (docs/topology.md, "Binding").

Where each local rank runs is decided by :func:`byteps_like.topology.place`; this module turns
that decision into a :class:`Binding` per worker ChildSpec and the lines bpslaunch reports.

How a binding is applied, in order of preference:

``numactl``
    when ``numactl`` is on the PATH, NUMA is on and sysfs describes the NUMA nodes: the argv
    becomes ``numactl --physcpubind=CPUS --membind=NODE -- COMMAND ...`` (``--membind`` is left
    out for a node without memory). numactl execs the command, so the supervised pid is the
    command's own.
``sched_setaffinity``
    otherwise: just before starting the child, the launcher's main thread sets its own
    affinity to the rank's CPUs, and restores it right after. On Linux an affinity mask belongs
    to a thread and a new process inherits the mask of the thread that forks it, so the child
    starts, and execs, already bound. The argv is unchanged, nothing external is needed, no
    code runs between fork and exec (``preexec_fn`` is not safe with the launcher's output
    threads running), and a mask the kernel refuses fails in the launcher, before the child
    exists. No memory policy is set; Linux's default (allocate on the node of the CPU that
    touches the page first) keeps memory local to the bound CPUs.

Standard library, byteps_like.config, byteps_like.errors and byteps_like.topology only.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from byteps_like.topology import (
    Topology,
    allowed_cpus,
    cuda_visible,
    discover,
    format_cpu_list,
    place,
)

from .plan import ChildSpec

NUMACTL = "numactl"
AFFINITY = "sched_setaffinity"


@dataclass(frozen=True)
class Binding:
    """Where one child runs, and how that is applied (``method``: numactl | sched_setaffinity)."""

    cpus: tuple[int, ...]
    numa_node: int | None
    method: str
    #: ``--membind`` node (numactl only); None when the node has no memory or NUMA is off.
    memory_node: int | None = None
    #: The numactl program (path) for the numactl method.
    numactl: str = NUMACTL

    def wrap(self, argv: Sequence[str]) -> tuple[str, ...]:
        """The argv that starts ``argv`` under this binding."""
        if self.method != NUMACTL:
            return tuple(argv)
        options = [f"--physcpubind={format_cpu_list(self.cpus)}"]
        if self.memory_node is not None:
            options.append(f"--membind={self.memory_node}")
        return (self.numactl, *options, "--", *argv)

    @property
    def affinity(self) -> tuple[int, ...] | None:
        """CPUs the launcher sets on itself around the child's start (sched_setaffinity)."""
        return self.cpus if self.method == AFFINITY else None

    def describe(self) -> str:
        """``CPUs 0-1, NUMA node 0 (numactl)``."""
        node = "no NUMA preference" if self.numa_node is None else f"NUMA node {self.numa_node}"
        return f"CPUs {format_cpu_list(self.cpus)}, {node} ({self.method})"


@dataclass(frozen=True)
class Machine:
    """What binding needs to know about this machine; :func:`probe` reads the real one."""

    topology: Topology
    #: The launcher's own affinity mask (a cpuset or an outer taskset narrows it); None: unknown.
    allowed: tuple[int, ...] | None = None
    #: Path of numactl, None when it is not on the PATH.
    numactl: str | None = None
    #: Whether this platform has sched_setaffinity (Linux does).
    can_set_affinity: bool = True
    #: Said about the machine, for the report (e.g. GPUs that could not be matched).
    notes: tuple[str, ...] = ()


def probe(env: Mapping[str, str], sysfs: str = "/sys") -> Machine:
    """The real machine: sysfs topology, our affinity mask, numactl on the children's PATH.

    The GPUs are those the children will see: ``CUDA_VISIBLE_DEVICES`` of the children's
    environment (``env``) selects and renumbers them, in PCI bus order.
    """
    topology = discover(sysfs)
    notes: tuple[str, ...] = ()
    if "CUDA_VISIBLE_DEVICES" in env and topology.gpus:
        topology, note = cuda_visible(topology, env["CUDA_VISIBLE_DEVICES"])
        notes = () if note is None else (note,)
    return Machine(topology, allowed_cpus(),
                   shutil.which(NUMACTL, path=env.get("PATH", os.defpath)),
                   hasattr(os, "sched_setaffinity"), notes)


class NoBinding(Exception):
    """Binding is impossible on this machine; the message says why."""


def bind_workers(specs: Sequence[ChildSpec], machine: Machine, *, local_size: int,
                 numa_on: bool = True, visible_cpus: Iterable[int] = (),
                 blacklist: Iterable[int] = ()) -> tuple[list[ChildSpec], list[str]]:
    """Attach a Binding to every worker spec (local rank = rank % local_size) and return the
    specs with the report lines (``worker 0 (local rank 0) -> CPUs 0-1, NUMA node 0
    (numactl)``, then any placement notes as ``note: ...``).

    ``visible_cpus`` empty means every CPU; it is intersected with ``machine.allowed``.
    Raises ValueError when the ranks cannot be placed (byteps_like.topology.place), and
    NoBinding when the platform cannot bind.
    """
    use_numactl = bool(machine.numactl) and numa_on and machine.topology.numa_known
    if not use_numactl and not machine.can_set_affinity:
        raise NoBinding("this platform has neither numactl nor sched_setaffinity")
    visible = set(visible_cpus) or None
    if machine.allowed is not None:
        visible = set(machine.allowed) if visible is None else visible & set(machine.allowed)
    placement = place(machine.topology, local_size=local_size, visible_cpus=visible,
                      blacklist=tuple(blacklist), numa_on=numa_on)
    out, lines = [], []
    for spec in specs:
        if spec.role != "worker" or spec.rank is None:
            out.append(spec)
            continue
        local_rank = spec.rank % local_size
        rank = placement[local_rank]
        binding = Binding(rank.cpus, rank.numa_node, NUMACTL if use_numactl else AFFINITY,
                          rank.memory_node, machine.numactl or NUMACTL)
        out.append(dataclasses.replace(spec, binding=binding))
        lines.append(f"{spec.name} (local rank {local_rank}) -> {binding.describe()}")
    lines += [f"note: {note}" for note in (*machine.notes, *placement.notes)]
    return out, lines
