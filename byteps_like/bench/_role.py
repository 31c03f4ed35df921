"""``python -m byteps_like.bench._role {scheduler,server,launcher} [args]``: run a role of the
byteps_like that is imported here, also from a bare source tree.

The roles live in the source tree's root folders ``scheduler/``, ``server/`` and ``launcher/``
and become ``byteps_like.scheduler`` etc. only through the install's package mapping
(``package-dir`` in pyproject.toml). With a plain ``PYTHONPATH=<source tree>``, or a source
checkout that shadows a non-editable install, ``python -m byteps_like.scheduler`` fails with
``No module named 'byteps_like.scheduler'``. This entry point first tries the normal import; if
the role is not found it maps ``<root>/<role>`` (next to the imported ``byteps_like`` folder)
to ``byteps_like.<role>`` and runs its ``__main__`` as ``python -m`` would. The same holds when
the import finds the role of *another* tree (a checkout run from its own folder while the
virtual environment has an editable install of a different checkout): the role next to the
imported byteps_like wins. The benchmarks use this entry point only when the plain
``python -m byteps_like.<role>`` would not run the role of the byteps_like they imported
(``harness.role_argv``).
"""
from __future__ import annotations

import importlib.util
import os
import runpy
import sys

ROLES = ("scheduler", "server", "launcher")


def _places(role: str) -> tuple[str, str]:
    """Where ``byteps_like.<role>`` belongs with the imported byteps_like: inside its folder (an
    install) or next to it (the source tree); the paths of the role's ``__init__.py``."""
    import byteps_like
    pkg = os.path.dirname(os.path.abspath(byteps_like.__file__))
    return (os.path.join(pkg, role, "__init__.py"),
            os.path.join(os.path.dirname(pkg), role, "__init__.py"))


def _same(a: str | None, b: str) -> bool:
    return a is not None and os.path.exists(b) and os.path.realpath(a) == os.path.realpath(b)


def plan(role: str) -> tuple[str, str | None]:
    """How ``byteps_like.<role>`` is found for the imported byteps_like:

    - ("import", origin): the normal import finds it inside the package's folder or next to it
      (a wheel or an editable install of this very tree);
    - ("map", folder): the source tree's ``<root>/<role>`` has to be mapped by hand (a bare
      source tree on sys.path, or one that shadows an install of another tree, whose finder
      would hand out that tree's role);
    - ("import", origin) for any other place the import finds (an unusual install layout);
    - ("missing", None)."""
    name = f"byteps_like.{role}"
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    origin = spec.origin if spec is not None else None
    inside, sibling = _places(role)
    if _same(origin, inside) or _same(origin, sibling):
        return "import", origin
    folder = os.path.dirname(sibling)
    if os.path.isfile(sibling) and os.path.isfile(os.path.join(folder, "__main__.py")):
        return "map", folder
    if origin is not None:
        return "import", origin
    return "missing", None


def locate(role: str) -> str | None:
    """Make ``byteps_like.<role>`` importable as :func:`plan` says (mapping the source-tree
    folder into the namespace when needed); its ``__init__.py``, or None."""
    how, where = plan(role)
    if how != "map":
        return where
    assert where is not None
    name = f"byteps_like.{role}"
    init = os.path.join(where, "__init__.py")
    spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[where])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    import byteps_like
    setattr(byteps_like, role, module)
    return init


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ROLES:
        print(f"usage: python -m byteps_like.bench._role {{{','.join(ROLES)}}} [args]",
              file=sys.stderr)
        return 2
    role, rest = argv[0], argv[1:]
    if locate(role) is None:
        import byteps_like
        print(f"byteps_like.bench._role: byteps_like.{role} is not importable, and "
              f"{os.path.dirname(os.path.dirname(byteps_like.__file__))} has no {role}/ folder "
              f"(byteps_like imported from {byteps_like.__file__}); install the package "
              "(pip install -e .)", file=sys.stderr)
        return 2
    sys.argv = [f"byteps_like.{role}", *rest]
    runpy.run_module(f"byteps_like.{role}", run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
