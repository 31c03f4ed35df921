"""bpslaunch without processes: plans, environments, argument handling, exit codes."""
from __future__ import annotations

import ast
import dataclasses
import json
import os
import pathlib
import signal
import sys
import tempfile

import pytest

from byteps_like.launcher import binding, cli
from byteps_like.launcher.binding import (
    AFFINITY,
    NUMACTL,
    Binding,
    Machine,
    NoBinding,
    bind_workers,
)
from byteps_like.launcher.cli import main, parse_args, plan_launch, split_command
from byteps_like.launcher.plan import (
    ChildSpec,
    LocalCluster,
    child_environment,
    local_cluster_plan,
    node_plan,
    role_argv,
)
from byteps_like.launcher.procs import describe_returncode, exit_status_for
from byteps_like.topology import Gpu, NumaNode, Topology, format_cpu_list

LAUNCHER_DIR = pathlib.Path(cli.__file__).parent
CMD = ("python", "train.py", "--lr", "0.1")


@pytest.fixture(autouse=True)
def fake_machine(monkeypatch):
    """Every plan in this module binds as on a two-node, 8-CPU machine, whatever runs it."""
    machine = two_node_machine(numactl=None)
    monkeypatch.setattr(cli, "probe", lambda env: machine)
    return machine


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "BYTEPS_"))}
    env.update(extra)
    return env


# -- local_cluster_plan ---------------------------------------------------------------------------

@pytest.mark.parametrize("workers,servers,local_size", [(1, 1, 1), (2, 1, 1), (2, 3, 2), (3, 2, 4)])
def test_local_plan_shape_and_ranks(workers, servers, local_size):
    specs = local_cluster_plan(LocalCluster(command=CMD, port=4321, workers=workers,
                                            servers=servers, local_size=local_size))
    assert len(specs) == 1 + servers + workers * local_size
    assert [s.role for s in specs] == (["scheduler"] + ["server"] * servers
                                       + ["worker"] * (workers * local_size))
    assert specs[0].rank is None and specs[0].name == "scheduler"
    assert [s.rank for s in specs if s.role == "server"] == list(range(servers))
    worker_specs = [s for s in specs if s.role == "worker"]
    assert [s.rank for s in worker_specs] == list(range(workers * local_size))
    for spec in worker_specs:
        wid, lrank = int(spec.env["DMLC_WORKER_ID"]), int(spec.env["BYTEPS_LOCAL_RANK"])
        assert spec.rank == wid * local_size + lrank
        assert 0 <= wid < workers and 0 <= lrank < local_size
        assert spec.argv == CMD
    for spec in specs:
        assert spec.env["DMLC_ROLE"] == spec.role
        assert spec.env["DMLC_NUM_WORKER"] == str(workers)
        assert spec.env["DMLC_NUM_SERVER"] == str(servers)
        assert spec.env["DMLC_PS_ROOT_URI"] == "127.0.0.1"
        assert spec.env["DMLC_PS_ROOT_PORT"] == "4321"
        assert spec.env["DMLC_NODE_HOST"] == "127.0.0.1"
        assert spec.env["BYTEPS_SERVER_PORT"] == "0"
        assert spec.env["BYTEPS_LOCAL_SIZE"] == str(local_size)
        assert all(isinstance(a, str) for a in spec.argv)


def test_local_plan_service_argv_and_env():
    specs = local_cluster_plan(LocalCluster(command=CMD, port=9, host="10.0.0.7"))
    scheduler, server = specs[0], specs[1]
    assert scheduler.argv == (sys.executable, "-P", "-m", "byteps_like.scheduler")
    assert server.argv == (sys.executable, "-P", "-m", "byteps_like.server")
    # A service has no worker id or local rank: inherited ones are removed.
    for spec in (scheduler, server):
        assert spec.env["DMLC_WORKER_ID"] is None and spec.env["BYTEPS_LOCAL_RANK"] is None
        assert spec.env["DMLC_PS_ROOT_URI"] == spec.env["DMLC_NODE_HOST"] == "10.0.0.7"
    assert [s.name for s in specs] == ["scheduler", "server 0", "worker 0", "worker 1"]
    assert [s.log_name for s in specs] == ["scheduler.log", "server-0.log", "worker-0.log",
                                           "worker-1.log"]


def test_role_argv_override():
    override = {"server": ["x", "y"]}
    assert role_argv("server", override) == ("x", "y")
    assert role_argv("scheduler", override) == role_argv("scheduler")
    specs = local_cluster_plan(LocalCluster(command=CMD, port=9, role_argv=override))
    assert specs[1].argv == ("x", "y")


@pytest.mark.parametrize("kwargs", [dict(port=0), dict(port=70000), dict(command=()),
                                    dict(workers=0), dict(local_size=0),
                                    dict(servers=0, workers=2)])
def test_local_plan_rejects_bad_shapes(kwargs):
    values = dict(command=CMD, port=1234)
    values.update(kwargs)
    with pytest.raises(ValueError):
        local_cluster_plan(LocalCluster(**values))


def test_one_worker_machine_runs_without_servers():
    from byteps_like.launcher.cli import build_parser, default_servers
    specs = local_cluster_plan(LocalCluster(command=CMD, port=1234, workers=1, servers=0,
                                            local_size=2))
    assert [s.role for s in specs] == ["scheduler", "worker", "worker"]
    assert all(s.env["DMLC_NUM_SERVER"] == "0" for s in specs)
    parse = build_parser().parse_args
    assert default_servers(parse(["--local", "--local-size", "2", "--workers", "1"]), {}) == 0
    assert default_servers(parse(["--local", "--local-size", "2", "--workers", "1"]),
                           {"BYTEPS_FORCE_DISTRIBUTED": "1"}) == 1
    assert default_servers(parse(["--local", "--workers", "1"]), {}) == 1   # one process
    assert default_servers(parse(["--local", "--workers", "2", "--local-size", "2"]), {}) == 1


