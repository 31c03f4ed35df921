"""``bpslaunch k8s``: Kubernetes manifests for one job (docs/deployment.md, "Kubernetes").

What it writes, all labelled ``app.kubernetes.io/name: byteps-like``,
``app.kubernetes.io/instance: <job>`` and ``byteps-like/role: <role>``:

* ``Service <job>-scheduler`` and ``Pod <job>-scheduler`` (DMLC_ROLE=scheduler);
* ``Job <job>-server``: an Indexed batch/v1 Job of DMLC_NUM_SERVER pods (DMLC_ROLE=server);
* ``Job <job>-worker``: an Indexed Job of DMLC_NUM_WORKER pods (DMLC_ROLE=worker), each running
  ``bpslaunch COMMAND`` with BYTEPS_LOCAL_SIZE = GPUs per pod and DMLC_WORKER_ID = the pod's
  completion index.

Every pod gets the BytePS contract (DMLC_NUM_WORKER, DMLC_NUM_SERVER, DMLC_PS_ROOT_URI = the
scheduler Service, DMLC_PS_ROOT_PORT, DMLC_NODE_HOST = the pod IP), BYTEPS_JOB_ID = <job>, and
BYTEPS_AUTH_SECRET from the Secret ``<job>-auth`` (key ``secret``) unless ``--no-auth``. That
Secret comes first in the output, holding a one-time 256-bit secret generated for the job, unless
``--existing-secret`` (you create and keep it yourself).
Indexed Jobs rather than StatefulSets: a StatefulSet restarts a pod that exits 0, and a worker
restarted after training would rejoin a finished job; a Job's pods run once
(``restartPolicy: Never``, ``backoffLimit: 0``: bpslaunch's all-or-nothing rule).

``--elastic`` (docs/elastic.md): the workers are an elastic job. ``Job <job>-worker`` is then a
NonIndexed Job of ``parallelism`` = DMLC_NUM_WORKER pods and no ``completions`` (it completes
when its pods have ended and one succeeded), without DMLC_WORKER_ID (each worker registers and
the scheduler gives it a rank), ``backoffLimit`` = ``--max-restarts`` (a failed worker pod is
replaced by a fresh one, which joins the running job). Scale it while it runs with
``kubectl patch job <job>-worker -p '{"spec":{"parallelism":N}}'`` (up to --max-workers; the new
pods join at the next commit). Every pod gets BYTEPS_ELASTIC=1 and its bounds; a worker pod runs
one worker process (BYTEPS_LOCAL_SIZE=1).

``--kubeflow`` (launcher/kubeflow.py): the job for Kubeflow Trainer v2 instead, a
ClusterTrainingRuntime (a JobSet of scheduler, server and worker replicated jobs) and a TrainJob,
with gang scheduling by ``--gang kueue|volcano|coscheduling``.

Output is YAML (a small emitter here: the launcher imports the standard library only) or JSON
(``--format json``, a ``v1 List``); ``kubectl apply -f`` takes either.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import re
import secrets
import sys
from collections.abc import Sequence
from typing import Any

APP = "byteps-like"
ROLE_LABEL = "byteps-like/role"
SECRET_KEY = "secret"
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
DEFAULT_PORT = 9000
DEFAULT_SERVER_PORT = 9100
_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
#: The longest suffix added to the job name ("-scheduler"), within the 63-character limit.
MAX_NAME = 63 - len("-scheduler")


def _labels(job: str, role: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": APP, "app.kubernetes.io/instance": job, ROLE_LABEL: role}


def _env(name: str, value: str) -> dict[str, Any]:
    return {"name": name, "value": value}


def _field_env(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def _resources(cpu: str, memory: str, gpus: int = 0) -> dict[str, Any]:
    # requests == limits with whole CPUs: Guaranteed QoS, so a kubelet with the static CPU
    # manager and the topology manager (single-numa-node) gives the pod exclusive cores on the
    # NUMA node of its GPUs.
    amounts: dict[str, Any] = {"cpu": cpu, "memory": memory}
    if gpus:
        amounts["nvidia.com/gpu"] = str(gpus)
    return {"requests": dict(amounts), "limits": dict(amounts)}


def kubeflow(job: str, image: str, command: Sequence[str], *, workers: int, servers: int,
             gpus_per_worker: int = 1, namespace: str | None = None, port: int = DEFAULT_PORT,
             server_port: int = DEFAULT_SERVER_PORT, auth: bool = True,
             worker_cpu: str = "8", worker_memory: str = "32Gi", server_cpu: str = "4",
             server_memory: str = "16Gi", shm_size: str = "8Gi",
             extra_env: Sequence[tuple[str, str]] = (), secret: str | None = None,
             **options: Any) -> list[dict[str, Any]]:
    """The Kubeflow Trainer v2 objects of one job (launcher/kubeflow.py): the Secret
    ``<job>-auth`` (with ``auth`` and ``secret``), a ClusterTrainingRuntime and a TrainJob.
    ``options``: :func:`launcher.kubeflow.kubeflow_manifests`'s (runtime_name, gang, queue,
    server_restarts, schedule_timeout). The same checks as :func:`manifests`."""
    from .kubeflow import kubeflow_manifests
    plain = manifests(job, image, command, workers=workers, servers=servers,
                      gpus_per_worker=gpus_per_worker, namespace=namespace, port=port,
                      server_port=server_port, auth=auth, secret=secret)  # the checks
    objs = kubeflow_manifests(
        job, image, command, workers=workers, servers=servers,
        labels={"app.kubernetes.io/name": APP, "app.kubernetes.io/instance": job},
        resources={"scheduler": _resources("1", "1Gi"),
                   "server": _resources(server_cpu, server_memory),
                   "worker": _resources(worker_cpu, worker_memory, gpus_per_worker)},
        gpus_per_worker=gpus_per_worker, port=port, server_port=server_port, auth=auth,
        secret_name=f"{job}-auth", secret_key=SECRET_KEY, namespace=namespace,
        shm_size=shm_size, extra_env=extra_env, **options)
    return [o for o in plain if o["kind"] == "Secret"] + objs


def manifests(job: str, image: str, command: Sequence[str], *, workers: int, servers: int,
              gpus_per_worker: int = 1, namespace: str | None = None, port: int = DEFAULT_PORT,
              server_port: int = DEFAULT_SERVER_PORT, auth: bool = True,
              worker_cpu: str = "8", worker_memory: str = "32Gi", server_cpu: str = "4",
              server_memory: str = "16Gi", shm_size: str = "8Gi",
              extra_env: Sequence[tuple[str, str]] = (),
              secret: str | None = None,
              elastic: ElasticSpec | None = None) -> list[dict[str, Any]]:
    """The Kubernetes objects of one job, as plain dicts (apiVersion, kind, metadata, spec).
    ``secret`` (with ``auth``): also the Secret ``<job>-auth`` holding it, first. ``elastic``:
    an elastic job (a worker Job that scales, see the module's text)."""
    if not _NAME.match(job) or len(job) > MAX_NAME:
        raise ValueError(f"job name {job!r} is not a DNS label of at most {MAX_NAME} "
                         "characters (lowercase letters, digits and '-', starting with a letter)")
    if not command:
        raise ValueError("missing the worker command")
    if workers < 1 or servers < 1 or gpus_per_worker < 0:
        raise ValueError(f"need workers >= 1, servers >= 1 and gpus_per_worker >= 0, got "
                         f"{workers}, {servers}, {gpus_per_worker}")
    for what, value in (("port", port), ("server port", server_port)):
        if not 0 < value < 65536:
            raise ValueError(f"{what} {value} is not a TCP port")
    if elastic is not None:
        elastic.check(workers)
    scheduler = f"{job}-scheduler"

    def meta(name: str, role: str) -> dict[str, Any]:
        m: dict[str, Any] = {"name": name, "labels": _labels(job, role)}
        if namespace:
            m["namespace"] = namespace
        return m

    def env(role: str) -> list[dict[str, Any]]:
        out = [_env("DMLC_ROLE", role), _env("DMLC_NUM_WORKER", str(workers)),
               _env("DMLC_NUM_SERVER", str(servers)), _env("DMLC_PS_ROOT_URI", scheduler),
               _env("DMLC_PS_ROOT_PORT", str(port)), _env("BYTEPS_JOB_ID", job),
               _field_env("DMLC_NODE_HOST", "status.podIP")]
        if role == "server":
            out.append(_env("BYTEPS_SERVER_PORT", str(server_port)))
        if role == "worker" and elastic is None:
            out += [_field_env("DMLC_WORKER_ID", f"metadata.annotations['{INDEX_ANNOTATION}']"),
                    _env("BYTEPS_LOCAL_SIZE", str(max(gpus_per_worker, 1)))]
        if elastic is not None:  # every role: the servers size their rounds to max_workers
            out += [_env(k, v) for k, v in elastic.env(workers)]
            if role == "worker":
                out.append(_env("BYTEPS_LOCAL_SIZE", "1"))
        if auth:
            out.append({"name": "BYTEPS_AUTH_SECRET", "valueFrom": {"secretKeyRef": {
                "name": f"{job}-auth", "key": SECRET_KEY}}})
        out += [_env(k, v) for k, v in extra_env]
        return out

    def container(role: str, args: Sequence[str], resources: dict, ports: list) -> dict:
        c: dict[str, Any] = {"name": role, "image": image, "command": ["bpslaunch"],
                             "env": env(role), "resources": resources}
        if args:
            c["args"] = list(args)
        if ports:
            c["ports"] = ports
        return c

    def pod_spec(role: str, args: Sequence[str], resources: dict, ports: list) -> dict:
        spec: dict[str, Any] = {"restartPolicy": "Never",
                                "containers": [container(role, args, resources, ports)]}
        if role == "worker":
            # Local ranks share data through /dev/shm; a container's default is 64 MiB.
            spec["containers"][0]["volumeMounts"] = [{"name": "dshm", "mountPath": "/dev/shm"}]
            spec["volumes"] = [{"name": "dshm", "emptyDir": {"medium": "Memory",
                                                            "sizeLimit": shm_size}}]
        return spec

    def indexed_job(role: str, count: int, args: Sequence[str], resources: dict,
                    ports: list) -> dict:
        return {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta(f"{job}-{role}", role),
                "spec": {"completionMode": "Indexed", "completions": count,
                         "parallelism": count, "backoffLimit": 0,
                         "template": {"metadata": {"labels": _labels(job, role)},
                                      "spec": pod_spec(role, args, resources, ports)}}}

    def elastic_job(count: int, args: Sequence[str], resources: dict) -> dict:
        assert elastic is not None
        return {"apiVersion": "batch/v1", "kind": "Job",
                "metadata": {**meta(f"{job}-worker", "worker"), "annotations": {
                    "byteps-like/elastic": (
                        f"min {elastic.min_workers}, max {elastic.max_workers or count} "
                        f"workers; scale with kubectl patch job {job}-worker -p "
                        "'{\"spec\":{\"parallelism\":N}}'")}},
                "spec": {"completionMode": "NonIndexed", "parallelism": count,
                         "backoffLimit": elastic.max_restarts,
                         "template": {"metadata": {"labels": _labels(job, "worker")},
                                      "spec": pod_spec("worker", args, resources, [])}}}

    sched_port = [{"name": "scheduler", "containerPort": port, "protocol": "TCP"}]
    own_secret = [{"apiVersion": "v1", "kind": "Secret", "metadata": meta(f"{job}-auth", "auth"),
                   "type": "Opaque", "stringData": {SECRET_KEY: secret}}] \
        if auth and secret else []
    return own_secret + [
        {"apiVersion": "v1", "kind": "Service", "metadata": meta(scheduler, "scheduler"),
         "spec": {"selector": _labels(job, "scheduler"),
                  "ports": [{"name": "scheduler", "port": port, "targetPort": port,
                             "protocol": "TCP"}]}},
        {"apiVersion": "v1", "kind": "Pod", "metadata": meta(scheduler, "scheduler"),
         "spec": pod_spec("scheduler", (), _resources("1", "1Gi"), sched_port)},
        indexed_job("server", servers, (), _resources(server_cpu, server_memory),
                    [{"name": "server", "containerPort": server_port, "protocol": "TCP"},
                     # the native data plane listens on BYTEPS_SERVER_PORT + 1
                     {"name": "server-data", "containerPort": server_port + 1,
                      "protocol": "TCP"}]),
        indexed_job("worker", workers, command,
                    _resources(worker_cpu, worker_memory, gpus_per_worker), [])
        if elastic is None else
        elastic_job(workers, command, _resources(worker_cpu, worker_memory, gpus_per_worker)),
    ]


class ElasticSpec:
    """The bounds of an elastic job's workers (``bpslaunch k8s --elastic``)."""

    def __init__(self, min_workers: int = 1, max_workers: int = 0, max_restarts: int = 3,
                 timeout: float | None = None):
        self.min_workers, self.max_workers = min_workers, max_workers
        self.max_restarts, self.timeout = max_restarts, timeout

    def check(self, workers: int) -> None:
        hi = self.max_workers or workers
        if self.min_workers < 1 or self.max_restarts < 0:
            raise ValueError(f"--min-workers must be >= 1 and --max-restarts >= 0, got "
                             f"{self.min_workers}, {self.max_restarts}")
        if not self.min_workers <= workers <= hi:
            raise ValueError(f"elastic bounds: need --min-workers {self.min_workers} <= "
                             f"--workers {workers} <= --max-workers {hi}")

    def env(self, workers: int) -> list[tuple[str, str]]:
        out = [("BYTEPS_ELASTIC", "1"), ("BYTEPS_FORCE_DISTRIBUTED", "1"),
               ("BYTEPS_ELASTIC_MIN_WORKERS", str(self.min_workers)),
               ("BYTEPS_ELASTIC_MAX_WORKERS", str(self.max_workers or workers))]
        if self.timeout is not None:
            out.append(("BYTEPS_ELASTIC_TIMEOUT_SECONDS", f"{self.timeout:g}"))
        return out


# ------------------------------------------------------------------------------ output
_PLAIN = re.compile(r"^[A-Za-z_/][A-Za-z0-9_./-]*$")
_YAML_WORDS = {"y", "n", "yes", "no", "on", "off", "true", "false", "null", "~"}


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return json.dumps(value)
    text = str(value)
    if _PLAIN.match(text) and text.lower() not in _YAML_WORDS:
        return text
    return json.dumps(text)  # a JSON string is a valid YAML double-quoted scalar


def _yaml(value: Any, indent: int) -> list[str]:
    pad = " " * indent
    lines: list[str] = []
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(item, (dict, list)) and item:
                lines.append(f"{pad}{_scalar(key)}:")
                lines += _yaml(item, indent + 2)
            else:
                lines.append(f"{pad}{_scalar(key)}: {_inline(item)}")
    elif isinstance(value, list):
        for item in value:
            sub = _yaml(item, indent + 2) if isinstance(item, (dict, list)) and item else \
                [f"{pad}  {_inline(item)}"]
            lines.append(f"{pad}- {sub[0][indent + 2:]}")
            lines += sub[1:]
    else:
        lines.append(pad + _inline(value))
    return lines


def _inline(value: Any) -> str:
    if isinstance(value, dict):
        return "{}"
    if isinstance(value, list):
        return "[]"
    return _scalar(value)


def to_yaml(objects: Sequence[dict]) -> str:
    """A multi-document YAML stream, one document per object."""
    return "".join("---\n" + "\n".join(_yaml(obj, 0)) + "\n" for obj in objects)


def to_json(objects: Sequence[dict]) -> str:
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objects)}, indent=2) + "\n"


