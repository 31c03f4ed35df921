"""``bpslaunch k8s``: the manifests load into the official kubernetes client's models and carry
the BytePS contract (roles, counts, env, ports, resources, the auth Secret)."""
from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest

from byteps_like.launcher.cli import main as cli_main

kubernetes = pytest.importorskip("kubernetes")
yaml = pytest.importorskip("yaml")

MODELS = {("v1", "Service"): "V1Service", ("v1", "Pod"): "V1Pod", ("batch/v1", "Job"): "V1Job"}
COMMAND = ["python", "train.py", "--epochs", "3", "--lr=0.1", "yes", "a: b", ""]


class _Response:
    def __init__(self, obj):
        self.data = json.dumps(obj)


def load(obj):
    """The object as the kubernetes client's model (what the API server would accept)."""
    model = MODELS[(obj["apiVersion"], obj["kind"])]
    client = kubernetes.client.ApiClient()
    if "content_type" in inspect.signature(client.deserialize).parameters:  # client >= 32
        return client.deserialize(json.dumps(obj), model, "application/json")
    return client.deserialize(_Response(obj), model)


def generate(capsys, *args, fmt="yaml"):
    rc = cli_main(["k8s", "--name", "bert", "--image", "registry.example/train:1.0",
                   "--workers", "3", "--servers", "2", "--gpus-per-worker", "8",
                   "--namespace", "ml", "--format", fmt, *args, "--", *COMMAND])
    out = capsys.readouterr()
    assert rc == 0, out.err
    if fmt == "json":
        doc = json.loads(out.out)
        assert doc["kind"] == "List"
        return doc["items"]
    return list(yaml.safe_load_all(out.out))


def env_of(container):
    """name -> value, or ('field', path) / ('secret', name, key) for valueFrom."""
    out = {}
    for e in container.env:
        if e.value_from is None:
            out[e.name] = e.value
        elif e.value_from.field_ref is not None:
            out[e.name] = ("field", e.value_from.field_ref.field_path)
        else:
            ref = e.value_from.secret_key_ref
            out[e.name] = ("secret", ref.name, ref.key)
    return out


@pytest.fixture(params=["yaml", "json"])
def objects(request, capsys):
    # the generated Secret <job>-auth is checked in test_launcher_safety.py
    return [load(o) for o in generate(capsys, fmt=request.param) if o["kind"] != "Secret"]


def test_objects_and_names(objects):
    kinds = [(type(o).__name__, o.metadata.name) for o in objects]
    assert kinds == [("V1Service", "bert-scheduler"), ("V1Pod", "bert-scheduler"),
                     ("V1Job", "bert-server"), ("V1Job", "bert-worker")]
    for o in objects:
        assert o.metadata.namespace == "ml"
        assert o.metadata.labels["app.kubernetes.io/instance"] == "bert"


def test_scheduler_service_selects_the_scheduler_pod(objects):
    svc, pod = objects[0], objects[1]
    assert svc.spec.selector == pod.metadata.labels
    assert pod.metadata.labels["byteps-like/role"] == "scheduler"
    assert [(p.port, p.target_port) for p in svc.spec.ports] == [(9000, 9000)]
    assert pod.spec.containers[0].ports[0].container_port == 9000
    env = env_of(pod.spec.containers[0])
    assert env["DMLC_ROLE"] == "scheduler" and env["DMLC_PS_ROOT_PORT"] == "9000"
    assert pod.spec.restart_policy == "Never"


