"""The summation server role (``python -m byteps_like.server``)."""
from .core import Server, run

__all__ = ["Server", "run"]
