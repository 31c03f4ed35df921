"""``bpslaunch k8s --kubeflow``: a byteps_like job for Kubeflow Trainer v2 (docs/deployment.md,
"Kubeflow Trainer").

Written against Kubeflow Trainer v2.3.0 (``trainer.kubeflow.org/v1alpha1``) and the JobSet API
it embeds (``jobset.x-k8s.io/v1alpha2``); tests/unit/test_k8s.py validates the output against
those published schemas (tests/data/kubeflow-trainer-v2.3.0/). Three objects:

* ``Secret <job>-auth`` (unless ``--existing-secret`` or ``--no-auth``), as the plain manifests;
* ``ClusterTrainingRuntime`` (default name ``byteps-like-<job>``): a JobSet of three replicated
  jobs: ``scheduler`` (one pod), ``server`` (an Indexed Job of DMLC_NUM_SERVER pods) and
  ``node``, the workers (the replicated job Kubeflow Trainer's ``trainer`` settings apply to:
  labelled ``trainer.kubeflow.org/trainjob-ancestor-step: trainer``, container ``node``; an
  Indexed Job of ``numNodes`` pods, DMLC_WORKER_ID = the completion index). Pods find the
  scheduler by its JobSet DNS name, ``<jobset>-scheduler-0-0.<jobset>`` (the JobSet's name is the
  TrainJob's). The JobSet succeeds when the workers do; a server pod that fails is replaced by
  its Job (``backoffLimit`` = ``--server-restarts``, a new pod of the same index and host name,
  once the old one is gone), which does not fail the Job nor the JobSet; a worker or the
  scheduler failing fails the JobSet (bpslaunch's all-or-nothing rule, ``maxRestarts: 0``).
  Gang scheduling: ``--gang volcano`` (``podGroupPolicy.volcano``, ``--queue`` a Volcano queue)
  or ``coscheduling`` (the scheduler-plugins PodGroup); ``--gang kueue`` labels the TrainJob
  with ``kueue.x-k8s.io/queue-name: --queue`` (Kueue admits the whole JobSet at once);
* ``TrainJob <job>``: the image, command, worker count and per-job environment
  (DMLC_NUM_WORKER and the Secret reference, for the scheduler and server containers through
  ``runtimePatches``, which Kubeflow Trainer merges into the runtime's).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

API = "trainer.kubeflow.org/v1alpha1"
ANCESTOR = "trainer.kubeflow.org/trainjob-ancestor-step"
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
PATCH_MANAGER = "byteps-like/bpslaunch"
GANGS = ("none", "kueue", "volcano", "coscheduling")


def _env(name: str, value: str) -> dict[str, Any]:
    return {"name": name, "value": value}


def _field(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def _secret_env(secret_name: str, key: str) -> dict[str, Any]:
    return {"name": "BYTEPS_AUTH_SECRET",
            "valueFrom": {"secretKeyRef": {"name": secret_name, "key": key}}}


def kubeflow_manifests(job: str, image: str, command: Sequence[str], *, workers: int,
                       servers: int, labels: dict[str, str], resources: dict[str, dict],
                       gpus_per_worker: int, port: int, server_port: int,
                       auth: bool, secret_name: str, secret_key: str,
                       namespace: str | None = None, shm_size: str = "8Gi",
                       extra_env: Sequence[tuple[str, str]] = (),
                       runtime_name: str | None = None, gang: str = "none",
                       queue: str | None = None, server_restarts: int = 3,
                       schedule_timeout: int | None = None) -> list[dict[str, Any]]:
    """The ClusterTrainingRuntime and the TrainJob of one job, as plain dicts. ``labels``:
    the common labels; ``resources``: per role (scheduler, server, worker), a container's
    ``resources``. Checked by :func:`launcher.k8s.manifests`, which calls this."""
    if gang not in GANGS:
        raise ValueError(f"--gang {gang!r}: expected one of {', '.join(GANGS)}")
    if gang == "kueue" and not queue:
        raise ValueError("--gang kueue needs --queue (the Kueue LocalQueue of the namespace)")
    if queue and gang in ("none", "coscheduling"):
        raise ValueError(f"--queue needs --gang kueue or volcano (got --gang {gang})")
    if server_restarts < 0:
        raise ValueError(f"--server-restarts {server_restarts}: must be >= 0")
    if schedule_timeout is not None and (gang != "coscheduling" or schedule_timeout < 1):
        raise ValueError("--schedule-timeout needs --gang coscheduling and a value >= 1")
    runtime = runtime_name or f"byteps-like-{job}"
    common = [_field("JOBSET_NAME", f"metadata.labels['{JOBSET_NAME_LABEL}']"),
              _env("DMLC_NUM_WORKER", str(workers)), _env("DMLC_NUM_SERVER", str(servers)),
              _env("DMLC_PS_ROOT_URI", "$(JOBSET_NAME)-scheduler-0-0.$(JOBSET_NAME)"),
              _env("DMLC_PS_ROOT_PORT", str(port)), _env("BYTEPS_JOB_ID", "$(JOBSET_NAME)"),
              _field("DMLC_NODE_HOST", "status.podIP")]
    extra = [_env(k, v) for k, v in extra_env]

    def container(role: str, name: str, env: list, args: Sequence[str], ports: list) -> dict:
        c: dict[str, Any] = {"name": name, "image": image, "command": ["bpslaunch"],
                             "env": [_env("DMLC_ROLE", role), *common, *env, *extra],
                             "resources": resources[role]}
        if args:
            c["args"] = list(args)
        if ports:
            c["ports"] = ports
        return c

    def replicated(name: str, role: str, count: int, cont: dict, *, backoff: int,
                   ancestor: bool = False) -> dict:
        pod: dict[str, Any] = {"restartPolicy": "Never", "containers": [cont]}
        if role == "worker":  # local ranks share /dev/shm; a container's default is 64 MiB
            cont["volumeMounts"] = [{"name": "dshm", "mountPath": "/dev/shm"}]
            pod["volumes"] = [{"name": "dshm", "emptyDir": {"medium": "Memory",
                                                           "sizeLimit": shm_size}}]
        spec: dict[str, Any] = {"completionMode": "Indexed", "completions": count,
                                "parallelism": count, "backoffLimit": backoff,
                                "template": {"metadata": {"labels": {**labels,
                                                                     "byteps-like/role": role}},
                                             "spec": pod}}
        if backoff:  # a replacement starts once the failed pod is gone (no two of one index)
            spec["podReplacementPolicy"] = "Failed"
        meta: dict[str, Any] = {"labels": {**labels, "byteps-like/role": role}}
        if ancestor:
            meta["labels"][ANCESTOR] = "trainer"
        return {"name": name, "replicas": 1, "template": {"metadata": meta, "spec": spec}}

    worker_env = [_field("DMLC_WORKER_ID", f"metadata.annotations['{INDEX_ANNOTATION}']"),
                  _env("BYTEPS_LOCAL_SIZE", str(max(gpus_per_worker, 1)))]
    jobset_meta: dict[str, Any] = {"labels": dict(labels)}
    if gang == "volcano" and queue:
        jobset_meta["annotations"] = {"scheduling.volcano.sh/queue-name": queue}
    runtime_spec: dict[str, Any] = {
        "mlPolicy": {"numNodes": workers},
        "template": {"metadata": jobset_meta, "spec": {
            "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
            # the job is over when the workers are; the scheduler and servers then end too
            "successPolicy": {"operator": "All", "targetReplicatedJobs": ["node"]},
            "failurePolicy": {"maxRestarts": 0},
            "replicatedJobs": [
                replicated("scheduler", "scheduler", 1, container(
                    "scheduler", "scheduler", [], (),
                    [{"name": "scheduler", "containerPort": port, "protocol": "TCP"}]),
                    backoff=0),
                replicated("server", "server", servers, container(
                    "server", "server", [_env("BYTEPS_SERVER_PORT", str(server_port))], (),
                    [{"name": "server", "containerPort": server_port, "protocol": "TCP"},
                     {"name": "server-data", "containerPort": server_port + 1,
                      "protocol": "TCP"}]),
                    backoff=server_restarts),
                replicated("node", "worker", workers,
                           container("worker", "node", worker_env, command, []),
                           backoff=0, ancestor=True),
            ]}}}
    if gang == "volcano":
        runtime_spec["podGroupPolicy"] = {"volcano": {}}
    elif gang == "coscheduling":
        runtime_spec["podGroupPolicy"] = {"coscheduling": {} if schedule_timeout is None else
                                          {"scheduleTimeoutSeconds": schedule_timeout}}
    runtime_obj = {"apiVersion": API, "kind": "ClusterTrainingRuntime",
                   "metadata": {"name": runtime, "labels": {
                       **labels, "trainer.kubeflow.org/framework": "byteps-like"}},
                   "spec": runtime_spec}

    per_job = [_env("DMLC_NUM_WORKER", str(workers))]
    if auth:
        per_job.append(_secret_env(secret_name, secret_key))
    job_meta: dict[str, Any] = {"name": job, "labels": dict(labels)}
    if namespace:
        job_meta["namespace"] = namespace
    if gang == "kueue":
        job_meta["labels"]["kueue.x-k8s.io/queue-name"] = str(queue)
    train_job = {"apiVersion": API, "kind": "TrainJob", "metadata": job_meta, "spec": {
        "runtimeRef": {"apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime",
                       "name": runtime},
        "trainer": {"image": image, "command": ["bpslaunch"], "args": list(command),
                    "numNodes": workers, "env": per_job},
        "runtimePatches": [{"manager": PATCH_MANAGER, "trainingRuntimeSpec": {"template": {
            "spec": {"replicatedJobs": [
                {"name": name, "template": {"spec": {"template": {"spec": {"containers": [
                    {"name": name, "env": per_job}]}}}}}
                for name in ("scheduler", "server")]}}}}]}}
    return [runtime_obj, train_job]
