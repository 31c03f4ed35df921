"""The documentation site (mkdocs.yml): it builds with ``mkdocs build --strict``, its API
reference covers the public modules, and the strict build fails on a broken link, a broken
anchor, a page missing from the nav and a nav entry without a page. The tools: the ``docs``
extra (``pip install -e '.[docs]'``; scripts/setup.sh installs it)."""
from __future__ import annotations

import fnmatch
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def mkdocs(config: Path, site: Path) -> subprocess.CompletedProcess:
    if shutil.which("mkdocs", path=os.path.dirname(sys.executable)) is None:
        pytest.fail("mkdocs is not installed in this environment: pip install -e '.[docs]' "
                    "(scripts/setup.sh installs it)")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", config,
                           "-d", site], capture_output=True, text=True, timeout=300, env=env)


def test_the_site_builds_strictly_with_the_api_reference(tmp_path):
    p = mkdocs(REPO / "mkdocs.yml", tmp_path / "site")
    assert p.returncode == 0, p.stdout + p.stderr
    site = tmp_path / "site"
    home = (site / "index.html").read_text()
    assert "Building from source" in home and 'href="launcher.html"' in home  # the README
    # a page's link to a repository file outside docs/ is served from a copy
    assert (site / "_src" / "examples" / "pytorch" / "train_digits.py").is_file()
    assert "_src/examples/pytorch/train_digits.py" in (site / "frameworks" / "pytorch.html"
                                                      ).read_text()
    api = {p.stem: p.read_text() for p in (site / "api").glob("*.html")}
    for page, names in {"byteps_like": ["byteps_like.worker.api.push_pull",
                                        "byteps_like.worker.handle.Handle.wait",
                                        "byteps_like.errors.MismatchError"],
                        "torch": ["byteps_like.torch.DistributedOptimizer",
                                  "byteps_like.torch.push_pull"],
                        "tensorflow": ["byteps_like.tensorflow.DistributedGradientTape"],
                        "keras": ["byteps_like.keras.DistributedOptimizer"],
                        "mxnet": ["byteps_like.mxnet.trainer.DistributedTrainer"],
                        "config": ["byteps_like.config.load"]}.items():
        for name in names:
            assert f'id="{name}"' in api[page], (page, name)
    assert ":func:" not in api["byteps_like"]  # Sphinx roles render as code


#: The API reference's page of each public module, and the module's source (its ``__all__``).
API_PAGES = {"byteps_like": "byteps_like/__init__.py", "torch": "byteps_like/torch/__init__.py",
             "tensorflow": "byteps_like/tensorflow/__init__.py",
             "keras": "byteps_like/keras/__init__.py", "mxnet": "byteps_like/mxnet/__init__.py"}
#: Public names made at run time (no static signature to render): their page names them in
#: its text instead.
API_PROSE = {"keras": {"callbacks", "BroadcastGlobalVariablesCallback", "MetricAverageCallback",
                       "JoinCallback", "LearningRateScheduleCallback",
                       "LearningRateWarmupCallback"}}


def public_names(source: Path) -> list[str]:
    """A module's ``__all__``, read from its source (nothing is imported: no framework needed);
    ``[*_A, *_B]`` spreads of module-level tuples are followed."""
    import ast
    tree = ast.parse(source.read_text())
    values = {t.id: node.value for node in tree.body if isinstance(node, ast.Assign)
              for t in node.targets if isinstance(t, ast.Name)}

    def names(node) -> list[str]:
        assert isinstance(node, (ast.List, ast.Tuple)), ast.dump(node)
        out: list[str] = []
        for e in node.elts:
            if isinstance(e, ast.Starred):
                out += names(values[e.value.id])
            else:
                out.append(e.value)
        return out
    return [n for n in names(values["__all__"]) if not n.startswith("__")]


def test_the_api_reference_covers_every_public_name(tmp_path):
    """Issue 40: each name of a public module's ``__all__`` is rendered on its API page (an
    anchor ending in ``.name``), or, made at run time, named in its text."""
    import re
    p = mkdocs(REPO / "mkdocs.yml", tmp_path / "site")
    assert p.returncode == 0, p.stdout + p.stderr
    missing = {}
    for page, source in API_PAGES.items():
        html = (tmp_path / "site" / "api" / f"{page}.html").read_text()
        ids = set(re.findall(r'id="([\w.]+)"', html))
        names = public_names(REPO / source)
        assert len(names) > 5, (source, names)
        gone = [n for n in names if n not in API_PROSE.get(page, ())
                and not any(i.endswith("." + n) for i in ids)]
        gone += [n for n in API_PROSE.get(page, ()) if not re.search(rf"\b{n}\b", html)]
        if gone:
            missing[page] = gone
    assert not missing, f"public names missing from docs/api: {missing}"


