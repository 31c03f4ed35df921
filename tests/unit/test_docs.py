"""The documentation site (mkdocs.yml): it builds with ``mkdocs build --strict``, its API
reference covers the public modules, and the strict build fails on a broken link, a broken
anchor, a page missing from the nav and a nav entry without a page. The tools: the ``docs``
extra (``pip install -e '.[docs]'``; scripts/setup.sh installs it)."""
from __future__ import annotations

import os
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