# -- node_plan (one machine of a multi-machine job) ----------------------------------------------

def test_node_plan_worker_runs_local_size_copies():
    specs = node_plan("worker", CMD, worker_id=1, local_size=3)
    assert [s.rank for s in specs] == [3, 4, 5]
    assert [s.env["BYTEPS_LOCAL_RANK"] for s in specs] == ["0", "1", "2"]
    assert all(s.argv == CMD and s.env["BYTEPS_LOCAL_SIZE"] == "3" for s in specs)


@pytest.mark.parametrize("role", ["scheduler", "server"])
def test_node_plan_service_ignores_command(role):
    (spec,) = node_plan(role, CMD)
    assert spec == ChildSpec(role, None, role_argv(role), {})


def test_node_plan_errors():
    with pytest.raises(ValueError, match="unknown role"):
        node_plan("client", CMD)
    with pytest.raises(ValueError, match="needs a command"):
        node_plan("worker", ())


def test_child_environment_passes_through_and_removes():
    base = {"PATH": "/bin", "BYTEPS_PARTITION_BYTES": "1000000", "DMLC_WORKER_ID": "4"}
    env = child_environment(base, {"DMLC_ROLE": "server", "DMLC_WORKER_ID": None})
    assert env == {"PATH": "/bin", "BYTEPS_PARTITION_BYTES": "1000000", "DMLC_ROLE": "server",
                   "PYTHONUNBUFFERED": "1"}
    assert child_environment({"PYTHONUNBUFFERED": ""}, {})["PYTHONUNBUFFERED"] == ""
    assert "DMLC_ROLE" not in base  # the input is not modified


# -- command line -------------------------------------------------------------------------------

@pytest.mark.parametrize("argv,options,command", [
    (["--local", "--workers", "2", "--", "python", "x.py"], ["--local", "--workers", "2"],
     ["python", "x.py"]),
    (["python", "train.py", "--workers", "3"], [], ["python", "train.py", "--workers", "3"]),
    (["--grace=1", "--timeout", "5", "python", "-u"], ["--grace=1", "--timeout", "5"],
     ["python", "-u"]),
    (["--local", "--", "--weird-prog"], ["--local"], ["--weird-prog"]),
    (["--local"], ["--local"], []),
    ([], [], []),
])
def test_split_command(argv, options, command):
    assert split_command(argv) == (options, command)


def test_parse_args_defaults_and_values():
    args, command = parse_args(["--local", "--workers", "3", "--servers", "2", "--local-size",
                                "4", "--port", "1234", "--host", "::1", "--timeout", "9",
                                "--grace", "0", "--log-dir", "L", "--", "a", "b"])
    assert (args.workers, args.servers, args.local_size, args.port, args.host) == \
           (3, 2, 4, 1234, "::1")
    assert (args.timeout, args.grace, args.timeout_shutdown, args.log_dir) == (9.0, 0.0, 30.0, "L")
    assert command == ["a", "b"]


@pytest.mark.parametrize("argv,message", [
    (["--workers", "2", "python"], "--workers: only valid with --local"),
    (["--local", "--workers", "0", "--", "python"], "at least 1"),
    (["--local", "--port", "70000", "--", "python"], "not a TCP port"),
    (["--local", "--timeout", "0", "--", "python"], "must be > 0"),
    (["--local", "--grace", "-1", "--", "python"], "must be >= 0"),
    (["--local", "--work", "2", "--", "python"], "unrecognized arguments"),
    (["--bogus", "python"], "unrecognized arguments"),
    (["--local"], "--local needs the worker command"),
    ([], "missing the worker command"),
    (["--_role-cmd", "worker=[\"x\"]", "python"], "ROLE=JSON"),
    (["--_role-cmd", "server=notjson", "python"], "ROLE=JSON"),
])
def test_usage_errors_exit_2(argv, message, capsys):
    assert main(argv, environ=_clean_env()) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.startswith("usage: bpslaunch")


def test_help_exits_0(capsys):
    assert main(["--help"], environ=_clean_env()) == 0
    out = capsys.readouterr().out
    assert "--local" in out and "exit status" in out and "--_role-cmd" not in out


# -- validation through byteps_like.config -------------------------------------------------------

@pytest.mark.parametrize("name,value", [("DMLC_NUM_WORKER", "abc"), ("DMLC_ROLE", "client"),
                                        ("BYTEPS_LOCAL_SIZE", "0"),
                                        ("BYTEPS_PARTITION_BYTES", "4x")])
