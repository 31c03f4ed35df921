"""Installs that explain themselves: without the compiled ``_core`` the pure-Python parts work
and the first use that needs it says how to rebuild; the launcher's roles are not shadowed by a
byteps_like source tree in the working directory. (The wheel itself, and a build without a
compiler: tests/integration/test_packaging.py.)"""
from __future__ import annotations

import shutil
import site
import subprocess
import sys
from pathlib import Path

from byteps_like.launcher.plan import role_argv

REPO = Path(__file__).resolve().parents[2]
SCRIPT = """
import sys
import byteps_like, byteps_like.config as config
assert byteps_like.__file__.startswith(sys.argv[1]), byteps_like.__file__
config.load(env={})                       # what the launcher needs: no _core
try:
    byteps_like.init()
except ImportError as exc:
    print(exc)
else:
    raise SystemExit("init() without _core did not raise")
"""


def _tree_without_core(dest: Path) -> Path:
    """A copy of the package's Python sources, no compiled extension."""
    shutil.copytree(REPO / "byteps_like", dest / "byteps_like",
                    ignore=shutil.ignore_patterns("*.so", "*.pyd", "__pycache__"))
    return dest


def _run_without_core(tree: Path, *more_path: Path) -> subprocess.CompletedProcess:
    # -S: no site processing, so the editable install's finder cannot hand out this checkout's
    # _core; numpy and pyzmq come from site-packages as a plain path
    path = [str(tree), *map(str, more_path), *site.getsitepackages()]
    return subprocess.run([sys.executable, "-S", "-P", "-c", SCRIPT, str(tree)], cwd=tree,
                          env={"PYTHONPATH": ":".join(path), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=120)


def test_without_core_import_and_config_work_and_init_says_how_to_rebuild(tmp_path):
    p = _run_without_core(_tree_without_core(tmp_path / "src"))
    assert p.returncode == 0, p.stderr
    msg = p.stdout
    assert "byteps_like._core" in msg and "never built" in msg, msg
    assert "pip install -e ." in msg and "bash scripts/setup.sh" in msg, msg
    assert "C++17 compiler" in msg, msg


def test_without_core_a_shadowed_install_is_named(tmp_path):
    """A source tree without a build in front of an installed byteps_like that has one."""
    tree = _tree_without_core(tmp_path / "src")
    installed = tmp_path / "site" / "byteps_like"
    installed.mkdir(parents=True)
    (installed / "_core.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")
    p = _run_without_core(tree, tmp_path / "site")
    assert p.returncode == 0, p.stderr
    assert "shadows the byteps_like installed at" in p.stdout, p.stdout
    assert str(installed) in p.stdout and "Run from another directory" in p.stdout, p.stdout


def test_roles_ignore_a_byteps_like_tree_in_the_working_directory(tmp_path):
    """bpslaunch run from a source tree's root with a non-editable install: the tree's
    byteps_like/ (no scheduler/ inside, maybe no _core) must not shadow the install."""
    (tmp_path / "byteps_like").mkdir()
    (tmp_path / "byteps_like" / "__init__.py").write_text("raise SystemExit('shadowed')\n")
    for role in ("scheduler", "server"):
        p = subprocess.run([*role_argv(role), "--help"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=120, stdin=subprocess.DEVNULL)
        assert p.returncode == 0 and "shadowed" not in p.stderr, (role, p.stderr)
        assert f"python -m byteps_like.{role}" in p.stdout, p.stdout


def test_an_editable_install_keeps_its_core_in_its_environment_not_in_the_tree():
    """One build per environment: .venv and .venv-mxnet are installed editable from one tree,
    so a build in the tree would be shared, and replaced by whichever installed last."""
    import byteps_like
    from byteps_like import _core
    from byteps_like._native import CORE_DIR, _cores_in, environment_core_dir
    pkg = str(REPO / "byteps_like")
    own = environment_core_dir(pkg)
    assert own is not None, f"no {CORE_DIR}/ for {pkg} on sys.path: not installed editable here?"
    assert Path(own).parent in map(Path, site.getsitepackages()), own
    assert Path(_core.__file__).parent == Path(own), _core.__file__
    assert byteps_like.__path__[0] == own
    assert _cores_in(pkg) == [], "a build in the source tree would be shared by environments"


def test_the_first_build_on_the_path_for_this_tree_is_the_one_loaded(tmp_path):
    """Environments see each other's site-packages (a worktree's .venv through a .pth line):
    a build for another source tree is passed over, the first one for this tree is loaded."""
    from byteps_like import _core
    from byteps_like._native import CORE_DIR
    real = Path(_core.__file__)
    sites = []
    for name, source in (("other", tmp_path / "elsewhere" / "byteps_like"),
                         ("mine", REPO / "byteps_like"), ("later", REPO / "byteps_like")):
        d = tmp_path / name / CORE_DIR
        d.mkdir(parents=True)
        (d / "SOURCE").write_text(f"{source}\n")
        shutil.copy(real, d / real.name)
        sites.append(d.parent)
    code = ("import byteps_like._core as c, byteps_like._native as n; print(c.__file__); "
            "print(n.environment_core_dir(n.os.path.dirname(n.__file__)))")
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120,
                       env={"PYTHONPATH": ":".join(map(str, sites)), "PATH": "/usr/bin:/bin"})
    assert p.returncode == 0, p.stderr
    loaded, found = p.stdout.split()
    assert loaded == str(sites[1] / CORE_DIR / real.name), p.stdout
    assert found == str(sites[1] / CORE_DIR), p.stdout