def test_the_strict_build_fails_on_broken_links_anchors_and_pages(tmp_path):
    tree = tmp_path / "tree"
    tree.mkdir()
    for name in ("mkdocs.yml", "README.md"):
        shutil.copy(REPO / name, tree / name)
    for name in ("byteps_like", "examples", "tests", "scripts"):
        (tree / name).symlink_to(REPO / name)
    shutil.copytree(REPO / "docs", tree / "docs", ignore=shutil.ignore_patterns("api"))
    with open(tree / "docs" / "errors.md", "a") as f:
        f.write("\n[gone](nowhere.md) [no anchor](launcher.md#no-such-heading) "
                "[no file](../examples/no_such_example.py)\n")
    (tree / "docs" / "stray.md").write_text("# Not in the nav\n")
    p = mkdocs(tree / "mkdocs.yml", tmp_path / "site")
    out = p.stdout + p.stderr
    assert p.returncode != 0, out
    assert "Aborted with" in out and "in strict mode" in out, out
    assert "'nowhere.md'" in out, out                          # a broken link
    assert "#no-such-heading" in out, out                      # a broken anchor
    assert "no_such_example.py" in out, out                    # a missing repository file
    assert "stray.md" in out, out                              # a page not in the nav
    assert "api/torch.md" in out, out                          # a nav entry without a page


# ---- every repository path a page names exists -------------------------------------------------
# Paths the docs name that no checkout holds because something makes them at run time, each
# with why. Nothing else may be missing.
GENERATED = {
    ".venv/": "the environment scripts/setup.sh makes (its python, pip, bpslaunch)",
    ".venv-mxnet/": "the MXNet environment scripts/setup_mxnet.sh makes",
    ".venv-horovod/": "the Horovod environment docs/cluster-benchmark.md says how to make",
    "./trace": "the trace folder a traced job writes (BYTEPS_TRACE_DIR; docs/observability.md)",
    ".devbundle/": "the GPU machine's bundle (git-ignored) that ../shared/device/make-bundle.sh "
                   "builds, with the trees scripts/device/sparse_ab.sh compares",
}
_SPAN = re.compile(r"`([^`\n]+)`")
_LINK = re.compile(r"\[([^\]\n]*)\]\(([^)\s]+)\)")
_FENCED = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
_EXTENSIONS = {"py", "pyi", "md", "sh", "cc", "h", "toml", "yml", "yaml", "txt", "json", "cfg",
               "ini", "csv", "c", "cpp", "so", "whl", "in", "ipynb"}


def _pages() -> list[Path]:
    return sorted((REPO / "docs").rglob("*.md")) + [REPO / "README.md"]


def _tracked() -> set[str]:
    p = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, timeout=60)
    assert p.returncode == 0, f"git ls-files in {REPO} failed: {p.stderr.decode()}"
    files = {f for f in p.stdout.decode().split("\0") if f}
    dirs = {str(parent) for f in files for parent in Path(f).parents} - {"."}
    return files | dirs


def _clean(token: str) -> str:
    token = token.strip("'\"(),;")
    token = re.sub(r"(::[\w\[\]\-.,=]+)+$", "", token)  # a test id: file::name
    token = re.sub(r":\d+(-\d+)?$", "", token)            # file:line
    return token.split("#")[0]


def _looks_like_a_path(token: str, tops: set[str]) -> bool:
    """A relative path with a folder in it (a bare file name is a name, not a path), whose
    first folder is one of the repository's, or whose last part has a file extension."""
    if "/" not in token or not re.fullmatch(r"[\w.\-/*]+", token) or token.startswith("/"):
        return False
    first, last = token.split("/")[0], token.rstrip("/").split("/")[-1]
    return (first in tops or first in (".", "..") or first.startswith(".")
            or last.rpartition(".")[2] in _EXTENSIONS and "." in last)