def test_role_counts_and_contract(objects):
    server, worker = objects[2], objects[3]
    for job, role, count in ((server, "server", 2), (worker, "worker", 3)):
        assert job.spec.completion_mode == "Indexed"
        assert job.spec.completions == job.spec.parallelism == count
        assert job.spec.backoff_limit == 0
        tmpl = job.spec.template
        assert tmpl.metadata.labels["byteps-like/role"] == role
        assert tmpl.spec.restart_policy == "Never"
        (c,) = tmpl.spec.containers
        env = env_of(c)
        assert env["DMLC_ROLE"] == role
        assert env["DMLC_NUM_WORKER"] == "3" and env["DMLC_NUM_SERVER"] == "2"
        assert env["DMLC_PS_ROOT_URI"] == "bert-scheduler"  # the Service's DNS name
        assert env["DMLC_PS_ROOT_PORT"] == "9000"
        assert env["BYTEPS_JOB_ID"] == "bert"
        assert env["DMLC_NODE_HOST"] == ("field", "status.podIP")
        assert env["BYTEPS_AUTH_SECRET"] == ("secret", "bert-auth", "secret")
        assert c.command == ["bpslaunch"]
    s = server.spec.template.spec.containers[0]
    assert env_of(s)["BYTEPS_SERVER_PORT"] == "9100"
    assert [p.container_port for p in s.ports] == [9100, 9101]  # ZeroMQ, the native plane
    assert s.args is None
    assert "nvidia.com/gpu" not in s.resources.limits
    w = worker.spec.template.spec.containers[0]
    we = env_of(w)
    assert we["DMLC_WORKER_ID"] == (
        "field", "metadata.annotations['batch.kubernetes.io/job-completion-index']")
    assert we["BYTEPS_LOCAL_SIZE"] == "8"
    assert w.args == COMMAND  # quoting of odd words survives YAML
    assert w.resources.limits["nvidia.com/gpu"] == "8"
    assert w.resources.requests == w.resources.limits  # Guaranteed QoS: NUMA-aligned CPUs
    assert w.volume_mounts[0].mount_path == "/dev/shm"
    assert worker.spec.template.spec.volumes[0].empty_dir.medium == "Memory"


def test_no_auth_and_extra_env(capsys):
    objs = [load(o) for o in generate(capsys, "--no-auth", "--env", "BYTEPS_LOG_LEVEL=INFO")]
    for o in objs[1:]:
        spec = o.spec if type(o).__name__ == "V1Pod" else o.spec.template.spec
        env = env_of(spec.containers[0])
        assert "BYTEPS_AUTH_SECRET" not in env
        assert env["BYTEPS_LOG_LEVEL"] == "INFO"


def test_yaml_equals_json(capsys):
    # (each run generates its own secret)
    assert generate(capsys, "--existing-secret", fmt="yaml") == \
        generate(capsys, "--existing-secret", fmt="json")


def test_output_file(tmp_path, capsys):
    path = tmp_path / "job.yaml"
    assert cli_main(["k8s", "--name", "j", "--image", "i", "--workers", "1", "--servers", "1",
                     "-o", str(path), "--", "python", "t.py"]) == 0
    assert len(list(yaml.safe_load_all(path.read_text()))) == 5  # with the Secret


@pytest.mark.parametrize("args,message", [
    (["--name", "Bad_Name"], "not a DNS label"),
    (["--name", "ok", "--workers", "0"], "workers >= 1"),
])
def test_errors(capsys, args, message):
    base = {"--name": "ok", "--image": "i", "--workers": "1", "--servers": "1"}
    it = iter(args)
    base.update(dict(zip(it, it)))
    argv = ["k8s", *[x for kv in base.items() for x in kv], "--", "python", "t.py"]
    assert cli_main(argv) == 2
    assert message in capsys.readouterr().err


def test_missing_command(capsys):
    assert cli_main(["k8s", "--name", "j", "--image", "i", "--workers", "1",
                     "--servers", "1"]) == 2
    assert "missing the worker command" in capsys.readouterr().err


# -- Kubeflow Trainer v2 (bpslaunch k8s --kubeflow) ---------------------------------------------
# The published API of Kubeflow Trainer v2.3.0 (trainer.kubeflow.org/v1alpha1, with the JobSet
# jobset.x-k8s.io/v1alpha2 and Kubernetes core types it embeds): field names, types, required
# fields and enumerations, every object closed. Vendored by scripts/vendor_kubeflow_schemas.py
# from PyPI kubeflow-trainer-api==2.3.0 (the models generated from kubeflow/trainer's
# api/openapi-spec/swagger.json at that release).
KF_SCHEMAS = Path(__file__).resolve().parents[1] / "data" / "kubeflow-trainer-v2.3.0"


