"""ARCHITECTURE.md section 2 as a test: who may import whom, and who may read the environment.

The source files are parsed with ``ast`` (imports inside functions count too); nothing is
imported except in the tests that check the installed package's namespace.
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
import pathlib
import re
import subprocess
import sys
from dataclasses import dataclass

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]

# repository folder -> installed package name
ROOTS = {"byteps_like": "byteps_like", "server": "byteps_like.server",
         "scheduler": "byteps_like.scheduler", "launcher": "byteps_like.launcher"}
FRAMEWORKS = {"torch", "torchvision", "tensorflow", "keras", "tf_keras", "mxnet", "jax", "jaxlib",
              "flax", "ray", "lightning", "pytorch_lightning", "lightning_fabric"}
# plugin folder -> the frameworks it may import (Horovod's keras plugin also imports tensorflow)
PLUGINS = {"torch": {"torch"}, "tensorflow": {"tensorflow"},
           "keras": {"keras", "tf_keras", "tensorflow"}, "mxnet": {"mxnet"},
           "ray": {"ray", "torch"}, "lightning": {"lightning", "torch"}}
PLUGIN_MODULES = tuple(f"byteps_like.{p}" for p in PLUGINS)
# Top-level modules that belong to the worker side although they sit beside the shared ones:
# the trace tool (``python -m byteps_like.trace``), the Keras code both Keras plugins share, and
# the package's lazy facade (``byteps_like.push_pull`` loads byteps_like.worker.api on first use).
WORKER_TOOLS = {"byteps_like/trace.py", "byteps_like/_keras.py", "byteps_like/__init__.py",
                "byteps_like/elastic.py"}
WORKER_SIDE = ("byteps_like.worker", "byteps_like.trace", "byteps_like._keras", "byteps_like.bench",
               *PLUGIN_MODULES)
STDLIB = set(sys.stdlib_module_names) | {"__future__"}


@dataclass(frozen=True)
class Source:
    path: pathlib.Path
    rel: str          # e.g. "server/core.py"
    module: str       # installed dotted name, e.g. "byteps_like.server.core"
    package: str      # the package relative imports resolve against
    tree: ast.Module

    @property
    def area(self) -> str:
        """shared | worker | tool | bench | plugin:<name> | server | scheduler | launcher"""
        top, *rest = self.rel.split("/")
        if top != "byteps_like":
            return top
        if rest and rest[0] == "bench":
            return "bench"
        if rest and rest[0] in PLUGINS and len(rest) > 1:
            return f"plugin:{rest[0]}"
        if rest and rest[0] == "worker":
            return "worker"
        if self.rel in WORKER_TOOLS:
            return "tool"
        return "shared"

    @property
    def core(self) -> bool:
        """Framework-neutral: shared modules, the worker package and the worker tools."""
        return self.area in ("shared", "worker", "tool")


def _load_sources() -> list[Source]:
    out = []
    for folder, pkg in ROOTS.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            rel_in = path.relative_to(REPO / folder)
            parts = list(rel_in.with_suffix("").parts)
            is_init = parts[-1] == "__init__"
            if is_init:
                parts = parts[:-1]
            module = ".".join([pkg, *parts])
            package = module if is_init else module.rpartition(".")[0]
            out.append(Source(path, path.relative_to(REPO).as_posix(), module, package,
                              ast.parse(path.read_text(), str(path))))
    return out


SOURCES = _load_sources()


def _resolve(src: Source, level: int, module: str | None) -> str:
    if not level:
        return module or ""
    parts = src.package.split(".")
    if level - 1 > len(parts) - 1:
        raise AssertionError(f"{src.rel}: relative import beyond the top-level package")
    base = ".".join(parts[:len(parts) - (level - 1)])
    return f"{base}.{module}" if module else base


def imported_names(src: Source) -> list[tuple[int, str]]:
    """(line, fully qualified name) of everything ``src`` imports, statically or through
    importlib.import_module / __import__ with a constant name. ``from X import a`` yields X.a."""
    found = []
    for node in ast.walk(src.tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(src, node.level, node.module)
            found += [(node.lineno, f"{base}.{a.name}" if a.name != "*" else base)
                      for a in node.names]
        elif isinstance(node, ast.Call) and node.args:
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", None)
            arg = node.args[0]
            if name in ("import_module", "__import__") and isinstance(arg, ast.Constant) \
                    and isinstance(arg.value, str):
                target = arg.value
                if target.startswith("."):
                    level = len(target) - len(target.lstrip("."))
                    target = _resolve(src, level, target.lstrip(".") or None)
                found.append((node.lineno, target))
    return found


def _top(name: str) -> str:
    return name.split(".")[0]


def _is_plugin(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in PLUGIN_MODULES)


def _report(violations: list[str], rule: str) -> None:
    assert not violations, f"{rule}:\n  " + "\n  ".join(violations)


def _sources(*areas: str) -> list[Source]:
    return [s for s in SOURCES if s.area in areas or
            any(a.endswith(":*") and s.area.startswith(a[:-1]) for a in areas)]


# ------------------------------------------------------------------------------ sanity
def test_the_walk_sees_every_layer():
    areas = {s.area for s in SOURCES}
    assert {"shared", "worker", "tool", "server", "scheduler", "launcher"} <= areas
    mods = {s.module for s in SOURCES}
    assert {"byteps_like.wire", "byteps_like.transport.zmq_transport", "byteps_like.server.core",
            "byteps_like.scheduler.core", "byteps_like.launcher"} <= mods


def test_relative_imports_resolve_into_the_installed_namespace():
    server_core = next(s for s in SOURCES if s.rel == "server/core.py")
    names = {n for _, n in imported_names(server_core)}
    assert "byteps_like.config.Config" in names  # from ..config import Config


# ------------------------------------------------------------------------------ import rules
def test_core_imports_no_framework_and_no_plugin():
    bad = []
    for src in (s for s in SOURCES if s.core):
        for line, name in imported_names(src):
            if _top(name) in FRAMEWORKS:
                bad.append(f"{src.rel}:{line} imports framework {name}")
            elif _is_plugin(name):
                bad.append(f"{src.rel}:{line} imports plugin {name}")
    _report(bad, "core modules must import no deep-learning framework and no plugin")


@pytest.mark.parametrize("area", ["server", "scheduler"])
def test_server_and_scheduler_import_no_plugin_and_no_framework(area):
    bad = []
    for src in _sources(area):
        for line, name in imported_names(src):
            if _top(name) in FRAMEWORKS or _is_plugin(name):
                bad.append(f"{src.rel}:{line} imports {name}")
    _report(bad, f"{area} imports the core only, never a framework or a framework plugin")


@pytest.mark.parametrize("area", ["shared", "server", "scheduler", "launcher"])
def test_nothing_but_workers_imports_the_worker_side(area):
    """The tree says who uses what: byteps_like/worker/ (and the plugins, the trace tool and the
    benchmarks) is what only a training process runs; servers, the scheduler, the launcher and
    the shared modules (config, errors, wire, transport, compression, topology, ...) never
    import it."""
    bad = []
    for src in _sources(area):
        for line, name in imported_names(src):
            if any(name == p or name.startswith(p + ".") for p in WORKER_SIDE):
                bad.append(f"{src.rel}:{line} imports {name}")
    _report(bad, f"{area} modules never import the worker side")


def test_the_worker_side_uses_of_the_launcher_are_its_torchrun_module_only():
    """Under torchrun, local rank 0 of each node starts that node's scheduler and servers with
    the launcher's supervision (launcher/torchrun.py, standard library only); nothing else of the
    launcher belongs in a worker, and the shared modules import none of it."""
    bad = []
    for src in _sources("shared", "worker", "tool"):
        allowed = ("byteps_like.launcher.torchrun",) if src.area == "worker" else ()
        for line, name in imported_names(src):
            if (name == "byteps_like.launcher" or name.startswith("byteps_like.launcher.")) \
                    and not any(name == a or name.startswith(a + ".") for a in allowed):
                bad.append(f"{src.rel}:{line} imports {name}")
    _report(bad, "only byteps_like.worker imports the launcher, and only its torchrun module")
    membership = next(s for s in SOURCES if s.rel == "byteps_like/worker/membership.py")
    assert "byteps_like.launcher.torchrun.join" in {n for _, n in imported_names(membership)}


def test_the_worker_package_holds_what_only_workers_run():
    worker = {s.module for s in _sources("worker")}
    assert {"byteps_like.worker.runtime", "byteps_like.worker.pipeline",
            "byteps_like.worker.sync", "byteps_like.worker.api"} <= worker


# What the launcher may import besides the standard library. byteps_like.topology,
# byteps_like.cpulist (the CPU-list syntax config and topology both read) and
# byteps_like.shm_names are allowed because they are themselves held to the same rule (the next
# test): standard library, config, errors.
LAUNCHER_DEPS = ("byteps_like.config", "byteps_like.errors", "byteps_like.topology",
                 "byteps_like.cpulist", "byteps_like.shm_names")


def _imports_outside(src: Source, allowed_prefixes: tuple[str, ...]) -> list[str]:
    bad = []
    for line, name in imported_names(src):
        if _top(name) in STDLIB:
            continue
        if any(name == p or name.startswith(p + ".") for p in allowed_prefixes):
            continue
        bad.append(f"{src.rel}:{line} imports {name}")
    return bad


# The one exception, imported lazily (inside a function) by one module: the notice bpslaunch
# sends the scheduler when a child exits (launcher/notify.py) speaks the job's control
# protocol, which needs pyzmq and numpy. It loads them only once a child has failed.
LAUNCHER_LAZY = {"launcher/notify.py": ("byteps_like.control",)}


def _lazy_imports(src: Source) -> set[int]:
    """Lines of the imports made inside a function of ``src``."""
    lines = set()
    for fn in ast.walk(src.tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines |= {n.lineno for n in ast.walk(fn) if isinstance(n, (ast.Import,
                                                                       ast.ImportFrom))}
    return lines


def test_launcher_imports_only_stdlib_config_errors_topology_and_itself():
    bad = []
    for src in _sources("launcher"):
        lazy, lines = LAUNCHER_LAZY.get(src.rel, ()), _lazy_imports(src)
        for line, name in imported_names(src):
            ok = (*LAUNCHER_DEPS, "byteps_like.launcher", *(lazy if line in lines else ()))
            if _top(name) not in STDLIB and not any(name == p or name.startswith(p + ".")
                                                    for p in ok):
                bad.append(f"{src.rel}:{line} imports {name}")
    _report(bad, "launcher imports the standard library, byteps_like.config, "
                 "byteps_like.errors, byteps_like.topology and byteps_like.shm_names only "
                 "(and, lazily, "
                 "LAUNCHER_LAZY)")


def test_what_the_launcher_imports_imports_only_stdlib_config_and_errors():
    bad = []
    for src in SOURCES:
        if src.module in LAUNCHER_DEPS:  # tomli: tomllib's backport, on Python 3.10 only
            bad += _imports_outside(src, (*LAUNCHER_DEPS, "tomli"))
    _report(bad, "byteps_like.config, .errors, .topology, .cpulist and .shm_names (the launcher's "
                 "dependencies) "
                 "import the standard library and each other only")


def test_plugins_import_only_their_own_framework():
    bad = []
    for src in _sources("plugin:*"):
        own = PLUGINS[src.area.split(":")[1]]
        for line, name in imported_names(src):
            if _top(name) in FRAMEWORKS - own:
                bad.append(f"{src.rel}:{line} imports {name}")
    _report(bad, "a plugin imports the core and its own framework, nothing else")


def test_the_lightning_plugin_reaches_the_core_through_byteps_like_torch_only():
    """byteps_like.lightning is a Lightning strategy over the PyTorch plugin: it imports torch,
    lightning and byteps_like.torch (and itself), nothing else of byteps_like."""
    bad = []
    srcs = _sources("plugin:lightning")
    assert {s.module for s in srcs} >= {"byteps_like.lightning", "byteps_like.lightning.strategy"}
    for src in srcs:
        for line, name in imported_names(src):
            if _top(name) != "byteps_like":
                continue
            if not any(name == p or name.startswith(p + ".")
                       for p in ("byteps_like.torch", "byteps_like.lightning")):
                bad.append(f"{src.rel}:{line} imports {name}")
    _report(bad, "byteps_like.lightning imports byteps_like.torch, nothing else of the core")


# ------------------------------------------------------------------------------ environment reads
ENV_OK_FOR_COPY = {"launcher", "bench"}
ENV_MUTATORS = {"update", "clear", "__setitem__", "__delitem__"}
ENV_REMOVERS = {"pop", "popitem"}  # a write when the value is discarded


def _parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _env_uses(src: Source) -> list[tuple[int, str, str]]:
    """(line, kind, text) for every use of the process environment: kind is read, write or
    copy."""
    parents = _parents(src.tree)
    env_names = {"environ", "environb"}  # names bound by ``from os import environ``
    uses = []
    for node in ast.walk(src.tree):
        if isinstance(node, ast.ImportFrom) and node.module == "os":
            for a in node.names:
                if a.name in ("environ", "environb", "getenv", "getenvb"):
                    uses.append((node.lineno, "read", f"from os import {a.name}"))
            continue
        is_os_attr = (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                      and node.value.id == "os")
        if is_os_attr and node.attr in ("getenv", "getenvb"):
            uses.append((node.lineno, "read", f"os.{node.attr}"))
            continue
        if not ((is_os_attr and node.attr in env_names)
                or (isinstance(node, ast.Name) and node.id in env_names
                    and not is_os_attr and _imported_from_os(src, node.id))):
            continue
        text = ast.unparse(node)
        parent = parents.get(node)
        if isinstance(parent, ast.Subscript) and parent.value is node:
            kind = "read" if isinstance(parent.ctx, ast.Load) else "write"
            uses.append((node.lineno, kind, ast.unparse(parent)))
            continue
        if isinstance(parent, ast.Attribute) and parent.value is node:
            call = parents.get(parent)
            method = parent.attr
            if method in ENV_MUTATORS:
                kind = "write"
            elif method in ENV_REMOVERS:
                kind = "write" if isinstance(parents.get(call), ast.Expr) else "read"
            elif method == "copy":
                kind = "copy"
            elif method == "items" and isinstance(parents.get(call), ast.comprehension):
                kind = "copy"  # {k: v for k, v in os.environ.items() if ...}: a filtered copy
            else:
                kind = "read"
            uses.append((node.lineno, kind, f"{text}.{method}"))
            continue
        # dict(os.environ) / dict(os.environ if x is None else x): a whole copy
        up = parent
        while isinstance(up, (ast.IfExp, ast.BoolOp)):
            up = parents.get(up)
        if isinstance(up, ast.Call) and getattr(up.func, "id", None) == "dict":
            uses.append((node.lineno, "copy", ast.unparse(up)))
            continue
        uses.append((node.lineno, "read", ast.unparse(parent) if parent is not None else text))
    return uses


def _imported_from_os(src: Source, name: str) -> bool:
    return any(isinstance(n, ast.ImportFrom) and n.module == "os"
               and any((a.asname or a.name) == name for a in n.names)
               for n in ast.walk(src.tree))


def test_env_use_classifier():
    code = """
