"""torchrun without processes (issue 30): what a process started by torchrun joins
(byteps_like.config), what local rank 0 starts (launcher/torchrun.py), and bpslaunch's answers
to torchrun's and horovodrun's habits (launcher/cli.py). The processes themselves:
tests/integration/test_torchrun.py."""
from __future__ import annotations

import os
import socket
import sys

import pytest

from byteps_like.config import load
from byteps_like.errors import ConfigError
from byteps_like.launcher import torchrun
from byteps_like.launcher.cli import main, parse_args, plan_launch
from tests.support import expect


def tr_env(rank=0, world=2, local_rank=0, local_world=2, group=None, **extra) -> dict:
    """What torchrun gives a worker (GROUP_RANK from the ranks unless given); a job of several
    nodes gets the secret its user must give it (byteps_like refuses one without)."""
    env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local_rank),
           "LOCAL_WORLD_SIZE": str(local_world),
           "GROUP_RANK": str(rank // local_world if group is None else group),
           "MASTER_ADDR": "node0.example", "MASTER_PORT": "29500",
           "TORCHELASTIC_RUN_ID": "run7", "TORCHELASTIC_RESTART_COUNT": "0",
           "TORCHELASTIC_MAX_RESTARTS": "0"}
    several = str(world).isdigit() and str(local_world).isdigit() and \
        int(world) > int(local_world)
    if several and "BYTEPS_AUTH_OFF" not in extra:
        env["BYTEPS_AUTH_SECRET"] = "several-nodes-secret"
    env.update(extra)
    return env


# -- byteps_like.config: joining torchrun's job ---------------------------------------------------

def test_torchrun_variables_make_one_job_of_world_size():
    cfg = load(env=tr_env(rank=3, world=4, local_rank=1))
    c, job = cfg.cluster, cfg.torchrun
    assert job is not None
    assert (job.rank, job.world_size, job.node_rank, job.nnodes, job.servers_per_node) == \
           (3, 4, 1, 2, 1)
    assert (c.role, c.num_worker, c.worker_id, c.local_rank, c.local_size) == \
           ("worker", 2, 1, 1, 2)
    assert c.total_workers == 4 and not c.is_standalone
    assert (c.num_server, c.root_uri) == (2, "node0.example")
    assert c.job_id == "torchrun-run7-29500-0"
    assert cfg.source("cluster.root_port") == "torchrun: derived from MASTER_PORT"
    assert cfg.source("cluster.worker_id") == "torchrun: GROUP_RANK"
    assert cfg.replace(**{"partition.partition_bytes": 8192}).torchrun == job


def test_torchrun_on_one_node_stays_on_loopback_without_servers():
    c = load(env=tr_env(rank=1, local_rank=1)).cluster
    assert (c.num_worker, c.local_size, c.num_server, c.root_uri) == (1, 2, 0, "127.0.0.1")
    forced = load(env=tr_env(BYTEPS_FORCE_DISTRIBUTED="1"))
    assert forced.cluster.num_server == 1 and forced.torchrun.servers_per_node == 1
    one = load(env=tr_env(world=1, local_world=1))
    assert one.torchrun is not None and one.cluster.is_standalone


def test_settings_of_the_user_win_over_torchrun():
    cfg = load(env=tr_env(world=4, DMLC_PS_ROOT_PORT="7000", BYTEPS_JOB_ID="mine",
                          DMLC_PS_ROOT_URI="10.0.0.1", BYTEPS_TORCHRUN_SERVERS_PER_NODE="3"))
    c = cfg.cluster
    assert (c.root_port, c.job_id, c.root_uri, c.num_server) == (7000, "mine", "10.0.0.1", 6)
    assert cfg.torchrun.servers_per_node == 3


@pytest.mark.parametrize("extra", [
    {"DMLC_ROLE": "worker"}, {"DMLC_NUM_WORKER": "1"}, {"DMLC_WORKER_ID": "0"},
    {"BYTEPS_LOCAL_RANK": "0"}, {"BYTEPS_LOCAL_SIZE": "2"}, {"DMLC_NUM_SERVER": "1"},
    {"BYTEPS_TORCHRUN": "off"}, {"MASTER_PORT": ""}, {"LOCAL_WORLD_SIZE": ""},
])
def test_a_configured_job_or_missing_variables_leave_torchrun_alone(extra):
    """bpslaunch gives its workers torchrun's RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE
    too, with a byteps_like job of their own: that job is theirs."""
    env = tr_env(rank=1, local_rank=1, **extra)
    env = {k: v for k, v in env.items() if v}
    if "BYTEPS_LOCAL_SIZE" in extra:
        env["BYTEPS_LOCAL_RANK"] = "1"
    cfg = load(env=env)
    assert cfg.torchrun is None
    assert not cfg.source("cluster.root_port").startswith("torchrun")


