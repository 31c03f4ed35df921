"""``bpslaunch plan``: how many servers, where, and which partition size (docs/deployment.md).

A pure function of the cluster's shape, from BytePS's analysis (docs/cluster-benchmark.md):
with n worker machines, k dedicated server machines (plus a server colocated on every worker
machine: mixed mode) and every NIC at B, a push_pull of S bytes takes

    2n(n-1)S / ((n² + kn - 2k) B)      (k = 0: colocated; k = n: S/B, the optimum)

against ``2(n-1)S / (nB)`` for a ring all-reduce. Dedicated servers beyond n gain nothing.
Standard library only.
"""
from __future__ import annotations

from dataclasses import dataclass

COLOCATED = "colocated"
MIXED = "mixed"
DEDICATED = "dedicated"

MIB = 1 << 20
#: Partition size bounds; the size aims at one partition per PARTITION_TARGET_S on the NIC.
MIN_PARTITION = 1 * MIB
MAX_PARTITION = 8 * MIB
#: A round starts and ends with one partition's push and pull that nothing overlaps (pipeline
#: fill and drain): about 20 ms of NIC time per partition kept that cost small in the
#: emulated-cluster benchmark (1 MiB at 400 Mbit/s did better than 4 MB, docs/performance.md).
PARTITION_TARGET_S = 0.02
DEFAULT_MODEL_BYTES = 256 * MIB


def ps_time(n: int, k: int, nbytes: float, rate_bits: float) -> float:
    """BytePS's analysis: push_pull of ``nbytes`` with n worker machines (each with a colocated
    server when k < n), k dedicated server machines, every NIC at ``rate_bits`` bits/s."""
    if n < 1 or k < 0 or rate_bits <= 0:
        raise ValueError(f"need n >= 1, k >= 0 and a positive rate, got n={n}, k={k}, "
                         f"B={rate_bits}")
    if n == 1:
        return 0.0
    k = min(k, n)
    return 2 * n * (n - 1) * nbytes * 8 / ((n * n + k * n - 2 * k) * rate_bits)


def allreduce_time(n: int, nbytes: float, rate_bits: float) -> float:
    """Ring all-reduce of ``nbytes`` over n machines: 2(n-1)S / (nB)."""
    if n < 1 or rate_bits <= 0:
        raise ValueError(f"need n >= 1 and a positive rate, got n={n}, B={rate_bits}")
    return 2 * (n - 1) * nbytes * 8 / (n * rate_bits)


def mixed_fraction(n: int, k: int) -> float:
    """Share of the bytes the k dedicated servers carry in mixed mode: 2k(n-1)/(n²+kn-2k)
    (the same as byteps_like.partition.mixed_mode_fraction, which the launcher may not
    import)."""
    if k == 0 or n == 1:
        return 0.0
    return min(1.0, 2 * k * (n - 1) / (n * n + k * n - 2 * k))


def partition_bytes(rate_bits: float) -> int:
    """A power of two near PARTITION_TARGET_S of NIC time, within [1 MiB, 8 MiB]."""
    want = rate_bits / 8 * PARTITION_TARGET_S
    size = MIN_PARTITION
    while size < MAX_PARTITION and size * 1.5 < want:
        size *= 2
    return size


@dataclass(frozen=True)
class Plan:
    workers: int
    gpus_per_worker: int
    nic_gbps: float
    cpu_nodes: int
    model_bytes: int
    placement: str            # colocated | mixed | dedicated
    dedicated_servers: int    # k: servers on CPU machines
    colocated_servers: int    # servers on worker machines (one per worker machine or none)
    partition_bytes: int
    push_pull_seconds: float
    allreduce_seconds: float
    colocated_seconds: float
    dedicated_fraction: float
    notes: tuple[str, ...] = ()

    @property
    def servers(self) -> int:
        """DMLC_NUM_SERVER."""
        return self.dedicated_servers + self.colocated_servers

    @property
    def speedup_vs_allreduce(self) -> float:
        return self.allreduce_seconds / self.push_pull_seconds if self.push_pull_seconds else 1.0

    def env(self) -> dict[str, str]:
        """The settings the plan implies, in the BytePS contract."""
        return {"DMLC_NUM_WORKER": str(self.workers), "DMLC_NUM_SERVER": str(self.servers),
                "BYTEPS_LOCAL_SIZE": str(self.gpus_per_worker),
                "BYTEPS_PARTITION_BYTES": str(self.partition_bytes)}

    def describe(self) -> str:
        gib = self.model_bytes / (1 << 30)
        where = {COLOCATED: f"one server on each of the {self.workers} worker machine(s)",
                 MIXED: f"one server on each of the {self.workers} worker machine(s) and one on "
                        f"each of {self.dedicated_servers} CPU machine(s); the dedicated ones "
                        f"carry {self.dedicated_fraction:.0%} of the bytes "
                        "(BYTEPS_MIXED_MODE=auto)",
                 DEDICATED: f"one server on each of {self.dedicated_servers} CPU machine(s), "
                            "none on the worker machines"}[self.placement]
        lines = [
            f"cluster: {self.workers} worker machine(s) x {self.gpus_per_worker} GPU(s), "
            f"NIC {self.nic_gbps:g} Gbit/s, {self.cpu_nodes} spare CPU machine(s)",
            f"placement: {self.placement}: {where}",
            f"servers: {self.servers} (DMLC_NUM_SERVER={self.servers})",
            f"worker processes per machine: {self.gpus_per_worker} "
            f"(BYTEPS_LOCAL_SIZE={self.gpus_per_worker})",
            f"partition size: {self.partition_bytes} bytes ({self.partition_bytes / MIB:g} MiB, "
            f"BYTEPS_PARTITION_BYTES={self.partition_bytes})",
            f"expected push_pull of {gib:g} GiB: {self.push_pull_seconds * 1e3:.1f} ms "
            f"(2n(n-1)S/((n²+kn-2k)B), n={self.workers}, k={self.dedicated_servers})",
            f"  ring all-reduce: {self.allreduce_seconds * 1e3:.1f} ms "
            f"(push_pull {self.speedup_vs_allreduce:.2f}x as fast); "
            f"colocated only: {self.colocated_seconds * 1e3:.1f} ms",
        ]
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)


