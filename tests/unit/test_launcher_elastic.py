"""bpslaunch's elastic options (issue 22): --local --elastic and bpslaunch k8s --elastic."""
from __future__ import annotations

import json

import pytest

from launcher import k8s
from launcher.cli import UsageError, parse_args, plan_launch


def plan(*options: str):
    args, cmd = parse_args(["--local", "--no-bind", *options, "--", "true"])
    return plan_launch(args, cmd, {"PATH": "/usr/bin:/bin"})


def test_elastic_options_need_elastic():
    for opt in (["--min-workers", "2"], ["--max-workers", "3"], ["--max-restarts", "1"],
                ["--elastic-timeout", "5"], ["--add-workers", "1"]):
        with pytest.raises(UsageError, match="only valid with --elastic"):
            parse_args(["--local", *opt, "--", "true"])


@pytest.mark.parametrize("options, what", [
    (["--workers", "2", "--min-workers", "3"], "more than --workers"),
    (["--workers", "3", "--max-workers", "2"], "less than --workers"),
    (["--workers", "2", "--local-size", "2"], "one worker process per machine"),
])
def test_contradicting_bounds_are_usage_errors(options, what):
    with pytest.raises(UsageError, match=what):
        plan("--elastic", *options)


def test_elastic_local_plan():
    launch = plan("--elastic", "--workers", "3", "--min-workers", "2", "--max-workers", "5",
                  "--max-restarts", "4", "--elastic-timeout", "7", "--add-workers", "1",
                  "--add-after", "2")
    env = launch.base_env
    assert (env["BYTEPS_ELASTIC"], env["BYTEPS_ELASTIC_MIN_WORKERS"],
            env["BYTEPS_ELASTIC_MAX_WORKERS"], env["BYTEPS_ELASTIC_TIMEOUT_SECONDS"]) == (
        "1", "2", "5", "7")
    workers = [s for s in launch.specs if s.role == "worker"]
    assert len(workers) == 3 and all(s.env["DMLC_WORKER_ID"] is None for s in workers)
    e = launch.elastic
    assert (e.min_workers, e.max_workers, e.max_restarts, e.add_workers, e.add_after) == (
        2, 5, 4, 1, 2.0)
    assert plan("--workers", "2").elastic is None  # not elastic: as before


def job(objs, name):
    return next(o for o in objs if o["kind"] == "Job" and o["metadata"]["name"] == name)


def env_of(obj) -> dict:
    return {e["name"]: e.get("value") for e in
            obj["spec"]["template"]["spec"]["containers"][0]["env"]}


def test_k8s_elastic_worker_job_scales():
    objs = k8s.manifests("j", "img", ["python", "t.py"], workers=2, servers=1, auth=False,
                         elastic=k8s.ElasticSpec(1, 4, 2, 30.0))
    w = job(objs, "j-worker")
    assert w["spec"]["completionMode"] == "NonIndexed" and "completions" not in w["spec"]
    assert w["spec"]["parallelism"] == 2 and w["spec"]["backoffLimit"] == 2
    assert "kubectl patch job j-worker" in w["metadata"]["annotations"]["byteps-like/elastic"]
    env = env_of(w)
    assert "DMLC_WORKER_ID" not in env and env["BYTEPS_LOCAL_SIZE"] == "1"
    assert (env["BYTEPS_ELASTIC"], env["BYTEPS_ELASTIC_MIN_WORKERS"],
            env["BYTEPS_ELASTIC_MAX_WORKERS"], env["BYTEPS_ELASTIC_TIMEOUT_SECONDS"]) == (
        "1", "1", "4", "30")
    assert env_of(job(objs, "j-server"))["BYTEPS_ELASTIC_MAX_WORKERS"] == "4"
    plain = job(k8s.manifests("j", "img", ["t"], workers=2, servers=1, auth=False), "j-worker")
    assert plain["spec"]["completionMode"] == "Indexed" and "BYTEPS_ELASTIC" not in env_of(plain)


def test_k8s_elastic_cli(capsys):
    assert k8s.main(["--name", "j", "--image", "i", "--workers", "2", "--servers", "1",
                     "--no-auth", "--elastic", "--max-workers", "3", "--format", "json",
                     "--", "python", "t.py"]) == 0
    objs = json.loads(capsys.readouterr().out)["items"]
    assert job(objs, "j-worker")["spec"]["completionMode"] == "NonIndexed"
    assert k8s.main(["--name", "j", "--image", "i", "--workers", "2", "--servers", "1",
                     "--min-workers", "2", "--", "t"]) == 2
    assert "need --elastic" in capsys.readouterr().err
    assert k8s.main(["--name", "j", "--image", "i", "--workers", "5", "--servers", "1",
                     "--elastic", "--max-workers", "3", "--", "t"]) == 2
    assert "elastic bounds" in capsys.readouterr().err


def test_elastic_on_one_machine_of_a_multi_machine_job():
    """Without --local: the elastic settings go to this machine's worker; no DMLC_WORKER_ID
    is needed."""
    args, cmd = parse_args(["--no-bind", "--elastic", "--min-workers", "2", "--max-workers",
                            "8", "--", "true"])
    launch = plan_launch(args, cmd, {"PATH": "/usr/bin:/bin", "DMLC_ROLE": "worker",
                                     "DMLC_NUM_WORKER": "4", "DMLC_NUM_SERVER": "1",
                                     "DMLC_PS_ROOT_URI": "127.0.0.1"})
    env = launch.base_env
    assert (env["BYTEPS_ELASTIC"], env["BYTEPS_ELASTIC_MIN_WORKERS"],
            env["BYTEPS_ELASTIC_MAX_WORKERS"]) == ("1", "2", "8")
    assert launch.elastic is None  # supervised like any worker machine
    with pytest.raises(UsageError, match="only valid with --local"):
        parse_args(["--elastic", "--max-restarts", "1", "--", "true"])


@pytest.mark.parametrize("env, what", [
    ({"BYTEPS_ELASTIC_MAX_WORKERS": "2"}, "BYTEPS_ELASTIC_MAX_WORKERS"),
    ({"BYTEPS_ELASTIC_MIN_WORKERS": "5"}, "BYTEPS_ELASTIC_MIN_WORKERS"),
    ({"BYTEPS_LOCAL_SIZE": "2"}, "one worker process per machine"),
])
def test_elastic_settings_are_checked_at_load(env, what):
    from byteps_like.config import load
    from byteps_like.errors import ConfigError
    base = {"BYTEPS_ELASTIC": "1", "DMLC_NUM_WORKER": "3"}
    with pytest.raises(ConfigError, match=what):
        load(env={**base, **env})
    assert load(env=base).elastic.capacity(3) == 3
    assert not load(env={**base, "BYTEPS_ELASTIC": "0", **env}).elastic.enabled
