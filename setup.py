"""Build of the native extension byteps_like._core (everything else is in pyproject.toml).

Building needs a C++17 compiler (g++ 7+ or clang 5+) and the Python headers (README.md,
"Building from source"). build_ext test-compiles a few lines with the extension's own flags
first, so a machine without them gets one paragraph saying what to install, not a raw trace.
"""
import importlib.util
import os
import sysconfig
import tempfile
from glob import glob

from pybind11.setup_helpers import Pybind11Extension
from pybind11.setup_helpers import build_ext as _build_ext
from setuptools import setup
from setuptools.errors import CompileError, PlatformError


def ucx_include_dir() -> str | None:
    """The libucx wheel's headers (the `ucx` extra), if installed where this build runs: the
    data plane's UCX streams are compiled against them. libucp is not linked; _core opens it
    at run time (byteps_like/transport/ucx_native.py), so the extension works without UCX."""
    try:
        spec = importlib.util.find_spec("libucx")
    except (ImportError, ValueError):
        spec = None
    where = list(spec.submodule_search_locations or []) if spec else []
    # pip builds in an isolated environment: the target environment's site-packages (the same
    # interpreter's prefix) is where the extra installed libucx
    paths = sysconfig.get_paths()
    where += [os.path.join(paths[k], "libucx") for k in ("purelib", "platlib")]
    for loc in where:
        inc = os.path.join(loc, "include")
        if os.path.isfile(os.path.join(inc, "ucp", "api", "ucp.h")):
            return inc
    return None


UCX_INCLUDE = ucx_include_dir()
ext = Pybind11Extension(
    "byteps_like._core",
    sources=sorted(glob("csrc/*.cc")),
    include_dirs=["csrc"] + ([UCX_INCLUDE] if UCX_INCLUDE else []),
    define_macros=[("BPS_WITH_UCX", "1" if UCX_INCLUDE else "0")],
    cxx_std=17,
    extra_compile_args=["-O3", "-fno-math-errno", "-pthread"],
    extra_link_args=["-pthread"] + (["-ldl"] if UCX_INCLUDE else []),
)

PROBE = """#include <Python.h>
#include <optional>
#if __cplusplus < 201703L
#error "byteps_like needs C++17"
#endif
int probe() { std::optional<int> x = 1; return *x - 1; }
"""

TOOLCHAIN_MISSING = (
    "byteps_like's native extension (byteps_like._core) needs a C++17 compiler and the Python "
    "headers, and a test compile with them failed ({cause}; the compiler's own words, if it "
    "ran, are above). Install both and build again: Debian/Ubuntu `apt-get install g++ "
    "python3-dev`; Fedora/RHEL `dnf install gcc-c++ python3-devel`; Alpine `apk add g++ "
    "python3-dev`; macOS `xcode-select --install`; conda `conda install -c conda-forge "
    "cxx-compiler`. g++ 7 / clang 5 or newer speak C++17; `c++ --version` and "
    "`python3-config --includes` show what is there. A compiler outside PATH: "
    "CC=/path/to/gcc CXX=/path/to/g++ pip install . (README.md, 'Building from source').")


class build_ext(_build_ext):  # noqa: N801 - setuptools' command name
    def build_extensions(self) -> None:
        self.check_toolchain()
        super().build_extensions()

    def check_toolchain(self) -> None:
        """Compile PROBE with the extension's flags; raise one clear paragraph if that fails."""
        with tempfile.TemporaryDirectory(prefix="bpsl-probe-") as tmp:
            src = os.path.join(tmp, "probe.cc")
            with open(src, "w") as f:
                f.write(PROBE)
            try:
                self.compiler.compile([src], output_dir=tmp,
                                      include_dirs=[sysconfig.get_paths()["include"]],
                                      extra_postargs=list(ext.extra_compile_args))
            except (CompileError, OSError) as exc:
                raise PlatformError(TOOLCHAIN_MISSING.format(cause=exc)) from None


setup(ext_modules=[ext], cmdclass={"build_ext": build_ext})
