"""bpslaunch with real processes: stand-in scripts play the scheduler, servers and workers.

The launcher runs as ``python -m byteps_like.launcher`` in its own process group under a
watchdog; the internal ``--_role-cmd ROLE=JSON`` option swaps the scheduler and server entry
points for the stand-in. Every child records its pid in a directory so that the tests can check
that nothing outlives the launcher.
"""
from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from byteps_like.launcher.procs import Supervisor
from byteps_like.topology import discover, format_cpu_list, parse_cpu_list
from tests.integration.harness import alive
from tests.support import watch

pytestmark = pytest.mark.integration

WATCHDOG_S = 60

# argv: PIDDIR BEHAVIOURS_JSON. BEHAVIOURS maps "worker-<rank>", "worker", "scheduler",
# "server" to a list of actions, run in order.
STANDIN = textwrap.dedent("""\
    import json, os, signal, subprocess, sys, time
    piddir, behaviours = sys.argv[1], json.loads(sys.argv[2])
    role = os.environ.get("DMLC_ROLE", "worker")
    if role == "worker":
        rank = (int(os.environ["DMLC_WORKER_ID"]) * int(os.environ["BYTEPS_LOCAL_SIZE"])
                + int(os.environ["BYTEPS_LOCAL_RANK"]))
        name = f"worker-{rank}"
    else:
        name = f"{role}-{os.getpid()}"

    def record(label, pid):
        tmp = os.path.join(piddir, f".{label}.tmp")
        with open(tmp, "w") as f:
            f.write(str(pid))
        os.rename(tmp, os.path.join(piddir, f"{label}.pid"))

    record(name, os.getpid())
    for action in behaviours.get(name, behaviours.get(role, ["ok"])):
        verb, _, arg = action.partition(":")
        if verb == "ok":
            sys.exit(0)
        elif verb == "say":
            print(arg)
        elif verb == "env":
            keys = ("DMLC_ROLE", "DMLC_WORKER_ID", "BYTEPS_LOCAL_RANK", "BYTEPS_LOCAL_SIZE",
                    "DMLC_NUM_WORKER", "DMLC_NUM_SERVER", "DMLC_PS_ROOT_URI",
                    "DMLC_PS_ROOT_PORT", "DMLC_NODE_HOST", "BYTEPS_SERVER_PORT",
                    "BYTEPS_PARTITION_BYTES", "BPSLAUNCH_TEST_PASSTHROUGH")
            print("ENV " + json.dumps({k: os.environ.get(k) for k in keys}, sort_keys=True))
        elif verb == "affinity":  # what the kernel says this process may run on
            with open("/proc/self/status") as f:
                allowed = [l.split()[1] for l in f if l.startswith("Cpus_allowed_list:")]
            print("AFFINITY " + allowed[0])
        elif verb == "binary":
            sys.stdout.buffer.write(b"raw \\xff\\xfe bytes\\n")
            sys.stdout.flush()
        elif verb == "stderr":
            print(arg, file=sys.stderr)
        elif verb == "nap":
            time.sleep(float(arg))
        elif verb == "await":  # wait until N pid files exist (all processes started)
            deadline = time.time() + 30
            while (len([f for f in os.listdir(piddir) if f.endswith(".pid")]) < int(arg)
                   and time.time() < deadline):
                time.sleep(0.02)
        elif verb == "mark":  # create a marker file LABEL.mark
            open(os.path.join(piddir, f"{arg}.mark"), "w").close()
        elif verb == "awaitmark":
            deadline = time.time() + 30
            marker = os.path.join(piddir, f"{arg}.mark")
            while not os.path.exists(marker) and time.time() < deadline:
                time.sleep(0.02)
        elif verb == "exit":
            print(f"boom-marker from {name}", file=sys.stderr)
            sys.exit(int(arg))
        elif verb == "suicide":
            os.kill(os.getpid(), signal.SIGKILL)
        elif verb == "ignore-term":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        elif verb == "grandchild":
            p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
            record(f"grandchild-of-{name}", p.pid)
        elif verb == "sleep":
            time.sleep(300)
    """)


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str
    elapsed: float

    @property
    def lines(self) -> list[str]:
        return self.stdout.splitlines()

    @property
    def last_err(self) -> str:
        lines = self.stderr.strip().splitlines()
        return lines[-1] if lines else ""

    def dump(self) -> str:
        return (f"exit status {self.returncode} after {self.elapsed:.1f} s\n--- stdout\n"
                f"{self.stdout}\n--- stderr\n{self.stderr}")


