#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment in .venv and install byteps_like into it,
# editable. Idempotent; safe to re-run, and to run with the other profile later.
#
#   bash scripts/setup.sh            the full profile, what the test suite needs (scripts/test.sh):
#                                    torch (CPU), tensorflow-cpu, byteps_like[test,examples,bench,ucx,ray,docs]
#   bash scripts/setup.sh --minimal  only what the PyTorch quick start needs
#                                    (scripts/quickstart.sh): torch (CPU), byteps_like[examples]
#
# SETUP_PROFILE=minimal (or full) chooses the same as the option. SETUP_DRY_RUN=1 (or --dry-run)
# prints, after "+ ", the commands a fresh clone would run, and runs none of them.
set -euo pipefail
cd "$(dirname "$0")/.."
profile=${SETUP_PROFILE:-full}
dry=${SETUP_DRY_RUN:-0}
for arg in "$@"; do
  case "$arg" in
    --minimal) profile=minimal ;;
    --full) profile=full ;;
    --dry-run) dry=1 ;;
    *) echo "setup.sh: unknown argument $arg (expected --minimal, --full or --dry-run)" >&2
       exit 2 ;;
  esac
done
case "$profile" in
  minimal|full) ;;
  *) echo "setup.sh: SETUP_PROFILE=$profile: expected minimal or full" >&2; exit 2 ;;
esac
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for c in python3.11 python3; do command -v "$c" >/dev/null && { PY=$c; break; }; done
fi
# run CMD...: run it, or in a dry run print it
run() { if [ "$dry" = 1 ]; then echo "+ $*"; else "$@"; fi; }
# have MODULE: whether .venv imports it already (never in a dry run: it shows a fresh clone)
have() { [ "$dry" != 1 ] && .venv/bin/python -c "import $1" 2>/dev/null; }

if [ "$dry" = 1 ] || [ ! -x .venv/bin/python ]; then run "$PY" -m venv .venv; fi
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
# torch is pinned first: the CPU build lies on this machine's disk; an unpinned torch would pull
# a multi-GB CUDA build. It serves the PyTorch plugin, the quick start and the gloo baselines of
# the benchmark.
have torch || run "${PIP[@]}" torch==2.13.0
if [ "$profile" = full ]; then
  # TensorFlow (CPU build, with Keras 3) for byteps_like.tensorflow / byteps_like.keras
  have tensorflow || run "${PIP[@]}" "tensorflow-cpu==2.21.*"
  run "${PIP[@]}" -e '.[test,examples,bench,ucx,ray,docs]'  # ray: test_ray.py; docs: test_docs.py
  # _core is compiled against the libucx wheel's headers when they are there at build time (the
  # data plane's UCX streams); in a fresh .venv the extra arrives after the build: build again
  if [ "$dry" != 1 ] && have libucx && ! .venv/bin/python -c \
      "import byteps_like._core as c, sys; sys.exit(not c.ucx_built())" 2>/dev/null; then
    run "${PIP[@]}" --no-deps -e .
  fi
else
  run "${PIP[@]}" -e '.[examples]'  # scikit-learn: the quick start's digits
fi
[ "$dry" = 1 ] && exit 0
echo "setup ($profile): $(.venv/bin/python -c 'import byteps_like, byteps_like._core as c, zmq, numpy; print("byteps_like", byteps_like.__version__, "| pyzmq", zmq.__version__, "| numpy", numpy.__version__, "| kernels", c.cpu_features().get("kernel_fp16", "?"), "| UCX streams", "built" if c.ucx_built() else "not built")')"
