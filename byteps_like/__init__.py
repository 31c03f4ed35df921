"""byteps_like: a Python-first parameter-server framework for data-parallel training.

``import byteps_like as bps`` gives the framework-neutral API on numpy arrays; the framework
plugins live in ``byteps_like.torch`` and friends. Importing has no side effects: nothing connects
until :func:`init`.
"""
from .api import (Handle, Runtime, barrier, declare, init, local_rank, local_size, poll,
                  push_pull, push_pull_async, rank, shutdown, size, synchronize)
from .errors import (BytePSError, CommTimeoutError, CommunicationError, ConfigError,
                     MismatchError, NotInitializedError, PeerLostError, ProtocolError,
                     RemoteError)

__version__ = "0.1.0"

__all__ = ["Handle", "Runtime", "barrier", "declare", "init", "local_rank", "local_size", "poll",
           "push_pull", "push_pull_async", "rank", "shutdown", "size", "synchronize",
           "BytePSError", "CommTimeoutError", "CommunicationError", "ConfigError",
           "MismatchError", "NotInitializedError", "PeerLostError", "ProtocolError",
           "RemoteError", "__version__"]