# ------------------------------------------------------------------------------ command line
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bpslaunch k8s", allow_abbrev=False,
        usage="bpslaunch k8s --name JOB --image IMAGE [options] -- COMMAND [ARG ...]",
        description="Write the Kubernetes manifests of a byteps_like job (scheduler Service and "
                    "Pod, Indexed Jobs of servers and workers, and the Secret <job>-auth with a "
                    "one-time secret) to stdout or -o FILE (mode 0600). Apply with `kubectl "
                    "apply -f FILE`, see docs/deployment.md.")
    p.add_argument("--name", required=True, help="job name: object names, BYTEPS_JOB_ID")
    p.add_argument("--image", required=True, help="container image with byteps_like installed")
    p.add_argument("--namespace", help="namespace of every object (default: kubectl's)")
    p.add_argument("--workers", type=int, required=True, help="worker pods, DMLC_NUM_WORKER")
    p.add_argument("--servers", type=int, required=True, help="server pods, DMLC_NUM_SERVER")
    p.add_argument("--gpus-per-worker", type=int, default=1,
                   help="nvidia.com/gpu per worker pod = BYTEPS_LOCAL_SIZE (default 1)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="scheduler port")
    p.add_argument("--server-port", type=int, default=DEFAULT_SERVER_PORT,
                   help="port every server pod listens on (BYTEPS_SERVER_PORT)")
    p.add_argument("--worker-cpu", default="8")
    p.add_argument("--worker-memory", default="32Gi")
    p.add_argument("--server-cpu", default="4")
    p.add_argument("--server-memory", default="16Gi")
    p.add_argument("--shm-size", default="8Gi", help="size of the worker pods' /dev/shm")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="extra environment variable of every pod (repeatable)")
    p.add_argument("--no-auth", action="store_true",
                   help="no secret: authentication off, any host that reaches the pods can "
                        "join the job")
    p.add_argument("--existing-secret", action="store_true",
                   help="do not write the Secret <job>-auth: reference one you created "
                        "(kubectl create secret generic <job>-auth --from-literal=secret=...)")
    p.add_argument("--elastic", action="store_true",
                   help="an elastic job: the worker Job scales (kubectl patch ... parallelism), "
                        "failed worker pods are replaced (docs/elastic.md)")
    p.add_argument("--min-workers", type=int, default=1,
                   help="--elastic: fewest workers, BYTEPS_ELASTIC_MIN_WORKERS (default 1)")
    p.add_argument("--max-workers", type=int, default=0,
                   help="--elastic: most workers, BYTEPS_ELASTIC_MAX_WORKERS (default "
                        "--workers)")
    p.add_argument("--max-restarts", type=int, default=3,
                   help="--elastic: failed worker pods replaced, the Job's backoffLimit "
                        "(default 3)")
    p.add_argument("--elastic-timeout", type=float, default=None,
                   help="--elastic: seconds below --min-workers before the job fails, "
                        "BYTEPS_ELASTIC_TIMEOUT_SECONDS (default 60)")
    p.add_argument("--kubeflow", action="store_true",
                   help="write a Kubeflow Trainer v2 ClusterTrainingRuntime and TrainJob "
                        "(a JobSet of scheduler, server and worker jobs) instead of plain "
                        "Jobs (docs/deployment.md, Kubeflow Trainer)")
    p.add_argument("--runtime-name", metavar="NAME",
                   help="--kubeflow: the ClusterTrainingRuntime's name (default "
                        "byteps-like-JOB)")
    p.add_argument("--gang", choices=("none", "kueue", "volcano", "coscheduling"),
                   default=None, help="--kubeflow: gang scheduling (default none)")
    p.add_argument("--queue", metavar="NAME",
                   help="--kubeflow: the Kueue LocalQueue (--gang kueue) or Volcano queue")
    p.add_argument("--server-restarts", type=int, default=None,
                   help="--kubeflow: failed server pods replaced (their Job's backoffLimit, "
                        "default 3)")
    p.add_argument("--schedule-timeout", type=int, default=None,
                   help="--kubeflow --gang coscheduling: the PodGroup's "
                        "scheduleTimeoutSeconds")
    p.add_argument("--format", choices=("yaml", "json"), default="yaml")
    p.add_argument("-o", "--output", metavar="FILE", help="write here instead of stdout")
    return p


