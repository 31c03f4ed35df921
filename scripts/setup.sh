#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment in .venv and install byteps_like into it,
# editable. Idempotent; safe to re-run, and to run with the other profile later.
#
#   bash scripts/setup.sh            the full profile, what the test suite needs (scripts/test.sh):
#                                    torch (CPU), tensorflow-cpu, byteps_like[test,examples,bench,ucx,ray,lightning,docs]
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
# (found, not imported: importing torch takes seconds)
have() { [ "$dry" != 1 ] && .venv/bin/python -c \
  "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)" 2>/dev/null; }

# (system packages first: an unchanged .venv below ends the script early)
if [ "$profile" = full ]; then
  # Debian packages the tests use: chromium (the live job page's tests drive it headless:
  # tests/integration/test_dashboard.py; the page itself needs no browser on a job's machines)
  # and numactl (tests/integration/test_launcher_procs.py binds real processes with it)
  missing=()
  for tool in chromium numactl; do
    if [ "$dry" = 1 ] || ! command -v "$tool" >/dev/null; then missing+=("$tool"); fi
  done
  if [ "${#missing[@]}" -gt 0 ]; then
    if [ "$dry" = 1 ] || { [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; }; then
      # wait up to 10 minutes for another apt (a fresh VM's unattended upgrades) to finish
      run env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 update -qq
      run env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y \
        -qq "${missing[@]}"
    else
      echo "setup.sh: ${missing[*]} missing and this is not root with apt-get: the tests that" \
           "use them will fail; install Debian's ${missing[*]} package(s)" >&2
    fi
  fi
fi
if [ "$dry" = 1 ] || [ ! -x .venv/bin/python ]; then run "$PY" -m venv .venv; fi
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
# torch is pinned first: the CPU build lies on this machine's disk; an unpinned torch would pull
# a multi-GB CUDA build. It serves the PyTorch plugin, the quick start and the gloo baselines of
# the benchmark.
have torch || run "${PIP[@]}" torch==2.13.0
# `pip install -e` rebuilds the C++ extension every time (a minute); it is skipped when this
# .venv already has byteps_like installed from this tree, built from the same build files and
# C++ sources by the same interpreter for this profile (or the full one, a superset): the stamp
# .venv/.byteps_like-<profile>.stamp records what the last install was made from.
sources_stamp() {
  { .venv/bin/python -VV; cat pyproject.toml setup.py
    find csrc -type f | LC_ALL=C sort | while read -r f; do echo "$f"; cat "$f"; done
  } | sha256sum | cut -d' ' -f1
}
installed_here() {
  .venv/bin/python -c "import os, sys, byteps_like, byteps_like._core
sys.exit(os.path.dirname(os.path.abspath(byteps_like.__file__)) != os.path.abspath('byteps_like'))" \
    2>/dev/null
}
if [ "$dry" != 1 ] && installed_here; then
  stamp=$(sources_stamp)
  for p in "$profile" full; do
    if [ "$(cat ".venv/.byteps_like-$p.stamp" 2>/dev/null)" = "$stamp" ]; then
      echo "setup ($profile): byteps_like is installed from this tree and its build files and" \
           "C++ sources are unchanged since (.venv/.byteps_like-$p.stamp): not rebuilt"
      exit 0
    fi
  done
fi
if [ "$profile" = full ]; then
  # TensorFlow (CPU build, with Keras 3) for byteps_like.tensorflow / byteps_like.keras
  have tensorflow || run "${PIP[@]}" "tensorflow-cpu==2.21.*"
  # ray: test_ray.py; lightning: test_lightning.py (its torch requirement is met by the pinned
  # torch above, so pip keeps it); docs: test_docs.py
  run "${PIP[@]}" -e '.[test,examples,bench,ucx,ray,lightning,docs]'
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
sources_stamp > ".venv/.byteps_like-$profile.stamp"
echo "setup ($profile): $(.venv/bin/python -c 'import byteps_like, byteps_like._core as c, zmq, numpy; print("byteps_like", byteps_like.__version__, "| pyzmq", zmq.__version__, "| numpy", numpy.__version__, "| kernels", c.cpu_features().get("kernel_fp16", "?"), "| UCX streams", "built" if c.ucx_built() else "not built")')"