import os
a = os.environ["X"]
b = os.environ.get("X")
c = os.getenv("X")
d = "X" in os.environ
os.environ["Y"] = "1"
del os.environ["Y"]
os.environ.update({"Z": "1"})
os.environ.pop("Z", None)
e = os.environ.pop("Z", None)
f = os.environ.copy()
g = dict(os.environ)
h = dict(os.environ if a else {})
i = {k: v for k, v in os.environ.items() if k}
for k in os.environ: pass
"""
    src = Source(REPO / "x.py", "byteps_like/x.py", "byteps_like.x", "byteps_like",
                 ast.parse(code))
    kinds = sorted((line - 2, kind) for line, kind, _ in _env_uses(src))
    assert kinds == [(1, "read"), (2, "read"), (3, "read"), (4, "read"), (5, "write"),
                     (6, "write"), (7, "write"), (8, "write"), (9, "read"), (10, "copy"),
                     (11, "copy"), (12, "copy"), (13, "copy"), (14, "read")]


def test_only_config_reads_the_environment():
    bad = []
    for src in SOURCES:
        if src.rel == "byteps_like/config.py":
            continue
        for line, kind, text in _env_uses(src):
            if kind == "write":
                continue  # writing a child's environment is allowed
            if kind == "copy" and src.area in ENV_OK_FOR_COPY:
                continue
            bad.append(f"{src.rel}:{line} {kind}s the environment: {text}")
    _report(bad, "only byteps_like/config.py reads os.environ / os.getenv (launcher and bench "
                 "may copy the whole environment for their children)")


def test_config_does_read_the_environment():
    """Guards the classifier: the one module allowed to read must be seen reading."""
    config = next(s for s in SOURCES if s.rel == "byteps_like/config.py")
    assert any(kind != "write" for _l, kind, _t in _env_uses(config))


# ------------------------------------------------------------------------------ installed namespace
@pytest.mark.parametrize("name", ["server", "scheduler", "launcher"])
def test_roles_are_not_top_level_modules_of_the_installed_package(name, tmp_path):
    """Checked in an isolated interpreter (-I, cwd outside the repository): the test process
    itself has the repository root on sys.path, where ``server/`` is visible as a package."""
    code = ("import importlib.util as u, sys\n"
            f"assert u.find_spec({name!r}) is None, u.find_spec({name!r})\n"
            f"import byteps_like.{name} as m\n"
            "print(m.__name__)\n")
    out = subprocess.run([sys.executable, "-I", "-c", code], cwd=tmp_path, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"byteps_like.{name}"


@pytest.mark.parametrize("name", ["byteps_like.server", "byteps_like.scheduler",
                                  "byteps_like.launcher"])
def test_role_packages_import(name):
    mod = importlib.import_module(name)
    assert mod.__name__ == name
    assert importlib.util.find_spec(name) is not None


def test_launcher_and_core_load_no_framework_at_run_time(tmp_path):
    """The static rules, checked dynamically: what importing each layer actually loads."""
    code = """
