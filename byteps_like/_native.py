"""Loading the compiled extension ``byteps_like._core`` with an error that says what to do.

``import byteps_like`` and the pure-Python modules (config, errors, the launcher) never need the
extension, so a launcher or a config check runs without it. The first module that needs it
(``from .. import _core`` in the worker, the server, compression, ...) reaches
``byteps_like.__getattr__``, which calls :func:`load_core`: a missing or unloadable extension
raises one ImportError naming why (never built, built for another Python, or a source tree
that shadows an installed byteps_like) and how to rebuild.

Each environment has its own build. A wheel (``pip install .``) carries ``_core`` inside its
``byteps_like/``. An editable install (``pip install -e .``) keeps it in the environment's
site-packages, in the folder :data:`CORE_DIR` with a ``SOURCE`` file naming the source package it
was built from (setup.py), never in the source tree: environments installed from one tree (.venv
and .venv-mxnet) would otherwise share, and replace, one build. ``byteps_like/__init__.py`` puts
:func:`environment_core_dir` first on the package's ``__path__``.
"""
from __future__ import annotations

import importlib
import importlib.machinery
import os
import sys
from types import ModuleType

REBUILD = ("Build it from the source tree with `pip install -e .` (or `bash scripts/setup.sh`, "
           "which sets up .venv), or reinstall with `pip install .`; building needs a C++17 "
           "compiler and the Python headers (README.md, 'Building from source').")


CORE_DIR = "byteps_like-core"  # setup.py reads it from here


def environment_core_dir(pkg: str) -> str | None:
    """The folder holding this environment's editable build of ``_core`` for the source package
    ``pkg``: the first :data:`CORE_DIR` on ``sys.path`` whose ``SOURCE`` names ``pkg`` (an
    environment whose site-packages sees another's, e.g. through a .pth line, comes first on its
    own path; a build for another tree never matches). None without one (a wheel's install, a
    tree never installed editable here)."""
    real = None
    for entry in sys.path:
        where = os.path.join(entry or os.curdir, CORE_DIR)
        try:
            with open(os.path.join(where, "SOURCE"), encoding="utf-8") as f:
                source = f.read().strip()
        except OSError:
            continue
        real = real or os.path.realpath(pkg)
        if os.path.realpath(source) == real:
            return where
    return None


def load_core() -> ModuleType:
    """``byteps_like._core``, or an ImportError that explains its absence."""
    try:
        return importlib.import_module("byteps_like._core")
    except ImportError as exc:
        raise ImportError(missing_core_message(exc), name="byteps_like._core") from None


def _cores_in(folder: str) -> list[str]:
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    return sorted(n for n in names if n.startswith("_core.")
                  and any(n.endswith(s) for s in importlib.machinery.EXTENSION_SUFFIXES + [".so",
                                                                                          ".pyd"]))


def missing_core_message(exc: BaseException) -> str:
    pkg = os.path.dirname(os.path.abspath(__file__))
    head = (f"byteps_like._core, the compiled part of byteps_like, cannot be imported from {pkg} "
            f"({type(exc).__name__}: {exc}).")
    # an installed byteps_like that does have the extension, hidden behind this one
    for entry in sys.path:
        other = os.path.join(os.path.abspath(entry or os.curdir), "byteps_like")
        if os.path.realpath(other) == os.path.realpath(pkg) or not _cores_in(other):
            continue
        return (f"{head} This byteps_like is the source tree {pkg}, which shadows the byteps_like "
                f"installed at {other}: Python puts the current directory first on sys.path for "
                "`python -c`, `python -m` and the interactive prompt (and a script's own "
                "directory for `python script.py`). Run from another directory, or install this "
                "tree editable (`pip install -e .`) so that both are the same.")
    found = _cores_in(pkg)
    if found and isinstance(exc, ModuleNotFoundError):
        tag = sys.implementation.cache_tag
        return (f"{head} {pkg} has {', '.join(found)}, built for another Python than this "
                f"{tag} ({sys.executable}). {REBUILD}")
    if found:  # present but does not load (a missing library, a mismatched build)
        return f"{head} {REBUILD}"
    own = environment_core_dir(pkg)
    if own is not None:  # this environment's editable build is there but does not load
        return (f"{head} This environment's build of it is in {own} (an editable install keeps "
                f"one per environment there). {REBUILD}")
    return (f"{head} It was never built for this environment ({sys.prefix}): a source checkout "
            "needs a build, and an editable install keeps it in the environment's own "
            f"site-packages ({CORE_DIR}/), so each environment installed from the tree needs its "
            f"own `pip install -e .`. {REBUILD}")
