"""``bpslaunch k8s``: the manifests load into the official kubernetes client's models and carry
the BytePS contract (roles, counts, env, ports, resources, the auth Secret)."""
from __future__ import annotations

import inspect
import json

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
