"""The one configuration object of byteps_like, and the only module that reads ``os.environ``.

Each setting is declared once below, as a dataclass field carrying its environment name, type,
default, unit, help and bounds; ``SETTINGS`` is the table collected from them. :func:`load`
builds the frozen :class:`Config`; docs/configuration.md (``--markdown``) explains the rules.
"""
from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import os
import re
import sys
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from types import MappingProxyType
from typing import Any, NamedTuple

from .cpulist import CpuListError, format_cpu_list, parse_cpu_list
from .errors import ConfigError

_log = logging.getLogger(__name__)

CONFIG_FILE_ENV = "BYTEPS_CONFIG_FILE"
_PREFIXES = ("BYTEPS_", "DMLC_")
#: Real BytePS / ps-lite variables that deployments set; accepted silently and ignored.
IGNORED_NAMES = frozenset({
    "DMLC_INTERFACE", "DMLC_LOCAL",
    "BYTEPS_NCCL_GROUP_SIZE", "BYTEPS_NCCL_NUM_RINGS",
    "BYTEPS_USE_HASH_KEY", "BYTEPS_KEY_HASH_FN", "BYTEPS_BUILT_IN_HASH_COEF",
    "BYTEPS_ENABLE_MIXED_MODE", "BYTEPS_SERVER_ENABLE_SCHEDULE", "BYTEPS_ENABLE_IPC",
    "BYTEPS_NUMA_DEFAULT_QUOTA", "BYTEPS_MULTITHREADED_CPU", "BYTEPS_OMP_THREAD_PER_GPU",
    "BYTEPS_PCIE_SWITCH_SIZE", "BYTEPS_REDUCE_ROOTS",
    "BYTEPS_THREADPOOL_SIZE", "BYTEPS_DEBUG_SAMPLE_TENSOR", "BYTEPS_ENABLE_GDB",
    "BYTEPS_SOCKET_PATH", "BYTEPS_DISABLE_P2P", "BYTEPS_DISABLE_CPU_ALLREDUCE",
    "BYTEPS_DISABLE_GPU_ALLREDUCE",
})


@dataclass(frozen=True)
class Setting:
    """One row of the settings table."""
    env: str
    kind: str  # str | int | float | bool | size | seconds | choice | cpulist
    default: Any
    help: str
    unit: str = ""
    min: float | None = None
    max: float | None = None
    choices: tuple[str, ...] = ()
    section: str = ""
    name: str = ""

    @property
    def path(self) -> str:
        return f"{self.section}.{self.name}"


def _s(env: str, kind: str, default: Any, help: str, *, repr: bool = True, **kw: Any) -> Any:
    return field(default=default, repr=repr,
                 metadata={"setting": Setting(env, kind, default, help, **kw)})


@dataclass(frozen=True)
class ClusterConfig:
    """Who this process is and how to reach the rest of the job (BytePS / ps-lite names)."""
    role: str = _s("DMLC_ROLE", "choice", "worker", "Role of this process.",
                   choices=("worker", "server", "scheduler"))
    num_worker: int = _s("DMLC_NUM_WORKER", "int", 1, "Number of worker machines (as in BytePS; "
                         "each runs `local_size` worker processes).", unit="machines", min=1)
    num_server: int = _s("DMLC_NUM_SERVER", "int", 0, "Number of server processes in the job.",
                         unit="processes", min=0)
    root_uri: str = _s("DMLC_PS_ROOT_URI", "str", "127.0.0.1",
                       "Host name or IP address of the scheduler.")
    root_port: int = _s("DMLC_PS_ROOT_PORT", "int", 9000, "TCP port the scheduler listens on.",
                        min=1, max=65535)
    worker_id: int | None = _s("DMLC_WORKER_ID", "int", None, "Index of this worker machine, "
                               "0 .. num_worker - 1; unset when not given.", min=0)
    scheduler_restart: int = _s("BYTEPS_SCHEDULER_RESTART", "int", 0, "How many times the "
                                "job's scheduler was started again (bpslaunch "
                                "--scheduler-restarts sets it; informational: a scheduler "
                                "that sees the nodes of a running job register again rebuilds "
                                "its membership from them whatever this says).", min=0)
    server_id: int | None = _s("BYTEPS_SERVER_ID", "int", None, "Index of this server, "
                               "0 .. num_server - 1, which becomes its server rank when every "
                               "server gives one (bpslaunch sets it, so its 'server N' is the "
                               "job's server rank N); unset: servers rank by address.", min=0)
    node_host: str = _s("DMLC_NODE_HOST", "str", "", "Address this node advertises to the others; "
                        "empty picks one automatically.")
    local_rank: int = _s("BYTEPS_LOCAL_RANK", "int", 0, "Index of this process on its machine, "
                         "0 .. local_size - 1.", min=0)
    local_size: int = _s("BYTEPS_LOCAL_SIZE", "int", 1, "Number of worker processes per machine.",
                         unit="processes", min=1)
    server_port: int = _s("BYTEPS_SERVER_PORT", "int", 0, "TCP port a server binds; 0 picks a "
                          "free (ephemeral) port.", min=0, max=65535)
    job_id: str = _s("BYTEPS_JOB_ID", "str", "default", "Name of the job, to tell the nodes of "
                     "different jobs apart. `bpslaunch --local` generates a unique one "
                     "(local-...) unless this is set.")
    shm_dir: str = _s("BYTEPS_SHM_DIR", "str", "/dev/shm", "Directory (a tmpfs) of the "
                      "shared-memory segments the local ranks of a machine reduce through; "
                      "each is reserved in full when created, so a full one is a clear error, "
                      "never a SIGBUS.")
    force_distributed: bool = _s("BYTEPS_FORCE_DISTRIBUTED", "bool", False, "With one worker "
                                 "machine (DMLC_NUM_WORKER=1) push_pull never leaves it: the "
                                 "local ranks reduce among themselves (NCCL all-reduce for CUDA "
                                 "tensors, shared memory for CPU ones) and no server is "
                                 "contacted. Set this to push through the servers anyway, as "
                                 "BytePS does with the same variable.")
    torchrun: str = _s("BYTEPS_TORCHRUN", "choice", "auto", "A process started by torchrun "
                       "(or by any launcher that sets RANK, WORLD_SIZE, LOCAL_RANK, "
                       "LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT) whose byteps_like job is "
                       "not configured (none of DMLC_ROLE, DMLC_NUM_WORKER, DMLC_NUM_SERVER, "
                       "DMLC_WORKER_ID, BYTEPS_LOCAL_RANK, BYTEPS_LOCAL_SIZE set): `auto` joins "
                       "one job of WORLD_SIZE workers, whose services local rank 0 of each node "
                       "starts (docs/launcher.md, \"torchrun\"); `off` ignores torchrun's "
                       "variables, so that every process is a job of its own.",
                       choices=("auto", "off"))
    torchrun_servers_per_node: int | None = _s(
        "BYTEPS_TORCHRUN_SERVERS_PER_NODE", "int", None, "Under torchrun: the servers local "
        "rank 0 of each node starts. Unset: 1 when the job spans several nodes (or "
        "BYTEPS_FORCE_DISTRIBUTED is set), none on one node, where push_pull stays on it.",
        unit="servers", min=0)

    @property
    def total_workers(self) -> int:
        """Worker processes in the whole job: ``num_worker * local_size``."""
        return self.num_worker * self.local_size

    @property
    def single_machine(self) -> bool:
        """One worker machine and no forced servers: push_pull stays on the machine."""
        return self.num_worker == 1 and not self.force_distributed

    @property
    def is_standalone(self) -> bool:
        """A single worker process and no server: nothing to communicate."""
        return self.total_workers == 1 and self.num_server == 0


@dataclass(frozen=True)
class PartitionConfig:
    """How tensors are cut into partitions, the unit of pipelining and of server load balance."""
    partition_bytes: int = _s("BYTEPS_PARTITION_BYTES", "size", 4096000, "Largest partition a "
                              "tensor is cut into. Servers refuse a compressed partition declared "
                              "larger than their own value: set the same on workers and "
                              "servers.", unit="bytes", min=1024)
    mixed_mode: str = _s("BYTEPS_MIXED_MODE", "choice", "auto", "BytePS's mixed mode: when some "
                         "servers share a host with a worker and others do not, give the k "
                         "dedicated servers 2k(n-1)/(n^2+kn-2k) of the bytes (n worker hosts) and "
                         "the colocated ones the rest. `auto` and `on` do so whenever both kinds "
                         "exist; `off` spreads bytes evenly over all servers.",
                         choices=("auto", "on", "off"))
    fusion_bytes: int = _s("BYTEPS_FUSION_BYTES", "size", 32 << 20, "Tensor fusion: the "
                           "gradient synchronizer of every plugin groups gradients, in the order "
                           "backward produces them, into buckets of at most this many bytes; a "
                           "bucket is one tensor on the wire (one key space, one device copy "
                           "each way on a GPU). A larger gradient goes alone (on a GPU cut into "
                           "chunks of this size, each its own copy and key). 0 turns fusion off "
                           "(one push_pull per gradient). Every worker must use the same value. "
                           "The default is measured (docs/performance.md, 'Real models'): "
                           "smaller buckets overlap backward better, larger ones cost fewer "
                           "operations.", unit="bytes", min=0)