def plan(workers: int, gpus_per_worker: int, nic_gbps: float, cpu_nodes: int = 0,
         model_bytes: int = DEFAULT_MODEL_BYTES) -> Plan:
    """Recommend servers, placement and partition size for ``workers`` machines of
    ``gpus_per_worker`` GPUs with ``nic_gbps`` NICs and ``cpu_nodes`` spare CPU machines.

    * no CPU machines: colocated, a server on every worker machine (k = 0);
    * fewer CPU machines than workers: mixed, use them all (each one lowers the time);
    * at least as many as workers: dedicated, n of them (k = n reaches S/B; more gain nothing).
    """
    if workers < 1 or gpus_per_worker < 1:
        raise ValueError(f"need at least 1 worker machine and 1 GPU per worker, got "
                         f"workers={workers}, gpus_per_worker={gpus_per_worker}")
    if cpu_nodes < 0:
        raise ValueError(f"cpu_nodes must be >= 0, got {cpu_nodes}")
    if not nic_gbps > 0:
        raise ValueError(f"the NIC bandwidth must be positive, got {nic_gbps} Gbit/s")
    if model_bytes < 1:
        raise ValueError(f"the model size must be positive, got {model_bytes}")
    rate = nic_gbps * 1e9
    n = workers
    notes: list[str] = []
    if n == 1:
        placement, k, colocated = COLOCATED, 0, 1
        notes.append("one worker machine: nothing crosses a NIC; one local server is enough")
    elif cpu_nodes == 0:
        placement, k, colocated = COLOCATED, 0, n
    elif cpu_nodes < n:
        placement, k, colocated = MIXED, cpu_nodes, n
    else:
        placement, k, colocated = DEDICATED, n, 0
        if cpu_nodes > n:
            notes.append(f"{cpu_nodes - n} CPU machine(s) left unused: more than n dedicated "
                         "servers do not lower the time")
    if n > 1 and placement != DEDICATED:
        notes.append(f"{n - k} more CPU machine(s) would reach the optimum S/B "
                     f"({ps_time(n, n, model_bytes, rate) * 1e3:.1f} ms)")
    return Plan(workers=n, gpus_per_worker=gpus_per_worker, nic_gbps=nic_gbps,
                cpu_nodes=cpu_nodes, model_bytes=model_bytes, placement=placement,
                dedicated_servers=k, colocated_servers=colocated,
                partition_bytes=partition_bytes(rate),
                push_pull_seconds=ps_time(n, k, model_bytes, rate),
                allreduce_seconds=allreduce_time(n, model_bytes, rate),
                colocated_seconds=ps_time(n, 0, model_bytes, rate),
                dedicated_fraction=mixed_fraction(n, k) if placement == MIXED else
                (1.0 if placement == DEDICATED else 0.0),
                notes=tuple(notes))


def main(argv) -> int:
    """``bpslaunch plan --workers N --gpus-per-worker G --nic-gbps B [--cpu-nodes K]``."""
    import argparse
    import json
    import sys

    p = argparse.ArgumentParser(
        prog="bpslaunch plan", allow_abbrev=False,
        description="Recommend the number of servers, their placement and the partition size "
                    "for a cluster, with the push_pull time BytePS's analysis expects.")
    p.add_argument("--workers", type=int, required=True, help="worker machines (n)")
    p.add_argument("--gpus-per-worker", type=int, required=True, help="GPUs per worker machine")
    p.add_argument("--nic-gbps", type=float, required=True, help="NIC bandwidth, Gbit/s (B)")
    p.add_argument("--cpu-nodes", type=int, default=0,
                   help="spare CPU machines that can run servers (default 0)")
    p.add_argument("--model-mib", type=float, default=DEFAULT_MODEL_BYTES / MIB,
                   help="gradient bytes per step (S), MiB (default "
                        f"{DEFAULT_MODEL_BYTES // MIB})")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    try:
        a = p.parse_args(list(argv))
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    try:
        result = plan(a.workers, a.gpus_per_worker, a.nic_gbps, a.cpu_nodes,
                      int(a.model_mib * MIB))
    except ValueError as exc:
        print(f"bpslaunch plan: error: {exc}", file=sys.stderr)
        return 2
    if a.json:
        from dataclasses import asdict
        print(json.dumps({**asdict(result), "servers": result.servers, "env": result.env()},
                         indent=2))
    else:
        print(result.describe())
    return 0