import importlib, json, sys
heavy = {"numpy", "zmq", "torch", "tensorflow", "keras", "mxnet", "jax"}
out = {}
for mod in ["byteps_like.launcher", "byteps_like.launcher.cli", "byteps_like.config",
            "byteps_like.topology", "byteps_like", "byteps_like.server",
            "byteps_like.scheduler", "byteps_like.worker.runtime"]:
    importlib.import_module(mod)
    out[mod] = sorted(heavy & {m.split(".")[0] for m in sys.modules})
print(json.dumps(out))
"""
    res = subprocess.run([sys.executable, "-I", "-c", code], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    import json
    loaded = json.loads(res.stdout)
    for mod in ("byteps_like.launcher", "byteps_like.launcher.cli", "byteps_like.config",
                "byteps_like.topology"):
        assert loaded[mod] == [], f"importing {mod} loads {loaded[mod]}"
    for mod, mods in loaded.items():
        assert not set(mods) & FRAMEWORKS, f"importing {mod} loads {mods}"


# ------------------------------------------------------------------------------ the worker's parts
WORKER_PKG = "byteps_like.worker"


def _package_imports(area: str, package: str) -> dict[str, dict[str, int]]:
    """module of ``package`` -> {module of the package it imports: line}. Every import
    counts: inside functions and under ``if TYPE_CHECKING:`` too, so a circle cannot hide in
    one."""
    mods = {s.module: s for s in _sources(area)
            if s.module == package or s.module.startswith(package + ".")}
    graph: dict[str, dict[str, int]] = {}
    for mod, src in mods.items():
        deps: dict[str, int] = {}
        for line, name in imported_names(src):
            # ``from . import broadcast`` names the module; ``from .x import Y`` names x.Y
            target = name if name in mods else name.rpartition(".")[0]
            if target in mods and target != mod and target != package:
                deps.setdefault(target, line)
        graph[mod] = deps
    return graph


def _circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (import_circles, below, on
    a graph whose edges carry the import's line)."""
    return import_circles({v: set(ws) for v, ws in graph.items()})


