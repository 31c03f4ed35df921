"""Build of the native extension byteps_like._core (everything else is in pyproject.toml).

Building needs a C++17 compiler (g++ 7+ or clang 5+) and the Python headers (README.md,
"Building from source"). build_ext test-compiles a few lines with the extension's own flags
first, so a machine without them gets one paragraph saying what to install, not a raw trace.

One build per environment: an editable install (`pip install -e .`) keeps its _core in the
environment's own site-packages, not in the source tree, so .venv and .venv-mxnet, installed from
the same tree, never replace each other's build (build_ext.install_for_environment).
"""
import importlib.util
import os
import runpy
import sysconfig
import tempfile
from glob import glob

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension
from pybind11.setup_helpers import build_ext as _build_ext
from setuptools import setup
from setuptools.errors import CompileError, PlatformError


def site_dirs(*sites: str) -> list[str]:
    """The site-packages folders ``sites`` and the folders their .pth files add, in the order
    the environment's Python puts them on sys.path (an environment can see another's packages
    through a .pth line; the isolated build does not process them)."""
    out: list[str] = []
    for d in dict.fromkeys(sites):
        out.append(d)
        try:
            pths = sorted(n for n in os.listdir(d) if n.endswith(".pth"))
        except OSError:
            continue
        for name in pths:
            try:
                with open(os.path.join(d, name), encoding="utf-8") as f:
                    lines = f.read().splitlines()
            except (OSError, UnicodeDecodeError):
                continue
            out += [os.path.join(d, ln.strip()) for ln in lines  # relative lines: to the site
                    if ln.strip() and not ln.startswith(("#", "import ", "import\t"))
                    and os.path.isdir(os.path.join(d, ln.strip()))]
    return out


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
    where += [os.path.join(d, "libucx") for d in site_dirs(paths["purelib"], paths["platlib"])]
    for loc in where:
        inc = os.path.join(loc, "include")
        if os.path.isfile(os.path.join(inc, "ucp", "api", "ucp.h")):
            return inc
    return None


# the sources compile at once, one per CPU (pybind11's ParallelCompile; setuptools compiles an
# extension's sources one after another): on 2 cores the build takes about half the time
ParallelCompile(default=0).install()

# the site-packages folder where an editable install keeps its environment's build of _core,
# defined once in byteps_like/_native.py (stdlib only), which finds the build there
HERE = os.path.dirname(os.path.abspath(__file__))
CORE_DIR = runpy.run_path(os.path.join(HERE, "byteps_like", "_native.py"))["CORE_DIR"]
UCX_INCLUDE = ucx_include_dir()
ext = Pybind11Extension(
    "byteps_like._core",
    sources=sorted(glob("csrc/*.cc")),
    include_dirs=["csrc"] + ([UCX_INCLUDE] if UCX_INCLUDE else []),
    define_macros=[("BPS_WITH_UCX", "1" if UCX_INCLUDE else "0")],
    cxx_std=17,
    extra_compile_args=["-O3", "-fno-math-errno", "-pthread"],
    extra_link_args=["-pthread", "-ldl"],  # dlopen: libucp (UCX), libcrypto (crypto.cc)
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
    def run(self) -> None:
        if not self.editable_mode:  # a wheel or `pip install .`: _core inside the package
            super().run()
            return
        # `pip install -e .`: setuptools would copy _core into the source tree, where every
        # environment installed from the tree would share it (the last build wins: a .venv-mxnet
        # build without UCX replaced the .venv one). Each environment keeps its own instead.
        self.inplace = False
        super().run()
        self.install_for_environment()

    def install_for_environment(self) -> None:
        """Put the build of an editable install into the editable wheel, so it lands in the
        environment's own site-packages (folder CORE_DIR), with a SOURCE file naming the source
        package it serves; byteps_like/_native.py finds it there (environment_core_dir)."""
        wheel_root = self.get_finalized_command("install").install_lib
        build_py = self.get_finalized_command("build_py")
        pkg = os.path.abspath(build_py.get_package_dir("byteps_like"))
        dest = os.path.join(wheel_root, CORE_DIR)
        os.makedirs(dest, exist_ok=True)
        built = os.path.join(self.build_lib, self.get_ext_filename(ext.name))
        self.copy_file(built, os.path.join(dest, os.path.basename(built)))
        with open(os.path.join(dest, "SOURCE"), "w") as f:
            f.write(pkg + "\n")
        # a build left in the tree by an older editable install would be what environments
        # without their own build load: this tree's builds live in environments now
        for name in os.listdir(pkg):
            if name.startswith("_core.") and name.endswith((".so", ".pyd")):
                os.remove(os.path.join(pkg, name))
                print(f"removed {os.path.join(pkg, name)}: an older build in the source tree "
                      "(each environment has its own build now)")

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
