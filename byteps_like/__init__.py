"""byteps_like: a Python-first parameter-server framework for data-parallel training.

``import byteps_like as bps`` gives the framework-neutral API on numpy arrays; the framework
plugins live in ``byteps_like.torch`` and friends. Importing has no side effects: nothing connects
until :func:`init`, and the submodules load on first use (so ``python -m byteps_like.config`` and
the launcher stay light).
"""
from __future__ import annotations

import importlib

from ._native import environment_core_dir as _core_dir

__version__ = "0.1.0"

# an editable install's _core lives in this environment's site-packages, not in this folder
# (_native.py: one build per environment)
if (_where := _core_dir(__path__[0])) is not None:
    __path__.insert(0, _where)

_API = ("Handle", "Runtime", "allgather", "barrier", "cross_rank", "cross_size", "declare",
        "get_pushpull_speed", "init", "join", "local_rank", "local_size", "poll",
        "push_pull", "push_pull_async", "rank", "shutdown", "size", "synchronize",
        "embedding_table", "set_progress")
_ERRORS = ("BytePSError", "CommTimeoutError", "CommunicationError", "ConfigError",
           "MembershipChangedError", "MismatchError", "NotInitializedError", "PeerLeftError",
           "PeerLostError", "ProtocolError", "RemoteError", "TooFewWorkersError")

__all__ = [*_API, *_ERRORS, "__version__"]


def __getattr__(name: str):
    if name == "_core":  # `from . import _core` asks here first: a missing build says what to do
        from ._native import load_core
        return load_core()
    if name in _API:
        return getattr(importlib.import_module(".worker.api", __name__), name)
    if name in _ERRORS:
        return getattr(importlib.import_module(".errors", __name__), name)
    raise AttributeError(f"module 'byteps_like' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
