"""The wheel as users get it: built by the package's own build, installed into a fresh virtual
environment, used from outside the source tree."""
from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def sh(*cmd, cwd=None, timeout=600, env=None):
    p = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True,
                       timeout=timeout, env=env)
    assert p.returncode == 0, f"{cmd}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p.stdout


def test_wheel_installs_one_namespace_and_runs(tmp_path):
    sh(sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", tmp_path / "dist", ROOT)
    wheel = next((tmp_path / "dist").glob("byteps_like-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"byteps_like", wheel.name.split("-")[0] + "-" + wheel.name.split("-")[1]
                    + ".dist-info"}, tops
    for must in ("byteps_like/server/core.py", "byteps_like/scheduler/core.py",
                 "byteps_like/launcher/cli.py", "byteps_like/_core.pyi",
                 "byteps_like/torch/__init__.py", "byteps_like/topology.py"):
        assert must in names
    assert any(n.startswith("byteps_like/_core.") and n.endswith(".so") for n in names)

    venv = tmp_path / "venv"
    sh(sys.executable, "-m", "venv", venv)
    py = venv / "bin" / "python"
    sh(py, "-m", "pip", "install", "-q", "--disable-pip-version-check", wheel, timeout=900)
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DMLC_", "BYTEPS_", "PYTHONPATH"))}
    sh(py, "-c", "import importlib.util as u, byteps_like._core, byteps_like.server, "
       "byteps_like.scheduler, byteps_like.launcher\n"
       "assert all(u.find_spec(m) is None for m in ('server', 'scheduler', 'launcher'))\n"
       f"import byteps_like; assert byteps_like.__file__.startswith({str(venv)!r})",
       cwd=work, env=env)
    script = work / "job.py"
    script.write_text("import numpy as np, byteps_like as bps\nbps.init()\n"
                      "s = bps.push_pull(np.ones(3, np.int64), name='x', average=False)\n"
                      "assert s.tolist() == [2, 2, 2], s\nprint('SUM', s.tolist())\n"
                      "bps.shutdown()\n")
    # from any folder, the repository root included: there the source tree's byteps_like/
    # (without scheduler/ and server/, which the install maps in) must not shadow the install
    for cwd in (work, ROOT):
        out = sh(venv / "bin" / "bpslaunch", "--local", "--workers", "2", "--servers", "1",
                 "--timeout", "120", "--", py, script, cwd=cwd, env=env, timeout=180)
        assert out.count("SUM [2, 2, 2]") == 2, (cwd, out)


def test_a_build_without_a_compiler_says_what_to_install(tmp_path):
    env = {**os.environ, "CC": "/nonexistent/gcc", "CXX": "/nonexistent/g++"}
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", tmp_path, ROOT],
                       capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode != 0
    out = p.stdout + p.stderr
    line = next((ln for ln in out.splitlines() if "needs a C++17 compiler" in ln), None)
    assert line is not None, out[-3000:]
    assert "Python headers" in line and "apt-get install g++ python3-dev" in line, line
    assert "/nonexistent/g++" in line, line