@dataclass(frozen=True)
class SchedulingConfig:
    """Flow control of the worker-side pipeline."""
    credit: int = _s("BYTEPS_SCHEDULING_CREDIT", "int", 4, "Partitions' worth of bytes each "
                     "worker may have in flight; 0 means unlimited.", unit="partitions", min=0)
    switch_interval: float = _s("BYTEPS_GIL_SWITCH_INTERVAL", "float", 0.0002, "While the "
                                "native data plane serves a worker, Python's thread switch "
                                "interval (sys.setswitchinterval): at most how long a thread "
                                "whose push_pull completed waits for the GIL while the training "
                                "thread runs Python. With Python's own 0.005 a synchronous "
                                "push_pull of 16 MiB kept 0.29 of its speed next to a busy "
                                "main thread, with 0.0002 0.93 (docs/performance.md). 0 leaves "
                                "the interpreter's setting alone, and so does a program that "
                                "changed it.", unit="seconds", min=0, max=1)
    queue_depth: int = _s("BYTEPS_PIPELINE_QUEUE_DEPTH", "int", 64, "Length of the bounded queue "
                          "between two pipeline stages.", unit="items", min=1)
    codec_threads: int = _s("BYTEPS_CODEC_THREADS", "int", 0, "Threads of each of the worker's "
                            "codec stages (compress, decompress: onebit, top-k, ...), so that "
                            "partitions encode in parallel (0 picks a quarter of the usable "
                            "CPUs, 1 to 4), and of the native data plane's codec pool, which "
                            "encodes and decodes a float32 host tensor's built-in codec in C++ "
                            "(0 picks the usable CPUs, 1 to 8).", unit="threads",
                            min=0, max=64)


@dataclass(frozen=True)
class ServerConfig:
    """The summation service."""
    engine_threads: int = _s("BYTEPS_SERVER_ENGINE_THREAD", "int", 4, "BytePS's summation "
                             "threads of a server; no effect: the native data plane's I/O "
                             "threads sum as they receive (BYTEPS_IO_THREADS).", unit="threads",
                             min=1)
    enable_async: bool = _s("BYTEPS_ENABLE_ASYNC", "bool", False, "Asynchronous training: a "
                            "server applies each push at once instead of waiting for all workers.")
    async_staleness: int = _s("BYTEPS_ASYNC_STALENESS", "int", 0, "Bounded staleness for "
                              "asynchronous mode (BYTEPS_ENABLE_ASYNC=1; stale synchronous "
                              "parallel): a worker runs at most this many rounds ahead of the "
                              "slowest worker still in the job; a server holds the answer of a "
                              "key's round r until every other worker has pushed round r - s "
                              "of it. Workers that finished, were lost or wait in join() are not "
                              "waited for. 0 means unbounded (each push is answered at once). "
                              "Dense keys only: server-held tables are not bounded "
                              "(docs/architecture.md, 'Asynchronous mode').", unit="rounds",
                              min=0, max=1 << 40)
    async_snapshot_seconds: float = _s("BYTEPS_ASYNC_SNAPSHOT_SECONDS", "float", 0.0,
                                       "Asynchronous mode (BYTEPS_ENABLE_ASYNC=1) keeps the "
                                       "model on the servers: with this > 0 each server "
                                       "writes every key's value under "
                                       "BYTEPS_SPARSE_CHECKPOINT_DIR this often, and a lost "
                                       "server's keys move to the servers left, starting from "
                                       "its newest snapshot (the pushes since, at most this "
                                       "many seconds of them, are lost; each server logs how "
                                       "old the snapshot was). 0: an asynchronous job cannot "
                                       "lose a server (docs/reliability.md, 'Losing a "
                                       "server').", unit="s", min=0.0, max=1e6)
    preemption_notice_file: str = _s("BYTEPS_PREEMPTION_NOTICE_FILE", "str", "", "A file "
                                     "whose appearance tells a server that its machine is "
                                     "about to be taken (a spot or preemptible instance's "
                                     "termination notice, written by a sidecar or the node's "
                                     "metadata watcher). The server polls it about every "
                                     "second; once it appears (or changes) the server announces "
                                     "its leave: the scheduler moves its keys to the other "
                                     "servers at once and tells it to exit, with no detection "
                                     "stall (docs/reliability.md, 'Losing a server'). Empty: no "
                                     "notice file.")
    failover: bool = _s("BYTEPS_SERVER_FAILOVER", "bool", True, "Losing a server: when a "
                        "server is lost (its streams close, its process exits, its heartbeat "
                        "stops) while at least one other survives, its keys move to the "
                        "survivors and the open rounds are pushed again from the workers' "
                        "buffers; the job goes on with the same sums (docs/reliability.md, "
                        "'Losing a server'). An asynchronous job keeps the model on the "
                        "servers: it goes on only with BYTEPS_ASYNC_SNAPSHOT_SECONDS (the lost "
                        "server's keys go back to its newest snapshot). 0: a lost server ends "
                        "the job with PeerLostError, as before.")
    backup_workers: int = _s("BYTEPS_BACKUP_WORKERS", "int", 0, "Backup workers (synchronous "
                             "mode; docs/reliability.md, 'Backup workers'): a round of an "
                             "averaged tensor completes on its server once all but this many "
                             "workers (worker machines, with several processes per machine) "
                             "have pushed it; the average divides by the pushes summed, the "
                             "same on every worker. A late push is dropped (counted as "
                             "late_pushes_dropped) and its worker gets the completed rounds' "
                             "sums in order, so every model stays the same. Sums "
                             "(average=False), broadcasts and allgathers still wait for every "
                             "worker. A worker setting (bps.init(BYTEPS_BACKUP_WORKERS=b) works "
                             "too): its declarations tell the servers; every worker must use "
                             "the same. Must be below DMLC_NUM_WORKER; refused with "
                             "asynchronous mode, elastic jobs, a compressor, join() and "
                             "server failover (set BYTEPS_SERVER_FAILOVER=0 with two servers "
                             "or more). 0: every round waits for every worker.", unit="workers",
                             min=0)
    backup_max_lag: int = _s("BYTEPS_BACKUP_MAX_LAG", "int", 64, "With BYTEPS_BACKUP_WORKERS "
                             "(a server setting): the completed rounds of a tensor a server "
                             "keeps, besides the newest, for a worker that fell behind (each a "
                             "copy of the partition, charged to "
                             "BYTEPS_SERVER_MAX_BYTES; fewer when the budget is full). A worker "
                             "further behind gets an error naming it and how far behind it is.",
                             unit="rounds", min=1, max=1 << 20)
    max_bytes: int = _s("BYTEPS_SERVER_MAX_BYTES", "size", 0, "Memory a server may hold for "
                        "its stores and tables together: each key's buffers (two per key; a "
                        "compressed key's float32 accumulator and codec), its declaration and "
                        "bookkeeping, and the server-held tables' shards. A declaration past "
                        "it is refused with an error naming this setting. 0 means 80% of the "
                        "machine's memory (or of the cgroup's limit, when lower), shared "
                        "evenly by the servers of the machine (BYTEPS_SERVER_LOCAL_SIZE).",
                        unit="bytes", min=0)
    local_servers: int = _s("BYTEPS_SERVER_LOCAL_SIZE", "int", 0, "Servers on this machine "
                            "that share the default memory budget (BYTEPS_SERVER_MAX_BYTES=0): "
                            "each takes 80% of the machine's memory divided by this many, so "
                            "local servers together stay within it. 0 means inferred: every "
                            "server of the job when this node's address is loopback (bpslaunch "
                            "--local, a one-node torchrun job), the servers per node under "
                            "torchrun, else 1. Set it where a launcher puts several servers on "
                            "one machine with a routable address.", unit="servers", min=0)
    sum_threads: int = _s("BYTEPS_SERVER_SUM_THREADS", "int", 1, "Threads one summation kernel "
                          "call of a server may use; no effect on the native data plane, which "
                          "sums on its I/O threads.", unit="threads", min=1)
    sparse_max_ids: int = _s("BYTEPS_SPARSE_MAX_IDS", "int", 1 << 20, "Most row ids one "
                             "request of a server-held embedding table may carry (a pull or a "
                             "push to one server; docs/sparse.md). Workers refuse a larger "
                             "batch before sending it, servers refuse a larger request before "
                             "allocating anything for it. Every node must use the same value.",
                             unit="ids", min=1, max=1 << 30)
    sparse_checkpoint_dir: str = _s("BYTEPS_SPARSE_CHECKPOINT_DIR", "str", "", "Directory "
                                    "where servers write and read the checkpoints of "
                                    "server-held embedding tables (table.save(tag) / "
                                    "table.load(tag); docs/sparse.md): one folder per tag, a "
                                    "file per table and shard. Every server must see the same "
                                    "directory (a shared file system across machines) for a "
                                    "restore onto another number of servers. Empty: saving and "
                                    "loading are refused.")
    sparse_survival: str = _s("BYTEPS_SPARSE_SURVIVAL", "choice", "none", "What keeps the "
                              "server-held embedding tables when a server is lost "
                              "(docs/sparse.md, 'Losing a server'): none (its shards are lost "
                              "and the job ends, naming the last checkpoint to load), replicate "
                              "(each shard also lives on the next server, which applies every "
                              "round before the round's last push is acknowledged; a loss "
                              "moves the shard's requests to that copy and the tables stay "
                              "exactly as they would have been; twice the tables' memory and "
                              "push traffic), or snapshot (every BYTEPS_SPARSE_SNAPSHOT_STEPS "
                              "rounds each server writes the rows changed since its last "
                              "snapshot under BYTEPS_SPARSE_CHECKPOINT_DIR; a loss rolls every "
                              "table back to the newest snapshot all its shards have, and the "
                              "workers log how many steps that was). Every node must use the "
                              "same value.", choices=("none", "replicate", "snapshot"))
    sparse_snapshot_steps: int = _s("BYTEPS_SPARSE_SNAPSHOT_STEPS", "int", 100, "Rounds between "
                                    "two incremental snapshots of the server-held tables "
                                    "(BYTEPS_SPARSE_SURVIVAL=snapshot): the most steps a lost "
                                    "server rolls the tables back.", unit="rounds", min=1)
    sparse_checkpoint_repair: str = _s("BYTEPS_SPARSE_CHECKPOINT_REPAIR", "choice", "refuse",
                                       "What a load does with the rows of a checkpoint file "
                                       "that hold NaN or inf, or whose id appears more than "
                                       "once: refuse the file (the default; the error names "
                                       "the file, the table and the first such row), or drop "
                                       "those rows, which start again from their initial "
                                       "values (logged with their count). A damaged file "
                                       "(truncated, bit-flipped, another format) is refused "
                                       "whatever this says.", choices=("refuse", "drop"))


