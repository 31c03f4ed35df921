"""MkDocs hooks for the documentation site (mkdocs.yml: ``hooks``).

The pages are written to read well on GitHub too, so they link to the repository's files
(``../../examples/pytorch/train_digits.py``) and the README is the front page. Here:

- the home page is README.md, its links rewritten for the page's place in the site
  (``docs/launcher.md`` -> ``launcher.md``);
- a link from any page to a repository file outside docs/ that exists is served from a copy of
  that file in the site (``_src/<path>``); one that does not exist is left alone, so that
  ``mkdocs build --strict`` reports it like any other broken link;
- the Sphinx roles docstrings use (``:func:`init```) render as the code they wrap.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

LINK = re.compile(r"(\]\()([^)\s]+)(\))")
SRC = "_src"
ROLE = re.compile(r":(?:func|class|meth|mod|attr|data|exc|obj|py:\w+):(?=<code>)")


def _repo(config: Any) -> Path:
    return Path(config["config_file_path"]).resolve().parent


def _docs(config: Any) -> Path:
    return Path(config["docs_dir"]).resolve()


def _target(real_dir: Path, target: str) -> tuple[Path, str] | None:
    """The file a relative link points to (and its #fragment), or None for other links."""
    if "://" in target or target.startswith(("#", "/", "mailto:")):
        return None
    path, _, frag = target.partition("#")
    if not path:
        return None
    return Path(os.path.normpath(real_dir / path)), frag


def rewrite(text: str, real_dir: Path, site_dir: Path, repo: Path, docs: Path,
            used: set[Path] | None = None) -> str:
    """Links of a page whose source lies in ``real_dir`` and which the site shows in
    ``site_dir`` (a folder under docs/): docs pages relative to ``site_dir``, other existing
    repository files through ``_src/``; ``used`` collects those files."""
    def one(m: re.Match) -> str:
        hit = _target(real_dir, m.group(2))
        if hit is None:
            return m.group(0)
        path, frag = hit
        if path == repo / "README.md":
            path = docs / "index.md"
        elif docs not in path.parents:
            if repo not in path.parents or not path.is_file():
                return m.group(0)  # broken: the strict build reports it
            if used is not None:
                used.add(path)
            path = docs / SRC / path.relative_to(repo)
        elif real_dir == site_dir:
            return m.group(0)
        new = os.path.relpath(path, site_dir).replace(os.sep, "/") + (f"#{frag}" if frag else "")
        return f"{m.group(1)}{new}{m.group(3)}"
    return LINK.sub(one, text)


def on_files(files: Files, config: Any) -> Files:
    repo, docs = _repo(config), _docs(config)
    used: set[Path] = set()
    for f in files.documentation_pages():
        page = Path(f.abs_src_path)
        rewrite(page.read_text(encoding="utf-8"), page.parent, page.parent, repo, docs, used)
    readme = repo / "README.md"
    if files.get_file_from_path("index.md") is None and readme.is_file():
        text = rewrite(readme.read_text(encoding="utf-8"), repo, docs, repo, docs, used)
        files.append(File.generated(config, "index.md", content=text))
    for path in sorted(used):
        files.append(File.generated(config, f"{SRC}/{path.relative_to(repo).as_posix()}",
                                    abs_src_path=str(path)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    if page.file.abs_src_path is None:  # generated (the README): rewritten in on_files
        return markdown
    real = Path(page.file.abs_src_path).resolve().parent
    return rewrite(markdown, real, real, _repo(config), _docs(config))


def on_page_content(html: str, page: Any, config: Any, files: Files) -> str:
    """``:func:`x``` in a docstring -> ``x`` as code; ``~pkg.mod.Name`` -> ``Name``."""
    html = ROLE.sub("", html)
    return re.sub(r"<code>~(?:[\w]+\.)*(\w+)</code>", r"<code>\1</code>", html)