def kf_validator(kind: str):
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((KF_SCHEMAS / f"{kind.lower()}.schema.json").read_text())
    assert "Kubeflow Trainer v2.3.0" in schema["$comment"]
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def kf_errors(obj) -> list[str]:
    errors = kf_validator(obj["kind"]).iter_errors(obj)
    return sorted(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors)


def kf_generate(capsys, *args, fmt="yaml"):
    objs = generate(capsys, "--kubeflow", *args, fmt=fmt)
    return {o["kind"]: o for o in objs}, [o["kind"] for o in objs]


def kf_envs(container) -> dict:
    out = {}
    for e in container.get("env", []):
        src = e.get("valueFrom")
        out[e["name"]] = e["value"] if src is None else (
            ("field", src["fieldRef"]["fieldPath"]) if "fieldRef" in src
            else ("secret", src["secretKeyRef"]["name"], src["secretKeyRef"]["key"]))
    return out


@pytest.mark.parametrize("fmt", ["yaml", "json"])
@pytest.mark.parametrize("gang", ["none", "kueue", "volcano", "coscheduling"])
def test_kubeflow_manifests_are_valid_against_the_published_apis(capsys, fmt, gang):
    extra = ["--gang", gang] + (["--queue", "team-a"] if gang in ("kueue", "volcano") else [])
    objs, kinds = kf_generate(capsys, *extra, fmt=fmt)
    assert kinds == ["Secret", "ClusterTrainingRuntime", "TrainJob"]
    for kind in ("ClusterTrainingRuntime", "TrainJob"):
        assert kf_errors(objs[kind]) == [], kind
    assert objs["Secret"]["metadata"]["name"] == "bert-auth"


def test_the_schemas_catch_what_the_api_server_would_refuse(capsys):
    """The vendored schemas are not vacuous: a misspelt field, a wrong type, a missing
    required field and a value outside an enumeration are each refused."""
    objs, _ = kf_generate(capsys)
    job, runtime = objs["TrainJob"], objs["ClusterTrainingRuntime"]
    bad = json.loads(json.dumps(job))
    bad["spec"]["trainer"]["numNode"] = 3                      # misspelt
    assert any("numNode" in e for e in kf_errors(bad))
    bad = json.loads(json.dumps(job))
    bad["spec"]["trainer"]["numNodes"] = "3"                   # a string for an integer
    assert any("numNodes" in e for e in kf_errors(bad))
    bad = json.loads(json.dumps(job))
    del bad["spec"]["runtimeRef"]["name"]                      # required
    assert any("'name' is a required property" in e for e in kf_errors(bad))
    bad = json.loads(json.dumps(runtime))
    pod = bad["spec"]["template"]["spec"]["replicatedJobs"][1]["template"]["spec"]["template"]
    pod["spec"]["restartPolicy"] = "Sometimes"                 # not in the enumeration
    assert any("Sometimes" in e for e in kf_errors(bad))
    bad = json.loads(json.dumps(runtime))
    bad["spec"]["template"]["spec"]["replicatedJobs"][0]["replica"] = 1   # JobSet field misspelt
    assert any("replica" in e for e in kf_errors(bad))


