"""Processes that share a host share its cores (launcher/shares.py, docs/topology.md "Thread
shares"): the split for various hosts and process counts, the thread variables, what the user
set, the off switches, the plan text, and the paths that use it (bpslaunch, SLURM, the
benchmarks' harness). Pure planning: no process is started."""
from __future__ import annotations

import dataclasses
import os

import pytest

from byteps_like.config import load
from byteps_like.errors import ConfigError
from byteps_like.launcher import cli
from byteps_like.launcher.binding import AFFINITY, NUMACTL, Machine
from byteps_like.launcher.cli import parse_args, plan_launch
from byteps_like.launcher.plan import LocalCluster, child_environment, local_cluster_plan, node_plan
from byteps_like.launcher.shares import (
    INTEROP_VARIABLE,
    IO_THREADS_MAX,
    IO_THREADS_MIN,
    THREAD_VARIABLES,
    ShareSettings,
    compute_threads,
    io_threads,
    plan_shares,
    share_host,
    sharing,
)
from byteps_like.topology import Gpu, NumaNode, Topology

CMD = ("python", "train.py")
ALL = (*THREAD_VARIABLES, INTEROP_VARIABLE)


def local(workers: int = 2, servers: int = 1, local_size: int = 1):
    return local_cluster_plan(LocalCluster(command=CMD, port=9, workers=workers,
                                           servers=servers, local_size=local_size))


def flat(cpus: int, **kwargs) -> Machine:
    return Machine(Topology.flat(cpus), **kwargs)


