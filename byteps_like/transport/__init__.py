"""Transports: how frames move between nodes.

:class:`~byteps_like.transport.base.Endpoint` is the interface every transport implements;
:class:`~byteps_like.transport.zmq_transport.ZmqEndpoint` is the ZeroMQ implementation. Over
``inproc://`` addresses the same class is the in-process transport the unit tests use.
"""
from .base import Endpoint, Route
from .zmq_transport import ZmqEndpoint

__all__ = ["Endpoint", "Route", "ZmqEndpoint", "make_endpoint"]


def make_endpoint(name: str, cfg, *, context=None) -> Endpoint:
    """The endpoint for ``cfg.transport.transport`` (only ``zmq`` for now)."""
    kind = cfg.transport.transport
    if kind == "zmq":
        return ZmqEndpoint(name, max_message_bytes=cfg.transport.max_message_bytes,
                           context=context)
    from ..errors import ConfigError
    raise ConfigError(f"BYTEPS_TRANSPORT={kind!r} is not available in this build")