def test_circle_finder_finds_a_circle():
    assert _circles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [
        ["a", "b", "c"]]
    assert _circles({"a": {"b": 1}, "b": {}}) == []


@pytest.mark.parametrize("area,package,facade,part", [
    ("worker", WORKER_PKG, "runtime", "dispatch"),
    ("scheduler", "byteps_like.scheduler", "core", "elastic")])
def test_no_import_circle_in_the_worker_and_scheduler_packages(area, package, facade, part):
    """The facade (the worker's runtime, the scheduler's core) imports its parts; a part takes
    a narrow object (worker/inflight.py's InFlight, scheduler/nodes.py's Host) and the other
    parts it uses, never the facade, so nothing imports the facade back. Imports under
    TYPE_CHECKING count as well: none is needed."""
    graph = _package_imports(area, package)
    assert f"{package}.{part}" in graph[f"{package}.{facade}"]  # the walk sees the imports
    bad = []
    for comp in _circles(graph):
        edges = [f"{a.rpartition('.')[2]}:{graph[a][b]} -> {b.rpartition('.')[2]}"
                 for a in comp for b in comp if b in graph[a]]
        bad.append(" <-> ".join(c.rpartition(".")[2] for c in comp) + f" ({'; '.join(edges)})")
    _report(bad, f"{package} has no import circle")