def named_paths(page: Path, text: str, tops: set[str]) -> list[tuple[str, str, str]]:
    """(path as written, path relative to the repository or "" when outside it, how named)
    for each repository-looking path in a code span, a fenced code block or a link of
    ``text``. A link is relative to its page; a path in code to the repository's root (where
    the docs' commands run), to its page when it starts with ./ or ../ and names a file from
    there, or, for the package's folders, to ``byteps_like/``. A code span
    that is the text of a link to a web address names a file of another project: not
    checked."""
    out = []
    external = set()
    for m in _LINK.finditer(text):
        target = m.group(2)
        if re.match(r"^[a-z][a-z0-9+.\-]*:", target):  # https:, mailto:
            external.add(m.start(1))
            continue
        target = target.split("#")[0]
        if target:
            out.append((target, _inside(page.parent / target), "link"))
    spans = [m.group(1) for m in _SPAN.finditer(text)
             if m.start() not in external and m.start() - 1 not in external]
    spans += [line for block in _FENCED.findall(text) for line in block.splitlines()]
    for span in spans:
        for raw in span.split():
            token = _clean(raw)
            if "=" in raw or not _looks_like_a_path(token, tops):
                continue
            if token.startswith(("./", "../")):   # from the root, or from the page
                rel = next((r for r in (_inside(REPO / token), _inside(page.parent / token))
                            if r and (REPO / r).exists()), _inside(REPO / token))
            else:   # from the root, or the package's folders named from the package
                rel = next((r for r in (token, "byteps_like/" + token) if
                            (REPO / r.rstrip("/")).exists() or "*" in r), token)
            out.append((token, rel, "code"))
    return out


def _inside(path: Path) -> str:
    try:
        return os.path.relpath(path.resolve(), REPO) if path.resolve().is_relative_to(
            REPO.resolve()) else ""
    except OSError:
        return ""


def missing_paths(pages: list[tuple[Path, str]]) -> list[str]:
    """What ``named_paths`` finds in (page, text) pairs that the repository does not hold."""
    tracked = _tracked()
    tops = {p.split("/")[0] for p in tracked}
    found = []
    for page, text in pages:
        for token, rel, how in named_paths(page, text, tops):
            if any(token.startswith(g) or rel.startswith(g) for g in GENERATED if rel or token):
                continue
            rel = rel.rstrip("/")
            ok = rel != "" and (rel in tracked if "*" not in rel
                                else any(fnmatch.fnmatch(t, rel) for t in tracked))
            if not ok:
                where = "outside the repository" if rel == "" else "not in the repository"
                found.append(f"{page.relative_to(REPO)}: {how} {token!r}: {where}")
    return sorted(set(found))


def test_every_repository_path_the_docs_name_exists():
    missing = missing_paths([(page, page.read_text()) for page in _pages()])
    assert not missing, ("the docs name paths that are not in the repository (fix the page, "
                         "or, for a path a run makes, add it to GENERATED with why):\n  "
                         + "\n  ".join(missing))


def test_every_generated_path_is_one_the_docs_name():
    """The allow-list stays small: an entry no page names any more goes."""
    tops = {p.split("/")[0] for p in _tracked()}
    named = [token for page in _pages()
             for token, _rel, _how in named_paths(page, page.read_text(), tops)]
    unused = [g for g in GENERATED if not any(t.startswith(g) for t in named)]
    assert not unused, f"GENERATED entries no page names: {unused}"


def test_the_path_check_sees_what_it_should():
    page = REPO / "docs" / "probe.md"   # never written: named_paths only reads the text
    text = ("`byteps_like/wire.py` `worker/pipeline.py` `tests/unit/test_wire.py::test_x` "
            "`csrc/wire.h:12` `python tests/frameworks/workers/gone.py ops` "
            "`shared/ARCHITECTURE.md` [up](../../elsewhere.md) [ok](architecture.md#roles) "
            "[`horovod/torch/CMakeLists.txt`](https://github.com/horovod/horovod) "
            "`S/B` `n/a` `.venv/bin/python` `compress.h` `BYTEPS_TRACE_DIR=./trace`\n"
            "```bash\npython scripts/no_such_script.py --x 1\n```\n")
    tops = {p.split("/")[0] for p in _tracked()}
    got = {token: rel for token, rel, _how in named_paths(page, text, tops)}
    assert got["byteps_like/wire.py"] == "byteps_like/wire.py"
    assert got["worker/pipeline.py"] == "byteps_like/worker/pipeline.py"
    assert got["tests/unit/test_wire.py"] == "tests/unit/test_wire.py"
    assert got["csrc/wire.h"] == "csrc/wire.h"
    assert got["tests/frameworks/workers/gone.py"] == "tests/frameworks/workers/gone.py"
    assert got["shared/ARCHITECTURE.md"] == "shared/ARCHITECTURE.md"
    assert got["../../elsewhere.md"] == "" and got["architecture.md"] == "docs/architecture.md"
    for name in ("horovod/torch/CMakeLists.txt", "S/B", "n/a", "compress.h", "./trace"):
        assert name not in got, name
    missing = "\n".join(missing_paths([(page, text)]))
    for gone in ("gone.py", "shared/ARCHITECTURE.md", "scripts/no_such_script.py"):
        assert gone in missing, missing
    for fine in ("wire.py'", "pipeline.py", ".venv/bin/python"):
        assert fine not in missing, missing
