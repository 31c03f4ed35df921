#!/usr/bin/env bash
# Build Horovod 0.28.1 (PyTorch + gloo, CPU only, no MPI/TF/MXNet) into a separate
# virtualenv for the emulated-cluster benchmark (`python -m byteps_like.bench cluster`).
#
#   scripts/build_horovod.sh [VENV_DIR]      # default: .venv-horovod next to .venv
#
# Horovod 0.28.1 pins C++14 in its CMake files, but torch >= 2.1 headers need C++17,
# so the sdist is patched before it is built.  The new venv sees the main .venv's
# packages (torch, numpy, byteps_like) through a .pth file, so torch is not installed
# twice.  Idempotent: exits at once when horovod.torch already imports there.
# Not run by CI; takes 15-30 minutes on 2 cores.  Needs cmake >= 3.13, g++, network
# access to PyPI for the sdist.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MAIN_VENV="${BYTEPS_MAIN_VENV:-$ROOT/.venv}"
HVD_VENV="${1:-$ROOT/.venv-horovod}"
VERSION=0.28.1
WORK="${HOROVOD_BUILD_DIR:-$ROOT/build/horovod}"

fail() { echo "build_horovod.sh: FAILED: $*" >&2; echo "build_horovod.sh: the cluster benchmark will skip Horovod." >&2; exit 1; }

[ -x "$MAIN_VENV/bin/python" ] || fail "main virtualenv not found at $MAIN_VENV"
if [ -x "$HVD_VENV/bin/python" ] && "$HVD_VENV/bin/python" -c "import horovod.torch" 2>/dev/null; then
    echo "build_horovod.sh: horovod.torch already importable in $HVD_VENV; nothing to do."
    exit 0
fi
command -v cmake >/dev/null || fail "cmake not found (needs >= 3.13)"
command -v g++ >/dev/null || fail "g++ not found"

PY="$MAIN_VENV/bin/python"
if [ ! -x "$HVD_VENV/bin/python" ]; then
    "$PY" -m venv "$HVD_VENV" || fail "cannot create $HVD_VENV"
fi
HPY="$HVD_VENV/bin/python"
# Let the Horovod venv see torch/numpy/byteps_like from the main venv.
MAIN_SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
HVD_SITE="$("$HPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$MAIN_SITE" > "$HVD_SITE/_byteps_main_venv.pth"
"$HPY" -c "import torch" || fail "torch not importable from $HVD_VENV (via $MAIN_SITE)"
"$HPY" -m pip install -q --upgrade pip setuptools wheel "cloudpickle" "psutil" "pyyaml" "packaging" \
    || fail "pip could not install Horovod's build requirements"

mkdir -p "$WORK"
cd "$WORK" || fail "cannot enter $WORK"
if [ ! -f "horovod-$VERSION.tar.gz" ]; then
    "$HPY" -m pip download -q --no-deps --no-binary :all: "horovod==$VERSION" -d . \
        || fail "cannot download the horovod $VERSION sdist"
fi
rm -rf "horovod-$VERSION"
tar xzf "horovod-$VERSION.tar.gz" || fail "cannot unpack the sdist"
SRC="$WORK/horovod-$VERSION"

# --- patches -----------------------------------------------------------------
# C++17 for Horovod itself and its PyTorch extension (torch headers need it).
sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
    "$SRC/CMakeLists.txt" "$SRC/horovod/torch/CMakeLists.txt" || fail "patching CMake files"
grep -q 'CMAKE_CXX_STANDARD 17' "$SRC/horovod/torch/CMakeLists.txt" || fail "C++17 patch did not apply"
# Optimised build without debug info: much faster to compile on 2 cores.
sed -i "s/else 'RelWithDebInfo'/else 'Release'/" "$SRC/setup.py"

export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1
export HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_WITHOUT_MPI=1
export HOROVOD_GPU_OPERATIONS= HOROVOD_CPU_OPERATIONS=gloo
export HOROVOD_CMAKE="$(command -v cmake)"
# CMake 4 refuses cmake_minimum_required(< 3.5) in the bundled gloo/flatbuffers.
export CMAKE_POLICY_VERSION_MINIMUM=3.5
export MAKEFLAGS="-j$(nproc)"
echo "build_horovod.sh: building horovod $VERSION in $SRC (log follows)"
cd "$SRC"
"$HPY" -m pip install -v --no-build-isolation --no-deps . || fail "pip install of the patched horovod failed"
cd "$ROOT"
"$HPY" -c "import horovod.torch as hvd; hvd.init(); print('horovod', hvd.__version__ if hasattr(hvd,'__version__') else '', 'gloo built:', hvd.gloo_built())" \
    || fail "horovod installed but horovod.torch does not import/init"
echo "build_horovod.sh: OK: $HVD_VENV"