@dataclass(frozen=True)
class PlacementConfig:
    """CPU binding, NUMA and thread shares of bpslaunch's processes (docs/topology.md)."""
    numa_on: bool = _s("BYTEPS_NUMA_ON", "bool", True, "Bind each local worker process to the "
                       "CPUs and memory of one NUMA node: its GPU's node, else the nodes in "
                       "turn. Off: every process may use all usable CPUs, with no NUMA "
                       "preference.")
    visible_cpu_cores: tuple[int, ...] = _s("BYTEPS_VISIBLE_CPU_CORES", "cpulist", (), "CPUs "
                                            "the local processes may use, e.g. `0-15,32-47`; "
                                            "empty means every online CPU bpslaunch may use.")
    cpu_blacklist: tuple[int, ...] = _s("BYTEPS_CPU_BLACKLIST", "cpulist", (), "CPUs no local "
                                        "process may use (same syntax), e.g. those serving "
                                        "interrupts.")
    thread_share: bool = _s("BYTEPS_THREAD_SHARE", "bool", True, "When bpslaunch starts "
                            "several workers or servers on one host (`--local`, a worker "
                            "machine of several local ranks, a SLURM node, the benchmarks), "
                            "give each its share of the cores: workers CPUs of their own where "
                            "there are enough (unless `--no-bind`; servers and the scheduler "
                            "float over every usable CPU), and OMP_NUM_THREADS, MKL_NUM_THREADS, "
                            "OPENBLAS_NUM_THREADS and TF_NUM_INTRAOP_THREADS set to that share "
                            "(TF_NUM_INTEROP_THREADS at most 2), except those you set. Off: "
                            "only the local workers are bound, by local rank, and no thread "
                            "count is set (`bpslaunch --no-thread-share`). See "
                            "docs/topology.md.")


@dataclass(frozen=True)
class TransportConfig:
    """Connections and messages between nodes."""
    tcp_connections: int = _s("BYTEPS_TCP_CONNECTIONS", "int", 1, "Accepted for compatibility, "
                              "no effect: a worker opens no ZeroMQ connection to the servers "
                              "(tensors and server-held tables travel on the native data plane: "
                              "BYTEPS_DATA_STREAMS streams, and one table stream).",
                              unit="connections", min=1, max=16)
    max_message_bytes: int = _s("BYTEPS_MAX_MESSAGE_BYTES", "size", 1 << 30, "Largest message a "
                                "node accepts; must be >= partition_bytes + 4096.", unit="bytes",
                                min=1024)
    socket_hwm: int = _s("BYTEPS_SOCKET_HWM", "int", 1000,
                         "Messages a listening ZeroMQ socket (server, scheduler, local root) "
                         "queues per client and direction (a server's socket keeps at most 4 "
                         "unread messages of a client, its messages being large): a client that "
                         "sends faster is slowed by TCP. Replies are bounded in bytes as well, for"
                         " all clients together: they share 64 MiB of replies not yet written; a "
                         "client over half its share is not served until it reads, one that reads "
                         "nothing loses replies past its share and is disconnected after 10 s "
                         "(counted and logged) instead of costing the node its memory. 0 means no "
                         "limit in messages.", unit="messages",
                         min=0)
    max_connections: int = _s("BYTEPS_MAX_CONNECTIONS", "int", 0, "Clients a listening ZeroMQ "
                              "socket keeps; more are closed as they connect. 0 derives it from "
                              "the descriptor limit (ulimit -n): all of it but 64, a quarter of "
                              "that next to a native data plane, whose streams take the rest.",
                              unit="connections", min=0)
    transport: str = _s("BYTEPS_TRANSPORT", "choice", "zmq", "Streams of the data plane "
                        "(worker <-> server): `zmq` (TCP), or `ucx` (the native data plane's "
                        "streams become UCX endpoints: RDMA, shared memory or TCP, per UCX_TLS; "
                        "needs `byteps_like[ucx]` so _core loads libucp, else a ConfigError at "
                        "start; the server-held tables' streams too). Control stays on ZeroMQ "
                        "either way, CURVE-encrypted with an auth secret. See docs/transports.md.",
                        choices=("zmq", "ucx"))
    enable_rdma: bool = _s("DMLC_ENABLE_RDMA", "bool", False, "BytePS's switch for RDMA: selects "
                           "BYTEPS_TRANSPORT=ucx unless BYTEPS_TRANSPORT is set explicitly.")
    enable_ucx: bool = _s("DMLC_ENABLE_UCX", "bool", False, "BytePS's switch for its UCX van: "
                          "selects BYTEPS_TRANSPORT=ucx like DMLC_ENABLE_RDMA.")
    data_plane: str = _s("BYTEPS_DATA_PLANE", "choice", "auto", "What moves partitions between "
                         "workers and servers: always the native data plane (compiled I/O "
                         "threads that never hold the GIL, several TCP streams per "
                         "worker-server pair, or UCX streams with BYTEPS_TRANSPORT=ucx; with an "
                         "auth secret every stream is authenticated, not encrypted). `auto` and "
                         "`native` mean it; `zmq` (the retired Python engine) is refused at "
                         "start with what replaces it. See docs/architecture.md.",
                         choices=("auto", "native", "zmq"))
    io_threads: int = _s("BYTEPS_IO_THREADS", "int", 0, "I/O threads of the native data plane "
                         "per process; 0 picks half the usable CPUs, between 2 and 8.",
                         unit="threads", min=0, max=64)
    data_streams: int = _s("BYTEPS_DATA_STREAMS", "int", 0, "TCP streams of the native data "
                           "plane from each worker to each server (a server's partitions take "
                           "them in turn); 0 picks the number of I/O threads.",
                           unit="connections", min=0, max=32)
    ucx_device_memory: bool = _s("BYTEPS_UCX_DEVICE_MEMORY", "bool", False, "Retired (the "
                                 "ucxx engine that sent CUDA buffers as they are): 1 is refused "
                                 "at start; CUDA buffers are staged through pinned host memory "
                                 "and moved by the native data plane.")


@dataclass(frozen=True)
class TimeoutsConfig:
    """Default timeouts of blocking operations and liveness checks."""
    op_timeout: float = _s("BYTEPS_TIMEOUT_SECONDS", "seconds", 600.0, "Default wait of one "
                           "push_pull before it fails with a timeout.", unit="seconds")
    register_timeout: float = _s("BYTEPS_REGISTER_TIMEOUT_SECONDS", "seconds", 120.0, "How long "
                                 "a node waits for the whole job to register.", unit="seconds")
    heartbeat_interval: float = _s("BYTEPS_HEARTBEAT_INTERVAL_SECONDS", "seconds", 1.0, "Time "
                                   "between two heartbeats of a node.", unit="seconds")
    heartbeat_timeout: float = _s("BYTEPS_HEARTBEAT_TIMEOUT_SECONDS", "seconds", 20.0, "Silence "
                                  "after which a node is declared lost; must exceed twice "
                                  "heartbeat_interval.", unit="seconds")
    shutdown_timeout: float = _s("BYTEPS_SHUTDOWN_TIMEOUT_SECONDS", "seconds", 30.0, "How long "
                                 "shutdown waits for peers before giving up.", unit="seconds")
    stall_check_time: float = _s("BYTEPS_STALL_CHECK_TIME_SECONDS", "seconds", 60.0, "Stall "
                                 "inspector: a synchronous round of a tensor that some workers "
                                 "have pushed and others have not for this long is reported by "
                                 "its server to the scheduler, which logs the tensor names and "
                                 "the missing worker ranks.", unit="seconds")
    stall_shutdown_time: float = _s("BYTEPS_STALL_SHUTDOWN_TIME_SECONDS", "float", 0.0, "Stall "
                                    "inspector: fail the whole job (every node raises "
                                    "PeerLostError naming the missing ranks) once a round has "
                                    "stalled this long; 0 turns it off.", unit="seconds", min=0)
    scheduler_connect_timeout: float = _s(
        "BYTEPS_SCHEDULER_CONNECT_TIMEOUT_SECONDS", "float", 13.0, "A node whose connection "
        "attempts to the scheduler's address get no answer at all (no connection, no refusal: "
        "an unroutable or firewalled DMLC_PS_ROOT_URI) fails after this long with one error "
        "naming the address; a scheduler that refuses (not started yet) is waited for up to "
        "BYTEPS_REGISTER_TIMEOUT_SECONDS. 0 turns it off.", unit="seconds", min=0)
    scheduler_lost_grace: float = _s(
        "BYTEPS_SCHEDULER_LOST_GRACE_SECONDS", "float", 0.5, "A node whose connection to the "
        "scheduler closes (the scheduler exited or was killed) fails with PeerLostError naming "
        "it after this long, unless the connection is back by then (a scheduler restarted on "
        "its address); a scheduler that hangs is found by BYTEPS_HEARTBEAT_TIMEOUT_SECONDS.",
        unit="seconds", min=0)
    startup_warn: float = _s("BYTEPS_STARTUP_WARN_SECONDS", "seconds", 30.0, "While the job "
                             "forms, the scheduler and each node waiting for it log what they "
                             "wait for every 5 s: at INFO while the others may merely be "
                             "starting (a framework import takes seconds), at WARNING from "
                             "this long on.", unit="seconds")