def two_nodes(cpus_per_node: int = 8, gpus: int = 0, smt: bool = False,
              numactl: str | None = None) -> Machine:
    """Two NUMA nodes; with ``smt`` each core is two hyper-threads (CPU c and c + half)."""
    n = 2 * cpus_per_node
    if smt:
        half = n // 2
        cores = tuple((c, c + half) for c in range(half))
        node0 = tuple(sorted([*range(half // 2), *range(half, half + half // 2)]))
    else:
        cores = tuple((c,) for c in range(n))
        node0 = tuple(range(cpus_per_node))
    node1 = tuple(c for c in range(n) if c not in node0)
    gpu_list = tuple(Gpu(i, f"0000:{3 + i:02x}:00.0", 0 if i < gpus / 2 else 1)
                     for i in range(gpus))
    return Machine(Topology(tuple(range(n)), (NumaNode(0, node0), NumaNode(1, node1)), cores,
                   gpu_list), numactl=numactl)


def shares_of(specs, machine, **settings):
    shares, notes = plan_shares(specs, machine, ShareSettings(**settings))
    return {s.name: (share.binding.cpus if share.binding else None, share.threads)
            for s, share in zip(specs, shares)}, notes


def omp(spec) -> str | None:
    return spec.env.get("OMP_NUM_THREADS")


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DMLC_", "BYTEPS_")) and k not in (*ALL, "PYTHONWARNINGS")}
    env.update(extra)
    return env


# -- who shares a host --------------------------------------------------------------------------

def test_a_host_is_shared_by_more_than_one_worker_or_server():
    assert sharing(local(workers=2, servers=1))
    assert sharing(local(workers=1, servers=1))        # a worker and a server
    assert sharing(node_plan("worker", CMD, local_size=2))
    assert not sharing(node_plan("worker", CMD, local_size=1))
    assert not sharing(node_plan("server", ()))
    assert not sharing(node_plan("scheduler", ()))
    one = local_cluster_plan(LocalCluster(command=CMD, port=9, workers=1, servers=0))
    assert not sharing(one)                            # a scheduler and one worker
    shares, notes = plan_shares(one, flat(4), ShareSettings())
    assert shares == [None, None] and notes == []
    specs, lines = share_host(one, flat(4), {}, ShareSettings())
    assert specs == one and lines == []


# -- the split ------------------------------------------------------------------------------------

def check_policy(specs, machine, usable, **settings) -> None:
    """The rules of every bound split: servers and the scheduler float over the usable CPUs
    (bound to all of them, shared); workers have sets of their own, disjoint, together every
    usable CPU when there are enough, and as many threads as CPUs less their part of the data
    plane's reserve; a server's thread count is the fair ``usable / n`` of the n workers and
    servers (the extras go to workers)."""
    shares, _ = plan_shares(specs, machine, ShareSettings(**settings))
    workers = [(s, sh) for s, sh in zip(specs, shares) if s.role == "worker"]
    others = [(s, sh) for s, sh in zip(specs, shares) if s.role != "worker"]
    n = sum(s.role in ("worker", "server") for s in specs)
    for spec, share in others:
        assert share.binding.cpus == tuple(usable), spec.name
        assert share.floating and share.shared and share.binding.memory_node is None, spec.name
        if spec.role == "server":
            assert share.threads == max(1, len(usable) // n), spec.name
        else:
            assert share.threads == 1
    sets = [set(share.binding.cpus) for _, share in workers]
    if len(usable) >= len(workers):
        assert sum(len(s) for s in sets) == len(set().union(*sets)), "workers overlap"
        assert set().union(*sets) == set(usable)
        nservers = sum(s.role == "server" for s in specs)
        want, reserve = compute_threads(len(usable), [len(c) for c in sets],
                                        [len(usable)] * nservers)
        assert 0 < reserve <= len(usable) // 2 or len(usable) < 2
        for (spec, share), n in zip(workers, want):
            assert not share.floating and not share.shared, spec.name
            assert share.threads == n <= len(share.binding.cpus), spec.name
        # every thread counted: the workers' compute threads and the plane's reserve fit
        assert sum(want) + reserve <= max(len(usable), len(workers) + reserve)


def test_sixteen_cores_two_workers_two_servers_servers_float_workers_split():
    # the case: 8 torch threads a worker plus the plane's I/O threads made the 161
    # ResNet-50 shapes 2.65x slower than one flat tensor; 4 a worker (half the cores left to
    # the data plane: 2 x 4 of the workers' and 2 x 8 of the servers' I/O threads, capped at
    # half) made them 1.00x
    got, notes = shares_of(local(workers=2, servers=2), flat(16))
    every = tuple(range(16))
    assert got == {"scheduler": (every, 1), "server 0": (every, 4), "server 1": (every, 4),
                   "worker 0": (tuple(range(8)), 4), "worker 1": (tuple(range(8, 16)), 4)}
    assert notes == ["the native data plane's I/O threads of the 2 worker(s) and 2 server(s) "
                     "here get 8 of the 16 usable CPUs: the workers' compute threads share the "
                     "other 8 (BYTEPS_IO_THREADS sets the plane's threads; OMP_NUM_THREADS "
                     "overrides)"]
    check_policy(local(workers=2, servers=2), flat(16), every)


@pytest.mark.parametrize("workers,servers,local_size,machine,usable", [
    (1, 1, 1, flat(16), range(16)),
    (2, 2, 1, flat(16), range(16)),
    (3, 2, 1, flat(16), range(16)),
    (4, 1, 1, flat(16), range(16)),
    (2, 1, 1, flat(7), range(7)),
    (2, 2, 1, flat(2), range(2)),
    (2, 2, 1, two_nodes(8), range(16)),
    (3, 2, 1, two_nodes(8, smt=True), range(16)),
    (2, 2, 1, two_nodes(8, numactl="/bin/numactl"), range(16)),
    (2, 1, 2, two_nodes(4, gpus=2), range(8)),
    (2, 2, 1, two_nodes(1, gpus=8), range(2)),
    (2, 1, 2, flat(16, allowed=tuple(range(1, 13))), range(1, 13)),
])
def test_servers_float_and_workers_get_disjoint_sets(workers, servers, local_size, machine,
                                                     usable):
    check_policy(local(workers=workers, servers=servers, local_size=local_size), machine,
                 tuple(usable), local_size=local_size)


def test_uneven_counts_give_the_extra_threads_to_workers():
    got, _ = shares_of(local(workers=3, servers=2), flat(16))
    # 16 CPUs: 8 left to the plane (3 + 2 + 2 + 8 + 8 I/O threads, capped at half); the
    # workers' 8 split 3, 3, 2
    assert [got[f"worker {r}"][1] for r in range(3)] == [3, 3, 2]
    assert [got[f"server {r}"][1] for r in range(2)] == [3, 3]
    cpus = [c for name, (s, _) in got.items() if name.startswith("worker") for c in s]
    assert sorted(cpus) == list(range(16))   # disjoint, and every core used
    got, _ = shares_of(local(workers=2, servers=1), flat(7))
    # 7 CPUs: 3 to the plane (2 + 2 + 3 I/O threads, capped at 7 // 2)
    assert {k: v[1] for k, v in got.items()} == {"scheduler": 1, "server 0": 2,
                                                  "worker 0": 2, "worker 1": 2}


def test_two_cores_two_workers_two_servers_and_a_scheduler():
    got, notes = shares_of(local(workers=2, servers=2), flat(2))
    # a CPU of its own for each worker; the servers float over both; one thread each
    assert got == {"scheduler": ((0, 1), 1), "server 0": ((0, 1), 1), "server 1": ((0, 1), 1),
                   "worker 0": ((0,), 1), "worker 1": ((1,), 1)}
    assert notes == []


def test_one_core():
    got, _ = shares_of(local(workers=2, servers=1), flat(1))
    assert set(got.values()) == {((0,), 1)}
    shares, _ = plan_shares(local(workers=2, servers=1), flat(1), ShareSettings())
    assert [(s.shared, s.floating) for s in shares] == [(True, True), (True, True),
                                                         (True, False), (True, False)]
    specs, lines = share_host(node_plan("worker", CMD, local_size=3), flat(1), {},
                              ShareSettings(local_size=3))
    assert [s.binding for s in specs] == [None] * 3 and [omp(s) for s in specs] == ["1"] * 3
    assert lines[-1] == ("note: not binding the processes to CPUs: 3 local ranks need at least "
                         "3 usable CPUs; there are 1 (0)")


def test_a_worker_machine_of_local_ranks_splits_like_before_and_sets_threads():
    specs, lines = share_host(node_plan("worker", CMD, worker_id=1, local_size=4), flat(16), {},
                              ShareSettings(local_size=4))
    assert [s.binding.cpus for s in specs] == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11),
                                               (12, 13, 14, 15)]
    # each local rank's 2 I/O threads count: 8 of the 16 CPUs left to the plane
    assert [omp(s) for s in specs] == ["2"] * 4
    assert lines[0] == ("worker 4 (local rank 0) -> CPUs 0-3, NUMA node 0 (sched_setaffinity); "
                        "2 threads (OMP_NUM_THREADS)")


def test_numa_nodes_workers_alternate_and_servers_float_over_both():
    machine = two_nodes(8, numactl="/bin/numactl")
    got, _ = shares_of(local(workers=2, servers=2), machine)
    every = tuple(range(16))
    assert got == {"scheduler": (every, 1), "server 0": (every, 4), "server 1": (every, 4),
                   "worker 0": (tuple(range(8)), 4), "worker 1": (tuple(range(8, 16)), 4)}
    shares, _ = plan_shares(local(workers=2, servers=2), machine, ShareSettings())
    server, worker = shares[1].binding, shares[3].binding
    assert (server.method, server.numa_node, server.memory_node) == (NUMACTL, None, None)
    assert (worker.method, worker.numa_node, worker.memory_node) == (NUMACTL, 0, 0)
    assert shares[4].binding.numa_node == 1
    assert server.wrap(["x"]) == ("/bin/numactl", "--physcpubind=0-15", "--", "x")


def test_hyperthread_siblings_stay_together():
    # 16 CPUs = 8 cores of two threads (c, c+8); node 0: cores 0-3
    got, _ = shares_of(local(workers=2, servers=2), two_nodes(8, smt=True))
    for name, (cpus, threads) in got.items():
        if name.startswith("worker"):
            assert len(cpus) == 8 and threads == 4 and all((c + 8 in cpus) or (c - 8 in cpus)
                                                     for c in cpus), (name, cpus)
        else:
            assert cpus == tuple(range(16)), name


def test_gpu_workers_keep_their_local_rank_node_and_split_it_among_machines():
    # --local on a 2-GPU machine: local rank l drives cuda:l, on that GPU's node
    machine = two_nodes(4, gpus=2)
    got, _ = shares_of(local(workers=2, servers=1, local_size=2), machine, local_size=2)
    assert got["server 0"] == (tuple(range(8)), 1)
    # (8 CPUs, half of them left to the plane: one compute thread a worker)
    assert got["worker 0"] == ((0, 1), 1) and got["worker 2"] == ((2, 3), 1)    # GPU 0's node
    assert got["worker 1"] == ((4, 5), 1) and got["worker 3"] == ((6, 7), 1)    # GPU 1's node


def test_gpu_nodes_too_small_to_split_give_way_to_cpus_of_their_own():
    # 2 CPUs on two nodes, 8 GPUs: local rank 0's node has one CPU, too few for two emulated
    # machines; one CPU each, wherever, beats two workers on one
    got, notes = shares_of(local(workers=2, servers=2), two_nodes(1, gpus=8))
    assert got == {"scheduler": ((0, 1), 1), "server 0": ((0, 1), 1), "server 1": ((0, 1), 1),
                   "worker 0": ((0,), 1), "worker 1": ((1,), 1)}
    assert notes == ["2 worker process(es) and 8 GPU(s) (1 local rank(s) a machine): placing "
                     "them without regard to GPUs"]


def test_a_node_of_servers_only():
    from byteps_like.launcher.slurm import layout, node_specs
    lay, index = layout({"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n[1-2]",
                         "SLURM_NNODES": "2", "SLURM_NTASKS": "2", "SLURM_NODEID": "1"},
                        server_nodes=1, servers=3)
    got, _ = shares_of(node_specs(lay, index, []), flat(16))
    every = tuple(range(16))
    assert got == {"server 0": (every, 6), "server 1": (every, 5), "server 2": (every, 5)}


def test_numa_off_binds_everyone_to_all_usable_cpus_with_fair_counts():
    got, _ = shares_of(local(workers=2, servers=2), flat(16), numa_on=False, blacklist=(15,))
    assert {v[0] for v in got.values()} == {tuple(range(15))}
    assert [got[n][1] for n in ("worker 0", "worker 1", "server 0", "server 1")] == [4, 4, 4, 3]


def test_visible_cpus_and_the_launchers_mask_narrow_the_split():
    machine = flat(16, allowed=tuple(range(8)))
    got, _ = shares_of(local(workers=1, servers=1), machine, visible_cpus=tuple(range(2, 16)))
    assert got["worker 0"] == ((2, 3, 4, 5, 6, 7), 3) and got["server 0"] == ((2, 3, 4, 5, 6, 7), 3)
    # the blacklist keeps the floating servers off its CPUs too
    got, _ = shares_of(local(workers=2, servers=1), flat(8), blacklist=(0, 7))
    assert got["server 0"][0] == got["scheduler"][0] == (1, 2, 3, 4, 5, 6)
    assert got["worker 0"][0] + got["worker 1"][0] == (1, 2, 3, 4, 5, 6)


def test_no_bind_keeps_the_fair_thread_counts():
    specs, lines = share_host(local(workers=3, servers=2), flat(16), {}, ShareSettings(),
                              bind=False)
    assert all(s.binding is None for s in specs)
    # the fair counts, the workers' cut to their compute share (8 CPUs left to the plane)
    assert [omp(s) for s in specs] == ["1", "3", "3", "3", "3", "2"]
    assert lines[1] == "server 0 -> not bound; 3 threads (OMP_NUM_THREADS)"
    assert lines[3] == "worker 0 (local rank 0) -> not bound; 3 threads (OMP_NUM_THREADS)"


# -- the variables --------------------------------------------------------------------------------

def test_every_thread_variable_is_set_and_interop_stays_small():
    specs, _ = share_host(local(workers=2, servers=2), flat(16), {}, ShareSettings())
    worker = specs[3].env
    assert {k: worker[k] for k in ALL} == {
        "OMP_NUM_THREADS": "4", "MKL_NUM_THREADS": "4", "OPENBLAS_NUM_THREADS": "4",
        "TF_NUM_INTRAOP_THREADS": "4", "TF_NUM_INTEROP_THREADS": "2"}
    server = specs[1].env
    assert {k: server[k] for k in ALL} == {
        "OMP_NUM_THREADS": "4", "MKL_NUM_THREADS": "4", "OPENBLAS_NUM_THREADS": "4",
        "TF_NUM_INTRAOP_THREADS": "4", "TF_NUM_INTEROP_THREADS": "2"}
    assert specs[0].env["OMP_NUM_THREADS"] == "1" and specs[0].env[INTEROP_VARIABLE] == "1"


@pytest.mark.parametrize("cpus", [16, 8, 2, 1])
def test_a_servers_engine_threads_are_left_alone(cpus):
    # the engines sum the ZeroMQ path's keys with the GIL released, only when data arrives,
    # on CPUs no longer confined: even a share of 1 keeps the configured count
    specs, lines = share_host(local(workers=2, servers=2), flat(cpus), {}, ShareSettings())
    assert all("BYTEPS_SERVER_ENGINE_THREAD" not in s.env for s in specs)
    assert not any("BYTEPS_SERVER_ENGINE_THREAD" in line for line in lines)


def test_what_the_user_set_is_never_changed():
    env = {"OMP_NUM_THREADS": "3", "MKL_NUM_THREADS": "5", "BYTEPS_SERVER_ENGINE_THREAD": "7"}
    specs, lines = share_host(local(workers=2, servers=2), flat(8), env, ShareSettings())
    for spec in specs:
        child = child_environment(env, spec.env)
        assert child["OMP_NUM_THREADS"] == "3" and child["MKL_NUM_THREADS"] == "5"
        # the rest follow the user's OMP_NUM_THREADS, as the libraries themselves would
        assert child["OPENBLAS_NUM_THREADS"] == child["TF_NUM_INTRAOP_THREADS"] == "3"
        assert child[INTEROP_VARIABLE] == "2"
        assert "OMP_NUM_THREADS" not in spec.env and "MKL_NUM_THREADS" not in spec.env
    assert child_environment(env, specs[1].env)["BYTEPS_SERVER_ENGINE_THREAD"] == "7"
    assert lines[1] == ("server 0 -> floating over CPUs 0-7 (sched_setaffinity); "
                        "OMP_NUM_THREADS=3 (yours); yours kept: MKL_NUM_THREADS=5")
    assert lines[3] == ("worker 0 (local rank 0) -> CPUs 0-3, NUMA node 0 (sched_setaffinity); "
                        "OMP_NUM_THREADS=3 (yours); yours kept: MKL_NUM_THREADS=5")


def test_settings_come_from_the_config():
    cfg = load(env={"BYTEPS_LOCAL_SIZE": "2", "BYTEPS_NUMA_ON": "0",
                    "BYTEPS_CPU_BLACKLIST": "3", "BYTEPS_VISIBLE_CPU_CORES": "0-5"})
    assert ShareSettings.from_config(cfg) == ShareSettings(2, False, (0, 1, 2, 3, 4, 5), (3,))
    assert ShareSettings.from_config(load(env={"BYTEPS_IO_THREADS": "3"})).io_threads == 3
    assert load(env={}).placement.thread_share is True
    assert load(env={"BYTEPS_THREAD_SHARE": "0"}).placement.thread_share is False


# -- bpslaunch: plan text, switches, errors ------------------------------------------------------

@pytest.fixture
def sixteen(monkeypatch):
    machine = flat(16)
    monkeypatch.setattr(cli, "probe", lambda env: machine)
    return machine


def test_the_launch_plan_says_each_share(sixteen):
    launch = plan_launch(*parse_args(["--local", "--workers", "2", "--servers", "2", "--",
                                      "true"]), _clean_env())
    assert launch.binding == (
        "scheduler -> floating over CPUs 0-15 (sched_setaffinity); 1 thread (OMP_NUM_THREADS)",
        "server 0 -> floating over CPUs 0-15 (sched_setaffinity); 4 threads (OMP_NUM_THREADS)",
        "server 1 -> floating over CPUs 0-15 (sched_setaffinity); 4 threads (OMP_NUM_THREADS)",
        "worker 0 (local rank 0) -> CPUs 0-7, NUMA node 0 (sched_setaffinity); 4 threads "
        "(OMP_NUM_THREADS)",
        "worker 1 (local rank 0) -> CPUs 8-15, NUMA node 0 (sched_setaffinity); 4 threads "
        "(OMP_NUM_THREADS)",
        "note: the native data plane's I/O threads of the 2 worker(s) and 2 server(s) here get 8 "
        "of the 16 usable CPUs: the workers' compute threads share the other 8 "
        "(BYTEPS_IO_THREADS sets the plane's threads; OMP_NUM_THREADS overrides)")
    assert launch.notes == ()
    every = tuple(range(16))
    assert [s.binding.affinity for s in launch.specs] == [every, every, every,
                                                          every[:8], every[8:]]
    assert [omp(s) for s in launch.specs] == ["1", "4", "4", "4", "4"]


def test_main_prints_the_plan(sixteen, capsys, monkeypatch):
    monkeypatch.setattr(cli, "_run", lambda args, launch: 0)
    assert cli.main(["--local", "--workers", "2", "--servers", "2", "--", "true"],
                    environ=_clean_env()) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0] == ("bpslaunch: scheduler -> floating over CPUs 0-15 (sched_setaffinity); "
                      "1 thread (OMP_NUM_THREADS)") and len(err) == 6


@pytest.mark.parametrize("off", [["--no-thread-share"], []])
def test_the_off_switches_restore_worker_only_binding(sixteen, off):
    env = _clean_env(**({} if off else {"BYTEPS_THREAD_SHARE": "0"}))
    launch = plan_launch(*parse_args(["--local", "--workers", "2", "--servers", "2", *off, "--",
                                      "true"]), env)
    assert launch.binding == (
        "worker 0 (local rank 0) -> CPUs 0-15, NUMA node 0 (sched_setaffinity)",
        "worker 1 (local rank 0) -> CPUs 0-15, NUMA node 0 (sched_setaffinity)")
    assert all(not set(ALL) & set(s.env) for s in launch.specs)
    assert [s.binding is None for s in launch.specs] == [True, True, True, False, False]


def test_a_config_file_turns_it_off(sixteen, tmp_path):
    conf = tmp_path / "bps.toml"
    conf.write_text("[placement]\nthread_share = false\n")
    launch = plan_launch(*parse_args(["--local", "--", "true"]),
                         _clean_env(BYTEPS_CONFIG_FILE=str(conf)))
    assert all(omp(s) is None for s in launch.specs)


def test_service_machines_are_left_alone(sixteen):
    for role in ("server", "scheduler"):
        launch = plan_launch(*parse_args([]), _clean_env(DMLC_ROLE=role, DMLC_NUM_SERVER="1"))
        assert launch.binding == () and omp(launch.specs[0]) is None


def test_the_users_own_cpu_lists_that_cannot_be_met_are_a_config_error(sixteen):
    with pytest.raises(ConfigError, match="cannot bind the local processes with "
                       "BYTEPS_VISIBLE_CPU_CORES='' and BYTEPS_CPU_BLACKLIST='0-15': no usable"):
        plan_launch(*parse_args(["--local", "--", "true"]),
                    _clean_env(BYTEPS_CPU_BLACKLIST="0-15"))


def test_the_help_names_the_switch(capsys):
    assert cli.main(["--help"], environ=_clean_env()) == 0
    assert "--no-thread-share" in capsys.readouterr().out


# -- the other paths: SLURM and the benchmarks ----------------------------------------------------

def test_a_slurm_node_shares_its_cores(monkeypatch, capsys):
    from byteps_like.launcher import binding, job
    started = {}

    def fake_run_job(specs, env, settings):
        started["specs"] = specs
        return 0

    monkeypatch.setattr(binding, "probe", lambda env: flat(16))
    monkeypatch.setattr(job, "run_job", fake_run_job)
    env = {**_clean_env(), "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "n[1-2]",
           "SLURM_NNODES": "2", "SLURM_NTASKS": "2", "SLURM_NODEID": "0"}
    # node 0: the scheduler, server 0 and two local ranks: the workers split the 16 cores,
    # the server floats over them with a third of the threads
    argv = ["slurm", "--no-auth", "--local-size", "2"]
    assert cli.main([*argv, "--", "python", "t.py"], environ=env) == 0
    got = {s.name: (s.binding.cpus, omp(s)) for s in started["specs"]}
    assert got == {"scheduler": (tuple(range(16)), "1"),
                   "server 0": (tuple(range(16)), "5"),
                   "worker 0": (tuple(range(8)), "4"), "worker 1": (tuple(range(8, 16)), "4")}
    err = capsys.readouterr().err
    assert "bpslaunch: worker 1 (local rank 1) -> CPUs 8-15, NUMA node 0 " \
           "(sched_setaffinity); 4 threads (OMP_NUM_THREADS)" in err
    assert "bpslaunch: server 0 -> floating over CPUs 0-15 (sched_setaffinity); " \
           "5 threads (OMP_NUM_THREADS)" in err
    assert cli.main([*argv, "--no-thread-share", "--", "python", "t.py"], environ=env) == 0
    assert all(s.binding is None and omp(s) is None for s in started["specs"])


def test_the_benchmark_harness_gets_the_same_shares(monkeypatch):
    from byteps_like.bench import harness
    from byteps_like.launcher import binding
    monkeypatch.setattr(binding, "probe", lambda env: flat(16))
    specs = harness.local_job(["w"], 9, workers=2, servers=2)
    env = _clean_env()
    got, plan = harness.share(specs, env)
    want, lines = share_host(specs, flat(16), env, ShareSettings())
    assert got == want and plan == lines and [omp(s) for s in got] == ["1", "4", "4", "4", "4"]
    assert harness.share(specs, {**env, "BYTEPS_THREAD_SHARE": "0"}) == (specs, [])
    # a bad configuration is left to the children to report, as before
    assert harness.share(specs, {**env, "BYTEPS_PARTITION_BYTES": "4x"}) == (specs, [])


def test_the_harness_starts_children_on_their_cpus(monkeypatch, tmp_path):
    """Job.start binds each child to its share (sched_setaffinity around the fork)."""
    import sys

    from byteps_like.bench import harness
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    calls = []
    monkeypatch.setattr(harness, "share", lambda specs, env: (
        [dataclasses.replace(s, binding=dataclasses.replace(
            _affinity(), cpus=(cpus[0],))) for s in specs], ["plan"]))
    show = (sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))")
    spec = dataclasses.replace(local(workers=1, servers=1)[2], argv=show, env={})
    with harness.Job("share") as job:
        job.sup.start = _recording(job.sup.start, calls)
        [worker] = job.start([spec], {"PATH": os.environ.get("PATH", "")})
        job.wait(30)
        assert worker.stdout().strip() == str([cpus[0]])
        assert job.plan == ["plan"] and calls == [(cpus[0],)]


def _affinity():
    from byteps_like.launcher.binding import Binding
    return Binding((0,), None, AFFINITY)


def _recording(start, calls):
    def wrapper(*args, cpus=None, **kwargs):
        calls.append(tuple(cpus) if cpus is not None else None)
        return start(*args, cpus=cpus, **kwargs)
    return wrapper


# -- the data plane's I/O threads count (compute_threads, pure) ---------------------------------

def test_io_threads_mirror_the_data_planes_own_default(monkeypatch):
    """The launcher may not import transport/native.py: its copy of the default must agree."""
    from byteps_like.transport import native
    for cpus in range(1, 40):
        monkeypatch.setattr(native, "usable_cpus", lambda cpus=cpus: cpus)
        for configured in (0, 3):
            cfg = load(env={"BYTEPS_IO_THREADS": str(configured)})
            assert io_threads(cpus, configured) == native.io_threads(cfg), (cpus, configured)
    assert io_threads(1) == IO_THREADS_MIN and io_threads(1000) == IO_THREADS_MAX


@pytest.mark.parametrize("usable,workers,servers,io,want,reserve", [
    (16, [8, 8], [16, 16], 0, [4, 4], 8),       # the 2 workers + 2 servers
    (16, [8, 8], [16], 0, [4, 4], 8),           # bench pushpull's 2 + 1
    (16, [16], [16], 0, [8], 8),
    (16, [4, 4, 4, 4], [], 0, [2, 2, 2, 2], 8),  # a worker machine of 4 local ranks
    (16, [8, 8], [16, 16], 1, [6, 6], 4),       # BYTEPS_IO_THREADS=1: 4 threads in all
    (64, [8] * 8, [], 0, [4] * 8, 32),
    (64, [32, 32], [64], 0, [20, 20], 24),      # a large host: the 8 + 8 + 8 threads counted
    (7, [4, 3], [7], 0, [2, 2], 3),
    (2, [1, 1], [2, 2], 0, [1, 1], 1),          # never below one thread
    (1, [1, 1], [1], 0, [1, 1], 0),
    (16, [6, 5, 5], [16, 16], 0, [3, 3, 2], 8),  # uneven: the first ones one more
])
def test_compute_threads_leave_the_data_plane_its_cpus(usable, workers, servers, io, want,
                                                       reserve):
    assert compute_threads(usable, workers, servers, io) == (want, reserve)


def test_compute_threads_never_oversubscribe_a_host_with_room():
    for usable in range(2, 130):
        for nw in range(1, 9):
            for ns in range(0, 5):
                if nw > usable // 2:
                    continue
                per = usable // nw
                threads, reserve = compute_threads(usable, [per] * nw, [usable] * ns)
                assert reserve <= usable // 2
                assert sum(threads) + reserve <= usable, (usable, nw, ns)
                assert all(1 <= t <= per for t in threads)
