"""The children of ``bpslaunch --local --workers 2 --servers 1`` see their share of the host
(launcher/shares.py): the OMP_NUM_THREADS and CPUs the launch plan names (the workers' sets
their own, the server and the scheduler floating over all of them), the user's own
OMP_NUM_THREADS unchanged, nothing with --no-thread-share. Every role is a tiny ``python -c``
that prints what it sees and exits, so a run takes about a second; a watchdog bounds it."""
from __future__ import annotations

import json
import re
import sys

import pytest

from byteps_like.launcher.shares import INTEROP_VARIABLE, THREAD_VARIABLES, compute_threads
from byteps_like.topology import parse_cpu_list
from tests.support import clean_env, spawn, watch

pytestmark = pytest.mark.integration

WATCHDOG_S = 30
SHOW = ("import json, os; print('SEES ' + json.dumps({'role': os.environ['DMLC_ROLE'], "
        "'rank': os.environ.get('DMLC_WORKER_ID'), 'cpus': sorted(os.sched_getaffinity(0)), "
        "'env': {k: v for k, v in os.environ.items() if k.endswith('_THREADS') "
        "or k == 'BYTEPS_SERVER_ENGINE_THREAD'}}))")
PLAN = re.compile(r"bpslaunch: (scheduler|server 0|worker \d)(?: \(local rank \d\))? -> "
                  r"(?:(?:floating over )?CPUs ([\d,-]*\d)|not bound)[^;]*; "
                  r"(?:(\d+) threads? \(OMP_NUM_THREADS\)|OMP_NUM_THREADS=(\d+) \(yours\)).*")


def launch(*options: str, **env: str) -> tuple[int, str, str]:
    cmd = json.dumps([sys.executable, "-c", SHOW])
    argv = [sys.executable, "-m", "byteps_like.launcher", "--local", "--workers", "2",
            "--servers", "1", *options, "--_role-cmd", f"scheduler={cmd}",
            "--_role-cmd", f"server={cmd}", "--", sys.executable, "-c", SHOW]
    full = clean_env(**env)
    for name in (*THREAD_VARIABLES, INTEROP_VARIABLE):
        if name not in env:
            full.pop(name, None)
    return watch(spawn(argv, full), WATCHDOG_S, "bpslaunch with env-printing children")


def seen(out: str) -> dict[str, dict]:
    """name (``scheduler``, ``server 0``, ``worker 1``) -> what that child printed."""
    got = {}
    for line in out.splitlines():
        m = re.fullmatch(r"\[(scheduler|server 0|worker \d)\] SEES (.*)", line)
        if m:
            got[m[1]] = json.loads(m[2])
    return got


def planned(err: str) -> dict[str, tuple[tuple[int, ...] | None, int]]:
    """name -> (CPUs or None, threads) from the launch plan on stderr."""
    out = {}
    for line in err.splitlines():
        m = PLAN.fullmatch(line)
        if m:
            out[m[1]] = (parse_cpu_list(m[2]) if m[2] else None, int(m[3] or m[4]))
    return out


def test_children_see_the_thread_share_the_plan_names():
    rc, out, err = launch()
    log = f"exit {rc}\n--- stdout\n{out}\n--- stderr\n{err}"
    assert rc == 0, log
    got, plan = seen(out), planned(err)
    assert sorted(got) == sorted(plan) == ["scheduler", "server 0", "worker 0", "worker 1"], log
    for name, (cpus, threads) in plan.items():
        env = got[name]["env"]
        assert env["OMP_NUM_THREADS"] == str(threads), log
        assert all(env[v] == str(threads) for v in THREAD_VARIABLES), log
        assert env[INTEROP_VARIABLE] == str(min(2, threads)), log
        if cpus is not None:
            assert tuple(got[name]["cpus"]) == cpus, log
    assert plan["scheduler"][1] == 1, log
    # a server's engine threads are its own: the share never lowers them
    assert "BYTEPS_SERVER_ENGINE_THREAD" not in got["server 0"]["env"], log
    every = plan["server 0"][0]
    if every is not None:  # bound: the server and the scheduler float over the workers' CPUs
        assert "bpslaunch: server 0 -> floating over CPUs " in err, log
        assert plan["scheduler"][0] == every, log
        workers = [set(plan[f"worker {r}"][0]) for r in (0, 1)]
        assert workers[0] | workers[1] == set(every), log
        if len(every) >= 2:
            assert not workers[0] & workers[1], log
            # a worker's CPUs less its part of the data plane's reserve (launcher/shares.py)
            want, _ = compute_threads(len(every), [len(w) for w in workers], [len(every)])
            assert [plan[f"worker {r}"][1] for r in (0, 1)] == want, log


def test_the_users_omp_num_threads_is_kept_and_the_switch_turns_it_off():
    rc, out, err = launch(OMP_NUM_THREADS="3")
    log = f"exit {rc}\n--- stdout\n{out}\n--- stderr\n{err}"
    assert rc == 0, log
    got = seen(out)
    assert len(got) == 4 and {g["env"]["OMP_NUM_THREADS"] for g in got.values()} == {"3"}, log
    assert {g["env"]["MKL_NUM_THREADS"] for g in got.values()} == {"3"}, log
    rc, out, err = launch("--no-thread-share", "--no-bind")
    log = f"exit {rc}\n--- stdout\n{out}\n--- stderr\n{err}"
    assert rc == 0 and err == "", log
    got = seen(out)
    assert len(got) == 4 and all("OMP_NUM_THREADS" not in g["env"] for g in got.values()), log