@dataclass(frozen=True)
class CompressionConfig:
    """Gradient compression (docs/compression.md); a compressor passed in code wins over these."""
    min_compress_bytes: int = _s("BYTEPS_MIN_COMPRESS_BYTES", "size", 64 << 10, "Tensors smaller "
                                 "than this travel uncompressed (their compression would cost "
                                 "more than it saves).", unit="bytes", min=0)
    compressor: str = _s("BYTEPS_COMPRESSOR", "str", "", "Compressor of the gradients: onebit, "
                         "topk, randomk, dithering, fp16, bf16, none, auto (picks one per "
                         "tensor size from the measured bandwidth and codec speeds: "
                         "docs/compression.md), or registered:NAME for a "
                         "compressor the code registers with byteps_like.compression.register; "
                         "empty = none. Checked when the configuration loads: another name is "
                         "a ConfigError naming the valid ones.")
    k: float = _s("BYTEPS_COMPRESSOR_K", "float", 0.01, "top-k / random-k: a fraction of each "
                  "partition's elements when below 1, else a count.", min=0)
    error_feedback: bool = _s("BYTEPS_COMPRESSOR_ERROR_FEEDBACK", "bool", False, "Wrap the "
                              "compressor in error feedback (the compression error of a step is "
                              "added to the next step's gradient).")
    momentum: float = _s("BYTEPS_COMPRESSOR_MOMENTUM", "float", 0.0, "Nesterov momentum "
                         "coefficient applied on the workers before compression; 0 turns it off "
                         "(then leave momentum out of the optimizer).", min=0, max=1)
    seed: int = _s("BYTEPS_COMPRESSOR_SEED", "int", 0, "Seed of random-k and dithering; workers "
                   "and servers derive the same random stream from it.", min=0)
    onebit_scaling: bool = _s("BYTEPS_COMPRESSOR_ONEBIT_SCALING", "bool", True, "onebit: scale "
                              "the signs by the mean absolute value.")
    levels: int = _s("BYTEPS_COMPRESSOR_DITHERING_LEVELS", "int", 16, "dithering: number of "
                     "quantisation levels.", min=1, max=127)
    partition: str = _s("BYTEPS_COMPRESSOR_DITHERING_PARTITION", "choice", "linear",
                        "dithering: level spacing.", choices=("linear", "natural"))
    normalize: str = _s("BYTEPS_COMPRESSOR_DITHERING_NORMALIZE", "choice", "max",
                        "dithering: the norm values are scaled by.", choices=("max", "l2"))
    auto_codecs: str = _s("BYTEPS_COMPRESSOR_AUTO_CODECS", "str", "fp16", "auto: the "
                          "candidates besides none (always one), comma-separated, of fp16, "
                          "bf16, onebit, topk, randomk, dithering; codecs with error feedback "
                          "and the BYTEPS_COMPRESSOR_K / _SEED / _DITHERING_LEVELS settings.")
    auto_margin: float = _s("BYTEPS_COMPRESSOR_AUTO_MARGIN", "float", 0.1, "auto: a candidate "
                            "replaces the current one only when predicted faster by more than "
                            "this fraction (hysteresis; the bandwidth must also have moved by "
                            "25% since the last decision).", min=0, max=10)
    auto_rounds: int = _s("BYTEPS_COMPRESSOR_AUTO_ROUNDS", "int", 1, "auto: rounds of a tensor "
                          "between the points where every rank may switch its compressor "
                          "(each point costs one small broadcast from rank 0).", min=1,
                          max=1_000_000)


@dataclass(frozen=True)
class AuthConfig:
    """Authentication of peers (docs/reliability.md): ZeroMQ CURVE keys derived from a secret."""
    secret: str = _s("BYTEPS_AUTH_SECRET", "str", "", "Shared secret of the job; when set, every "
                     "ZeroMQ connection is encrypted and authenticated with CURVE keys derived "
                     "from it, every native data-plane stream is authenticated (not encrypted: "
                     "to encrypt data in flight, run the job over an encrypted network), and "
                     "peers without it cannot connect. Empty turns authentication off. "
                     "`bpslaunch --local` generates one per job unless --no-auth.", repr=False)
    secret_file: str = _s("BYTEPS_AUTH_SECRET_FILE", "str", "", "File whose contents (stripped) "
                          "are the shared secret; used when BYTEPS_AUTH_SECRET is empty, so the "
                          "secret need not appear in the environment.")
    off: bool = _s("BYTEPS_AUTH_OFF", "bool", False, "Run without authentication where "
                   "byteps_like would make the job's secret itself: a single-node torchrun job "
                   "makes a one-time secret (shared through a file of its owner's, mode 0600) "
                   "unless this is 1; the job then says once that it is unauthenticated. "
                   "(bpslaunch --local has --no-auth for the same.)")


# --- observability (docs/observability.md): timeline traces, metrics, telemetry ---------------
@dataclass(frozen=True)
class TraceConfig:
    """Timeline traces of the worker pipeline (Chrome trace-event JSON, as in BytePS)."""
    on: bool = _s("BYTEPS_TRACE_ON", "bool", False, "Write a timeline trace: one event per "
                  "pipeline stage per partition, to BYTEPS_TRACE_DIR/<rank>/comm.json.")
    start_step: int = _s("BYTEPS_TRACE_START_STEP", "int", 10, "First traced step; a step is a "
                         "training step (each gradient averaging a plugin notes; without a "
                         "plugin, a round of the tensor push_pulled most).", min=0)
    end_step: int = _s("BYTEPS_TRACE_END_STEP", "int", 20, "Last traced step (inclusive); the "
                       "trace file is written once it is over, or at shutdown.", min=0)
    dir: str = _s("BYTEPS_TRACE_DIR", "str", "./trace", "Directory of the trace files.")


@dataclass(frozen=True)
class MetricsConfig:
    """Prometheus metrics endpoint and the periodic telemetry summary line."""
    port: int = _s("BYTEPS_METRICS_PORT", "int", 0, "Serve Prometheus metrics over HTTP on "
                   "this port (needs the `metrics` extra, prometheus-client; a worker serves "
                   "this port + BYTEPS_LOCAL_RANK); 0 turns it off. "
                   "`bpslaunch --local --metrics` assigns a free port to every process.",
                   min=0, max=65535)
    host: str = _s("BYTEPS_METRICS_HOST", "str", "0.0.0.0", "Address the metrics endpoint "
                   "binds to.")
    summary_interval: float = _s("BYTEPS_TELEMETRY_INTERVAL_SECONDS", "seconds", 10.0,
                                 "Workers log a summary line (throughput, slowest stage) at "
                                 "INFO level this often; 0 turns it off.", unit="seconds")
    report_interval: float = _s("BYTEPS_REPORT_INTERVAL_SECONDS", "seconds", 1.0, "Workers and "
                                "servers send the scheduler their telemetry (progress, traffic, "
                                "the straggler report) this often; the live page and the "
                                "straggler log read it. 0 turns the reports off.",
                                unit="seconds", min=0.0)
    straggler_fraction: float = _s("BYTEPS_STRAGGLER_FRACTION", "float", 0.1, "The scheduler "
                                   "logs one line naming a worker (rank and host) when the "
                                   "others waited for it more than this fraction of the job's "
                                   "time over BYTEPS_STRAGGLER_WINDOW_SECONDS, and one when it "
                                   "recovers; 0 turns the line off.", min=0.0, max=1.0)
    straggler_window: float = _s("BYTEPS_STRAGGLER_WINDOW_SECONDS", "seconds", 5.0, "The span "
                                 "over which a worker's cost to the job is measured for the "
                                 "straggler line and the live page.", unit="seconds", min=0.5)
    dashboard_port: int = _s("BYTEPS_DASHBOARD_PORT", "int", 0, "The scheduler serves the live "
                             "job page (and its JSON, /api/state) on this port; 0 turns it off. "
                             "`bpslaunch --dashboard` sets it.", min=0, max=65535)
    dashboard_host: str = _s("BYTEPS_DASHBOARD_HOST", "str", "127.0.0.1", "Address the live "
                             "page binds to. On any address but loopback it requires the job's "
                             "secret (BYTEPS_AUTH_SECRET) as a token.")
# --- end observability -------------------------------------------------------------------------


@dataclass(frozen=True)
class ElasticConfig:
    """Elastic training (docs/elastic.md): workers may leave and join a running job."""
    enabled: bool = _s("BYTEPS_ELASTIC", "bool", False, "Elastic job: a worker lost (heartbeat "
                       "or exit) or a new worker registering starts a new membership epoch; "
                       "ranks are renumbered densely, the servers drop the old epoch's open "
                       "rounds, and the survivors get MembershipChangedError and rejoin. "
                       "DMLC_NUM_WORKER is then the starting count and DMLC_WORKER_ID is "
                       "optional. Off: a lost worker fails the job, as always.")
    min_workers: int = _s("BYTEPS_ELASTIC_MIN_WORKERS", "int", 1, "Elastic job: fewest workers "
                          "it runs with; below it for longer than BYTEPS_ELASTIC_TIMEOUT_SECONDS "
                          "the job fails with TooFewWorkersError.", unit="workers", min=1)
    max_workers: int = _s("BYTEPS_ELASTIC_MAX_WORKERS", "int", 0, "Elastic job: most workers at "
                          "once (the servers size their bookkeeping to it); a registration "
                          "beyond it is refused. 0: DMLC_NUM_WORKER.", unit="workers", min=0)
    timeout: float = _s("BYTEPS_ELASTIC_TIMEOUT_SECONDS", "seconds", 60.0, "Elastic job: how "
                        "long it may stay below BYTEPS_ELASTIC_MIN_WORKERS (waiting for workers "
                        "to join) before it fails with TooFewWorkersError.", unit="seconds",
                        min=0)

    def capacity(self, num_worker: int) -> int:
        """Most workers at once: max_workers, or the starting count when 0."""
        return max(self.max_workers or num_worker, num_worker)


@dataclass(frozen=True)
class LogConfig:
    """Logging."""
    level: str = _s("BYTEPS_LOG_LEVEL", "choice", "WARNING", "Log level (case-insensitive).",
                    choices=("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL"))
    report_unknown: bool = _s("BYTEPS_REPORT_UNKNOWN_SETTINGS", "bool", True, "Log one line "
                              "naming the `BYTEPS_*`/`DMLC_*` environment variables that are "
                              "no setting, each with the closest setting's name. bpslaunch "
                              "says it once for the processes it starts and sets this to 0 for "
                              "them; a process started otherwise says it itself (the scheduler, "
                              "each server, local rank 0 of each worker machine).")


