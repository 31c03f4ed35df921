"""Build of the native extension byteps_like._core (everything else is in pyproject.toml)."""
from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

ext = Pybind11Extension(
    "byteps_like._core",
    sources=sorted(__import__("glob").glob("csrc/*.cc")),
    include_dirs=["csrc"],
    cxx_std=17,
    extra_compile_args=["-O3", "-fno-math-errno", "-pthread"],
    extra_link_args=["-pthread"],
)

setup(ext_modules=[ext], cmdclass={"build_ext": build_ext})