class Harness:
    def __init__(self, tmp_path: Path):
        self.piddir = tmp_path / "pids"
        self.piddir.mkdir()
        self.script = tmp_path / "standin.py"
        self.script.write_text(STANDIN)
        self.tmp_path = tmp_path

    def cmd(self, behaviours: dict) -> list[str]:
        return [sys.executable, str(self.script), str(self.piddir), json.dumps(behaviours)]

    def argv(self, behaviours: dict, *options: str, local: bool = True) -> list[str]:
        role_cmd = json.dumps(self.cmd(behaviours))
        return [sys.executable, "-m", "byteps_like.launcher",
                *(["--local"] if local else []), *options,
                "--_role-cmd", f"scheduler={role_cmd}", "--_role-cmd", f"server={role_cmd}",
                "--", *self.cmd(behaviours)]

    def start(self, argv: list[str], env_extra: dict | None = None) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "BYTEPS_"))}
        env.pop("PYTHONWARNINGS", None)
        env.update(env_extra or {})
        self._t0 = time.monotonic()
        return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True, cwd=self.tmp_path)

    def finish(self, proc: subprocess.Popen, timeout: float = WATCHDOG_S) -> Result:
        """Collect the launcher's result; on a hang kill its group (and every recorded child)
        and fail with its logs (tests/support.py's watchdog)."""
        rc, out, err = watch(proc, timeout, "bpslaunch", on_hang=self.kill_recorded)
        return Result(rc, out.decode("utf-8", errors="replace"),
                      err.decode("utf-8", errors="replace"), time.monotonic() - self._t0)

    def run(self, argv: list[str], env_extra: dict | None = None) -> Result:
        return self.finish(self.start(argv, env_extra))

    def pids(self) -> dict[str, int]:
        return {p.stem: int(p.read_text()) for p in self.piddir.glob("*.pid")}

    def wait_for_pids(self, count: int, proc: subprocess.Popen) -> dict[str, int]:
        deadline = time.monotonic() + 30
        while len(self.pids()) < count:
            if proc.poll() is not None or time.monotonic() > deadline:
                result = self.finish(proc, timeout=5)
                pytest.fail(f"expected {count} processes, got {sorted(self.pids())}\n"
                            + result.dump())
            time.sleep(0.02)
        return self.pids()

    def wait_for_mark(self, label: str, proc: subprocess.Popen) -> None:
        deadline = time.monotonic() + 30
        while not (self.piddir / f"{label}.mark").exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"no mark {label!r}\n" + self.finish(proc, timeout=5).dump())
            time.sleep(0.02)

    def assert_all_gone(self, result: Result) -> None:
        deadline = time.monotonic() + 5
        left = {}
        while time.monotonic() < deadline:
            left = {name: pid for name, pid in self.pids().items() if alive(pid)}
            if not left:
                return
            time.sleep(0.05)
        self.kill_recorded()
        pytest.fail(f"processes outlived bpslaunch: {left}\n" + result.dump())

    def kill_recorded(self) -> None:
        for pid in self.pids().values():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


@pytest.fixture
def harness(tmp_path):
    h = Harness(tmp_path)
    yield h
    h.kill_recorded()  # never leave anything behind, even when a test fails


