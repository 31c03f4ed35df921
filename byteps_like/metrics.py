"""Optional Prometheus metrics of every role (``BYTEPS_METRICS_PORT``; the ``metrics`` extra).

Every process serves its own registry over HTTP (``/metrics``); every metric carries the labels
``role`` and ``rank``. Counters are read from the process's own counters when scraped, so they
cost the hot path nothing; the stage-latency histogram is a pipeline observer. The metric names
are listed in docs/observability.md (and :data:`METRIC_NAMES`).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from .errors import ConfigError

log = logging.getLogger("byteps_like.metrics")

#: name -> (type, help); the documented metric names (without the _total/_bucket suffixes that
#: the exposition format adds).
METRIC_NAMES = {
    # workers
    "byteps_bytes_pushed": ("counter", "Bytes this worker pushed to the servers."),
    "byteps_bytes_pulled": ("counter", "Bytes this worker pulled from the servers."),
    "byteps_rounds": ("counter", "push_pull rounds started, summed over the tensors."),
    "byteps_step": ("gauge", "Training step in progress, from 0 (the trace step): optimizer "
                             "steps of a framework plugin, else rounds of the busiest tensor."),
    "byteps_queue_depth": ("gauge", "Partitions waiting in each pipeline stage's queue "
                                    "(label stage)."),
    "byteps_push_inflight_bytes": ("gauge", "Bytes pushed and not yet acknowledged (credit)."),
    "byteps_stage_seconds": ("histogram", "Time a partition spends in a stage (label stage)."),
    "byteps_stage_queue_wait_seconds": ("histogram", "Time a partition waits in a stage's queue "
                                                     "(label stage)."),
    "byteps_pushpull_speed_mbps": ("gauge", "get_pushpull_speed(): MB/s pushed plus pulled."),
    # servers
    "byteps_server_bytes_summed": ("counter", "Bytes of pushed partitions a server summed."),
    "byteps_server_sum_seconds": ("counter", "Seconds a server's I/O threads spent summing "
                                             "pushes into its stores (decoding compressed "
                                             "ones), all threads together."),
    "byteps_server_pushes": ("counter", "Push messages a server received."),
    "byteps_server_rounds": ("counter", "Rounds a server completed (all pushes summed)."),
    "byteps_server_backup_rounds": ("counter", "Rounds a server completed without every "
                                               "worker's push (BYTEPS_BACKUP_WORKERS)."),
    "byteps_server_late_pushes_dropped": ("counter", "Pushes a server dropped because their "
                                                     "round had completed without them "
                                                     "(BYTEPS_BACKUP_WORKERS)."),
    "byteps_server_lag_errors": ("counter", "Requests of workers that fell further behind "
                                            "than BYTEPS_BACKUP_MAX_LAG, answered with an "
                                            "error."),
    "byteps_server_table_rounds": ("counter", "Rounds of server-held embedding tables a "
                                              "server applied (docs/sparse.md)."),
    "byteps_server_table_rows_updated": ("counter", "Table rows a server's optimizers updated."),
    "byteps_server_table_pulls_answered": ("counter", "Table pulls the native plane's I/O "
                                                      "threads answered themselves "
                                                      "(docs/sparse.md)."),
    "byteps_server_table_pulls_parked": ("counter", "Of those, pulls that waited there for "
                                                    "their round to be applied."),
    "byteps_server_table_bytes": ("gauge", "Bytes a server's tables hold (as charged to "
                                           "BYTEPS_SERVER_MAX_BYTES)."),
    "byteps_server_table_snapshots": ("counter", "Incremental snapshots of table shards a "
                                                 "server took (BYTEPS_SPARSE_SURVIVAL=snapshot)."),
    "byteps_server_table_snapshot_changed_bytes": ("counter", "Bytes of the changed rows "
                                                              "(ids, rows, optimizer state) the "
                                                              "snapshots held."),
    "byteps_server_table_snapshot_bytes_written": ("counter", "Bytes of snapshot and checkpoint "
                                                              "files a server wrote."),
    "byteps_server_table_snapshot_write_s": ("counter", "Seconds a server's writer thread spent "
                                                        "writing snapshots and checkpoints."),
    "byteps_server_table_rollbacks": ("counter", "Tables a server rolled back to a snapshot "
                                                 "after a lost server."),
    "byteps_server_table_rounds_rolled_back": ("counter", "Rounds those rollbacks undid."),
    # scheduler
    "byteps_scheduler_nodes": ("gauge", "Registered nodes (label node_role)."),
    "byteps_scheduler_heartbeats_missed": ("counter", "Heartbeat deadlines nodes missed."),
    "byteps_scheduler_worker_held_seconds": ("gauge", "Seconds the other workers waited for "
                                                      "this worker's pushes since the start, "
                                                      "the most any server saw (label "
                                                      "worker: its rank; docs/observability.md)."),
    "byteps_scheduler_worker_held_fraction": ("gauge", "Fraction of the last "
                                                       "BYTEPS_STRAGGLER_WINDOW_SECONDS the other "
                                                       "workers waited for this worker (label "
                                                       "worker)."),
    "byteps_scheduler_straggler_rank": ("gauge", "Rank of the worker the others wait for more "
                                                 "than BYTEPS_STRAGGLER_FRACTION of the time "
                                                 "(its machine's first rank); -1: none."),
    "byteps_up": ("gauge", "1 while the process serves metrics."),
}

#: the label of a metric whose value is a dict, where it is not the role's default
LABEL_OF = {"byteps_scheduler_worker_held_seconds": "worker",
            "byteps_scheduler_worker_held_fraction": "worker"}

_BUCKETS = (1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.5, 1.0, 5.0, float("inf"))


def _require():
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        raise ConfigError("BYTEPS_METRICS_PORT is set but prometheus-client is not installed: "
                          "pip install 'byteps_like[metrics]' (or unset BYTEPS_METRICS_PORT)"
                          ) from None
    return prometheus_client


class RoleMetrics:
    """A registry served over HTTP, with a collector that reads ``sample()`` when scraped.

    ``sample()`` returns ``{metric name: value or {label value: value}}`` for names in
    :data:`METRIC_NAMES` (a dict value is labelled with ``label``)."""

    def __init__(self, role: str, rank: int, host: str, port: int,
                 sample: Callable[[], dict[str, Any]], label: str = "stage"):
        pc = _require()
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        self.role, self.rank = role, str(rank)
        self.registry = pc.CollectorRegistry(auto_describe=False)
        self._sample = sample
        outer = self

        class _Collector:
            def collect(self_inner):
                values = outer._safe_sample()
                values.setdefault("byteps_up", 1)
                for name, value in values.items():
                    kind, help_ = METRIC_NAMES[name]
                    fam_cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
                    extra = [LABEL_OF.get(name, label)] if isinstance(value, dict) else []
                    fam = fam_cls(name, help_, labels=["role", "rank", *extra])
                    if isinstance(value, dict):
                        for lv, v in value.items():
                            fam.add_metric([outer.role, outer.rank, str(lv)], v)
                    else:
                        fam.add_metric([outer.role, outer.rank], value)
                    yield fam

        self.registry.register(_Collector())
        self.server, self._thread = pc.start_http_server(port, addr=host, registry=self.registry)
        self.port = self.server.server_port
        log.info("%s %s: Prometheus metrics on http://%s:%d/metrics", role, rank, host, self.port)

    def _safe_sample(self) -> dict[str, Any]:
        try:
            return dict(self._sample())
        except Exception as exc:  # noqa: BLE001 - a scrape must never break the process
            if not getattr(self, "_warned", False):
                self._warned = True
                log.warning("%s %s: metrics sample failed: %r", self.role, self.rank, exc)
            return {}

    def histogram(self, name: str, labels: tuple[str, ...] = ("stage",)):
        pc = _require()
        return pc.Histogram(name, METRIC_NAMES[name][1], ["role", "rank", *labels],
                            registry=self.registry, buckets=_BUCKETS)

    def close(self) -> None:
        try:
            self.server.shutdown()
            self.server.server_close()
        except Exception:  # noqa: BLE001
            pass


class WorkerMetrics:
    """The metrics of a worker runtime; :meth:`observe` is its pipeline observer."""

    def __init__(self, runtime: Any, telemetry: Any, host: str, port: int):
        self.runtime, self.tel = runtime, telemetry
        self.role = RoleMetrics("worker", runtime.rank_, host, port, self._sample)
        rank = str(runtime.rank_)
        h = self.role.histogram("byteps_stage_seconds")
        w = self.role.histogram("byteps_stage_queue_wait_seconds")
        self._lat = {}
        self._wait = {}
        for stage in runtime.pipeline.queues:
            self._lat[stage] = h.labels("worker", rank, stage)
            self._wait[stage] = w.labels("worker", rank, stage)
        self._open: dict[tuple[int, str], float] = {}
        self.port = self.role.port

    def observe(self, task: Any, stage: str, event: str, t: float) -> None:
        ident = (id(task), stage)
        if event == "start":
            self._open[ident] = t
            self._wait[stage].observe(max(0.0, t - task.enqueued_at))
            return
        t0 = self._open.pop(ident, None)
        if t0 is not None:
            self._lat[stage].observe(t - t0)

    def _sample(self) -> dict[str, Any]:
        rt = self.runtime
        out: dict[str, Any] = {
            "byteps_bytes_pushed": rt.bytes_pushed, "byteps_bytes_pulled": rt.bytes_pulled,
            "byteps_rounds": self.tel.rounds(), "byteps_step": self.tel.step(),
            "byteps_pushpull_speed_mbps": self.tel.speed()[1]}
        pipe = rt.pipeline
        if pipe is not None:
            out["byteps_queue_depth"] = {s: _depth(q) for s, q in pipe.queues.items()}
            push = pipe.queues.get("push")
            if push is not None and hasattr(push, "inflight"):
                out["byteps_push_inflight_bytes"] = push.inflight
        return out

    def close(self) -> None:
        self.role.close()


def _depth(q: Any) -> int:
    try:
        return len(q)
    except TypeError:  # pipeline._ClosableQueue: a deque inside
        return len(getattr(q, "_q", ()))


def serve_role(role: str, rank: int, cfg: Any, sample: Callable[[], dict[str, Any]],
               label: str = "stage") -> RoleMetrics | None:
    """For servers and the scheduler: serve ``sample()`` if BYTEPS_METRICS_PORT is set."""
    if not cfg.metrics.port:
        return None
    return RoleMetrics(role, rank, cfg.metrics.host, cfg.metrics.port, sample, label)