def test_kubeflow_runtime_is_a_jobset_of_scheduler_servers_and_workers(capsys):
    objs, _ = kf_generate(capsys)
    runtime, job = objs["ClusterTrainingRuntime"], objs["TrainJob"]
    assert runtime["metadata"]["name"] == "byteps-like-bert"
    assert "namespace" not in runtime["metadata"]              # cluster-scoped
    assert job["metadata"]["namespace"] == "ml"
    assert job["spec"]["runtimeRef"] == {"apiGroup": "trainer.kubeflow.org",
                                         "kind": "ClusterTrainingRuntime",
                                         "name": "byteps-like-bert"}
    spec = runtime["spec"]["template"]["spec"]
    rjobs = {r["name"]: r for r in spec["replicatedJobs"]}
    assert list(rjobs) == ["scheduler", "server", "node"]
    assert spec["network"]["enableDNSHostnames"] is True
    assert spec["successPolicy"] == {"operator": "All", "targetReplicatedJobs": ["node"]}
    assert runtime["spec"]["mlPolicy"] == {"numNodes": 3}
    # the workers are the replicated job the TrainJob's trainer settings apply to
    node = rjobs["node"]["template"]
    assert node["metadata"]["labels"]["trainer.kubeflow.org/trainjob-ancestor-step"] == "trainer"
    counts = {n: (r["replicas"], r["template"]["spec"]["parallelism"],
                  r["template"]["spec"]["completions"],
                  r["template"]["spec"]["completionMode"]) for n, r in rjobs.items()}
    assert counts == {"scheduler": (1, 1, 1, "Indexed"), "server": (1, 2, 2, "Indexed"),
                      "node": (1, 3, 3, "Indexed")}
    pods = {n: r["template"]["spec"]["template"]["spec"] for n, r in rjobs.items()}
    containers = {n: p["containers"][0] for n, p in pods.items()}
    assert [c["name"] for c in containers.values()] == ["scheduler", "server", "node"]
    assert containers["node"]["args"] == COMMAND
    assert containers["node"]["resources"]["limits"]["nvidia.com/gpu"] == "8"
    for name, c in containers.items():
        env = kf_envs(c)
        role = {"node": "worker"}.get(name, name)
        assert env["DMLC_ROLE"] == role
        assert env["DMLC_NUM_WORKER"] == "3" and env["DMLC_NUM_SERVER"] == "2"
        assert env["JOBSET_NAME"] == ("field",
                                      "metadata.labels['jobset.sigs.k8s.io/jobset-name']")
        # the JobSet's DNS name of the scheduler pod; JOBSET_NAME comes first (expansion)
        assert env["DMLC_PS_ROOT_URI"] == "$(JOBSET_NAME)-scheduler-0-0.$(JOBSET_NAME)"
        assert [e["name"] for e in c["env"]].index("JOBSET_NAME") < \
            [e["name"] for e in c["env"]].index("DMLC_PS_ROOT_URI")
        assert env["DMLC_PS_ROOT_PORT"] == "9000" and env["BYTEPS_JOB_ID"] == "$(JOBSET_NAME)"
        assert env["DMLC_NODE_HOST"] == ("field", "status.podIP")
    assert kf_envs(containers["node"])["DMLC_WORKER_ID"] == (
        "field", "metadata.annotations['batch.kubernetes.io/job-completion-index']")
    assert kf_envs(containers["server"])["BYTEPS_SERVER_PORT"] == "9100"
    assert [p["containerPort"] for p in containers["server"]["ports"]] == [9100, 9101]


def test_kubeflow_server_pods_are_replaced_and_workers_are_all_or_nothing(capsys):
    objs, _ = kf_generate(capsys, "--server-restarts", "5")
    spec = objs["ClusterTrainingRuntime"]["spec"]["template"]["spec"]
    jobs = {r["name"]: r["template"]["spec"] for r in spec["replicatedJobs"]}
    # a failed server pod: its Job makes a new pod of the same index (host name), once the
    # old one has gone; the Job does not fail, so the JobSet does not
    assert jobs["server"]["backoffLimit"] == 5
    assert jobs["server"]["podReplacementPolicy"] == "Failed"
    assert jobs["server"]["template"]["spec"]["restartPolicy"] == "Never"
    assert jobs["scheduler"]["backoffLimit"] == 0 and jobs["node"]["backoffLimit"] == 0
    assert spec["failurePolicy"] == {"maxRestarts": 0}
    # servers do not decide success: the JobSet completes with the workers
    assert spec["successPolicy"]["targetReplicatedJobs"] == ["node"]


