"""``byteps_like/_core.pyi`` (hand-written: it carries the types and the documentation) is
checked against the compiled module: every public name of ``_core`` is in the stub and every
name of the stub is in ``_core`` (functions, classes, their methods and attributes, constants),
and each function's parameters (names, order, keyword-only, defaults) and whether it returns
None agree with the signature pybind11 writes on the first line of its docstring."""
from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass
from pathlib import Path

import pytest

from byteps_like import _core

STUB = Path(__file__).resolve().parents[2] / "byteps_like" / "_core.pyi"
ANY = object()  # a stub default of ``...``: any default


@dataclass(frozen=True)
class Param:
    name: str
    kw_only: bool
    default: object  # None: no default; ANY; else the value


@dataclass(frozen=True)
class Sig:
    params: tuple[Param, ...]
    returns_none: bool


# ---- the module's side: pybind11's docstring signatures ---------------------------------------
def _split_top(text: str) -> list[str]:
    """``text`` split at the commas outside brackets."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return out + ([cur.strip()] if cur.strip() else [])


def _closing_paren(text: str, opening: int) -> int:
    depth = 0
    for i in range(opening, len(text)):
        depth += text[i] == "("
        depth -= text[i] == ")"
        if depth == 0:
            return i
    raise AssertionError(f"unbalanced parentheses in {text!r}")


def _literal(text: str) -> object:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return ANY  # a default pybind11 cannot spell as a literal: its presence is checked


def pybind_sig(name: str, obj: object, method: bool) -> Sig:
    doc = inspect.getdoc(obj) or ""
    first = doc.splitlines()[0] if doc else ""
    assert first.startswith(f"{name}("), f"{name}: no pybind11 signature line in {doc[:80]!r}"
    assert "Overloaded function" not in doc, f"{name}: overloads need @overload in the stub"
    end = _closing_paren(first, len(name))
    args, ret = _split_top(first[len(name) + 1:end]), first[end + 1:].strip()
    if method:
        assert args and args[0].startswith("self"), f"{name}: {first}"
        args = args[1:]
    params, kw_only = [], False
    for arg in args:
        if arg == "*":
            kw_only = True
            continue
        head, _, default = arg.partition(" = ")
        params.append(Param(head.split(":")[0].strip(), kw_only,
                            _literal(default) if default else None))
    return Sig(tuple(params), ret == "-> None")


def module_api() -> dict[str, object]:
    """{name: Sig} for functions, {name: {member: Sig or "attribute"}} for classes,
    "constant" for other values; public names and ``_``-prefixed hooks, no dunders."""
    api: dict[str, object] = {}
    for name, obj in vars(_core).items():
        if name.startswith("__"):
            continue
        if isinstance(obj, type):
            members: dict[str, object] = {}
            for m, v in vars(obj).items():
                if (m.startswith("__") and m != "__init__") or m.startswith("_pybind11"):
                    continue
                members[m] = "attribute" if isinstance(v, property) else pybind_sig(m, v, True)
            api[name] = members
        elif callable(obj):
            api[name] = pybind_sig(name, obj, False)
        else:
            api[name] = "constant"
    return api


# ---- the stub's side ---------------------------------------------------------------------------
def _stub_sig(fn: ast.FunctionDef, method: bool) -> Sig:
    a = fn.args
    assert not a.vararg and not a.kwarg, f"{fn.name}: *args/**kwargs in the stub"
    pos = a.posonlyargs + a.args
    if method:
        pos = pos[1:]
    defaults: list[ast.expr | None] = [None] * (len(pos) - len(a.defaults)) + list(a.defaults)

    def value(d: ast.expr | None) -> object:
        if d is None:
            return None
        if isinstance(d, ast.Constant) and d.value is Ellipsis:
            return ANY
        return ast.literal_eval(d)
    params = [Param(p.arg, False, value(d)) for p, d in zip(pos, defaults)]
    params += [Param(p.arg, True, value(d)) for p, d in zip(a.kwonlyargs, a.kw_defaults)]
    returns_none = isinstance(fn.returns, ast.Constant) and fn.returns.value is None
    return Sig(tuple(params), returns_none)


def _stub_only(node: ast.stmt) -> bool:
    """Typing helpers that exist only in the stub: type aliases and TypedDicts."""
    if isinstance(node, ast.AnnAssign):
        return ast.unparse(node.annotation) == "TypeAlias"
    if isinstance(node, ast.ClassDef):
        return any(ast.unparse(b) == "TypedDict" for b in node.bases)
    return False


def stub_api(tree: ast.Module) -> dict[str, object]:
    api: dict[str, object] = {}
    for node in tree.body:
        if _stub_only(node):
            continue
        if isinstance(node, ast.FunctionDef):
            api[node.name] = _stub_sig(node, False)
        elif isinstance(node, ast.ClassDef):
            members: dict[str, object] = {}
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    members[item.name] = _stub_sig(item, True)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    members[item.target.id] = "attribute"
            api[node.name] = members
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            api[node.target.id] = "constant"
    return api


def differences(module: dict[str, object], stub: dict[str, object]) -> list[str]:
    out = [f"{n}: in _core, not in _core.pyi" for n in sorted(set(module) - set(stub))]
    out += [f"{n}: in _core.pyi, not in _core" for n in sorted(set(stub) - set(module))]
    for name in sorted(set(module) & set(stub)):
        m, s = module[name], stub[name]
        if isinstance(m, dict) and isinstance(s, dict):
            out += [f"{name}.{d}" for d in differences(m, s)]
        elif isinstance(m, Sig) and isinstance(s, Sig):
            out += _sig_differences(name, m, s)
        elif m != s:
            out.append(f"{name}: a {_kind(m)} in _core, a {_kind(s)} in _core.pyi")
    return out


def _kind(x: object) -> str:
    return "class" if isinstance(x, dict) else "function" if isinstance(x, Sig) else str(x)


def _sig_differences(name: str, m: Sig, s: Sig) -> list[str]:
    out = []
    spell = lambda sig: ", ".join(("*" if p.kw_only else "") + p.name
                                  + ("=..." if p.default is not None else "")
                                  for p in sig.params)
    if [(p.name, p.kw_only, p.default is None) for p in m.params] != \
            [(p.name, p.kw_only, p.default is None) for p in s.params]:
        out.append(f"{name}: parameters ({spell(m)}) in _core, ({spell(s)}) in _core.pyi")
    for pm, ps in zip(m.params, s.params):
        if ANY not in (pm.default, ps.default) and pm.default != ps.default \
                and pm.name == ps.name:
            out.append(f"{name}: {pm.name} defaults to {pm.default!r} in _core, "
                       f"{ps.default!r} in _core.pyi")
    if m.returns_none != s.returns_none:
        out.append(f"{name}: returns {'None' if m.returns_none else 'a value'} in _core, "
                   f"{'None' if s.returns_none else 'a value'} in _core.pyi")
    return out


def test_the_stub_and_the_module_declare_the_same_api():
    diff = differences(module_api(), stub_api(ast.parse(STUB.read_text())))
    assert not diff, ("byteps_like/_core.pyi and the compiled _core (csrc/module.cc) differ; "
                      "update the stub:\n  " + "\n  ".join(diff))


def test_the_check_covers_the_whole_module():
    api = module_api()
    assert {"add_into", "DataServer", "DataClient", "NativeCodec", "wire_spec",
            "codec_frame_spec", "DTYPES", "_set_isa"} <= set(api)
    assert isinstance(api["DataServer"], dict) and "listen" in api["DataServer"]
    assert api["NativeCodec"]["n"] == "attribute"


@pytest.mark.parametrize("stub,says", [
    ("def add_into(dst, src, dtype, nthreads=1) -> None: ...\n", "copy_into: in _core, not"),
    ("def add_into(dst, src, nthreads=1) -> None: ...\n", "add_into: parameters"),
    ("def add_into(dst, src, dtype, *, nthreads=1) -> None: ...\n", "add_into: parameters"),
    ("def add_into(dst, src, dtype, nthreads=2) -> None: ...\n", "nthreads defaults to 1"),
    ("def add_into(dst, src, dtype, nthreads=1) -> int: ...\n", "returns None in _core"),
    ("def add_into(dst, src, dtype, nthreads=1) -> None: ...\ndef gone() -> None: ...\n",
     "gone: in _core.pyi, not in _core"),
    ("class NativeCodec:\n    n: int\n    def __init__(self, params, key, n) -> None: ...\n",
     "NativeCodec.max_bytes: in _core, not"),
])
def test_the_check_finds_each_kind_of_difference(stub, says):
    """The comparison itself, on stubs wrong in one way each (only add_into and NativeCodec
    are compared from _core here)."""
    module = {k: v for k, v in module_api().items() if k in ("add_into", "NativeCodec")}
    if "copy_into" in says:
        module["copy_into"] = module_api()["copy_into"]
    stub_side = stub_api(ast.parse(stub))
    if "class NativeCodec" not in stub:
        module.pop("NativeCodec")
    diff = differences(module, stub_side)
    assert any(says in d for d in diff), diff
