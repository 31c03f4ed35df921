"""Transports: how frames move between nodes.

:class:`~byteps_like.transport.base.Endpoint` is the interface every transport implements;
:class:`~byteps_like.transport.zmq_transport.ZmqEndpoint` is the ZeroMQ implementation. Over
``inproc://`` addresses the same class is the in-process transport the unit tests use. Every
node's endpoint is a ZeroMQ one, whatever BYTEPS_TRANSPORT says: that setting chooses the
streams of the native data plane (TCP, or UCX with ``ucx``), not the endpoint (issue 39
retired the ucxx endpoint that UCX jobs without a secret used for the server-held tables).
"""
from .base import Endpoint, Route
from .secret import auth_secret
from .zmq_transport import CurveKeys, ZmqEndpoint, derive_curve_keys

__all__ = ["CurveKeys", "Endpoint", "Route", "ZmqEndpoint", "auth_secret", "derive_curve_keys",
           "make_endpoint"]


def make_endpoint(name: str, cfg, *, context=None, data_plane: bool = True,
                  recv_hwm: int | None = None) -> Endpoint:
    """A node's ZeroMQ endpoint (CURVE when the job has a secret): control, and a server's
    listening socket for the server-held tables and a worker's connections to it, over TCP
    and UCX jobs alike. ``data_plane``: whether a native data plane listens next to it (not
    the scheduler's), which takes part of the descriptor budget. ``recv_hwm``: messages a
    client of a listening socket may have waiting to be read, when fewer than
    BYTEPS_SOCKET_HWM (a server's: its clients' messages are large)."""
    from .native import zmq_max_connections
    secret = auth_secret(cfg)
    # a listening socket's bounds (issue 19): queues per client, clients per socket
    return ZmqEndpoint(name, max_message_bytes=cfg.transport.max_message_bytes, context=context,
                       curve=derive_curve_keys(secret) if secret else None,
                       hwm=cfg.transport.socket_hwm, recv_hwm=recv_hwm,
                       max_connections=zmq_max_connections(cfg, data_plane))