@pytest.mark.parametrize("env,needles", [
    (tr_env(world=5), ("WORLD_SIZE=5", "same number of processes on every node")),
    (tr_env(rank=1, local_rank=0, group=0), ("RANK=1", "GROUP_RANK * LOCAL_WORLD_SIZE")),
    (tr_env(world="two"), ("WORLD_SIZE='two' (torchrun's environment)",)),
    (tr_env(MASTER_PORT="0"), ("MASTER_PORT='0' (torchrun's environment)",)),
    (tr_env(BYTEPS_ELASTIC="1"), ("BYTEPS_ELASTIC='1' (environment)", "bpslaunch --elastic")),
    (tr_env(world=4, BYTEPS_TORCHRUN_SERVERS_PER_NODE="0"),
     ("BYTEPS_TORCHRUN_SERVERS_PER_NODE=0", "needs at least one")),
])
def test_torchrun_settings_that_cannot_work_are_config_errors(env, needles):
    expect(ConfigError, lambda: load(env=env), *needles)


# -- launcher/torchrun.py: what local rank 0 starts ------------------------------------------------

def test_node_0_starts_the_scheduler_and_its_servers():
    cfg = load(env=tr_env(world=4))
    specs = torchrun.service_specs(cfg)
    assert [(s.role, s.rank) for s in specs] == [("scheduler", None), ("server", 0)]
    env = specs[1].env
    assert env["DMLC_ROLE"] == "server" and specs[0].env["DMLC_ROLE"] == "scheduler"
    assert (env["DMLC_NUM_WORKER"], env["DMLC_NUM_SERVER"], env["BYTEPS_LOCAL_SIZE"]) == \
           ("2", "2", "2")
    assert (env["DMLC_PS_ROOT_URI"], env["DMLC_PS_ROOT_PORT"]) == \
           ("node0.example", str(cfg.cluster.root_port))
    assert env["BYTEPS_JOB_ID"] == "torchrun-run7-29500-0"
    assert env["DMLC_WORKER_ID"] is None and env["BYTEPS_LOCAL_RANK"] is None
    assert specs[0].argv[0] == sys.executable and specs[0].argv[-1] == "byteps_like.scheduler"


def test_other_nodes_start_their_servers_only():
    cfg = load(env=tr_env(rank=4, world=6, BYTEPS_TORCHRUN_SERVERS_PER_NODE="2"))
    assert [(s.role, s.rank) for s in torchrun.service_specs(cfg)] == \
           [("server", 4), ("server", 5)]
    one = torchrun.service_specs(load(env=tr_env()))
    assert [s.role for s in one] == ["scheduler"]
    assert one[0].env["DMLC_NODE_HOST"] == "127.0.0.1"
    with pytest.raises(ValueError):
        torchrun.service_specs(load(env={}))


def test_the_start_line_says_what_of_torchrun_does_not_apply():
    cfg = load(env=tr_env(world=4, TORCHELASTIC_RESTART_COUNT="1",
                          TORCHELASTIC_MAX_RESTARTS="3"))
    line = torchrun.describe(cfg)
    assert "\n" not in line
    assert "one byteps_like job of 4 workers (2 node(s) x 2 processes" in line
    assert f"node0.example:{cfg.cluster.root_port} (derived from MASTER_PORT)" in line
    assert "1 server(s) per node" in line
    assert "restart 1 of 3, a new job from the start" in line
    assert "Not applied: torchrun's elasticity (--nnodes MIN:MAX, --max-restarts)" in line


def test_only_rank_0_speaks_and_only_local_rank_0_starts_anything(capsys):
    got = torchrun.join(load(env=tr_env(rank=1, local_rank=1, BYTEPS_AUTH_SECRET="s")),
                        on_failure=print, job_over=lambda: True)
    assert got is None and capsys.readouterr().err == ""


