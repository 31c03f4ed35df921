"""Issue 19, the launcher's share (no sockets, no cluster): a local job gets a job id and a secret
of its own, --no-auth turns that off, settings that cannot work (a missing secret file, an
unresolvable scheduler host) are refused before anything starts, the data plane stays native with
a secret, bpslaunch k8s writes a one-time Secret, bpslaunch slurm wants a secret or --no-auth,
and the launcher names shared-memory segments like the runtime and sweeps dead jobs' ones."""
from __future__ import annotations

import logging
import os
import re
import stat
import subprocess
import sys
import time

import pytest

from byteps_like import local
from byteps_like.config import load
from byteps_like.errors import ConfigError
from byteps_like.launcher.cli import UsageError, main, parse_args, plan_launch
from byteps_like.roles import role_main
from byteps_like.transport import native

ENV = {"PATH": os.environ.get("PATH", os.defpath)}
SECRET = "k" * 64


def plan(*options: str, env: dict | None = None):
    args, command = parse_args(["--local", "--no-bind", *options, "--",
                                sys.executable, "-c", "pass"])
    return plan_launch(args, command, {**ENV, **(env or {})})


def children_env(launch) -> list[dict]:
    from byteps_like.launcher.plan import child_environment
    return [child_environment(launch.base_env, s.env) for s in launch.specs]


# ---- item 7: a job id of its own -----------------------------------------------------------------
def test_a_local_job_gets_a_job_id_of_its_own():
    a, b = plan(), plan()
    ids = {e["BYTEPS_JOB_ID"] for e in children_env(a)}
    assert len(ids) == 1, ids  # every process of the job: the same
    (job,) = ids
    assert job.startswith("local-") and job != b.base_env["BYTEPS_JOB_ID"]
    assert re.fullmatch(rf"local-\d+-{os.getpid()}-[0-9a-f]+", job), job
    kept = plan(env={"BYTEPS_JOB_ID": "mine"})
    assert {e["BYTEPS_JOB_ID"] for e in children_env(kept)} == {"mine"}


# ---- authentication on by default ----------------------------------------------------------------
def test_a_local_job_gets_a_one_time_secret():
    a, b = plan(), plan()
    secrets_a = {e["BYTEPS_AUTH_SECRET"] for e in children_env(a)}
    assert len(secrets_a) == 1 and re.fullmatch(r"[0-9a-f]{64}", next(iter(secrets_a)))
    assert a.base_env["BYTEPS_AUTH_SECRET"] != b.base_env["BYTEPS_AUTH_SECRET"]
    assert plan("--auth").base_env["BYTEPS_AUTH_SECRET"]  # the old flag: still accepted
    # a secret of the user's own is kept
    assert plan(env={"BYTEPS_AUTH_SECRET": SECRET}).base_env["BYTEPS_AUTH_SECRET"] == SECRET


def test_no_auth_runs_without_a_secret(tmp_path):
    off = plan("--no-auth")
    assert not any("BYTEPS_AUTH_SECRET" in e for e in children_env(off))
    f = tmp_path / "secret"
    f.write_text(SECRET)
    inherited = plan("--no-auth", env={"BYTEPS_AUTH_SECRET": SECRET,
                                       "BYTEPS_AUTH_SECRET_FILE": str(f)})
    assert not any(k.startswith("BYTEPS_AUTH") for e in children_env(inherited) for k in e)
    assert any("--no-auth" in n for n in inherited.notes), inherited.notes
    with pytest.raises(UsageError, match="--no-auth"):
        plan("--auth", "--no-auth")
    with pytest.raises(UsageError, match="only valid with --local"):
        parse_args(["--no-auth", "python", "t.py"])


def test_a_ucx_job_gets_its_secret_and_loopback_ucx_too():
    """Issue 41: UCX jobs authenticate like TCP ones (their native streams run the HMAC
    hello), so --local makes the secret for them too and says nothing about it being off;
    a job on loopback keeps UCX on the loopback device unless UCX_NET_DEVICES is set."""
    ucx = plan(env={"BYTEPS_TRANSPORT": "ucx"})
    assert len(ucx.base_env["BYTEPS_AUTH_SECRET"]) == 64
    assert not any("authentication off" in n for n in ucx.notes), ucx.notes
    assert ucx.base_env["UCX_NET_DEVICES"] == "lo"
    assert plan(env={"BYTEPS_TRANSPORT": "ucx", "UCX_NET_DEVICES": "mlx5_0:1"}
                ).base_env["UCX_NET_DEVICES"] == "mlx5_0:1"
    from byteps_like.launcher.cli import local_job_env
    args, _ = parse_args(["--local", "--host", "10.1.2.3", "--", "python", "t.py"])
    assert "UCX_NET_DEVICES" not in local_job_env(args, {"BYTEPS_TRANSPORT": "ucx"}, [])