def _runtime_private_members() -> set[str]:
    """The underscore methods and attributes of :class:`Runtime` (no dunders), and the
    names its class body assigns."""
    src = next(s for s in SOURCES if s.rel == "byteps_like/worker/runtime.py")
    cls = next(n for n in src.tree.body if isinstance(n, ast.ClassDef) and n.name == "Runtime")
    names = set()
    for node in ast.walk(cls):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):  # a method under a second name
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
              and isinstance(node.value, ast.Name) and node.value.id == "self"):
            names.add(node.attr)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def test_no_private_runtime_member_is_used_outside_runtime():
    """Nothing outside runtime.py reaches into the runtime's underscore members (its lock, its
    handles, its fatal error, ``_teardown()``, ...): the parts use the in-flight object, plugins
    and the API its public methods. Any ``x._name`` with ``_name`` one of Runtime's and ``x``
    not ``self`` counts, whatever ``x`` is."""
    private = _runtime_private_members()
    assert {"_lock", "_teardown", "_connect"} <= private  # the walk sees them
    bad = []
    for src in _sources("shared", "worker", "tool", "plugin:*", "bench", "server", "scheduler",
                        "launcher"):
        if src.rel == "byteps_like/worker/runtime.py":
            continue
        for node in ast.walk(src.tree):
            if (isinstance(node, ast.Attribute) and node.attr in private
                    and not (isinstance(node.value, ast.Name)
                             and node.value.id in ("self", "cls"))):
                bad.append(f"{src.rel}:{node.lineno} {ast.unparse(node)}")
    _report(bad, "private Runtime members are used in runtime.py only")