def test_success_prefixes_env_and_logs(harness):
    behaviours = {"scheduler": ["say:ready", "nap:0.2", "ok"], "server": ["say:ready", "ok"],
                  "worker": ["env", "binary", "stderr:to-stderr", "ok"]}
    logs = harness.tmp_path / "logs"
    result = harness.run(
        harness.argv(behaviours, "--workers", "2", "--servers", "2", "--local-size", "2",
                     "--grace", "1", "--log-dir", str(logs)),
        {"BYTEPS_PARTITION_BYTES": "2048000", "BPSLAUNCH_TEST_PASSTHROUGH": "yes"})
    assert result.returncode == 0, result.dump()
    lines = result.lines
    assert lines.count("[scheduler] ready") == 1, result.dump()
    assert sorted(line for line in lines if line.endswith("] ready")) == [
        "[scheduler] ready", "[server 0] ready", "[server 1] ready"], result.dump()
    envs = {}
    for line in lines:
        if " ENV " in line:
            prefix, _, payload = line.partition(" ENV ")
            envs[prefix] = json.loads(payload)
    assert sorted(envs) == [f"[worker {r}]" for r in range(4)], result.dump()
    port = envs["[worker 0]"]["DMLC_PS_ROOT_PORT"]
    for rank in range(4):
        env = envs[f"[worker {rank}]"]
        assert env == {
            "DMLC_ROLE": "worker", "DMLC_WORKER_ID": str(rank // 2),
            "BYTEPS_LOCAL_RANK": str(rank % 2), "BYTEPS_LOCAL_SIZE": "2",
            "DMLC_NUM_WORKER": "2", "DMLC_NUM_SERVER": "2", "DMLC_PS_ROOT_URI": "127.0.0.1",
            "DMLC_PS_ROOT_PORT": port, "DMLC_NODE_HOST": "127.0.0.1",
            "BYTEPS_SERVER_PORT": "0", "BYTEPS_PARTITION_BYTES": "2048000",
            "BPSLAUNCH_TEST_PASSTHROUGH": "yes"}
        assert f"[worker {rank}] raw \ufffd\ufffd bytes" in lines
        assert f"[worker {rank}] to-stderr" in result.stderr.splitlines()
    assert 0 < int(port) < 65536
    # stdout and stderr of a child go to one log file; their relative order is not defined
    log_lines = (logs / "worker-3.log").read_bytes().splitlines(keepends=True)
    assert sorted(log_lines)[0].startswith(b"ENV {") and len(log_lines) == 3, log_lines
    assert b"raw \xff\xfe bytes\n" in log_lines and b"to-stderr\n" in log_lines, log_lines
    assert (logs / "scheduler.log").read_text() == "ready\n"
    assert (logs / "server-1.log").read_text() == "ready\n"


def test_failing_worker_stops_the_rest_and_is_named(harness):
    # 4 processes + 1 grandchild; worker 1 fails once everyone has started.
    behaviours = {"scheduler": ["sleep"], "server": ["sleep"],
                  "worker-0": ["grandchild", "sleep"],
                  "worker-1": ["await:5", "stderr:Traceback (most recent call last):",
                               "exit:3"]}
    result = harness.run(harness.argv(behaviours, "--grace", "0.5"))
    assert result.returncode == 3, result.dump()
    pids = harness.pids()
    assert len(pids) == 5, pids
    last = result.last_err
    assert last.startswith("bpslaunch: error: worker 1 "), result.dump()
    assert f"pid {pids['worker-1']}" in last and "exit status 3" in last, result.dump()
    assert "boom-marker from worker-1" in last and "Traceback" in last, result.dump()
    # what follows a traceback is held back for the report (launcher/report.py), not printed
    # as it comes: it is in the report, once
    assert "[worker 1] boom-marker from worker-1" not in result.stderr, result.dump()
    assert result.stderr.count("boom-marker from worker-1") == 2, result.dump()  # tail, last
    assert "bpslaunch: | boom-marker from worker-1" in result.stderr, result.dump()
    harness.assert_all_gone(result)


def test_no_worker_left_stops_the_rest_without_the_grace_period(harness):
    # every worker fails before the job could start (a missing file, a crash before init):
    # the scheduler and server have nobody to wait for; a 60 s grace must not be waited out
    behaviours = {"scheduler": ["sleep"], "server": ["sleep"],
                  "worker-0": ["await:4", "exit:3"], "worker-1": ["await:4", "exit:3"]}
    result = harness.run(harness.argv(behaviours, "--grace", "60"))
    assert result.returncode == 3, result.dump()
    assert "(no worker is left)" in result.stderr, result.dump()
    assert result.elapsed < 30, result.dump()
    harness.assert_all_gone(result)


def test_survivors_exiting_during_grace_do_not_replace_first_failure(harness):
    behaviours = {"scheduler": ["sleep"], "server": ["sleep"],
                  "worker-0": ["await:4", "suicide"],
                  "worker-1": ["await:4", "nap:0.3", "exit:5"]}
    result = harness.run(harness.argv(behaviours, "--grace", "1.5"))
    assert result.returncode == 128 + signal.SIGKILL, result.dump()
    assert "worker 0" in result.last_err and "killed by SIGKILL" in result.last_err
    assert "worker 1 (pid" in result.stderr and "exit status 5" in result.stderr
    harness.assert_all_gone(result)


def test_a_scheduler_that_cannot_start_is_blamed_whatever_failed_before_it(harness):
    """Issue 30, item 10: two jobs on one port; the losing job's worker, refused by the other
    job's scheduler, exited 1 before its own scheduler's bind failure (exit 2) was reaped, and
    bpslaunch blamed the worker. The scheduler that could not start is the cause."""
    behaviours = {"scheduler": ["await:4", "nap:0.3", "stderr:cannot listen on the port",
                                "mark:scheduler", "exit:2"],
                  "server": ["sleep"],
                  "worker-0": ["await:4", "exit:1"],   # first: refused by another scheduler
                  "worker-1": ["awaitmark:scheduler", "nap:0.3", "exit:1"]}
    result = harness.run(harness.argv(behaviours, "--grace", "30"))
    assert result.returncode == 2, result.dump()
    seen = [ln for ln in result.stderr.splitlines() if " failed: " in ln]
    assert seen[0].startswith("bpslaunch: worker 0 "), result.dump()  # the race, reproduced
    last = result.last_err
    assert last.startswith("bpslaunch: error: scheduler (pid "), result.dump()
    assert "exit status 2" in last and "cannot listen on the port" in last, result.dump()
    harness.assert_all_gone(result)


@pytest.mark.parametrize("signum,status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_to_launcher_stops_everything(harness, signum, status):
    behaviours = {"scheduler": ["sleep"], "server": ["sleep"],
                  "worker": ["grandchild", "sleep"]}
    proc = harness.start(harness.argv(behaviours, "--servers", "2", "--grace", "30"))
    harness.wait_for_pids(1 + 2 + 2 + 2, proc)
    os.kill(proc.pid, signum)
    result = harness.finish(proc)
    assert result.returncode == status, result.dump()
    assert f"interrupted by {signal.Signals(signum).name}" in result.last_err, result.dump()
    assert result.elapsed < 20, result.dump()
    harness.assert_all_gone(result)


def test_child_ignoring_sigterm_is_killed(harness):
    behaviours = {"scheduler": ["sleep"], "server": ["sleep"],
                  "worker-0": ["ignore-term", "mark:ignoring", "sleep"],
                  "worker-1": ["await:4", "awaitmark:ignoring", "exit:1"]}
    result = harness.run(harness.argv(behaviours, "--grace", "0.2"))
    assert result.returncode == 1, result.dump()
    pids = harness.pids()
    assert f"SIGKILL to worker 0 (pid {pids['worker-0']})" in result.stderr, result.dump()
    assert "worker 1" in result.last_err, result.dump()
    assert 5 <= result.elapsed < 20, result.dump()
    harness.assert_all_gone(result)


def test_second_signal_skips_to_sigkill(harness):
    behaviours = {"scheduler": ["sleep"], "server": ["sleep"],
                  "worker-0": ["ignore-term", "mark:ignoring", "sleep"], "worker-1": ["sleep"]}
    proc = harness.start(harness.argv(behaviours))
    harness.wait_for_pids(4, proc)
    harness.wait_for_mark("ignoring", proc)
    os.kill(proc.pid, signal.SIGINT)
    time.sleep(0.5)
    os.kill(proc.pid, signal.SIGINT)
    result = harness.finish(proc)
    assert result.returncode == 130, result.dump()
    assert "SIGKILL to worker 0" in result.stderr and result.elapsed < 4.5, result.dump()
    harness.assert_all_gone(result)


@pytest.mark.parametrize("program", ["no-such-program-bpslaunch", "/no/such/dir/prog"])
def test_missing_executable_exits_127_and_starts_nothing(harness, program):
    role_cmd = json.dumps(harness.cmd({"scheduler": ["sleep"], "server": ["sleep"]}))
    result = harness.run([sys.executable, "-m", "byteps_like.launcher", "--local",
                          "--_role-cmd", f"scheduler={role_cmd}",
                          "--_role-cmd", f"server={role_cmd}", "--", program, "arg"])
    assert result.returncode == 127, result.dump()
    assert repr(program) in result.last_err, result.dump()
    assert harness.pids() == {}


def test_all_success_exits_0(harness):
    result = harness.run(harness.argv({"worker": ["say:hello", "ok"]}))
    assert result.returncode == 0, result.dump()
    assert sorted(result.lines) == ["[worker 0] hello", "[worker 1] hello"], result.dump()
    assert sorted(bindings(result)) == [0, 1], result.dump()
    # nothing else on stderr than the launch plan: a line per process (thread shares) and notes
    assert all(_PLAN_RE.fullmatch(line) for line in result.stderr.splitlines()), result.dump()
    assert len(result.stderr.splitlines()) >= 4, result.dump()
    harness.assert_all_gone(result)


def test_timeout_exits_124(harness):
    result = harness.run(harness.argv({"scheduler": ["sleep"], "server": ["sleep"],
                                       "worker": ["sleep"]}, "--timeout", "1"))
    assert result.returncode == 124, result.dump()
    assert "--timeout 1 s" in result.last_err and result.elapsed < 15, result.dump()
    harness.assert_all_gone(result)


def test_services_that_do_not_shut_down_are_a_failure(harness):
    behaviours = {"scheduler": ["sleep"], "server": ["ok"], "worker": ["ok"]}
    result = harness.run(harness.argv(behaviours, "--timeout-shutdown", "0.5"))
    assert result.returncode == 1, result.dump()
    assert "did not exit within --timeout-shutdown 0.5 s" in result.last_err, result.dump()
    assert "scheduler (pid" in result.last_err, result.dump()
    assert "never calls bps.init()" in result.last_err, result.dump()   # the likely cause
    harness.assert_all_gone(result)


def test_worker_machine_runs_local_size_copies(harness):
    result = harness.run(harness.argv({"worker": ["env", "ok"]}, local=False),
                         {"DMLC_NUM_WORKER": "2", "DMLC_WORKER_ID": "1",
                          "BYTEPS_LOCAL_SIZE": "3"})
    assert result.returncode == 0, result.dump()
    ranks = sorted(line.split("]")[0] + "]" for line in result.lines)
    assert ranks == ["[worker 3]", "[worker 4]", "[worker 5]"], result.dump()


def test_server_machine_runs_the_role_and_ignores_command(harness):
    result = harness.run(harness.argv({"server": ["say:serving", "ok"]}, local=False),
                         {"DMLC_ROLE": "server", "DMLC_NUM_SERVER": "1"})
    assert result.returncode == 0, result.dump()
    assert result.lines == ["[server] serving"], result.dump()
    assert "ignoring the command" in result.stderr


# -- CPU binding ----------------------------------------------------------------------------------
_BINDING_RE = re.compile(r"bpslaunch: worker (\d+) \(local rank (\d+)\) -> CPUs ([\d,-]+), "
                         r"(NUMA node \d+|no NUMA preference) \((numactl|sched_setaffinity)\)"
                         r"(?:, shared)?(?:; .*)?")  # then the thread share (launcher/shares.py)
_PLAN_RE = re.compile(r"bpslaunch: ((scheduler|server \d+|worker \d+ \(local rank \d+\)) -> "
                      r".*|note: .*)")


def bindings(result: Result) -> dict[int, tuple[int, tuple[int, ...], str, str]]:
    """worker rank -> (local rank, CPUs, node text, method) from bpslaunch's binding lines."""
    out = {}
    for line in result.stderr.splitlines():
        m = _BINDING_RE.fullmatch(line)
        if m:
            out[int(m[1])] = (int(m[2]), parse_cpu_list(m[3]), m[4], m[5])
    return out


def affinities(result: Result) -> dict[int, tuple[int, ...]]:
    """worker rank -> the CPUs its process was allowed to run on (/proc/self/status)."""
    out = {}
    for line in result.lines:
        m = re.fullmatch(r"\[worker (\d+)\] AFFINITY ([\d,-]+)", line)
        if m:
            out[int(m[1])] = parse_cpu_list(m[2])
    return out


OWN_CPUS = tuple(sorted(os.sched_getaffinity(0)))


def test_local_workers_run_on_the_cpus_reported(harness):
    result = harness.run(harness.argv({"worker": ["affinity", "ok"]}, "--workers", "2",
                                      "--local-size", "2"))
    assert result.returncode == 0, result.dump()
    bound, seen = bindings(result), affinities(result)
    assert sorted(bound) == sorted(seen) == [0, 1, 2, 3], result.dump()
    for rank, (local_rank, cpus, _node, _method) in bound.items():
        assert local_rank == rank % 2 and seen[rank] == cpus, result.dump()
        assert set(cpus) <= set(OWN_CPUS)
    if len(OWN_CPUS) >= 4:  # thread shares: CPUs of their own, whatever the local rank
        assert all(not set(bound[a][1]) & set(bound[b][1])
                   for a in range(4) for b in range(a + 1, 4)), result.dump()
    else:  # too few: the workers of a local rank share its CPUs
        assert bound[0][1] == bound[2][1] and bound[1][1] == bound[3][1], result.dump()
    if len(OWN_CPUS) >= 2:  # e.g. a 2-CPU machine: one CPU each
        assert not set(bound[0][1]) & set(bound[1][1]), result.dump()
        if len(OWN_CPUS) == 2:
            assert [seen[0], seen[1]] == [OWN_CPUS[:1], OWN_CPUS[1:]], result.dump()


def test_worker_machine_binds_its_local_ranks(harness):
    result = harness.run(harness.argv({"worker": ["affinity", "ok"]}, local=False),
                         {"DMLC_NUM_WORKER": "2", "DMLC_WORKER_ID": "1", "BYTEPS_LOCAL_SIZE": "2"})
    assert result.returncode == 0, result.dump()
    bound, seen = bindings(result), affinities(result)
    assert sorted(bound) == [2, 3] and {r: b[1] for r, b in bound.items()} == seen, \
        result.dump()


def test_no_bind_leaves_the_affinity_alone(harness):
    result = harness.run(harness.argv({"worker": ["affinity", "ok"]}, "--no-bind",
                                      "--local-size", "2"))
    assert result.returncode == 0, result.dump()
    assert bindings(result) == {} and "-> CPUs" not in result.stderr, result.dump()
    assert set(affinities(result).values()) == {OWN_CPUS}, result.dump()


def test_numa_off_and_blacklist(harness):
    if len(OWN_CPUS) < 2:
        pytest.skip("needs two CPUs")
    result = harness.run(harness.argv({"worker": ["affinity", "ok"]}, "--local-size", "2"),
                         {"BYTEPS_NUMA_ON": "0", "BYTEPS_CPU_BLACKLIST": str(OWN_CPUS[-1])})
    assert result.returncode == 0, result.dump()
    assert {b[2:] for b in bindings(result).values()} == {
        ("no NUMA preference", "sched_setaffinity")}, result.dump()
    assert set(affinities(result).values()) == {OWN_CPUS[:-1]}, result.dump()


FAKE_NUMACTL = """\
#!{python}
# Stands in for numactl: records its argv, applies --physcpubind, execs the command.
import os, sys
args = sys.argv[1:]
with open(os.path.join({record!r}, f"numactl-{{os.getpid()}}.json"), "w") as f:
    f.write(__import__("json").dumps(args))
cpus = [a.split("=", 1)[1] for a in args if a.startswith("--physcpubind=")][0]
sys.path.insert(0, {src!r})
from byteps_like.topology import parse_cpu_list
os.sched_setaffinity(0, parse_cpu_list(cpus))
command = args[args.index("--") + 1:]
os.execvp(command[0], command)
"""


def test_numactl_wraps_the_command_when_on_the_path(harness, tmp_path):
    if not discover().numa_known:
        pytest.skip("this machine's sysfs has no NUMA nodes; bpslaunch would not use numactl")
    bin_dir, record = tmp_path / "bin", tmp_path / "numactl-calls"
    bin_dir.mkdir()
    record.mkdir()
    numactl = bin_dir / "numactl"
    src = str(Path(__file__).resolve().parents[2])
    numactl.write_text(FAKE_NUMACTL.format(python=sys.executable, record=str(record), src=src))
    numactl.chmod(0o755)
    result = harness.run(harness.argv({"worker": ["affinity", "ok"]}, "--local-size", "2"),
                         {"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"})
    assert result.returncode == 0, result.dump()
    bound, seen = bindings(result), affinities(result)
    assert {b[3] for b in bound.values()} == {"numactl"}, result.dump()
    assert {r: b[1] for r, b in bound.items()} == seen, result.dump()
    calls = sorted(json.loads(p.read_text())[:3] for p in record.glob("*.json"))
    # with thread shares the scheduler and server run under numactl too (no --membind)
    assert len(calls) == result.stderr.count("(numactl)"), result.dump()
    expected = sorted([f"--physcpubind={format_cpu_list(b[1])}",
                       f"--membind={b[2].split()[-1]}", "--"] for b in bound.values())
    assert [c for c in calls if c[1].startswith("--membind=")] == expected, result.dump()
    # the supervised pid is the command's own: numactl execs it
    assert set(harness.pids()) >= {"worker-0", "worker-1"}


def test_real_numactl(harness):
    # scripts/setup.sh installs numactl: missing, the setup left it out (a failure, not a skip)
    assert shutil.which("numactl"), "numactl is not installed: run bash scripts/setup.sh"
    if not discover().numa_known:
        pytest.skip("this machine's sysfs has no NUMA nodes")
    result = harness.run(harness.argv({"worker": ["affinity", "ok"]}, "--local-size", "2"))
    assert result.returncode == 0, result.dump()
    bound, seen = bindings(result), affinities(result)
    assert {b[3] for b in bound.values()} == {"numactl"}, result.dump()
    assert {r: b[1] for r, b in bound.items()} == seen, result.dump()


def test_supervisor_binds_only_the_child(tmp_path):
    """The launcher's main thread takes the child's mask for the fork only; later children
    and the launcher itself keep theirs."""
    show = [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"]
    out = io.StringIO()
    sup = Supervisor(stdout=out, stderr=io.StringIO())
    try:
        bound = sup.start("bound", show, dict(os.environ), cpus=OWN_CPUS[:1])
        assert os.sched_getaffinity(0) == set(OWN_CPUS)
        free = sup.start("free", show, dict(os.environ))
        for child in (bound, free):
            child.popen.wait(30)
            child.join_pumps(5)
    finally:
        sup.close()
    lines = sorted(out.getvalue().splitlines())
    assert lines == [f"[bound] {list(OWN_CPUS[:1])}", f"[free] {list(OWN_CPUS)}"]
