"""The one place that imports MXNet, lazily, with an error that says how to get a working one.

MXNet 1.9.1 (its last release) uses numpy aliases removed in numpy 1.24 (``np.bool``, ...), so
it imports only with numpy < 1.24; byteps_like needs numpy >= 1.23. It therefore lives in its own
environment (``bash scripts/setup_mxnet.sh`` makes ``.venv-mxnet`` with numpy 1.23.5). numpy is
never patched from here.
"""
from __future__ import annotations

import warnings
from types import ModuleType

WORKING_NUMPY = ">=1.23,<1.24"  # byteps_like's floor, MXNet 1.9.1's ceiling

_mx: ModuleType | None = None


def mx() -> ModuleType:
    """The ``mxnet`` module; ImportError naming the working numpy range when it cannot load."""
    global _mx
    if _mx is None:
        try:
            with warnings.catch_warnings():  # MXNet 1.9.1 touches numpy's deprecated aliases
                warnings.simplefilter("ignore", DeprecationWarning)
                import mxnet
        except Exception as exc:  # AttributeError on numpy>=1.24, OSError on a bad libmxnet
            import numpy
            raise ImportError(
                f"byteps_like.mxnet could not import mxnet ({type(exc).__name__}: {exc}). "
                f"It needs mxnet 1.9.1 with numpy{WORKING_NUMPY} (MXNet 1.9.1 breaks on the "
                f"aliases numpy 1.24 removed; found numpy {numpy.__version__}). Use a separate "
                "environment: bash scripts/setup_mxnet.sh, or pip install "
                f"'mxnet==1.9.1' 'numpy{WORKING_NUMPY}'") from exc
        _mx = mxnet
    return _mx