def test_kubeflow_trainjob_carries_the_per_job_settings_and_the_secret(capsys):
    objs, _ = kf_generate(capsys)
    secret, job = objs["Secret"], objs["TrainJob"]
    assert secret["metadata"]["name"] == "bert-auth" and len(secret["stringData"]["secret"]) == 64
    trainer = job["spec"]["trainer"]
    assert trainer["numNodes"] == 3 and trainer["image"] == "registry.example/train:1.0"
    assert trainer["command"] == ["bpslaunch"] and trainer["args"] == COMMAND
    want = {"DMLC_NUM_WORKER": "3", "BYTEPS_AUTH_SECRET": ("secret", "bert-auth", "secret")}
    assert kf_envs(trainer) == want
    # the scheduler and server containers get the same through runtimePatches (the Trainer
    # API lets a TrainJob set env only there for containers other than node)
    (patch,) = job["spec"]["runtimePatches"]
    assert patch["manager"] == "byteps-like/bpslaunch"
    rjobs = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    assert [r["name"] for r in rjobs] == ["scheduler", "server"]
    for r in rjobs:
        (c,) = r["template"]["spec"]["template"]["spec"]["containers"]
        assert c["name"] == r["name"] and kf_envs(c) == want
    # no secret in the runtime: it is shared, the secret is the job's
    assert "BYTEPS_AUTH_SECRET" not in json.dumps(objs["ClusterTrainingRuntime"])


def test_kubeflow_existing_secret_and_no_auth(capsys):
    objs, kinds = kf_generate(capsys, "--existing-secret")
    assert kinds == ["ClusterTrainingRuntime", "TrainJob"]
    assert kf_envs(objs["TrainJob"]["spec"]["trainer"])["BYTEPS_AUTH_SECRET"] == (
        "secret", "bert-auth", "secret")
    objs, kinds = kf_generate(capsys, "--no-auth")
    assert kinds == ["ClusterTrainingRuntime", "TrainJob"]
    assert "BYTEPS_AUTH_SECRET" not in json.dumps(objs)


@pytest.mark.parametrize("args, where, want", [
    (["--gang", "kueue", "--queue", "team-a"], "job-label",
     {"kueue.x-k8s.io/queue-name": "team-a"}),
    (["--gang", "volcano", "--queue", "team-a"], "runtime", {"volcano": {}}),
    (["--gang", "coscheduling", "--schedule-timeout", "120"], "runtime",
     {"coscheduling": {"scheduleTimeoutSeconds": 120}}),
])
def test_kubeflow_gang_scheduling(capsys, args, where, want):
    objs, _ = kf_generate(capsys, *args)
    runtime, job = objs["ClusterTrainingRuntime"], objs["TrainJob"]
    if where == "job-label":
        assert want.items() <= job["metadata"]["labels"].items()
        assert "podGroupPolicy" not in runtime["spec"]
    else:
        assert runtime["spec"]["podGroupPolicy"] == want
    if "volcano" in args:
        assert runtime["spec"]["template"]["metadata"]["annotations"] == {
            "scheduling.volcano.sh/queue-name": "team-a"}
    assert kf_errors(runtime) == [] and kf_errors(job) == []


@pytest.mark.parametrize("args, needle", [
    (["--gang", "kueue"], "--gang kueue needs --queue"),
    (["--gang", "coscheduling", "--queue", "q"], "--queue needs --gang kueue or volcano"),
    (["--schedule-timeout", "5"], "--schedule-timeout needs --gang coscheduling"),
    (["--server-restarts", "-1"], "--server-restarts -1"),
    (["--elastic"], "--kubeflow does not take --elastic"),
])
def test_kubeflow_bad_options_are_refused(capsys, args, needle):
    rc = cli_main(["k8s", "--kubeflow", "--name", "bert", "--image", "i", "--workers", "2",
                   "--servers", "1", *args, "--", "python", "t.py"])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err, err


def test_kubeflow_options_need_kubeflow(capsys):
    rc = cli_main(["k8s", "--name", "bert", "--image", "i", "--workers", "2", "--servers", "1",
                   "--gang", "volcano", "--", "python", "t.py"])
    assert rc == 2 and "need --kubeflow" in capsys.readouterr().err


def test_kubeflow_runtime_name_is_shared_by_reference(capsys):
    objs, _ = kf_generate(capsys, "--runtime-name", "byteps-like-4-servers")
    assert objs["ClusterTrainingRuntime"]["metadata"]["name"] == "byteps-like-4-servers"
    assert objs["TrainJob"]["spec"]["runtimeRef"]["name"] == "byteps-like-4-servers"
    assert kf_errors(objs["ClusterTrainingRuntime"]) == [] and kf_errors(objs["TrainJob"]) == []