def test_no_worker_module_resets_another_modules_globals():
    """A module of byteps_like/worker/ assigns no attribute of another module (the elastic
    membership restarts broadcast's names through ``broadcast.reset_names()``)."""
    bad = []
    for src in _sources("worker"):
        modules = {a.asname or a.name for n in ast.walk(src.tree)
                   if isinstance(n, ast.ImportFrom) and n.level and not n.module
                   for a in n.names}
        for node in ast.walk(src.tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                    and isinstance(node.value, ast.Name) and node.value.id in modules):
                bad.append(f"{src.rel}:{node.lineno} {ast.unparse(node)}")
    _report(bad, "worker modules set no other module's globals")


# ------------------------------------------------------------------------------ rooms of a size one reads
MAX_CLASS_LINES = 400


def test_no_class_is_over_400_lines():
    """A class one reads whole: none of the package (byteps_like/, server/, scheduler/,
    launcher/) is over 400 lines. A class that grows past it is split by concern, as the
    worker's Runtime and the Scheduler were (a facade over parts of one job each)."""
    bad = []
    for src in SOURCES:
        for node in ast.walk(src.tree):
            if isinstance(node, ast.ClassDef):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > MAX_CLASS_LINES:
                    bad.append(f"{src.rel}:{node.lineno} class {node.name}: {n} lines")
    _report(bad, f"no class is over {MAX_CLASS_LINES} lines")


# ------------------------------------------------------------------------------ C++ rooms
# Issue 29: csrc/ by concern, no C++ file over 1,000 lines and no function over 80. A function
# is a body at namespace or class scope (a member defined in its class counts alone; lambdas
# and blocks count in the function that holds them), measured from the first line of its
# declaration to its closing brace. The scan below strips comments, literals and preprocessor
# lines, then matches braces; test_cpp_scan_* pin down what it understands.
MAX_CPP_FILE_LINES = 1000
MAX_CPP_FUNCTION_LINES = 80
CSRC = REPO / "csrc"
_CPP_LABEL = re.compile(r"\b(?:public|private|protected)\s*:(?!:)")
_CPP_SIGNATURE_END = re.compile(
    r"\)\s*(?:const|override|final|noexcept|volatile|&&?|->\s*[\w:<>,\s*&]+|\s)*$")


