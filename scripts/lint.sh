#!/usr/bin/env bash
# Static checks: ruff (lint) over the tree and mypy over the package as it installs, i.e. with
# server/, scheduler/ and launcher/ mapped into byteps_like (pyproject's package-dir). mypy cannot
# follow setuptools' editable import hooks, so it reads a staging tree of symbolic links to the
# sources. Settings for both are in pyproject.toml. Exit status non-zero on any finding.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
py=${PYTHON:-.venv/bin/python}
echo "lint: ruff check"
"$py" -m ruff check --quiet . || { echo "lint: ruff found problems (see above)" >&2; exit 1; }
stage=$(mktemp -d "${TMPDIR:-/tmp}/bpsl-mypy.XXXXXX")
trap 'rm -rf "$stage"' EXIT
mkdir "$stage/byteps_like"
for f in "$root"/byteps_like/*; do
  case $(basename "$f") in __pycache__|*.so) continue ;; esac
  ln -s "$f" "$stage/byteps_like/$(basename "$f")"
done
for role in server scheduler launcher; do ln -s "$root/$role" "$stage/byteps_like/$role"; done
echo "lint: mypy -p byteps_like"
(cd "$stage" && "$root/$py" -m mypy --config-file "$root/pyproject.toml" \
   --cache-dir "$root/.mypy_cache" -p byteps_like) \
  | sed "s#^byteps_like/\(server\|scheduler\|launcher\)/#\1/#" \
  || { echo "lint: mypy found problems (paths above are the repository's)" >&2; exit 1; }