@dataclass(frozen=True)
class TorchrunJob:
    """What torchrun (``torch.distributed.run``, or a launcher that sets the same variables)
    told this process. :func:`load` reads it when the process joins a torchrun job, and fills
    the cluster settings from it (docs/launcher.md, "torchrun")."""
    rank: int                # RANK
    world_size: int          # WORLD_SIZE
    local_rank: int          # LOCAL_RANK
    local_world_size: int    # LOCAL_WORLD_SIZE
    node_rank: int           # GROUP_RANK (else RANK // LOCAL_WORLD_SIZE)
    nnodes: int              # WORLD_SIZE // LOCAL_WORLD_SIZE (GROUP_WORLD_SIZE)
    master_addr: str         # MASTER_ADDR: the host of node rank 0
    master_port: int         # MASTER_PORT
    servers_per_node: int    # BYTEPS_TORCHRUN_SERVERS_PER_NODE, or its default
    run_id: str = ""         # TORCHELASTIC_RUN_ID ("" without torchrun's agent)
    restart_count: int = 0   # TORCHELASTIC_RESTART_COUNT
    max_restarts: int = 0    # TORCHELASTIC_MAX_RESTARTS


@dataclass(frozen=True)
class Config:
    """The whole configuration; build it with :func:`load`, change it with :meth:`replace`."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    partition: PartitionConfig = field(default_factory=PartitionConfig)
    scheduling: SchedulingConfig = field(default_factory=SchedulingConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    timeouts: TimeoutsConfig = field(default_factory=TimeoutsConfig)
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    trace: TraceConfig = field(default_factory=TraceConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    log: LogConfig = field(default_factory=LogConfig)
    _sources: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}),
                                        compare=False, repr=False)
    _unknown: tuple[str, ...] = field(default=(), compare=False, repr=False)
    _torchrun: TorchrunJob | None = field(default=None, compare=False, repr=False)

    @property
    def torchrun(self) -> TorchrunJob | None:
        """What torchrun told this process, when it joins a torchrun job (the cluster settings
        then come from torchrun's variables); None otherwise."""
        return self._torchrun

    @property
    def unknown_settings(self) -> tuple[str, ...]:
        """The ``BYTEPS_*``/``DMLC_*`` environment variables :func:`load` found that are no
        setting, each as ``NAME (did you mean OTHER?)``; see :func:`report_unknown_settings`."""
        return self._unknown

    def get(self, path: str) -> Any:
        """The value at a dotted path such as ``"cluster.num_worker"``."""
        section, name = _resolve(path, "argument").path.split(".")
        return getattr(getattr(self, section), name)

    @property
    def can_lose_servers(self) -> bool:
        """Whether this job goes on when a server is lost (docs/reliability.md):
        BYTEPS_SERVER_FAILOVER, two servers or more, and synchronous, or asynchronous with
        snapshots of the model the servers keep (BYTEPS_ASYNC_SNAPSHOT_SECONDS)."""
        return (self.server.failover and self.cluster.num_server >= 2
                and (not self.server.enable_async or self.server.async_snapshot_seconds > 0))

    def source(self, path: str) -> str:
        """Where the value at ``path`` came from ("default", "environment", ...)."""
        return self._sources.get(_resolve(path, "argument").path, "default")

    def to_env(self, include_defaults: bool = False) -> dict[str, str]:
        """Environment names and string values of every non-default field (all with
        ``include_defaults``); ``load(env=cfg.to_env()) == cfg``."""
        out = {}
        for s in SETTINGS:
            value = self.get(s.path)
            if value is not None and (include_defaults or value != s.default):
                out[s.env] = _format(value)
        return out

    def replace(self, **overrides: Any) -> Config:
        """A new validated Config; keys are dotted paths or environment names."""
        values = {s.path: (self.get(s.path), self.source(s.path)) for s in SETTINGS}
        for key, value in overrides.items():
            values[_resolve(key, "override").path] = (value, "override")
        return _build(values, self._torchrun)


def _collect() -> tuple[Setting, ...]:
    rows = []
    for sec in dataclasses.fields(Config):
        if not sec.name.startswith("_"):
            for f in dataclasses.fields(sec.default_factory):  # type: ignore[arg-type]
                rows.append(dataclasses.replace(f.metadata["setting"], section=sec.name,
                                                name=f.name))
    return tuple(rows)


#: The settings table, in declaration order.
SETTINGS: tuple[Setting, ...] = _collect()
_BY_PATH = {s.path: s for s in SETTINGS}
_BY_ENV = {s.env: s for s in SETTINGS}
_SECTIONS = {s.section for s in SETTINGS}

# ---------------------------------------------------------------------------------- parsing
SIZE_HINT = ("is not a size: use bytes or a suffix K, M, G (powers of 1024) "
             "or KB, MB, GB (powers of 1000)")
_SIZE_RE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(i?)(b?)", re.IGNORECASE)
_SECONDS_RE = re.compile(r"(.+?)\s*(ms|s|m|h)?", re.IGNORECASE)
_SECONDS_UNIT = {"": 1.0, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


class _Bad(Exception):
    """A value failed to parse; the caller adds the variable name and source."""


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _parse_number(v: Any, conv: Any, error: str) -> Any:
    """``conv`` of an int (or a float, for floats) or of a string; finite."""
    try:
        if _is_int(v) or (conv is float and isinstance(v, float)):
            x = conv(v)
        else:
            x = conv(v.strip()) if isinstance(v, str) else None
    except (ValueError, InvalidOperation):
        x = None
    if x is None or (conv is float and not math.isfinite(x)):
        raise _Bad(error)
    return x


def _parse_size(v: Any) -> int:
    if _is_int(v):
        return v
    m = _SIZE_RE.fullmatch(v.strip()) if isinstance(v, str) else None
    if m is None or (m[3] and not m[2]):
        raise _Bad(SIZE_HINT)
    power = "kmgt".index(m[2].lower()) + 1 if m[2] else 0
    base = 1000 if (m[2] and m[4] and not m[3]) else 1024
    n = Decimal(m[1]) * base ** power
    if n != n.to_integral_value():
        raise _Bad("is not a whole number of bytes")
    return int(n)


def parse_size(value: str | int) -> int:
    """Bytes of a size written as a setting is: an int, or a string of bytes with an optional
    suffix K, M, G, T (powers of 1024; KiB ... too) or KB, MB, GB, TB (powers of 1000), any
    case, e.g. ``"64K"`` -> 65536, ``"1.5M"`` -> 1572864, ``"4MB"`` -> 4000000.

    Raises ValueError naming the value and the accepted forms (``'4x' is not a size: ...``).
    Command lines (the benchmarks') use it for their size options, so that a size reads the
    same there as in ``BYTEPS_PARTITION_BYTES``."""
    try:
        return _parse_size(value)
    except _Bad as exc:
        raise ValueError(f"{value!r} {exc}") from None


def _parse_seconds(v: Any) -> float:
    m = _SECONDS_RE.fullmatch(v.strip()) if isinstance(v, str) else None
    scale = _SECONDS_UNIT[(m[2] or "").lower()] if m else 1.0
    x = scale * _parse_number(m[1] if m else v, float,
                              "is not a duration: use seconds, or a suffix ms, s, m or h")
    if x <= 0:
        raise _Bad("must be a positive number of seconds")
    return x


def _parse_bool(v: Any) -> bool:
    text = str(int(v)) if _is_int(v) or isinstance(v, bool) else v
    if isinstance(text, str) and text.strip().lower() in _TRUE | _FALSE:
        return text.strip().lower() in _TRUE
    raise _Bad("is not a boolean: use 1/0, true/false, yes/no or on/off")


def _parse_cpulist(v: Any) -> tuple[int, ...]:
    if isinstance(v, str):
        try:
            return parse_cpu_list(v)
        except CpuListError as exc:
            raise _Bad(f"is not a CPU list: {exc.reason} (use e.g. 0-3,8,10-11)") from None
    if isinstance(v, (list, tuple, set, frozenset)) and all(_is_int(c) and c >= 0 for c in v):
        return tuple(sorted(set(v)))
    raise _Bad("is not a CPU list: use a string such as 0-3,8,10-11 or a list of CPU numbers")


_PARSERS = {
    "int": lambda v: _parse_number(v, int, "is not an integer"),
    "float": lambda v: _parse_number(v, float, "is not a finite number"),
    "size": _parse_size, "seconds": _parse_seconds, "bool": _parse_bool,
    "cpulist": _parse_cpulist,
}


def _parse(s: Setting, v: Any) -> Any:
    if s.kind == "choice":
        for choice in s.choices:
            if isinstance(v, str) and v.strip().lower() == choice.lower():
                return choice
        raise _Bad("is not one of " + ", ".join(s.choices))
    if s.kind == "str":
        if not isinstance(v, str):
            raise _Bad("is not a string")
        if not v.strip() and s.default:
            raise _Bad("must not be empty")
        return v.strip()
    x = _PARSERS[s.kind](v)
    if s.min is not None and s.max is not None and not s.min <= x <= s.max:
        raise _Bad(f"must be between {s.min} and {s.max}")
    elif s.min is not None and x < s.min:
        raise _Bad(f"must be >= {s.min}")
    elif s.max is not None and x > s.max:
        raise _Bad(f"must be <= {s.max}")
    return x


def _format(v: Any) -> str:
    if isinstance(v, tuple):  # a CPU list
        return format_cpu_list(v)
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, float):
        return str(int(v)) if v.is_integer() and abs(v) < 1e15 else repr(v)
    return str(v)


# ---------------------------------------------------------------------------------- layers
def _suggest(name: str, candidates: Any) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f"did you mean {close[0]}?" if close else "not a byteps_like setting"


def _resolve(key: str, source: str) -> Setting:
    s = _BY_PATH.get(key) or _BY_ENV.get(key)
    if s is None:
        raise ConfigError(f"unknown setting {key!r} ({source}): "
                          f"{_suggest(key, [*_BY_PATH, *_BY_ENV])}")
    return s


def _read_mapping(values: Any, source: str) -> dict[str, tuple[Any, str]]:
    """Overrides keyed by dotted path or env name; None means "not given" (argparse-friendly)."""
    items = values.items() if isinstance(values, Mapping) else vars(values).items()
    return {_resolve(k, source).path: (v, source) for k, v in items if v is not None}


def _read_file(path: str, origin: str) -> dict[str, tuple[Any, str]]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ModuleNotFoundError:
            raise ConfigError(
                f"config file {path} ({origin}) needs Python >= 3.11 or tomli") from None
    source = f"config file {path}"
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except OSError as exc:
        raise ConfigError(f"{source} ({origin}) cannot be read: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source} is not valid TOML: {exc}") from None
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if key in _SECTIONS and isinstance(value, dict):
            flat.update({f"{key}.{name}": v for name, v in value.items()})
        else:
            flat[key] = value
    return _read_mapping(flat, source)


def _read_env(env: Mapping[str, str]) -> tuple[dict[str, tuple[Any, str]], list[str]]:
    values, unknown = {}, []
    for name, raw in env.items():
        if not name.startswith(_PREFIXES) or name == CONFIG_FILE_ENV:
            continue
        if name in _BY_ENV:
            if raw.strip():  # empty means unset
                values[_BY_ENV[name].path] = (raw, "environment")
        elif name in IGNORED_NAMES:
            _log.debug("%s is a BytePS setting that byteps_like accepts and ignores", name)
        else:
            unknown.append(f"{name} ({_suggest(name, _BY_ENV)})")
    return values, unknown


def _build(values: Mapping[str, tuple[Any, str]], torchrun: TorchrunJob | None = None) -> Config:
    parsed: dict[str, dict[str, Any]] = {sec: {} for sec in _SECTIONS}
    for s in SETTINGS:
        raw, source = values[s.path]
        try:
            if raw is None and s.default is not None:
                raise _Bad("must be set")
            parsed[s.section][s.name] = None if raw is None else _parse(s, raw)
        except _Bad as exc:
            raise ConfigError(f"{s.env}={raw!r} ({source}) {exc}") from None
    tr = parsed["transport"]
    if tr["enable_rdma"] or tr["enable_ucx"]:   # BytePS's switches select the UCX transport
        if values["transport.transport"][1] == "default":
            tr["transport"] = "ucx"
        elif tr["transport"] != "ucx":
            flag = "DMLC_ENABLE_RDMA" if tr["enable_rdma"] else "DMLC_ENABLE_UCX"
            raise ConfigError(f"{flag}=1 ({values[_BY_ENV[flag].path][1]}) asks for RDMA/UCX "
                              f"but BYTEPS_TRANSPORT={tr['transport']!r} "
                              f"({values['transport.transport'][1]}); unset one of them")
    section_types: dict[str, Any] = {f.name: f.default_factory for f in dataclasses.fields(Config)
                                     if f.name in _SECTIONS}
    sections = {name: make(**parsed[name]) for name, make in section_types.items()}
    cfg = Config(**sections, _sources=MappingProxyType({k: v[1] for k, v in values.items()}),
                 _torchrun=torchrun)
    _cross_check(cfg)
    return cfg


def _cross_check(cfg: Config) -> None:
    def who(path: str) -> str:
        return f"{_BY_PATH[path].env}={cfg.get(path)!r} ({cfg.source(path)})"

    c, t = cfg.cluster, cfg.timeouts
    if c.worker_id is not None and c.worker_id >= c.num_worker:
        raise ConfigError(f"{who('cluster.worker_id')} must be < {who('cluster.num_worker')}")
    if c.local_rank >= c.local_size:
        raise ConfigError(f"{who('cluster.local_rank')} must be < {who('cluster.local_size')}")
    if cfg.transport.max_message_bytes < cfg.partition.partition_bytes + 4096:
        raise ConfigError(f"{who('transport.max_message_bytes')} must be >= "
                          f"{who('partition.partition_bytes')} + 4096 (one partition and header)")
    if t.heartbeat_timeout <= 2 * t.heartbeat_interval:
        raise ConfigError(f"{who('timeouts.heartbeat_timeout')} must exceed twice "
                          f"{who('timeouts.heartbeat_interval')}")
    e = cfg.elastic
    if e.enabled:
        if e.max_workers and e.max_workers < c.num_worker:
            raise ConfigError(f"{who('elastic.max_workers')} must be >= "
                              f"{who('cluster.num_worker')} (the starting count)")
        if e.min_workers > e.capacity(c.num_worker):
            raise ConfigError(f"{who('elastic.min_workers')} must be <= the most workers "
                              f"({who('elastic.max_workers')}, {who('cluster.num_worker')})")
        if c.local_size != 1:
            raise ConfigError(f"{who('elastic.enabled')}: elastic jobs run one worker process "
                              f"per machine; {who('cluster.local_size')} is not supported")
        if cfg.server.sparse_survival == "snapshot":
            raise ConfigError(f"{who('server.sparse_survival')}: a rollback of the tables "
                              "and an elastic job's membership epochs do not go together; use "
                              "replicate (or none) in an elastic job")
    if cfg.server.async_staleness and not cfg.server.enable_async:
        raise ConfigError(f"{who('server.async_staleness')} bounds asynchronous mode only; set "
                          f"BYTEPS_ENABLE_ASYNC=1, or 0 for synchronous training (every round "
                          f"waits for every worker: a staleness of none)")
    if cfg.server.async_snapshot_seconds and not cfg.server.enable_async:
        raise ConfigError(f"{who('server.async_snapshot_seconds')} keeps asynchronous mode's "
                          "parameters; set BYTEPS_ENABLE_ASYNC=1 (synchronous jobs lose a "
                          "server without it: the workers push the open rounds again)")
    _check_retired(cfg, who)
    _check_compression(cfg, who)
    _check_backup(cfg, who)
    if (cfg.auth.secret_file and not cfg.auth.secret
            and cfg.source("auth.secret_file") != TORCHRUN_SECRET_SOURCE):
        # said at start, not in a child later (a torchrun job's file is made by its local
        # rank 0 when it joins: launcher/torchrun.py)
        try:
            with open(cfg.auth.secret_file, encoding="utf-8") as f:
                empty = not f.read().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{who('auth.secret_file')}: cannot read the secret ("
                              f"{getattr(exc, 'strerror', None) or exc})") from None
        if empty:
            raise ConfigError(f"{who('auth.secret_file')} is empty")


def _check_backup(cfg: Config, who: Callable[[str], str]) -> None:
    """BYTEPS_BACKUP_WORKERS with what it can serve; every combination it cannot make right is
    refused here, naming the settings (docs/reliability.md, 'Backup workers')."""
    b = cfg.server.backup_workers
    if b == 0:
        return
    bw = who("server.backup_workers")
    if b >= cfg.cluster.num_worker:
        raise ConfigError(f"{bw} must be below {who('cluster.num_worker')}: a round needs "
                          "at least one worker's push")
    if cfg.server.enable_async:
        raise ConfigError(f"{bw} is for synchronous rounds; {who('server.enable_async')} has "
                          "none: unset one of them")
    if cfg.elastic.enabled:
        raise ConfigError(f"{bw} does not combine with {who('elastic.enabled')}: unset one "
                          "of them")
    if cfg.compression.compressor.strip():
        raise ConfigError(f"{bw} does not combine with {who('compression.compressor')} (a "
                          "server codec's rounds need every worker's push): unset one of them")
    if cfg.can_lose_servers:
        raise ConfigError(f"{bw} does not combine with losing a server "
                          f"({who('server.failover')} with {who('cluster.num_server')}): set "
                          "BYTEPS_SERVER_FAILOVER=0 or BYTEPS_BACKUP_WORKERS=0")


#: The compressors BYTEPS_COMPRESSOR names (byteps_like/compression.py registers them under
#: these names; tests/unit/test_early_errors.py holds the two together). A compressor the code
#: registers is named REGISTERED_PREFIX + its name: it exists only once the code has run, so only
#: the form of its name is checked at load.
BUILTIN_COMPRESSORS = ("onebit", "topk", "randomk", "dithering", "fp16", "bf16", "none",
                       "auto")
REGISTERED_PREFIX = "registered:"
#: what BYTEPS_COMPRESSOR_AUTO_CODECS may list (byteps_like/autocompress.py's CANDIDATES + none)
AUTO_CANDIDATES = ("none", "fp16", "bf16", "onebit", "topk", "randomk", "dithering")
_REGISTERED_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]{0,63}")


