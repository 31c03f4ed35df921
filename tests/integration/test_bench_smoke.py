"""Smoke tests of ``python -m byteps_like.bench``: tiny sizes, real processes on loopback.

Each run is a subprocess in its own session under a watchdog: on a hang the whole process group
is killed and the test fails with everything the benchmark printed.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from .bench_run import bench, dump, parse_table

pytestmark = pytest.mark.integration

COLUMNS = ["size", "bps time ms", "bps GB/s", "server core-s/GB", "raw zmq GB/s", "bps/raw",
           "gloo GB/s", "bps/gloo"]
HAS_TORCH = importlib.util.find_spec("torch") is not None


def numeric(row: dict[str, str], *cols: str) -> None:
    for c in cols:
        value = float(row[c])  # raises on n/a or garbage
        assert value > 0, (c, row)


def test_pushpull_smoke_without_gloo(tmp_path):
    out = tmp_path / "bench.json"
    r = bench("pushpull", "--sizes", "64K,1M", "--repeats", "1", "--warmup", "0",
              "--skip-gloo", "--json", str(out))
    assert r.returncode == 0, dump(r)
    rows = parse_table(r.stdout, COLUMNS)
    assert [row["size"] for row in rows] == ["64KiB", "1MiB"], r.stdout
    for row in rows:
        numeric(row, "bps time ms", "bps GB/s", "raw zmq GB/s", "bps/raw")
        assert row["gloo GB/s"] == "n/a" and row["bps/gloo"] == "n/a", row
        # the servers' CPU over the timed windows: measured (CPU time moves in 10 ms ticks, so
        # a tiny size's may be 0)
        assert float(row["server core-s/GB"]) >= 0, row
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
    (row,) = parse_table(r.stdout, COLUMNS)
    assert row["size"] == "64KiB"
    numeric(row, *(c for c in COLUMNS[1:] if c != "server core-s/GB"))
    assert float(row["server core-s/GB"]) >= 0, row


def test_pushpull_shapes_compares_the_model_with_one_flat_tensor():
    r = bench("pushpull", "--shapes", "resnet50", "--workers", "2", "--servers", "1",
              "--repeats", "1", "--warmup", "0", timeout=300)
    assert r.returncode == 0, dump(r)
    (row,) = parse_table(r.stdout, ["model", "tensors", "bytes", "shapes ms", "flat ms",
                                    "flat/shapes"])
    assert (row["model"], row["tensors"], row["bytes"]) == ("resnet50", "161", "97.5 MiB"), row
    numeric(row, "shapes ms", "flat ms", "flat/shapes")
    assert "plan: worker 0 (local rank 0) -> " in r.stdout, r.stdout


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
# bench cluster --rate LIST (pure functions: no namespaces, no root)
# --------------------------------------------------------------------------------------------

def test_cluster_rate_list_parsing():
    import argparse

    from byteps_like.bench.cluster import build_parser, fmt_cap, parse_rates
    assert parse_rates("10gbit,25gbit,50gbit") == [10e9, 25e9, 50e9]
    assert parse_rates("1gbit") == [1e9]
    assert parse_rates(" 400mbit , 1gbit,400mbit") == [400e6, 1e9]   # order kept, repeats dropped
    assert parse_rates("2.5gbit,100m") == [2.5e9, 100e6]
    for bad in ("", ",", "10gbit,", "10gbit,,25gbit", "fast", "10gbit,500kbit"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_rates(bad)
    p = build_parser()
    assert p.parse_args([]).rate == [1e9]
    assert p.parse_args(["--rate", "400mbit"]).rate == [400e6]
    assert p.parse_args(["--rate", "10gbit,25gbit,50gbit"]).rate == [10e9, 25e9, 50e9]
    with pytest.raises(SystemExit):
        p.parse_args(["--rate", "10gbit,x"])
    assert fmt_cap(25e9) == "25 Gbit/s" and fmt_cap(400e6) == "400 Mbit/s"


def _cluster_records(cap: float, link: float, scale: float) -> list[dict]:
    from byteps_like.bench.cluster import allreduce_time, ps_time
    S = 16 << 20
    base = {"bytes": S, "link_bits_per_second": link, "cap_bits_per_second": cap}
    return [
        {"system": "byteps_like", "n": 2, "k": 0, "seconds": 1.0 * scale,
         "theory_seconds": ps_time(2, 0, S, link), **base},
        {"system": "byteps_like", "n": 2, "k": 2, "seconds": 0.9 * scale,
         "theory_seconds": ps_time(2, 2, S, link), **base},
        {"system": "gloo", "n": 2, "k": None, "seconds": 1.2 * scale,
         "theory_seconds": allreduce_time(2, S, link), **base},
        {"system": "theory", "n": 2, "k": 0, "seconds": 0.5, "model": "ps", **base},
    ]


def test_cluster_table_has_a_row_per_rate():
    from byteps_like.bench.cluster import format_table
    records = _cluster_records(10e9, 9.4e9, 1.0) + _cluster_records(25e9, 20e9, 0.5)
    lines = format_table(records, by_rate=True).splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header == ["system", "n", "k", "size", "cap", "B Gbit/s", "time s", "theory s",
                      "of optimum", "vs gloo", "server core-s/GB"]
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:]]
    # 3 measured systems/configurations x 2 rates; theory records are not rows
    assert [(r[0], r[2], r[4]) for r in rows] == [
        ("byteps_like", "0", "10 Gbit/s"), ("byteps_like", "0", "25 Gbit/s"),
        ("byteps_like", "2", "10 Gbit/s"), ("byteps_like", "2", "25 Gbit/s"),
        ("gloo", "-", "10 Gbit/s"), ("gloo", "-", "25 Gbit/s")]
    assert [r[5] for r in rows[:2]] == ["9.400", "20.000"]
    # "vs gloo" compares with gloo at the same rate
    assert rows[0][9] == "1.20x" and rows[1][9] == "1.20x" and rows[4][9] == "1.00x"
    # one rate: the table of earlier versions, no rate columns
    single = format_table(_cluster_records(1e9, 0.95e9, 1.0)).splitlines()[0]
    assert [c.strip() for c in single.strip("|").split("|")] == [
        "system", "n", "k", "size", "time s", "theory s", "of optimum", "vs gloo",
        "server core-s/GB"]


def test_cluster_compression_ratios_are_per_rate():
    from byteps_like.bench.cluster import add_ratios, format_compression_table
    recs = []
    for cap, t in ((1e9, 1.0), (10e9, 0.25)):
        for comp, f in (("none", 1.0), ("fp16", 0.5)):
            recs.append({"system": "byteps_like_compressed", "compressor": comp,
                         "setting": comp, "n": 2, "k": 2, "bytes": 4 << 20, "seconds": t * f,
                         "wire_bytes_per_step": 8e6 * f, "algbw_bits_per_second": 1e9,
                         "floor_seconds": 0.1, "link_bits_per_second": cap * 0.95,
                         "cap_bits_per_second": cap})
    add_ratios(recs)
    assert [r["time_ratio"] for r in recs] == [1.0, 0.5, 1.0, 0.5]
    lines = format_compression_table(recs, by_rate=True).splitlines()
    assert "cap" in lines[0] and len(lines) == 2 + 4
    assert "10 Gbit/s" in lines[3] and "fp16" in lines[4]   # one compressor's rates together


# --------------------------------------------------------------------------------------------
# Children find the parent's byteps_like, from any install (bench/harness.py, bench/_role.py)
# --------------------------------------------------------------------------------------------

def test_child_env_prepends_the_package_root(monkeypatch):
    from byteps_like.bench import harness
    monkeypatch.setattr(harness, "package_root", lambda: "/src/tree")
    monkeypatch.setattr(harness, "_automatic_paths", lambda: set())
    assert harness.child_env({})["PYTHONPATH"] == "/src/tree"
    env = harness.child_env({"PYTHONPATH": f"/a{os.pathsep}/src/tree{os.pathsep}/b", "X": "1"})
    assert env["PYTHONPATH"] == os.pathsep.join(["/src/tree", "/a", "/b"]) and env["X"] == "1"
    # a site-packages folder stays where the interpreter puts it (after the standard library)
    monkeypatch.setattr(harness, "_automatic_paths", lambda: {os.path.realpath("/src/tree")})
    assert "PYTHONPATH" not in harness.child_env({})
    assert harness.child_env({}, always=True)["PYTHONPATH"] == "/src/tree"


def _copy_tree(dst, layout: str):
    """A copy of the imported byteps_like: 'source' puts server/, scheduler/, launcher/ next to
    byteps_like/ (a source tree, no install); 'wheel' inside it (what pip installs). The roles'
    __init__.py note where they were imported from in $BPSL_TEST_ROLE_LOG."""
    import shutil

    from byteps_like.bench.harness import package_root
    root = package_root()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(os.path.join(root, "byteps_like"), dst / "byteps_like", ignore=ignore)
    # the compiled part: this environment's build (kept in its site-packages for an editable
    # install, which names the tree it was built for), inside the copy as a wheel has it
    import byteps_like._core as core
    shutil.copy2(core.__file__, dst / "byteps_like" / os.path.basename(core.__file__))
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
        [sys.executable, "-c", "import byteps_like; from byteps_like.bench.harness import "
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
    # the benchmark itself runs on the launcher's plan and supervisor: that tree's too
    assert {ln.split()[0] for ln in seen} == {"byteps_like.scheduler", "byteps_like.server",
                                              "byteps_like.launcher"}
    for line in seen:
        assert line.split()[1].startswith(str(tree)), seen


def test_role_entry_point_says_why_it_cannot_run(tmp_path):
    """A byteps_like without its roles (neither inside nor next to it) and no install to fall
    back on (-S: no site-packages, so no editable finder): exit 2 with the reason."""
    import shutil

    from byteps_like.bench.harness import package_root
    shutil.copytree(os.path.join(package_root(), "byteps_like"), tmp_path / "byteps_like",
                    ignore=shutil.ignore_patterns("__pycache__"))
    r = subprocess.run([sys.executable, "-m", "byteps_like.bench._role", "bogus"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "usage" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-S", "-m", "byteps_like.bench._role", "server"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "byteps_like.server is not importable" in r.stderr and "pip install" in r.stderr


# --------------------------------------------------------------------------------------------
# The toolkit the benchmarks share (bench/harness.py, bench/report.py)
# --------------------------------------------------------------------------------------------

def test_size_options_read_as_the_config_does():
    import argparse

    from byteps_like.bench.gil import parse_mib
    from byteps_like.bench.report import size_arg, size_list
    from byteps_like.config import parse_size
    assert size_list("64K, 4MiB,1MB,4096") == [64 << 10, 4 << 20, 10**6, 4096]
    assert [size_arg(t) for t in ("1.5M", "2g")] == [parse_size("1.5M"), 2 << 30]
    assert parse_mib("4") == 4 << 20 and parse_mib("256K") == 256 << 10
    for bad, kw in (("4x", {}), ("0.3", {}), ("0", {}), ("6", {"multiple": 4}),
                    ("4", {"minimum": 8})):
        with pytest.raises(argparse.ArgumentTypeError, match=repr(bad)):
            size_arg(bad, **kw)
    with pytest.raises(ValueError, match="'4x' is not a size: use bytes or a suffix"):
        parse_size("4x")


def test_markdown_table_aligns_and_checks_rows():
    from byteps_like.bench.report import markdown_table
    assert markdown_table(("name", "n"), [("a", "10"), ("bcd", "2")], left=1).splitlines() == [
        "| name |  n |", "|------|---:|", "| a    | 10 |", "| bcd  |  2 |"]
    with pytest.raises(ValueError, match="a row of 1 cells in a table of 2 columns"):
        markdown_table(("name", "n"), [("a",)])


def test_free_port_is_bindable_and_a_taken_port_is_refused():
    import socket

    from byteps_like.bench.harness import free_port, free_ports
    from byteps_like.launcher.procs import free_port as launcher_free_port
    assert free_port is launcher_free_port   # one port picker for bpslaunch and the benchmarks
    ports = free_ports(3)
    assert len(set(ports)) == 3
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[0]))
        s.listen(1)
        with pytest.raises(OSError):
            free_port("127.0.0.1", ports[0])


def test_job_collects_results_reports_a_failed_child_and_stops_the_rest(capsys):
    import io

    from byteps_like.bench.harness import ChildFailed, Job, collect
    log = io.StringIO()
    with Job("unit", log=log) as job:
        sleeper = job.spawn("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"],
                            dict(os.environ), service=True)
        ok = job.spawn("ok", [sys.executable, "-c", "from byteps_like.bench.report import "
                              "emit, progress; progress('half way'); emit({'x': 1})"],
                       dict(os.environ))
        job.wait(60, relay=ok, relay_prefix="[unit] ", service_grace=0.2)
        assert collect([ok], "unit") == [{"x": 1}]
        assert "[unit] half way" in log.getvalue() and "sleeper still running" in log.getvalue()
        bad = job.spawn("bad", [sys.executable, "-c", "import sys; print('boom', "
                                "file=sys.stderr); sys.exit(3)"], dict(os.environ))
        with pytest.raises(ChildFailed) as exc:
            job.wait(60)
        assert "bad exited with status 3" in str(exc.value) and "boom" in str(exc.value)
        assert bad.poll() == 3 and sleeper.poll() is None
    assert sleeper.poll() is not None   # leaving the block stopped the service
    assert capsys.readouterr().out == ""   # the children's output is not echoed



def test_job_reads_a_port_file_once_written_or_names_a_child_that_exited():
    from byteps_like.bench.harness import ChildFailed, Job
    with Job("unit") as job:
        path = os.path.join(job.dir, "port")
        writer = job.spawn("writer", [sys.executable, "-c", "import sys, time; time.sleep(0.3); "
                                      "open(sys.argv[1], 'w').write('1234\\n'); time.sleep(60)",
                                      path], dict(os.environ), service=True)
        assert job.read_when_written(writer, path, "the writer") == "1234"
        gone = job.spawn("gone", [sys.executable, "-c", "pass"], dict(os.environ),
                         service=True)
        with pytest.raises(ChildFailed, match="the rendezvous exited"):
            job.read_when_written(gone, os.path.join(job.dir, "never"), "the rendezvous")

def test_bench_modules_import_no_private_names_of_each_other():
    import ast
    import pathlib

    import byteps_like.bench
    bad = []
    for path in pathlib.Path(byteps_like.bench.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level:
                bad += [f"{path.name}: {a.name}" for a in node.names if a.name.startswith("_")]
    assert not bad, bad