def _cpp_strip(text: str) -> str:
    """``text`` with comments, string and character literals and preprocessor lines blanked;
    every newline is kept, so offsets map to the same lines."""
    out: list[str] = []
    i, n = 0, len(text)
    line_start = True

    def blank(chunk: str) -> str:
        return re.sub(r"[^\n]", " ", chunk)

    while i < n:
        c = text[i]
        if c == "\n":
            out.append(c)
            i += 1
            line_start = True
            continue
        if c in " \t":
            out.append(c)
            i += 1
            continue
        if line_start and c == "#":  # a directive, with its continuation lines
            j = i
            while j < n and text[j] != "\n":
                j += 2 if text.startswith("\\\n", j) else 1
            out.append(blank(text[i:j]))
            i = j
            continue
        line_start = False
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(blank(text[i:j]))
            i = j
            continue
        if text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(blank(text[i:j]))
            i = j
            continue
        raw = re.match(r'R"([^(\s]*)\(', text[i:i + 20])
        if raw and not (i and (text[i - 1].isalnum() or text[i - 1] == "_")):
            end = text.find(")" + raw.group(1) + '"', i)
            j = n if end < 0 else end + len(raw.group(1)) + 2
            out.append(blank(text[i:j]))
            i = j
            continue
        if c in "\"'":
            if c == "'" and i and text[i - 1].isalnum():  # a digit separator: 1'000
                out.append(" ")
                i += 1
                continue
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            out.append(c + blank(text[i + 1:j]) + c)
            i = j + 1
            continue
        out.append(c)
        i += 1
    return "".join(out)


def _cpp_functions(text: str) -> list[tuple[str, int, int]]:
    """(name, first line, last line) of every function body at namespace or class scope."""
    s = _cpp_strip(text)
    n = len(s)

    def closing(j: int) -> int:  # the brace that closes the one at j
        depth = 0
        for k in range(j, n):
            if s[k] == "{":
                depth += 1
            elif s[k] == "}":
                depth -= 1
                if depth == 0:
                    return k
        raise AssertionError(f"unbalanced braces from offset {j}")

    found = []
    start = 0  # where the declaration before the next brace begins
    i = 0
    while i < n:
        c = s[i]
        if c in ";}":
            start = i + 1
        elif c == "{":
            decl = _CPP_LABEL.sub(lambda m: " " * len(m.group()), s[start:i])
            flat = " ".join(decl.split())
            ctor_list = re.search(r"\)\s*:[^:]", flat) is not None
            if re.search(r"\bnamespace\b", flat) or re.fullmatch(r'extern\s*"\s*"', flat):
                start = i + 1  # a scope: its declarations are read one by one
            elif ctor_list and re.search(r"[\w>]$", flat):
                i = closing(i)  # a member's brace initializer in a constructor's list
            elif re.search(r"=\s*\[[^\]]*\]\s*\(", flat):  # a lambda, initializing
                i = closing(i)
                start = i + 1
            elif _CPP_SIGNATURE_END.search(flat) or (ctor_list and flat.endswith("}")):
                j = closing(i)
                lead = len(decl) - len(decl.lstrip())
                named = re.sub(r"__attribute__\s*\(\(.*?\)\)", " ", flat)
                name = re.search(r"(~?[A-Za-z_][\w:]*|operator\W+)\s*\(", named)
                found.append((name.group(1) if name else flat[:40],
                              s.count("\n", 0, start + lead) + 1, s.count("\n", 0, j) + 1))
                i, start = j, j + 1
            elif re.search(r"\b(?:class|struct|union|enum)\b", flat) and "=" not in flat:
                start = i + 1
            else:  # an initializer or a lambda outside any function: not a scope
                i = closing(i)
                start = i + 1
        i += 1
    return found


def _cpp_files() -> list[pathlib.Path]:
    return sorted(p for p in CSRC.iterdir() if p.suffix in (".cc", ".h"))


def test_cpp_scan_finds_functions_and_skips_what_is_not_one():
    text = """#include <x.h>
#define TWICE(x) { (x); (x); }
namespace bps {
namespace {
constexpr int kTable[] = {1, 2, 3};  // a brace: { not a function
const auto f = [](int a) { return a + '{'; };
}  // namespace
/* a comment with a body: void g() {
} */
class A : public B {
 public:
  A(int x) : x_{x}, y_(R"({)") {
    if (x) { y_ = "}"; }
  }
  int get() const override { return x_; }
  std::atomic<int> n_{0};
 private:
  enum State { kOne, kTwo };
  int x_;
};
template <typename T>
T A::twice(T v) noexcept {
  auto inner = [&] {
    return v;
  };
  return inner() + v;
}
extern "C" {
int c_entry(void) { return 1'000; }
}
}  // namespace bps
"""
    assert _cpp_functions(text) == [("A", 12, 14), ("get", 15, 15), ("A::twice", 21, 27),
                                    ("c_entry", 29, 29)]


