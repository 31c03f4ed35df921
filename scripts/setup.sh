#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment in .venv and install byteps_like into it,
# editable, with its test and example extras. Idempotent; safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for c in python3.11 python3; do command -v "$c" >/dev/null && { PY=$c; break; }; done
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
# torch is pinned first: the CPU build lies on this machine's disk; an unpinned torch would pull
# a multi-GB CUDA build. It serves the gloo baselines of the benchmark and the PyTorch plugin.
.venv/bin/python -c "import torch" 2>/dev/null || "${PIP[@]}" torch==2.13.0
# TensorFlow (CPU build, with Keras 3) for byteps_like.tensorflow / byteps_like.keras
.venv/bin/python -c "import tensorflow" 2>/dev/null || "${PIP[@]}" "tensorflow-cpu==2.21.*"
"${PIP[@]}" -e '.[test,examples,bench,ucx]'
echo "setup: $(.venv/bin/python -c 'import byteps_like, byteps_like._core as c, zmq, numpy; print("byteps_like", byteps_like.__version__, "| pyzmq", zmq.__version__, "| numpy", numpy.__version__, "| kernels", c.cpu_features().get("kernel_fp16", "?"))')"
