#!/usr/bin/env bash
# Create (or refresh) .venv-mxnet: MXNet 1.9.1 with numpy 1.23.5 and byteps_like (editable, with
# its test and example extras). MXNet 1.9.1, its last release, breaks on numpy >= 1.24, so it
# cannot share .venv (numpy 2). Idempotent: a stamp of the build inputs skips the reinstall.
# The editable install builds .venv-mxnet's own _core into its site-packages (setup.py): it never
# replaces .venv's (which has UCX; this one is built without the ucx extra).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for c in python3.11 python3; do command -v "$c" >/dev/null && { PY=$c; break; }; done
fi
VENV=.venv-mxnet
[ -x $VENV/bin/python ] || "$PY" -m venv $VENV
STAMP=$VENV/.byteps_like-stamp
want=$(cat pyproject.toml setup.py byteps_like/_native.py csrc/* scripts/setup_mxnet.sh | sha256sum | cut -d' ' -f1)
if [ "$(cat $STAMP 2>/dev/null)" != "$want" ] || ! $VENV/bin/python -c \
    "import byteps_like._core, byteps_like.server, byteps_like.launcher, pytest, sklearn" \
    2>/dev/null; then
  $VENV/bin/python -m pip install --quiet --disable-pip-version-check \
    numpy==1.23.5 -e '.[mxnet,test,examples]'
  echo "$want" > $STAMP
fi
echo "setup_mxnet: $($VENV/bin/python -W ignore::DeprecationWarning -c 'import byteps_like, mxnet, numpy; print("byteps_like", byteps_like.__version__, "| mxnet", mxnet.__version__, "| numpy", numpy.__version__)')"