def _check_compression(cfg: Config, who: Callable[[str], str]) -> None:
    """BYTEPS_COMPRESSOR names a compressor and BYTEPS_COMPRESSOR_K suits it, said when the job
    starts instead of when an optimizer first resolves them (issue 41, item 8)."""
    name = cfg.compression.compressor.strip()
    if not name or name in BUILTIN_COMPRESSORS:
        pass
    elif name.startswith(REGISTERED_PREFIX):
        if not _REGISTERED_NAME.fullmatch(name[len(REGISTERED_PREFIX):]):
            raise ConfigError(f"{who('compression.compressor')}: after {REGISTERED_PREFIX!r} "
                              "comes the name a compressor was registered under "
                              "(byteps_like.compression.register), e.g. registered:mine")
    else:
        close = difflib.get_close_matches(name, BUILTIN_COMPRESSORS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"{who('compression.compressor')} is not a compressor{hint}; valid: "
                          f"{', '.join(BUILTIN_COMPRESSORS)}, or registered:NAME for one the "
                          "code registers with byteps_like.compression.register "
                          "(docs/compression.md)")
    if name == "auto":
        bad = [c.strip() for c in cfg.compression.auto_codecs.split(",")
               if c.strip() and c.strip() not in AUTO_CANDIDATES]
        if bad:
            raise ConfigError(f"{who('compression.auto_codecs')}: {', '.join(bad)} is not a "
                              f"candidate of auto; use some of {', '.join(AUTO_CANDIDATES)}")
    k = cfg.compression.k
    if name in ("topk", "randomk") and not (0 < k < 1 or (k >= 1 and float(k).is_integer())):
        raise ConfigError(f"{who('compression.k')} does not suit {name}: a fraction in (0, 1) "
                          "of each partition's elements, or a whole count >= 1")