def test_with_a_secret_the_native_data_plane_authenticates_its_streams():
    cfg = load(env={"BYTEPS_AUTH_SECRET": SECRET})
    native.check(cfg)
    assert native.auth_key(cfg)  # its streams are authenticated
    assert not native.auth_key(load(env={}))


def test_the_scheduler_warns_when_anyone_can_join(caplog):
    from byteps_like.roles import warn_if_open
    with caplog.at_level(logging.WARNING, logger="byteps_like.scheduler"):
        assert warn_if_open(load(env={"DMLC_PS_ROOT_URI": "10.1.2.3"}))
        assert not warn_if_open(load(env={"DMLC_PS_ROOT_URI": "10.1.2.3",
                                          "BYTEPS_AUTH_SECRET": SECRET}))
        assert not warn_if_open(load(env={"DMLC_PS_ROOT_URI": "127.0.0.1"}))
    (rec,) = caplog.records
    assert "any host that reaches 10.1.2.3" in rec.getMessage()


# ---- settings that cannot work: refused before anything starts --------------------------------
def test_a_missing_secret_file_is_refused_up_front(tmp_path, capsys):
    missing = str(tmp_path / "nonexistent")
    with pytest.raises(ConfigError, match="BYTEPS_AUTH_SECRET_FILE=.*nonexistent.*cannot read"):
        load(env={"BYTEPS_AUTH_SECRET_FILE": missing})
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match="BYTEPS_AUTH_SECRET_FILE=.* is empty"):
        load(env={"BYTEPS_AUTH_SECRET_FILE": str(empty)})
    with pytest.raises(ConfigError, match="BYTEPS_AUTH_SECRET_FILE"):
        plan(env={"BYTEPS_AUTH_SECRET_FILE": missing})
    # BytePS mode: exit 2 from bpslaunch itself, before any process
    assert main(["python", "t.py"], environ={**ENV, "BYTEPS_AUTH_SECRET_FILE": missing}) == 2
    err = capsys.readouterr().err
    assert "BYTEPS_AUTH_SECRET_FILE" in err and "Traceback" not in err


def test_an_unresolvable_scheduler_host_is_refused_at_once(capsys, monkeypatch):
    from byteps_like.config import resolve_root
    bad = {"DMLC_PS_ROOT_URI": "no-such-host.invalid", "DMLC_ROLE": "worker"}
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match="DMLC_PS_ROOT_URI='no-such-host.invalid'"):
        resolve_root(load(env=bad))
    assert main(["python", "t.py"], environ={**ENV, **bad}) == 2
    assert "no-such-host.invalid" in capsys.readouterr().err
    for name, value in bad.items():
        monkeypatch.setenv(name, value)
    assert role_main("server", lambda cfg: pytest.fail("ran"), []) == 2
    assert "DMLC_PS_ROOT_URI" in capsys.readouterr().err
    assert time.monotonic() - t0 < 30  # not BYTEPS_REGISTER_TIMEOUT_SECONDS (120)


def test_a_worker_started_directly_refuses_an_unresolvable_scheduler_host_at_once():
    """Without bpslaunch or the role entry points: init() of a worker's runtime."""
    from byteps_like.worker.runtime import Runtime
    env = {"DMLC_PS_ROOT_URI": "no-such-host.invalid", "DMLC_PS_ROOT_PORT": "9", "DMLC_ROLE":
           "worker", "DMLC_NUM_WORKER": "2", "DMLC_NUM_SERVER": "1",
           "BYTEPS_REGISTER_TIMEOUT_SECONDS": "60"}
    rt = Runtime(load(env=env))
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match="DMLC_PS_ROOT_URI='no-such-host.invalid'"):
        rt.init()
    assert time.monotonic() - t0 < 20  # not the 60 s registration timeout
    rt.shutdown()


# ---- bpslaunch k8s and bpslaunch slurm -----------------------------------------------------------
def _k8s(tmp_path, *args):
    import json
    out = tmp_path / "job.json"
    assert main(["k8s", "--name", "j", "--image", "i", "--workers", "1", "--servers", "1",
                 "--format", "json", "-o", str(out), *args, "--", "python", "t.py"]) == 0
    return json.loads(out.read_text())["items"], out