# -- issue 41: a single-node torchrun job authenticates by default -----------------------------

def test_a_single_node_job_makes_its_secret_and_its_local_ranks_share_it(tmp_path, monkeypatch):
    """Local rank 0 writes a one-time secret (0600, in a 0700 directory of this user's); the
    other local ranks and the services read the same file; it goes at local rank 0's exit."""
    import atexit
    import stat

    from byteps_like.transport import auth_secret
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", None)
    removers = []
    monkeypatch.setattr(atexit, "register", lambda f, *a: removers.append((f, a)))
    cfgs = [load(env=tr_env(rank=r, local_rank=r)) for r in (0, 1)]
    path = cfgs[0].auth.secret_file
    assert path and path == cfgs[1].auth.secret_file and str(tmp_path) in path
    assert torchrun.makes_secret(cfgs[0]) and not os.path.exists(path)
    torchrun.share_secret(cfgs[0], 1.0)          # local rank 0 writes it
    torchrun.share_secret(cfgs[1], 1.0)          # local rank 1 finds it
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    secret = auth_secret(cfgs[1])
    assert len(secret) == 64 and secret == auth_secret(cfgs[0])
    assert dict(torchrun.service_specs(cfgs[0])[0].env)["BYTEPS_AUTH_SECRET_FILE"] == path
    assert "authenticated with a one-time secret" in torchrun.describe(cfgs[0])
    for f, a in removers:
        f(*a)
    assert not os.path.exists(path)


def test_a_torchrun_job_is_unauthenticated_only_by_name_and_says_so():
    off = load(env=tr_env(BYTEPS_AUTH_OFF="1"))
    assert not off.auth.secret_file and not torchrun.makes_secret(off)
    assert "authentication OFF (BYTEPS_AUTH_OFF=1)" in torchrun.describe(off)
    given = load(env=tr_env(BYTEPS_AUTH_SECRET="s3cret"))
    assert not torchrun.makes_secret(given) and "the secret BYTEPS_AUTH_SECRET" in \
        torchrun.describe(given)
    # several nodes: no file can be shared, so the job needs the user's secret or the opt-out
    with pytest.raises(ConfigError, match="needs the job's secret on every node"):
        load(env={k: v for k, v in tr_env(world=4, local_world=2).items()
                  if k != "BYTEPS_AUTH_SECRET"})
    multi = load(env=tr_env(world=4, local_world=2, BYTEPS_AUTH_SECRET="s3cret"))
    assert not torchrun.makes_secret(multi) and "the secret" in torchrun.describe(multi)
    off2 = load(env=tr_env(world=4, local_world=2, BYTEPS_AUTH_OFF="1"))
    assert "authentication OFF" in torchrun.describe(off2)


def test_local_ranks_wait_for_the_secret_and_name_it_when_it_does_not_come(tmp_path,
                                                                          monkeypatch):
    import tempfile
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)
    cfg = load(env=tr_env(rank=1, local_rank=1))
    with pytest.raises(ConfigError, match="one-time secret did not appear.*BYTEPS_AUTH_OFF=1"):
        torchrun.share_secret(cfg, 0.2)


def test_every_node_derives_the_same_scheduler_port_outside_the_ephemeral_ports():
    """Not MASTER_PORT + 1: bind(0) gives MASTER_PORT, an odd ephemeral port, and connect()
    takes the even ones, so MASTER_PORT + 1 was often some connection's local port."""
    ports = {load(env=tr_env(rank=r, world=6, local_rank=r % 2)).cluster.root_port
             for r in range(6)}
    assert len(ports) == 1 and 20000 <= ports.pop() < 32768
    others = {load(env=tr_env(**{name: value})).cluster.root_port
              for name, value in (("MASTER_PORT", "29501"), ("TORCHELASTIC_RUN_ID", "run8"),
                                  ("TORCHELASTIC_RESTART_COUNT", "1"))}
    assert len(others) == 3 and load(env=tr_env()).cluster.root_port not in others