def _check_retired(cfg: Config, who: Callable[[str], str]) -> None:
    """Settings of the retired ZeroMQ and ucxx data paths (issue 29): refused with what
    replaces them."""
    if cfg.transport.data_plane == "zmq":
        raise ConfigError(
            f"{who('transport.data_plane')} is retired: worker-server data always moves on the "
            "native data plane, authenticated with the job's secret (BYTEPS_AUTH_SECRET) but not "
            "encrypted; to encrypt data in flight, run the job over an encrypted network "
            "(WireGuard, IPsec). The control plane stays CURVE-encrypted. Unset it (or set auto "
            "or native); see docs/transports.md")
    if cfg.transport.ucx_device_memory:
        raise ConfigError(
            f"{who('transport.ucx_device_memory')} is retired: CUDA buffers are staged through "
            "pinned host memory and moved by the native data plane (over UCX streams with "
            "BYTEPS_TRANSPORT=ucx); unset it; see docs/transports.md")


#: What torchrun sets in each worker's environment, all of which a process needs to join a
#: torchrun job (GROUP_RANK, GROUP_WORLD_SIZE and TORCHELASTIC_* are read when present).
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                      "MASTER_PORT")
#: Under torchrun the scheduler listens on a port every node derives alike from MASTER_PORT,
#: the run id and the restart count (a new port for each restart), in this range: below the
#: ephemeral ports of Linux (32768-60999), where MASTER_PORT + 1 was often taken by a
#: connection's local port (bind(0) hands out odd ports there and connect() even ones).
TORCHRUN_PORT_RANGE = (20000, 32768)
TORCHRUN_PORT_SOURCE = "torchrun: derived from MASTER_PORT"


def torchrun_scheduler_port(job: TorchrunJob) -> int:
    """The scheduler's port of a torchrun job unless DMLC_PS_ROOT_PORT says otherwise: the same
    on every node, from what torchrun gives them all (see TORCHRUN_PORT_RANGE)."""
    import zlib
    lo, hi = TORCHRUN_PORT_RANGE
    key = f"{job.master_port}/{job.run_id}/{job.restart_count}".encode()
    return lo + zlib.crc32(key) % (hi - lo)


#: The settings that configure a byteps_like job; with any of them set, a process under
#: torchrun belongs to that job, not to torchrun's (bpslaunch sets them for its workers).
_JOB_PATHS = ("cluster.role", "cluster.num_worker", "cluster.num_server", "cluster.worker_id",
              "cluster.local_rank", "cluster.local_size")