def test_k8s_writes_a_one_time_secret(tmp_path):
    objs, out = _k8s(tmp_path)
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    secret = objs[0]
    assert (secret["kind"], secret["metadata"]["name"]) == ("Secret", "j-auth")
    value = secret["stringData"]["secret"]
    assert re.fullmatch(r"[0-9a-f]{64}", value)
    assert _k8s(tmp_path)[0][0]["stringData"]["secret"] != value
    refs = [e for o in objs if o["kind"] in ("Pod", "Job")
            for c in (o["spec"] if o["kind"] == "Pod" else o["spec"]["template"]["spec"])
            ["containers"] for e in c["env"] if e["name"] == "BYTEPS_AUTH_SECRET"]
    assert len(refs) == 3 and all(r["valueFrom"]["secretKeyRef"]["name"] == "j-auth"
                                  for r in refs)
    kinds = [o["kind"] for o in _k8s(tmp_path, "--existing-secret")[0]]
    assert "Secret" not in kinds and len(kinds) == 4
    assert "Secret" not in [o["kind"] for o in _k8s(tmp_path, "--no-auth")[0]]


def test_slurm_needs_a_secret_or_no_auth(capsys):
    slurm = {**ENV, "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NNODES": "2",
             "SLURM_NTASKS": "2", "SLURM_NODEID": "1"}
    assert main(["slurm", "--", "python", "t.py"], environ=slurm) == 2
    err = capsys.readouterr().err
    assert "BYTEPS_AUTH_SECRET" in err and "--no-auth" in err


def test_the_sbatch_script_generates_a_secret():
    from pathlib import Path
    script = (Path(__file__).resolve().parents[2] / "scripts" / "sbatch_byteps_like.sh"
              ).read_text()
    assert "BYTEPS_AUTH_SECRET=" in script and "--no-auth" in script


# ---- shared memory: names and sweeping ------------------------------------------------------
@pytest.mark.parametrize("job", ["default", "local-1-2-ab", "a b/c:d", "x.y_z-1"])
def test_the_launcher_names_segments_like_the_runtime(job):
    from byteps_like.launcher import shm
    assert shm.segment_prefix(job, 9000) == local.segment_prefix(job, 9000)


def test_segments_of_dead_local_jobs_are_swept(tmp_path):
    from byteps_like.launcher import shm
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    ns = shm._pid_namespace()
    files = {
        "dead": f"bpsl-local-{ns}-{dead.pid}-00ff-4242-m0-t1",
        "alive": f"bpsl-local-{ns}-{os.getppid()}-00ff-4243-m0-t1",
        "mine": f"bpsl-local-{ns}-{os.getpid()}-00ff-4244-m0-t1",
        "elsewhere": f"bpsl-local-{ns + 1}-{dead.pid}-00ff-4245-m0-t1",
        "user": "bpsl-myjob-4246-m0-t1",
    }
    for name in files.values():
        (tmp_path / name).write_bytes(b"x")
    assert shm.sweep_dead_local_jobs(str(tmp_path)) == [files["dead"]]
    assert sorted(os.listdir(tmp_path)) == sorted(v for k, v in files.items() if k != "dead")
    assert shm.sweep(str(tmp_path), "bpsl-myjob-4246-") == [files["user"]]



def test_pid_alive_counts_zombies_and_the_dead_as_gone():
    """The one pid check (launcher/procs.py) bpslaunch's sweep, the benchmarks' netns sweep and
    the integration harness share."""
    from byteps_like.launcher.procs import pid_alive
    assert pid_alive(os.getpid()) and pid_alive(os.getppid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # exited, not reaped yet: a zombie
        with open(f"/proc/{child.pid}/stat", "rb") as f:
            zombie = f.read().rsplit(b")", 1)[1][1:2] == b"Z"
        if zombie:
            break
        time.sleep(0.01)
    assert not pid_alive(child.pid)
    child.wait()
    assert not pid_alive(child.pid)

def test_bpslaunch_knows_where_its_workers_segments_are(tmp_path):
    launch = plan(env={"BYTEPS_SHM_DIR": str(tmp_path), "BYTEPS_JOB_ID": "j"})
    port = int(launch.base_env.get("DMLC_PS_ROOT_PORT") or
               next(s.env["DMLC_PS_ROOT_PORT"] for s in launch.specs))
    assert launch.segments == (str(tmp_path), f"bpsl-j-{port}-")