def _held_port(env: dict) -> tuple[socket.socket, object]:
    """A listening socket on the scheduler port ``load(env=env)`` gives (another run id until
    that port can be taken here)."""
    for run in range(50):
        cfg = load(env={**env, "TORCHELASTIC_RUN_ID": f"held{run}"})
        sock = socket.socket()
        try:
            sock.bind(("127.0.0.1", cfg.cluster.root_port))
        except OSError:
            sock.close()
            continue
        sock.listen()
        return sock, cfg
    raise AssertionError("no derived port could be bound")


@pytest.mark.parametrize("own", [False, True])
def test_a_taken_scheduler_port_is_one_clear_error(own):
    env = tr_env(world=4, MASTER_ADDR="127.0.0.1")
    if own:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            env["DMLC_PS_ROOT_PORT"] = str(probe.getsockname()[1])
    held, cfg = _held_port(env)
    port = cfg.cluster.root_port
    with held:
        origin = "DMLC_PS_ROOT_PORT, environment" if own else "derived from MASTER_PORT"
        expect(ConfigError, lambda: torchrun.wait_for_port(cfg, wait=0),
               f"cannot listen on 127.0.0.1:{port} ({origin})", "set DMLC_PS_ROOT_PORT")
    torchrun.wait_for_port(cfg, wait=0)  # free again


# -- bpslaunch: torchrun's and horovodrun's habits -------------------------------------------------

def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "BYTEPS_"))}
    env.update(extra)
    return env


@pytest.fixture
def script(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('hi')\n")
    return "train.py"


@pytest.mark.parametrize("local", [True, False])
def test_a_python_script_runs_with_this_python(script, local):
    quiet = ["--no-bind", "--no-thread-share"]  # nothing of this machine in the plan
    argv = ["--local", *quiet, script, "--lr", "1"] if local else [*quiet, script, "--lr", "1"]
    launch = plan_launch(*parse_args(argv), _clean_env())
    workers = [s for s in launch.specs if s.role == "worker"]
    assert workers and all(s.argv == (sys.executable, script, "--lr", "1") for s in workers)
    assert f"note: running {script} with this Python: {sys.executable} {script}" in launch.notes


def test_bpslaunch_script_py_runs_instead_of_command_not_found(script, capsys):
    assert main(["--no-bind", script], environ=_clean_env()) == 0  # one worker, standalone
    out, err = capsys.readouterr()
    assert "[worker 0] hi" in out, err
    assert f"bpslaunch: note: running {script} with this Python" in err


@pytest.mark.parametrize("argv,needles", [
    (["--nproc_per_node", "2", "python", "t.py"],
     ["--nproc_per_node 2 is torchrun's option", "--local-size 2 with --local",
      "bpslaunch --local --workers 1 --local-size 2", "BYTEPS_LOCAL_SIZE=2", "keep torchrun"]),
    (["--nproc-per-node=4", "t.py"], ["--nproc-per-node 4 is torchrun's", "--local-size 4"]),
    (["--local", "--nnodes", "3", "--", "t.py"], ["--nnodes 3", "--workers 3 with --local",
                                                  "DMLC_NUM_WORKER=3"]),
    (["--node_rank", "1", "--master_addr", "10.0.0.1", "--master_port", "29500", "t.py"],
     ["DMLC_WORKER_ID=1", "DMLC_PS_ROOT_URI=10.0.0.1", "--host 10.0.0.1", "--port 29500",
      "DMLC_PS_ROOT_PORT=29500"]),
    (["--standalone", "t.py"], ["--standalone is torchrun's option", "--local"]),
    (["-np", "4", "python", "t.py"], ["-np 4 is horovodrun's option", "--local --workers 4",
                                      "W x L = 4"]),
    (["-H", "a:2,b:2", "t.py"], ["-H a:2,b:2 is horovodrun's", "DMLC_WORKER_ID=i",
                                 "BYTEPS_LOCAL_SIZE=<slots>"]),
])
def test_torchrun_and_horovodrun_options_name_bpslaunchs_own(argv, needles, capsys):
    assert main(argv, environ=_clean_env()) == 2
    err = capsys.readouterr().err
    for needle in needles:
        assert needle in err, err
    assert "unrecognized arguments" not in err
    if argv[0] in ("-np", "-H"):
        assert "torchrun" not in err


def test_the_commands_own_options_are_its_own():
    args, command = parse_args(["python", "t.py", "--nnodes", "2", "-np", "4"])
    assert command == ["python", "t.py", "--nnodes", "2", "-np", "4"]