def test_cpp_scan_reads_this_tree():
    """The scan understands the real files: it finds known functions at their lines, and every
    file's braces balance."""
    for path in _cpp_files():
        _cpp_functions(path.read_text())  # raises on unbalanced braces
    stream = CSRC / "dataplane_server_stream.cc"
    names = {name for name, _, _ in _cpp_functions(stream.read_text())}
    assert {"ServerConn::ServerConn", "ServerConn::on_header", "ServerConn::advance"} <= names
    io = {name for name, _, _ in _cpp_functions((CSRC / "dataplane_io.h").read_text())}
    assert {"flush_locked", "read_header", "next_discard"} <= io  # defined in their class


def test_no_cpp_file_is_over_1000_lines():
    bad = []
    for path in _cpp_files():
        n = len(path.read_text().splitlines())
        if n > MAX_CPP_FILE_LINES:
            bad.append(f"csrc/{path.name}: {n} lines")
    _report(bad, f"no C++ file is over {MAX_CPP_FILE_LINES} lines (split it by concern)")


def test_no_cpp_function_is_over_80_lines():
    bad = []
    for path in _cpp_files():
        for name, first, last in _cpp_functions(path.read_text()):
            n = last - first + 1
            if n > MAX_CPP_FUNCTION_LINES:
                bad.append(f"csrc/{path.name}:{first} {name}: {n} lines")
    _report(bad, f"no C++ function is over {MAX_CPP_FUNCTION_LINES} lines")


# ---- no import circles between files ----------------------------------------------------------
def _type_checking_lines(src: Source) -> set[int]:
    """Lines of the imports under ``if TYPE_CHECKING:`` (types only: never run)."""
    lines = set()
    for node in ast.walk(src.tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            lines |= {n.lineno for stmt in node.body for n in ast.walk(stmt)
                      if isinstance(n, (ast.Import, ast.ImportFrom))}
    return lines


def import_graph(sources: list[Source]) -> dict[str, set[str]]:
    """module -> the modules of ``sources`` it imports, wherever in the file (a function's
    import is a dependency too, only a later one: deferring an import hides a circle, it does
    not break it), importlib's with a constant name included, TYPE_CHECKING's left out. ``from
    pkg import name`` counts pkg.name when that is a module, else pkg; the compiled
    ``byteps_like._core`` is a module that imports none of these."""
    mods = {s.module for s in sources} | {"byteps_like._core"}
    graph: dict[str, set[str]] = {}
    for src in sources:
        skip = _type_checking_lines(src)
        deps = set()
        for line, name in imported_names(src):
            if line in skip:
                continue
            while name and name not in mods:
                name = name.rpartition(".")[0]
            if name and name != src.module:
                deps.add(name)
        graph[src.module] = deps
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(groups)


def test_no_import_circles_between_files():
    """Two files that import each other (at the top or inside a function) are one unit split in
    two: move the piece both need into a module of its own (as byteps_like/cpulist.py,
    transport/secret.py, torch/_dtypes.py, keras/_backend.py, bench/vgg16.py did)."""
    graph = import_graph(SOURCES)
    circles = import_circles(graph)
    _report([" <-> ".join(c) + ": " + "; ".join(f"{a} imports {b}" for a in c
                                                for b in sorted(graph[a] & set(c)))
             for c in circles], "import circles between files")


def test_the_circle_check_finds_circles_deferred_or_not():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}, "f": set()}
    assert import_circles(graph) == [["a", "b", "c"]]
    code = ("from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from .b import B\n"
            "def f():\n    from . import b\n    return b\n")
    a = Source(REPO / "x" / "a.py", "byteps_like/a.py", "byteps_like.a", "byteps_like",
               ast.parse(code))
    b = Source(REPO / "x" / "b.py", "byteps_like/b.py", "byteps_like.b", "byteps_like",
               ast.parse("import byteps_like.a\n"))
    assert import_graph([a, b]) == {"byteps_like.a": {"byteps_like.b"},
                                    "byteps_like.b": {"byteps_like.a"}}
    assert import_circles(import_graph([a, b])) == [["byteps_like.a", "byteps_like.b"]]
    a_types_only = Source(a.path, a.rel, a.module, a.package,
                          ast.parse(code.split("def f")[0]))
    assert import_circles(import_graph([a_types_only, b])) == []
