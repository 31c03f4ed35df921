"""Smoke tests of ``python -m byteps_like.bench``: tiny sizes, real processes on loopback.

Each run is a subprocess in its own session under a watchdog: on a hang the whole process group
is killed and the test fails with everything the benchmark printed.
"""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

COLUMNS = ["size", "bps time ms", "bps GB/s", "raw zmq GB/s", "bps/raw", "gloo GB/s", "bps/gloo"]
HAS_TORCH = importlib.util.find_spec("torch") is not None


def bench(*args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "byteps_like.bench", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, stdin=subprocess.DEVNULL)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # SIGTERM first: the benchmark then kills its own children's process groups
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        pytest.fail(f"watchdog: {' '.join(cmd)} hung for {timeout} s and was killed\n"
                    f"--- stdout ---\n{out}\n--- stderr ---\n{err}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def dump(r: subprocess.CompletedProcess) -> str:
    return f"exit {r.returncode}\n--- stdout ---\n{r.stdout}\n--- stderr ---\n{r.stderr}"


def parse_table(stdout: str) -> list[dict[str, str]]:
    lines = [ln for ln in stdout.splitlines() if ln.startswith("|")]
    assert len(lines) >= 3, stdout
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header == COLUMNS, header
    assert set(lines[1]) <= set("|-:"), lines[1]
    return [dict(zip(header, (c.strip() for c in ln.strip("|").split("|")))) for ln in lines[2:]]


def numeric(row: dict[str, str], *cols: str) -> None:
    for c in cols:
        value = float(row[c])  # raises on n/a or garbage
        assert value > 0, (c, row)


def test_pushpull_smoke_without_gloo(tmp_path):
    out = tmp_path / "bench.json"
    r = bench("pushpull", "--sizes", "64K,1M", "--repeats", "1", "--warmup", "0",
              "--skip-gloo", "--json", str(out))
    assert r.returncode == 0, dump(r)
    rows = parse_table(r.stdout)
    assert [row["size"] for row in rows] == ["64KiB", "1MiB"], r.stdout
    for row in rows:
        numeric(row, "bps time ms", "bps GB/s", "raw zmq GB/s", "bps/raw")
        assert row["gloo GB/s"] == "n/a" and row["bps/gloo"] == "n/a", row
    assert "command: python -m byteps_like.bench pushpull" in r.stdout
    assert "nproc=" in r.stdout and "pyzmq" in r.stdout
    assert "[pushpull] byteps_like: done" in r.stderr, r.stderr
    data = json.loads(out.read_text())
    assert [x["nbytes"] for x in data["results"]] == [65536, 1 << 20]
    assert data["results"][0]["bps"]["median_s"] > 0 and data["results"][0]["gloo"] is None


@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
def test_pushpull_smoke_with_gloo():
    r = bench("pushpull", "--sizes", "64K", "--repeats", "2", "--warmup", "1",
              "--workers", "2", "--servers", "1", timeout=180)
    assert r.returncode == 0, dump(r)
    (row,) = parse_table(r.stdout)
    assert row["size"] == "64KiB"
    numeric(row, *COLUMNS[1:])


def test_pushpull_child_failure_exits_nonzero_with_its_stderr():
    # 100-byte partitions are below BYTEPS_PARTITION_BYTES's minimum: every role refuses to start
    r = bench("pushpull", "--sizes", "64K", "--repeats", "1", "--warmup", "0", "--skip-gloo",
              "--partition-bytes", "100", timeout=60)
    assert r.returncode != 0, dump(r)
    assert "byteps_like failed" in r.stderr and "BYTEPS_PARTITION_BYTES" in r.stderr, dump(r)
    assert not any(ln.startswith("|") for ln in r.stdout.splitlines()), r.stdout


def test_bench_dispatcher():
    r = bench("nonsense", timeout=30)
    assert r.returncode == 2 and "unknown benchmark 'nonsense'" in r.stderr, dump(r)
    r = bench("--help", timeout=30)
    assert r.returncode == 0 and "pushpull" in r.stdout and "sum" in r.stdout, dump(r)
    r = bench("pushpull", "--help", timeout=30)
    assert r.returncode == 0 and "--partition-bytes" in r.stdout, dump(r)
    if importlib.util.find_spec("byteps_like.bench.summation") is not None:
        r = bench("sum", "--help", timeout=30)
        assert r.returncode == 0, dump(r)


# --------------------------------------------------------------------------------------------
# Children find the parent's byteps_like, from any install (bench/_procs.py, bench/_role.py)
# --------------------------------------------------------------------------------------------

def test_child_env_prepends_the_package_root(monkeypatch):
    from byteps_like.bench import _procs
    monkeypatch.setattr(_procs, "package_root", lambda: "/src/tree")
    monkeypatch.setattr(_procs, "_automatic_paths", lambda: set())
    assert _procs.child_env({})["PYTHONPATH"] == "/src/tree"
    env = _procs.child_env({"PYTHONPATH": f"/a{os.pathsep}/src/tree{os.pathsep}/b", "X": "1"})
    assert env["PYTHONPATH"] == os.pathsep.join(["/src/tree", "/a", "/b"]) and env["X"] == "1"
    # a site-packages folder stays where the interpreter puts it (after the standard library)
    monkeypatch.setattr(_procs, "_automatic_paths", lambda: {os.path.realpath("/src/tree")})
    assert "PYTHONPATH" not in _procs.child_env({})
    assert _procs.child_env({}, always=True)["PYTHONPATH"] == "/src/tree"


def _copy_tree(dst, layout: str):
    """A copy of the imported byteps_like: 'source' puts server/, scheduler/, launcher/ next to
    byteps_like/ (a source tree, no install); 'wheel' inside it (what pip installs). The roles'
    __init__.py note where they were imported from in $BPSL_TEST_ROLE_LOG."""
    import shutil

    from byteps_like.bench._procs import package_root
    root = package_root()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(os.path.join(root, "byteps_like"), dst / "byteps_like", ignore=ignore)
    for role in ("server", "scheduler", "launcher"):
        src = importlib.util.find_spec(f"byteps_like.{role}").submodule_search_locations[0]
        target = dst / role if layout == "source" else dst / "byteps_like" / role
        shutil.copytree(src, target, ignore=ignore)
        with open(target / "__init__.py", "a", encoding="utf-8") as f:
            f.write("\nimport os as _o\nif _o.environ.get('BPSL_TEST_ROLE_LOG'):\n"
                    "    with open(_o.environ['BPSL_TEST_ROLE_LOG'], 'a') as _f:\n"
                    "        _f.write(f'{__name__} {__file__}\\n')\n")


@pytest.mark.parametrize("how", ["source-cwd", "source-pythonpath", "wheel"])
def test_pushpull_from_a_copy_runs_that_copys_roles(tmp_path, how):
    """The benchmark run from another tree than the editable install of this environment: a bare
    source tree (as the current folder, or on PYTHONPATH), and a wheel-like install. Every role
    must come from that tree, not from the editable install's mapping."""
    layout = "wheel" if how == "wheel" else "source"
    tree = tmp_path / "tree"
    _copy_tree(tree, layout)
    log = tmp_path / "roles.log"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["BPSL_TEST_ROLE_LOG"] = str(log)
    cwd = tree if how == "source-cwd" else tmp_path
    if how != "source-cwd":
        env["PYTHONPATH"] = str(tree)
    probe = subprocess.run(
        [sys.executable, "-c", "import byteps_like; from byteps_like.bench._procs import "
         "role_argv; print(byteps_like.__file__); print(' '.join(role_argv('server')[1:]))"],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
    assert probe.returncode == 0, probe.stderr
    where, argv = probe.stdout.splitlines()
    assert where == str(tree / "byteps_like" / "__init__.py"), where
    assert argv == ("-m byteps_like.server" if layout == "wheel"
                    else "-m byteps_like.bench._role server"), argv
    cmd = [sys.executable, "-m", "byteps_like.bench", "pushpull", "--sizes", "64K",
           "--repeats", "1", "--warmup", "0", "--workers", "1", "--servers", "1",
           "--skip-gloo", "--skip-raw"]
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=120,
                       stdin=subprocess.DEVNULL, start_new_session=True)
    assert r.returncode == 0, dump(r)
    assert "64KiB" in r.stdout
    seen = log.read_text().splitlines()
    assert {ln.split()[0] for ln in seen} == {"byteps_like.scheduler", "byteps_like.server"}
    for line in seen:
        assert line.split()[1].startswith(str(tree)), seen


def test_role_entry_point_says_why_it_cannot_run(tmp_path):
    """A byteps_like without its roles (neither inside nor next to it) and no install to fall
    back on (-S: no site-packages, so no editable finder): exit 2 with the reason."""
    import shutil

    from byteps_like.bench._procs import package_root
    shutil.copytree(os.path.join(package_root(), "byteps_like"), tmp_path / "byteps_like",
                    ignore=shutil.ignore_patterns("__pycache__"))
    r = subprocess.run([sys.executable, "-m", "byteps_like.bench._role", "bogus"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "usage" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-S", "-m", "byteps_like.bench._role", "server"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "byteps_like.server is not importable" in r.stderr and "pip install" in r.stderr