def main(argv: Sequence[str]) -> int:
    argv = list(argv)
    if "--" in argv:
        i = argv.index("--")
        options, command = argv[:i], argv[i + 1:]
    else:
        options, command = argv, []
    parser = build_parser()
    try:
        args = parser.parse_args(options)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    elastic = None
    if args.elastic:
        elastic = ElasticSpec(args.min_workers, args.max_workers, args.max_restarts,
                              args.elastic_timeout)
    elif (args.min_workers, args.max_workers, args.max_restarts, args.elastic_timeout) != (
            1, 0, 3, None):
        print("bpslaunch k8s: error: --min-workers, --max-workers, --max-restarts and "
              "--elastic-timeout need --elastic", file=sys.stderr)
        return 2
    kf_options = {"runtime_name": args.runtime_name, "gang": args.gang, "queue": args.queue,
                  "server_restarts": args.server_restarts,
                  "schedule_timeout": args.schedule_timeout}
    if not args.kubeflow and any(v is not None for v in kf_options.values()):
        print("bpslaunch k8s: error: --runtime-name, --gang, --queue, --server-restarts and "
              "--schedule-timeout need --kubeflow", file=sys.stderr)
        return 2
    if args.kubeflow and args.elastic:
        print("bpslaunch k8s: error: --kubeflow does not take --elastic (a TrainJob's node "
              "count is fixed); use the plain manifests for an elastic job", file=sys.stderr)
        return 2
    extra = []
    for item in args.env:
        name, sep, value = item.partition("=")
        if not sep or not name:
            print(f"bpslaunch k8s: error: --env {item!r}: expected NAME=VALUE", file=sys.stderr)
            return 2
        extra.append((name, value))
    try:
        make: Any = manifests
        if args.kubeflow:
            make = functools.partial(kubeflow, **{k: v for k, v in kf_options.items()
                                                  if v is not None})
        objs = make(args.name, args.image, command, workers=args.workers,
                         servers=args.servers, gpus_per_worker=args.gpus_per_worker,
                         namespace=args.namespace, port=args.port, server_port=args.server_port,
                         auth=not args.no_auth, worker_cpu=args.worker_cpu,
                         worker_memory=args.worker_memory, server_cpu=args.server_cpu,
                         server_memory=args.server_memory, shm_size=args.shm_size,
                         extra_env=extra, **({"elastic": elastic} if elastic else {}),
                         secret=None if args.no_auth or args.existing_secret
                         else secrets.token_hex(32))
    except ValueError as exc:
        print(f"bpslaunch k8s: error: {exc}", file=sys.stderr)
        return 2
    text = to_json(objs) if args.format == "json" else to_yaml(objs)
    if args.output:  # it may hold the job's secret: readable by its owner only
        fd = os.open(args.output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)  # an existing file keeps its mode otherwise
        with open(fd, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0