def test_bad_setting_exits_2_with_config_message(monkeypatch, capsys, name, value):
    for key in list(os.environ):
        if key.startswith(("DMLC_", "BYTEPS_")):
            monkeypatch.delenv(key)
    monkeypatch.setenv(name, value)
    assert main(["python", "train.py"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("bpslaunch: error: ") and name in err[-1] and value in err[-1]


def test_bad_setting_in_local_mode_exits_2(capsys):
    env = _clean_env(BYTEPS_PARTITION_BYTES="4x")
    assert main(["--local", "--", "python", "x.py"], environ=env) == 2
    assert "BYTEPS_PARTITION_BYTES='4x'" in capsys.readouterr().err


def test_worker_id_beyond_num_worker_exits_2(capsys):
    env = _clean_env(DMLC_NUM_WORKER="2", DMLC_WORKER_ID="2")
    assert main(["python", "x.py"], environ=env) == 2
    assert "DMLC_WORKER_ID" in capsys.readouterr().err


def test_plan_launch_local_validates_every_child_and_derives_grace():
    env = _clean_env(BYTEPS_HEARTBEAT_TIMEOUT_SECONDS="7", BYTEPS_PARTITION_BYTES="1000000",
                     DMLC_WORKER_ID="9")
    args, command = parse_args(["--local", "--workers", "3", "--local-size", "2", "--", "true"])
    launch = plan_launch(args, command, env)
    assert launch.settings.grace == pytest.approx(12.0)
    assert launch.settings.timeout is None and launch.settings.shutdown_timeout == 30.0
    assert len(launch.specs) == 1 + 1 + 6
    port = launch.specs[0].env["DMLC_PS_ROOT_PORT"]
    assert 0 < int(port) < 65536 and all(s.env["DMLC_PS_ROOT_PORT"] == port for s in launch.specs)
    assert launch.base_env["BYTEPS_PARTITION_BYTES"] == "1000000"  # passes through


def test_plan_launch_respects_port_and_grace():
    args, command = parse_args(["--local", "--port", "23456", "--grace", "1.5", "--", "true"])
    launch = plan_launch(args, command, _clean_env())
    assert launch.settings.grace == 1.5
    assert {s.env["DMLC_PS_ROOT_PORT"] for s in launch.specs} == {"23456"}


def test_plan_launch_worker_role_from_environment():
    env = _clean_env(DMLC_NUM_WORKER="2", DMLC_WORKER_ID="1", BYTEPS_LOCAL_SIZE="3")
    args, command = parse_args(["--", "true", "arg"])
    launch = plan_launch(args, command, env)
    assert [(s.name, s.argv) for s in launch.specs] == [
        (f"worker {r}", ("true", "arg")) for r in (3, 4, 5)]
    assert launch.notes == ()


@pytest.mark.parametrize("role", ["server", "scheduler"])
def test_plan_launch_service_role_notes_ignored_command(role):
    env = _clean_env(DMLC_ROLE=role, DMLC_NUM_SERVER="1")
    args, command = parse_args(["python", "train.py"])
    launch = plan_launch(args, command, env)
    assert [s.argv for s in launch.specs] == [role_argv(role)]
    assert len(launch.notes) == 1 and "ignoring the command 'python train.py'" in launch.notes[0]
    # no command is fine for a service
    assert plan_launch(*parse_args([]), env).notes == ()


def test_config_warnings_become_one_note_each():
    env = _clean_env(BYTEPS_PARTITON_BYTES="1M")  # misspelt
    launch = plan_launch(*parse_args(["--local", "--workers", "3", "--", "true"]), env)
    assert len(launch.notes) == 1, launch.notes
    assert launch.notes[0].startswith("warning: ") and "BYTEPS_PARTITON_BYTES" in launch.notes[0]


# -- command not executable: checked before anything starts --------------------------------------

def test_command_not_found_exits_127(capsys):
    assert main(["--local", "--", "no-such-program-bpslaunch"], environ=_clean_env()) == 127
    assert "command not found: 'no-such-program-bpslaunch'" in capsys.readouterr().err
    assert main(["/no/such/dir/prog"], environ=_clean_env()) == 127
    assert "'/no/such/dir/prog'" in capsys.readouterr().err


def test_command_not_executable_exits_126(tmp_path, capsys):
    script = tmp_path / "train.sh"
    script.write_text("echo hi\n")
    script.chmod(0o644)
    assert main([str(script)], environ=_clean_env()) == 126
    assert "not executable" in capsys.readouterr().err


# -- small helpers and the import rule ------------------------------------------------------------

def test_returncode_descriptions():
    assert describe_returncode(3) == "exit status 3"
    assert describe_returncode(-signal.SIGKILL) == "killed by SIGKILL"
    assert exit_status_for(3) == 3 and exit_status_for(-signal.SIGTERM) == 143


def test_launcher_imports_only_stdlib_config_errors_and_topology():
    allowed = {"byteps_like.config", "byteps_like.errors", "byteps_like.topology",
               "byteps_like.shm_names"}   # as tests/unit/test_layering.py's LAUNCHER_DEPS
    for path in LAUNCHER_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: inside the launcher package
                    continue
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                stdlib = top != "byteps_like" and top in sys.stdlib_module_names
                # the exit notice's lazy import (tests/unit/test_layering.py, LAUNCHER_LAZY)
                lazy = path.name == "notify.py" and name == "byteps_like.control"
                assert name in allowed or stdlib or lazy, f"{path.name} imports {name}"


# -- CPU binding (launcher/binding.py; placement itself is tested in test_topology.py) ----------

def two_node_machine(numactl: str | None = "/usr/bin/numactl", **kwargs) -> Machine:
    """8 CPUs on two NUMA nodes (0-3, 4-7), two GPUs, one per node."""
    topo = Topology(tuple(range(8)), (NumaNode(0, (0, 1, 2, 3)), NumaNode(1, (4, 5, 6, 7))),
                    tuple((c,) for c in range(8)),
                    (Gpu(0, "0000:03:00.0", 0), Gpu(1, "0000:83:00.0", 1)))
    return Machine(topo, numactl=numactl, **kwargs)


def test_binding_wraps_argv_for_numactl_only():
    numa = Binding((0, 1, 2, 3, 8), 0, NUMACTL, memory_node=0, numactl="/bin/numactl")
    assert numa.wrap(CMD) == ("/bin/numactl", "--physcpubind=0-3,8", "--membind=0", "--", *CMD)
    assert numa.affinity is None
    assert numa.describe() == "CPUs 0-3,8, NUMA node 0 (numactl)"
    no_memory = Binding((4,), 1, NUMACTL, memory_node=None)
    assert no_memory.wrap(CMD) == ("numactl", "--physcpubind=4", "--", *CMD)
    aff = Binding((0, 1), None, AFFINITY)
    assert aff.wrap(CMD) == CMD and aff.affinity == (0, 1)
    assert aff.describe() == "CPUs 0-1, no NUMA preference (sched_setaffinity)"
    spec = ChildSpec("worker", 0, CMD, {}, numa)
    assert spec.launch_argv[0] == "/bin/numactl" and spec.argv == CMD
    assert ChildSpec("worker", 0, CMD).launch_argv == CMD


def test_bind_workers_local_cluster_binds_by_local_rank():
    specs = local_cluster_plan(LocalCluster(command=CMD, port=9, workers=2, local_size=2))
    bound, lines = bind_workers(specs, two_node_machine(), local_size=2)
    assert [s.binding for s in bound[:2]] == [None, None]  # scheduler, server: unbound
    workers = bound[2:]
    assert [(w.binding.cpus, w.binding.numa_node, w.binding.method) for w in workers] == [
        ((0, 1, 2, 3), 0, NUMACTL), ((4, 5, 6, 7), 1, NUMACTL),
        ((0, 1, 2, 3), 0, NUMACTL), ((4, 5, 6, 7), 1, NUMACTL)]
    assert workers[0].launch_argv == ("/usr/bin/numactl", "--physcpubind=0-3", "--membind=0",
                                      "--", *CMD)
    assert lines == [
        "worker 0 (local rank 0) -> CPUs 0-3, NUMA node 0 (numactl)",
        "worker 1 (local rank 1) -> CPUs 4-7, NUMA node 1 (numactl)",
        "worker 2 (local rank 0) -> CPUs 0-3, NUMA node 0 (numactl)",
        "worker 3 (local rank 1) -> CPUs 4-7, NUMA node 1 (numactl)"]


def test_probe_applies_cuda_visible_devices(tmp_path):
    from tests.unit.test_topology import FakeSys, dgx_like
    sysfs = FakeSys(tmp_path / "sys")
    dgx_like(sysfs, 2)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "numactl").write_text("#!/bin/sh\n")
    (bin_dir / "numactl").chmod(0o755)
    machine = binding.probe({"PATH": str(bin_dir)}, sysfs=str(sysfs.root))
    assert len(machine.topology.gpus) == 8 and machine.notes == ()
    assert machine.numactl == str(bin_dir / "numactl")
    machine = binding.probe({"CUDA_VISIBLE_DEVICES": "7,6", "PATH": ""}, sysfs=str(sysfs.root))
    assert machine.numactl is None
    assert [(g.index, g.numa_node) for g in machine.topology.gpus] == [(0, 1), (1, 1)]
    machine = dataclasses.replace(machine, allowed=None)  # not this test process's own mask
    _, lines = bind_workers(node_plan("worker", CMD, local_size=2), machine, local_size=2)
    assert lines == ["worker 0 (local rank 0) -> CPUs 8-11,24-27, NUMA node 1 "
                     "(sched_setaffinity)",
                     "worker 1 (local rank 1) -> CPUs 12-15,28-31, NUMA node 1 "
                     "(sched_setaffinity)"]
    machine = binding.probe({"CUDA_VISIBLE_DEVICES": "GPU-1234"}, sysfs=str(sysfs.root))
    _, lines = bind_workers(node_plan("worker", CMD, local_size=2), machine, local_size=2)
    assert lines[-1].startswith("note: CUDA_VISIBLE_DEVICES='GPU-1234' names GPUs by UUID")


def test_bind_workers_methods_and_settings():
    specs = node_plan("worker", CMD, worker_id=1, local_size=2)
    # no numactl: the launcher's thread affinity
    bound, lines = bind_workers(specs, two_node_machine(numactl=None), local_size=2)
    assert [s.binding.method for s in bound] == [AFFINITY, AFFINITY]
    assert lines[0] == "worker 2 (local rank 0) -> CPUs 0-3, NUMA node 0 (sched_setaffinity)"
    # NUMA off: every worker gets every usable CPU, no numactl
    bound, lines = bind_workers(specs, two_node_machine(), local_size=2, numa_on=False,
                                blacklist=[7])
    assert [s.binding.cpus for s in bound] == [tuple(range(7))] * 2
    assert lines[1] == "worker 3 (local rank 1) -> CPUs 0-6, no NUMA preference " \
                       "(sched_setaffinity)"
    # visible CPUs and the launcher's own mask narrow the choice; placement notes follow
    bound, lines = bind_workers(specs, two_node_machine(allowed=(0, 1, 2, 3, 4, 5)),
                                local_size=2, visible_cpus=[1, 2, 3, 4, 5, 6])
    assert [s.binding.cpus for s in bound] == [(1, 2, 3), (4, 5)]
    # sysfs without NUMA information: no numactl (it would refuse to run)
    flat = Machine(Topology.flat(4), numactl="/usr/bin/numactl")
    bound, _ = bind_workers(specs, flat, local_size=2)
    assert [s.binding.method for s in bound] == [AFFINITY, AFFINITY]
    with pytest.raises(NoBinding):
        bind_workers(specs, Machine(Topology.flat(4), can_set_affinity=False), local_size=2)
    with pytest.raises(ValueError, match="2 local ranks need at least 2 usable CPUs"):
        bind_workers(specs, Machine(Topology.flat(1)), local_size=2)
    _, lines = bind_workers(node_plan("worker", CMD, local_size=4),
                            Machine(Topology.flat(8, [Gpu(0, "0000:01:00.0", 0)])), local_size=4)
    assert lines[-1].startswith("note: 4 local ranks but 1 GPU(s)")




def test_plan_launch_binds_workers(fake_machine):
    # without thread shares (tests/unit/test_thread_share.py): the workers, by local rank
    launch = plan_launch(*parse_args(["--local", "--local-size", "2", "--no-thread-share", "--",
                                      "true"]), _clean_env())
    assert launch.binding == (
        "worker 0 (local rank 0) -> CPUs 0-3, NUMA node 0 (sched_setaffinity)",
        "worker 1 (local rank 1) -> CPUs 4-7, NUMA node 1 (sched_setaffinity)",
        "worker 2 (local rank 0) -> CPUs 0-3, NUMA node 0 (sched_setaffinity)",
        "worker 3 (local rank 1) -> CPUs 4-7, NUMA node 1 (sched_setaffinity)")
    assert launch.notes == ()
    assert [s.binding is None for s in launch.specs] == [True, True] + [False] * 4
    # an explicit machine wins over the probe
    launch = plan_launch(*parse_args(["--", "true"]), _clean_env(BYTEPS_NUMA_ON="off"),
                         machine=Machine(Topology.flat(3)))
    assert launch.binding == ("worker 0 (local rank 0) -> CPUs 0-2, no NUMA preference "
                              "(sched_setaffinity)",)


def test_no_bind_and_service_roles_bind_nothing(fake_machine):
    launch = plan_launch(*parse_args(["--local", "--no-bind", "--", "true"]), _clean_env())
    assert all(s.binding is None for s in launch.specs)  # the thread shares stay
    procs = [line for line in launch.binding if not line.startswith("note: ")]
    assert len(procs) == 4 and all("-> not bound; " in line for line in procs)
    launch = plan_launch(*parse_args(["--local", "--no-bind", "--no-thread-share", "--",
                                      "true"]), _clean_env())
    assert launch.binding == () and all(s.binding is None for s in launch.specs)
    env = _clean_env(DMLC_ROLE="server", DMLC_NUM_SERVER="1")
    assert plan_launch(*parse_args([]), env).binding == ()
    assert parse_args(["--no-bind", "python", "x.py"])[1] == ["python", "x.py"]


def test_impossible_binding_is_a_note_by_default_and_an_error_when_asked_for(
        fake_machine, capsys):
    env = _clean_env(BYTEPS_LOCAL_SIZE="9")
    launch = plan_launch(*parse_args(["--no-thread-share", "--", "true"]), env)
    assert launch.binding == ()
    assert launch.notes == ("note: not binding the workers to CPUs: 9 local ranks need at "
                            "least 9 usable CPUs; there are 8 (0-7) (--no-bind silences this)",)
    launch = plan_launch(*parse_args(["--", "true"]), env)  # with thread shares: unbound too
    assert all(s.binding is None for s in launch.specs)
    assert launch.notes == ("note: not binding the processes to CPUs: 9 local ranks need at "
                            "least 9 usable CPUs; there are 8 (0-7) (--no-bind silences this)",)
    assert main(["true"], environ=_clean_env(BYTEPS_CPU_BLACKLIST="0-7")) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == (
        "bpslaunch: error: cannot bind the local workers with BYTEPS_VISIBLE_CPU_CORES='' and "
        "BYTEPS_CPU_BLACKLIST='0-7': no usable CPU: online 0-7, blacklisted 0-7")
    assert main(["true"], environ=_clean_env(BYTEPS_VISIBLE_CPU_CORES="0-x")) == 2
    assert "BYTEPS_VISIBLE_CPU_CORES='0-x' (environment) is not a CPU list" in \
        capsys.readouterr().err


def _run_python_workers(*options: str) -> int:
    quick = json.dumps([sys.executable, "-c", "pass"])
    # a shared-memory directory of its own: segments that other tests' killed jobs left in
    # /dev/shm would be swept (rightly) and reported on the stderr these tests read
    with tempfile.TemporaryDirectory() as shm_dir:
        return main([*options, "--_role-cmd", f"scheduler={quick}", "--_role-cmd",
                     f"server={quick}", "--", sys.executable, "-c", "pass"],
                    environ=_clean_env(BYTEPS_SHM_DIR=shm_dir))


def test_main_reports_the_binding_on_stderr(monkeypatch, capsys):
    cpus = sorted(os.sched_getaffinity(0))
    monkeypatch.setattr(cli, "probe", lambda env: Machine(Topology.flat(cpus)))
    assert _run_python_workers("--local", "--workers", "1", "--no-thread-share") == 0
    err = capsys.readouterr().err.splitlines()
    assert err == [f"bpslaunch: worker 0 (local rank 0) -> CPUs {format_cpu_list(cpus)}, "
                   "NUMA node 0 (sched_setaffinity)"]


def test_a_cpu_the_kernel_refuses_stops_the_launch(monkeypatch, capsys):
    monkeypatch.setattr(cli, "probe", lambda env: Machine(Topology.flat([4000, 4001])))
    assert _run_python_workers("--local", "--workers", "1", "--no-thread-share") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("bpslaunch: error: cannot bind worker 0 to CPUs 4000,4001: "
                              "Invalid argument; bpslaunch --no-bind starts without binding "
                              "(stopped scheduler (pid "), err
    # with thread shares the scheduler, started first, is bound too (floating over every
    # usable CPU, as the servers)
    assert _run_python_workers("--local", "--workers", "1") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("bpslaunch: error: cannot bind scheduler to CPUs 4000,4001: Invalid "
                       "argument; bpslaunch --no-bind starts without binding"), err


def test_help_mentions_no_bind(capsys):
    assert main(["--help"], environ=_clean_env()) == 0
    assert "--no-bind" in capsys.readouterr().out


def test_version_and_a_missing_script_are_distinct_from_usage_errors(tmp_path, capsys):
    from byteps_like.launcher.cli import EXIT_USAGE, main
    with pytest.raises(SystemExit) as exc:
        build_parser_for_version().parse_args(["--version"])
    assert exc.value.code == 0
    assert "bpslaunch (byteps_like " in capsys.readouterr().out
    assert main(["--version"]) == 0
    assert "byteps_like" in capsys.readouterr().out
    missing = str(tmp_path / "nope.py")
    status = main(["--local", "--workers", "1", "--", sys.executable, missing])
    assert status == 127 and status != EXIT_USAGE
    assert f"script not found: {missing!r}" in capsys.readouterr().err
    assert main(["--local", "--bogus"]) == EXIT_USAGE


def build_parser_for_version():
    from byteps_like.launcher.cli import build_parser
    return build_parser()


@pytest.mark.parametrize("role", ["server", "scheduler"])
def test_role_help_prints_usage_instead_of_joining_a_job(role):
    import subprocess
    out = subprocess.run([sys.executable, "-m", f"byteps_like.{role}", "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"usage: python -m byteps_like.{role}" in out.stdout
    bad = subprocess.run([sys.executable, "-m", f"byteps_like.{role}", "--port", "9"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unexpected arguments" in bad.stderr, bad.stderr


def test_workers_get_the_variables_torchrun_sets():
    specs = local_cluster_plan(LocalCluster(command=CMD, port=1234, workers=2, local_size=2))
    workers = [s for s in specs if s.role == "worker"]
    got = [(s.env["RANK"], s.env["WORLD_SIZE"], s.env["LOCAL_RANK"], s.env["LOCAL_WORLD_SIZE"])
           for s in workers]
    assert got == [("0", "4", "0", "2"), ("1", "4", "1", "2"), ("2", "4", "0", "2"),
                   ("3", "4", "1", "2")]
    assert all("RANK" not in s.env for s in specs if s.role != "worker")
    from byteps_like.launcher.plan import node_plan
    node = node_plan("worker", CMD, worker_id=1, local_size=2, num_workers=3)
    assert [(s.env["RANK"], s.env["WORLD_SIZE"]) for s in node] == [("2", "6"), ("3", "6")]


def test_a_taken_port_is_refused_before_launching(capsys):
    import socket as _socket

    from byteps_like.launcher.cli import EXIT_USAGE, main
    with _socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        status = main(["--local", "--port", str(port), "--", sys.executable, "-c", "pass"])
    assert status == EXIT_USAGE
    err = capsys.readouterr().err
    assert f"port {port} on 127.0.0.1 is in use" in err and "DMLC_PS_ROOT_PORT" in err, err


@pytest.mark.parametrize("flag", ["--status", "--metrics"])
def test_status_without_prometheus_client_fails_at_once(flag, monkeypatch, capsys):
    import importlib.util

    from byteps_like.launcher.cli import EXIT_USAGE, main
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "prometheus_client" else real(name, *a))
    assert main(["--local", flag, "--", sys.executable, "-c", "pass"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert f"{flag} reads every process's metrics" in err and "byteps_like[metrics]" in err


# -- the quick start and the test set-up (scripts/setup.sh, scripts/quickstart.sh) --------------

SCRIPTS = LAUNCHER_DIR.parent / "scripts"


def _dry_run(script: str, *args: str) -> list[str]:
    """The commands ``bash scripts/<script> ARGS`` would run on a fresh clone (SETUP_DRY_RUN=1:
    printed after ``+ ``, none run)."""
    import subprocess
    text = (SCRIPTS / script).read_text()
    # an older script without a dry run would really install (and build) everything: never run it
    assert "SETUP_DRY_RUN" in text, f"scripts/{script} has no dry run (SETUP_DRY_RUN=1)"
    env = {**_clean_env(), "SETUP_DRY_RUN": "1"}
    env.pop("SETUP_PROFILE", None)
    p = subprocess.run(["bash", str(SCRIPTS / script), *args], env=env, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return [line[2:] for line in p.stdout.splitlines() if line.startswith("+ ")]


def _installed(commands: list[str]) -> list[str]:
    """What the ``pip install`` commands install, in order."""
    out = []
    for cmd in commands:
        words = cmd.split()
        if "pip" in words and "install" in words:
            args = words[words.index("install") + 1:]
            out += [w for w in args if not w.startswith("--")]
    return out


def test_quick_start_installs_only_what_the_pytorch_demo_needs():
    commands = _dry_run("quickstart.sh", "--epochs", "1")
    # torch pinned (an unpinned torch pulls a multi-GB CUDA build), byteps_like with the
    # examples extra (scikit-learn's digits); no TensorFlow, test, benchmark or UCX packages
    assert _installed(commands) == ["torch==2.13.0", "-e", ".[examples]"], commands
    assert commands[-1].endswith(".venv/bin/bpslaunch --local --workers 2 --servers 1 -- "
                                 ".venv/bin/python examples/pytorch/train_digits.py --epochs 1"), \
        commands


def test_the_full_set_up_still_installs_everything_the_tests_need():
    commands = _dry_run("setup.sh")
    assert _installed(commands) == ["torch==2.13.0", "tensorflow-cpu==2.21.*", "-e",
                                    ".[test,examples,bench,ucx,ray,lightning,docs]"], commands
    # a fresh VM's unattended upgrades may hold dpkg's lock: apt waits for it, not fails
    apt = [c for c in commands if "apt-get" in c]
    assert apt and all("DPkg::Lock::Timeout=" in c for c in apt), apt
    # scripts/test.sh uses the full set-up, the quick start the minimal one
    assert "bash scripts/setup.sh\n" in (SCRIPTS / "test.sh").read_text()
    assert _installed(_dry_run("setup.sh", "--minimal")) == ["torch==2.13.0", "-e",
                                                             ".[examples]"]


def test_setup_refuses_an_unknown_profile():
    import subprocess
    assert "SETUP_DRY_RUN" in (SCRIPTS / "setup.sh").read_text()  # never a real install here
    p = subprocess.run(["bash", str(SCRIPTS / "setup.sh"), "--tiny"], capture_output=True,
                       text=True, timeout=60, env={**_clean_env(), "SETUP_DRY_RUN": "1"})
    assert p.returncode == 2 and "--tiny" in p.stderr, p.stderr


def test_setup_does_not_rebuild_an_unchanged_tree(tmp_path):
    """Issue 40: re-running the quick start (scripts/setup.sh) does not `pip install -e` (and
    so rebuild the C++ extension) when byteps_like is installed from this tree and its build
    files and C++ sources did not change; a changed C++ source is built again. On a copy of
    the script in a tree of its own, whose .venv/bin/python logs pip's installs instead of
    running them (and runs everything else with this interpreter)."""
    import shutil
    import subprocess
    tree = tmp_path / "tree"
    (tree / "scripts").mkdir(parents=True)
    shutil.copy(SCRIPTS / "setup.sh", tree / "scripts" / "setup.sh")
    (tree / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    (tree / "setup.py").write_text("# build\n")
    (tree / "csrc").mkdir()
    (tree / "csrc" / "a.cc").write_text("int a() { return 1; }\n")
    (tree / "byteps_like").mkdir()
    (tree / "byteps_like" / "__init__.py").write_text("__version__ = 'test'\n")
    (tree / "byteps_like" / "_core.py").write_text("def cpu_features():\n    return {}\n")
    (tree / ".venv" / "bin").mkdir(parents=True)
    python = tree / ".venv" / "bin" / "python"
    python.write_text(f'#!/bin/sh\nif [ "$1 $2" = "-m pip" ]; then echo "$*" >> "{tree}/pip.log"; '
                      f'exit 0; fi\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    env = {**_clean_env(), "PYTHONPATH": str(tree)}
    env.pop("SETUP_PROFILE", None)
    env.pop("SETUP_DRY_RUN", None)

    def setup() -> tuple[str, list[str]]:
        p = subprocess.run(["bash", "scripts/setup.sh", "--minimal"], cwd=tree, env=env,
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stdout + p.stderr
        log = tree / "pip.log"
        return p.stdout, [ln for ln in (log.read_text() if log.exists() else "").splitlines()
                          if " -e " in ln]

    out, installs = setup()
    assert len(installs) == 1 and installs[0].endswith("-e .[examples]"), installs
    assert (tree / ".venv" / ".byteps_like-minimal.stamp").is_file()
    out, installs = setup()   # nothing changed: no install
    assert len(installs) == 1 and "not rebuilt" in out, (out, installs)
    (tree / "csrc" / "a.cc").write_text("int a() { return 2; }\n")
    out, installs = setup()   # a C++ source changed: built again
    assert len(installs) == 2 and "not rebuilt" not in out, (out, installs)
    out, installs = setup()
    assert len(installs) == 2 and "not rebuilt" in out, (out, installs)


def test_local_says_which_exported_sizes_it_overrides():
    """Issue 40: --local sets the sizes from its options; exported ones that differ are named
    (the children never see them), equal ones are no news."""
    env = _clean_env(DMLC_NUM_WORKER="4", DMLC_NUM_SERVER="1", BYTEPS_LOCAL_SIZE="3")
    launch = plan_launch(*parse_args(["--local", "--workers", "2", "--", "true"]), env)
    assert launch.notes == (
        "note: --local runs --workers 2: ignoring the exported DMLC_NUM_WORKER=4 (pass "
        "--workers 4 to use it)",
        "note: --local runs --local-size 1: ignoring the exported BYTEPS_LOCAL_SIZE=3 (pass "
        "--local-size 3 to use it)"), launch.notes
    assert {s.env["DMLC_NUM_WORKER"] for s in launch.specs} == {"2"}
    env = _clean_env(DMLC_NUM_WORKER="2")
    assert plan_launch(*parse_args(["--local", "--workers", "2", "--", "true"]), env).notes == ()


def test_a_command_without_local_or_a_dmlc_environment_is_told_what_it_runs():
    """Issue 40: `bpslaunch train.py` alone runs a one-worker job: said, with what to pass."""
    launch = plan_launch(*parse_args(["--", "true", "train.py"]), _clean_env())
    (note,) = launch.notes
    assert note.startswith("note: no --local and no DMLC_* environment: running true train.py "
                           "as a job of one worker process with no scheduler and no servers; "
                           "bpslaunch --local --workers N"), note
    assert [s.argv for s in launch.specs] == [("true", "train.py")]
    launch = plan_launch(*parse_args(["--", "true"]), _clean_env(DMLC_NUM_WORKER="1"))
    assert launch.notes == ()   # a DMLC environment: the user chose it


def test_a_traceback_is_held_back_until_released_and_other_lines_are_not(tmp_path):
    """Issue 40 (one failure, one report): bpslaunch's supervisor holds a child's stderr back
    from a traceback on (the failure report shows the root cause's, the others are
    summarised); release_held prints it in order, at once or once it is old enough."""
    import io

    from byteps_like.launcher.procs import Supervisor
    from tests.support import wait_until
    go = tmp_path / "go"
    code = ("import sys, os, time\nprint('before', file=sys.stderr, flush=True)\n"
            "print('Traceback (most recent call last):', file=sys.stderr, flush=True)\n"
            "print('ValueError: handled', file=sys.stderr, flush=True)\n"
            "print('on stdout', flush=True)\n"
            f"while not os.path.exists({str(go)!r}):\n    time.sleep(0.01)\n")
    out, err = io.StringIO(), io.StringIO()
    sup = Supervisor(stdout=out, stderr=err, hold_tracebacks=True)
    try:
        child = sup.start("worker 0", [sys.executable, "-c", code], dict(os.environ))
        assert wait_until(lambda: "ValueError: handled" in child.stderr_tail
                          and "on stdout" in out.getvalue(), 30), (out.getvalue(),
                                                                   err.getvalue())
        assert err.getvalue() == "[worker 0] before\n"   # the traceback is held
        sup.release_held(older_than=3600)                # not old enough
        assert "handled" not in err.getvalue()
        sup.release_held()
        assert err.getvalue() == ("[worker 0] before\n[worker 0] Traceback (most recent call "
                                  "last):\n[worker 0] ValueError: handled\n")
    finally:
        go.touch()
        sup.close()


def test_the_failure_report_ends_with_the_root_causes_exception_whole():
    """The report's tail reaches back to the root cause's final exception however long its
    message, and the final line states it whole (no truncation)."""
    import collections
    from types import SimpleNamespace

    from byteps_like.launcher import report
    long = "x" * 2000
    tail = ["Traceback (most recent call last):", '  File "t.py", line 1, in <module>',
            "tensorflow.UnknownError: Graph execution error:", *(["  frame"] * 12),
            f"byteps_like.errors.PeerLeftError: worker rank 1 ended without join() {long}",
            "call join()", "\t [[{{node EagerPyFunc}}]]"]
    child = SimpleNamespace(stderr_tail=collections.deque(tail), returncode=1, restarted=False,
                            describe=lambda: "worker 0 (pid 7)")
    other = SimpleNamespace(stderr_tail=collections.deque(), returncode=75, restarted=False,
                            describe=lambda: "worker 1 (pid 8)")
    lines = report.failure_report(child, [child, other], set())
    assert lines[0] == "the other processes: worker 1 (pid 8) exited because of it"
    assert lines[1].startswith("last stderr lines of worker 0 (pid 7) on ")
    assert lines[2:-1] == [f"| {ln}" for ln in tail[-10:]]
    assert lines[-1] == ("error: worker 0 (pid 7) failed first: exit status 1; last stderr: "
                         f"byteps_like.errors.PeerLeftError: worker rank 1 ended without join() "
                         f"{long} | call join() | [[{{{{node EagerPyFunc}}}}]]")
    # a message of 15 more lines: the tail starts where the exception does, not 10 lines up
    message = ["ValueError: the first line", *(f"line {i}" for i in range(15))]
    child.stderr_tail = collections.deque(tail[:2] + message)
    lines = report.failure_report(child, [child], set())
    assert lines[1:] == [*(f"| {ln}" for ln in message),
                         "error: worker 0 (pid 7) failed first: exit status 1; last stderr: "
                         + " | ".join(message)], lines


def test_the_failure_report_calls_a_restarted_process_restarted_not_failed():
    """A scheduler or server that bpslaunch started again stays listed (its replacement is a
    new child): the report says it was lost and restarted, not that it "failed too"."""
    import collections
    import signal
    from types import SimpleNamespace

    from byteps_like.launcher import report
    child = SimpleNamespace(stderr_tail=collections.deque(["ValueError: bad"]), returncode=1,
                            restarted=False, describe=lambda: "worker 0 (pid 7)")
    old = SimpleNamespace(stderr_tail=collections.deque(), returncode=-signal.SIGKILL,
                          restarted=True, describe=lambda: "scheduler (pid 5)")
    new = SimpleNamespace(stderr_tail=collections.deque(), returncode=None, restarted=False,
                          describe=lambda: "scheduler (pid 9)")
    line = report.failure_report(child, [old, child, new], [new])[0]
    assert line == ("the other processes: scheduler (pid 5) was lost (killed by SIGKILL) and "
                    "restarted; scheduler (pid 9) stopped by bpslaunch"), line