def _torchrun_job(values: dict[str, tuple[Any, str]],
                  env: Mapping[str, str]) -> TorchrunJob | None:
    """Whether this process joins a torchrun job (BYTEPS_TORCHRUN=auto, torchrun's variables
    present, no byteps_like job configured); if so, its :class:`TorchrunJob`, and the cluster
    settings not set otherwise are filled from it in ``values`` (sources ``torchrun: ...``)."""
    try:
        mode = _parse(_BY_PATH["cluster.torchrun"], values["cluster.torchrun"][0])
        elastic = _parse(_BY_PATH["elastic.enabled"], values["elastic.enabled"][0])
        forced = _parse(_BY_PATH["cluster.force_distributed"],
                        values["cluster.force_distributed"][0])
        per_node_raw = values["cluster.torchrun_servers_per_node"][0]
        per_node = None if per_node_raw is None else _parse(
            _BY_PATH["cluster.torchrun_servers_per_node"], per_node_raw)
    except _Bad:
        return None  # _build names the bad value
    if mode == "off" or any(values[p][1] != "default" for p in _JOB_PATHS):
        return None
    if not all(env.get(name, "").strip() for name in TORCHRUN_VARIABLES):
        return None

    def number(name: str, default: int | None = None, lo: int = 0) -> int:
        raw = env.get(name, "").strip()
        if not raw and default is not None:
            return default
        try:
            value = int(raw)
        except ValueError:
            value = lo - 1
        if value < lo:
            raise ConfigError(f"{name}={raw!r} (torchrun's environment) is not a whole number "
                              f">= {lo}")
        return value
    world, local_world = number("WORLD_SIZE", lo=1), number("LOCAL_WORLD_SIZE", lo=1)
    rank, local_rank = number("RANK"), number("LOCAL_RANK")
    port = number("MASTER_PORT", lo=1)
    nnodes = number("GROUP_WORLD_SIZE", world // local_world or 1, lo=1)
    node_rank = number("GROUP_RANK", rank // local_world)
    where = (f"WORLD_SIZE={world}, LOCAL_WORLD_SIZE={local_world}, RANK={rank}, "
             f"LOCAL_RANK={local_rank}, GROUP_RANK={node_rank}, nodes {nnodes} (torchrun)")
    if world != nnodes * local_world:
        raise ConfigError(f"{where}: byteps_like needs the same number of processes on every "
                          "node (torchrun --nproc-per-node, BYTEPS_LOCAL_SIZE)")
    if local_rank >= local_world or node_rank >= nnodes \
            or rank != node_rank * local_world + local_rank:
        raise ConfigError(f"{where}: these ranks do not describe a job of {nnodes} node(s) of "
                          f"{local_world} process(es); byteps_like's rank is GROUP_RANK * "
                          "LOCAL_WORLD_SIZE + LOCAL_RANK")
    if elastic:
        raise ConfigError(f"BYTEPS_ELASTIC={values['elastic.enabled'][0]!r} "
                          f"({values['elastic.enabled'][1]}): an elastic byteps_like job does "
                          "not run under torchrun; start it with bpslaunch --elastic "
                          "(docs/elastic.md)")
    if per_node is None:
        per_node = 1 if nnodes > 1 or forced else 0
    elif per_node == 0 and world > 1 and (nnodes > 1 or forced):
        raise ConfigError(f"BYTEPS_TORCHRUN_SERVERS_PER_NODE=0 "
                          f"({values['cluster.torchrun_servers_per_node'][1]}): a job of "
                          f"{nnodes} node(s) that pushes through servers needs at least one")
    job = TorchrunJob(rank=rank, world_size=world, local_rank=local_rank,
                      local_world_size=local_world, node_rank=node_rank, nnodes=nnodes,
                      master_addr=env["MASTER_ADDR"].strip(), master_port=port,
                      servers_per_node=per_node, run_id=env.get("TORCHELASTIC_RUN_ID", "").strip(),
                      restart_count=number("TORCHELASTIC_RESTART_COUNT", 0),
                      max_restarts=number("TORCHELASTIC_MAX_RESTARTS", 0))
    # one node: everything on this host, nothing reachable from others
    host = job.master_addr if nnodes > 1 else "127.0.0.1"
    job_id = f"torchrun-{job.run_id or 'none'}-{port}-{job.restart_count}"
    derived: dict[str, tuple[Any, str]] = {
        "cluster.num_worker": (nnodes, "torchrun: WORLD_SIZE / LOCAL_WORLD_SIZE"),
        "cluster.worker_id": (node_rank, "torchrun: GROUP_RANK"),
        "cluster.local_rank": (local_rank, "torchrun: LOCAL_RANK"),
        "cluster.local_size": (local_world, "torchrun: LOCAL_WORLD_SIZE"),
        "cluster.num_server": (nnodes * per_node, "torchrun: nodes x servers per node"),
        "server.local_servers": (per_node, "torchrun: servers per node"),
        "cluster.root_uri": (host, "torchrun: MASTER_ADDR" if nnodes > 1
                             else "torchrun: one node"),
        "cluster.root_port": (torchrun_scheduler_port(job), TORCHRUN_PORT_SOURCE),
        "cluster.job_id": (job_id, "torchrun: TORCHELASTIC_RUN_ID, MASTER_PORT, restart"),
    }
    if nnodes == 1 and _torchrun_makes_secret(values):
        derived["auth.secret_file"] = (torchrun_secret_path(job_id), TORCHRUN_SECRET_SOURCE)
    elif nnodes > 1 and _torchrun_makes_secret(values):
        # torchrun's own store authenticates nothing, so nothing can carry a secret to the
        # other nodes safely: the user gives one, or opts out by name (issue 41)
        raise ConfigError(f"{where}: a torchrun job of {nnodes} nodes needs the job's secret "
                          "on every node: set the same BYTEPS_AUTH_SECRET (or "
                          "BYTEPS_AUTH_SECRET_FILE) on each, or BYTEPS_AUTH_OFF=1 to run it "
                          "unauthenticated (any process that reaches its ports could push "
                          "into it)")
    for path, value in derived.items():
        if values[path][1] == "default":
            values[path] = value
    return job


#: The source of a single-node torchrun job's secret file (its local rank 0 writes it)
TORCHRUN_SECRET_SOURCE = "torchrun: one-time secret of the job"


def _torchrun_makes_secret(values: Mapping[str, tuple[Any, str]]) -> bool:
    """Whether a single-node torchrun job makes its own secret: none set, not opted out."""
    if values["auth.secret"][0] or values["auth.secret_file"][0]:
        return False
    try:
        return not _parse(_BY_PATH["auth.off"], values["auth.off"][0])
    except _Bad:
        return False   # _build names the bad value


def torchrun_secret_path(job_id: str) -> str:
    """Where a single-node torchrun job keeps its one-time secret: a file in a directory of
    its owner's (mode 0700) under the temporary directory, named after the job (issue 41)."""
    import hashlib
    import tempfile
    # torchrun's agent (the workers' parent) too: two runs with one run id and port (no
    # --standalone, a fixed --rdzv-id) never share a file
    name = hashlib.sha256(f"{job_id}/{os.getppid()}".encode()).hexdigest()[:24]
    return os.path.join(tempfile.gettempdir(), f"byteps_like-{os.getuid()}", f"{name}.secret")


def resolve_root(cfg: Config, *, retry_s: float = 5.0) -> None:
    """Fail at once with a ConfigError naming DMLC_PS_ROOT_URI when the scheduler's host name
    does not resolve, instead of every node waiting the registration timeout. A temporary
    failure of the resolver (EAI_AGAIN) is retried for ``retry_s`` seconds."""
    import socket
    import time
    host, deadline = cfg.cluster.root_uri, time.monotonic() + retry_s
    while True:
        try:
            socket.getaddrinfo(host, cfg.cluster.root_port, type=socket.SOCK_STREAM)
            return
        except socket.gaierror as exc:
            if exc.errno == socket.EAI_AGAIN and time.monotonic() < deadline:
                time.sleep(0.2)
                continue
            raise ConfigError(f"DMLC_PS_ROOT_URI={host!r} ({cfg.source('cluster.root_uri')}) "
                              f"does not resolve: {exc.strerror or exc}; set it to the "
                              "scheduler's host name or IP address") from None


def ucx_environment(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The ``UCX_*`` variables UCX itself reads (UCX_TLS, UCX_NET_DEVICES, ...), for messages
    that say which settings a failing UCX tried."""
    env = os.environ if env is None else env
    return {k: v for k, v in env.items() if k.startswith("UCX_")}


def load(env: Mapping[str, str] | None = None, overrides: Mapping[str, object] | None = None,
         config_file: str | None = None, argv_overrides: Any = None) -> Config:
    """Build the validated Config: defaults < config file < environment < command line (
    ``argv_overrides``: a mapping or argparse namespace) < ``overrides``. ``env=None`` reads
    ``os.environ``; the config file comes from ``config_file`` or ``BYTEPS_CONFIG_FILE``.
    Override keys are dotted paths ("cluster.num_worker") or env names ("DMLC_NUM_WORKER")."""
    env = os.environ if env is None else env
    values: dict[str, tuple[Any, str]] = {s.path: (s.default, "default") for s in SETTINGS}
    path, origin = config_file, "argument"
    if not path and env.get(CONFIG_FILE_ENV, "").strip():
        path, origin = env[CONFIG_FILE_ENV].strip(), CONFIG_FILE_ENV
    if path:
        values.update(_read_file(os.fspath(path), origin))
    env_values, unknown = _read_env(env)
    values.update(env_values)
    if argv_overrides is not None:
        values.update(_read_mapping(argv_overrides, "command line"))
    if overrides:
        values.update(_read_mapping(overrides, "override"))
    try:
        torchrun = _torchrun_job(values, env)
        cfg = _build(values, torchrun)
    except ConfigError as exc:  # a misspelt name is a likely cause: say it with the error
        if not unknown:
            raise
        raise ConfigError(f"{exc}; {_unknown_message(tuple(sorted(unknown)))}") from None
    return dataclasses.replace(cfg, _unknown=tuple(sorted(unknown))) if unknown else cfg


def _unknown_message(names: tuple[str, ...]) -> str:
    return ("unknown environment variable(s) ignored: " + ", ".join(names)
            + "; `python -m byteps_like.config --describe` lists the settings")


def unknown_settings_message(cfg: Config) -> str:
    """One line naming the environment variables that looked like settings but are none
    (``""``: there were none)."""
    return _unknown_message(cfg.unknown_settings) if cfg.unknown_settings else ""


def report_unknown_settings(cfg: Config, logger: logging.Logger | None = None) -> bool:
    """Log :func:`unknown_settings_message` once, at WARNING, unless
    ``BYTEPS_REPORT_UNKNOWN_SETTINGS`` is off (bpslaunch said it already). Called by a
    process's entry point once its logging is set up; True when it logged."""
    text = unknown_settings_message(cfg)
    if not text or not cfg.log.report_unknown:
        return False
    (logger or _log).warning("%s", text)
    return True


# ---------------------------------------------------------------------------------- docs
class DescribeRow(NamedTuple):
    section: str
    path: str
    env: str
    type: str
    default: str
    unit: str
    help: str


def _describe_type(s: Setting) -> str:
    if s.kind == "choice":
        return "one of " + ", ".join(f"`{c}`" for c in s.choices)
    bounds = ""
    if s.min is not None and s.max is not None:
        bounds = f" {s.min}..{s.max}"
    elif s.min is not None:
        bounds = f" >= {s.min}"
    optional = ", optional" if s.default is None else ""
    return {"seconds": "seconds > 0", "cpulist": "CPU list"}.get(s.kind, s.kind + bounds) \
        + optional


def _describe_default(s: Setting) -> str:
    if s.default is None:
        return "unset"
    if s.kind == "size" and s.default % 1024 == 0:
        n, unit = s.default, 0
        while n % 1024 == 0 and unit < 3:
            n, unit = n // 1024, unit + 1
        return f"`{s.default}` ({n} {'BKMG'[unit]}{'iB' if unit else ''})"
    return f"`{_format(s.default)}`" if s.default not in ("", ()) else "empty"


def describe_rows() -> list[DescribeRow]:
    """One row of strings per setting, in declaration order (used by ``--describe``)."""
    return [DescribeRow(s.section, s.path, s.env, _describe_type(s), _describe_default(s),
                        s.unit, s.help) for s in SETTINGS]


def describe_markdown() -> str:
    """The settings tables, one per section, as markdown."""
    out: list[str] = []
    section = None
    for row in describe_rows():
        if row.section != section:
            section = row.section
            doc = [f.default_factory.__doc__ or "" for f in dataclasses.fields(Config)
                   if f.name == section][0]
            out += ([""] if out else []) + [f"## `{section}`", "", doc, "",
                    "| Variable | Field | Type | Default | Unit | Description |",
                    "|---|---|---|---|---|---|"]
        cells = (f"`{row.env}`", f"`{row.path}`", row.type, row.default, row.unit, row.help)
        out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(out) + "\n"


_MARKDOWN_INTRO = """\
# Configuration

<!-- Generated by `python -m byteps_like.config --markdown > docs/configuration.md`.
     Do not edit by hand: change byteps_like/config.py and regenerate. -->

Every setting of byteps_like is read once, validated once and passed around as a frozen
`byteps_like.config.Config`. Values come from these layers; a later layer wins:

1. the defaults in the tables below;
2. a TOML config file, named by `load(config_file=...)` or `BYTEPS_CONFIG_FILE`, with a table
   per section (`[cluster]` / `num_worker = 2`) or top-level environment names
   (`DMLC_NUM_WORKER = 2`); an unknown key there is an error;
3. the environment, under the BytePS / ps-lite names below; an empty value counts as unset;
4. command-line flags, then keyword overrides to `load(overrides=...)`, keyed by field path
   (`"cluster.num_worker"`) or environment name (`"DMLC_NUM_WORKER"`).

A bad value stops the program with a `ConfigError` naming the variable, the value and its
source, e.g. `BYTEPS_PARTITION_BYTES='4x' (environment) is not a size: ...`.

Value syntax:

- **size**: a whole number of bytes, or a number with a suffix, case-insensitive:
  `K`, `M`, `G`, `T` and `KiB`, `MiB`, `GiB`, `TiB` are powers of 1024 (`4M` = 4194304);
  `KB`, `MB`, `GB`, `TB` are powers of 1000 (`4MB` = 4000000).
- **bool**: `1`/`0`, `true`/`false`, `yes`/`no`, `on`/`off`, case-insensitive.
- **seconds**: a positive number of seconds, optionally with a suffix `ms`, `s`, `m` or `h`.
- **one of**: case-insensitive.
- **CPU list**: CPU numbers and ranges separated by commas, as in Linux's `cpulist` files and
  `taskset -c`: `0-3,8,10-11`.

An unknown `BYTEPS_*` or `DMLC_*` environment variable is reported once per job, in one line
naming the closest known one: by bpslaunch for the processes it starts, else by the process
itself (`BYTEPS_REPORT_UNKNOWN_SETTINGS`). A `ConfigError` names them too. These BytePS /
ps-lite variables are accepted and ignored:
{ignored}.

`python -m byteps_like.config --show` prints the effective configuration and where each value
came from.

"""


def render_markdown() -> str:
    """The full text of docs/configuration.md."""
    ignored = textwrap.fill(", ".join(f"`{n}`" for n in sorted(IGNORED_NAMES)), 96)
    return _MARKDOWN_INTRO.replace("{ignored}", ignored) + describe_markdown()


def main(argv: list[str] | None = None) -> int:
    import argparse
    parser = argparse.ArgumentParser(prog="python -m byteps_like.config",
                                     description="Describe or show byteps_like settings.")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--describe", action="store_true", help="markdown table of every setting")
    what.add_argument("--markdown", action="store_true", help="the text of docs/configuration.md")
    what.add_argument("--show", action="store_true", help="the effective configuration")
    parser.add_argument("--config-file", help="TOML config file for --show")
    args = parser.parse_args(argv)
    if args.describe:
        sys.stdout.write(describe_markdown())
    elif args.markdown:
        sys.stdout.write(render_markdown())
    else:
        try:
            cfg = load(config_file=args.config_file)
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        for s in SETTINGS:
            print(f"{s.path:30} = {cfg.get(s.path)!r:14} # {s.env}, {cfg.source(s.path)}")
        if cfg.unknown_settings:
            print(f"warning: {unknown_settings_message(cfg)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
