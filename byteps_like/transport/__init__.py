"""Transports: how frames move between nodes.

:class:`~byteps_like.transport.base.Endpoint` is the interface every transport implements;
:class:`~byteps_like.transport.zmq_transport.ZmqEndpoint` is the ZeroMQ implementation. Over
``inproc://`` addresses the same class is the in-process transport the unit tests use.
"""
from .base import Endpoint, Route
from .secret import auth_secret
from .zmq_transport import CurveKeys, ZmqEndpoint, derive_curve_keys

__all__ = ["CurveKeys", "Endpoint", "Route", "ZmqEndpoint", "auth_secret", "data_scheme",
           "derive_curve_keys", "make_endpoint"]


def data_scheme(cfg) -> str:
    """The address scheme of the data plane (servers bind it, workers connect with it)."""
    return "ucx" if cfg.transport.transport == "ucx" else "tcp"


def make_endpoint(name: str, cfg, *, context=None, data_plane: bool = True,
                  recv_hwm: int | None = None) -> Endpoint:
    """The endpoint for ``cfg.transport.transport``: ``zmq``, or ``ucx`` (UCX for ``ucx://``
    addresses, the data plane; ZeroMQ for the scheduler's ``tcp://`` control traffic). A node
    without data traffic (the scheduler: ``data_plane=False``) always gets ZeroMQ.
    ``recv_hwm``: messages a client of a listening ZeroMQ socket may have waiting to be read,
    when fewer than BYTEPS_SOCKET_HWM (a server's: its clients' messages are large)."""
    from .native import zmq_max_connections
    kind = cfg.transport.transport if data_plane else "zmq"
    # a listening socket's bounds (issue 19): queues per client, clients per socket
    bounds = {"hwm": cfg.transport.socket_hwm, "recv_hwm": recv_hwm,
              "max_connections": zmq_max_connections(cfg, data_plane)}
    if kind == "zmq":
        secret = auth_secret(cfg)
        curve = derive_curve_keys(secret) if secret else None
        return ZmqEndpoint(name, max_message_bytes=cfg.transport.max_message_bytes,
                           context=context, curve=curve, **bounds)
    from ..errors import ConfigError
    if kind == "ucx":
        if auth_secret(cfg):
            raise ConfigError("BYTEPS_AUTH_SECRET (or BYTEPS_AUTH_SECRET_FILE) is set with "
                              "BYTEPS_TRANSPORT=ucx: UCX traffic is neither authenticated nor "
                              "encrypted, so the secret could not protect it; unset the secret "
                              "and keep the job on a trusted network, or use "
                              "BYTEPS_TRANSPORT=zmq (docs/transports.md)")
        from ..config import ucx_environment
        from .ucx_transport import UcxEndpoint, UcxZmqEndpoint
        ucx = UcxEndpoint(name, max_message_bytes=cfg.transport.max_message_bytes,
                          ucx_env=ucx_environment(),
                          device_memory=cfg.transport.ucx_device_memory)
        zmq_ep = ZmqEndpoint(name, max_message_bytes=cfg.transport.max_message_bytes,
                             context=context, **bounds)
        return UcxZmqEndpoint(name, ucx, zmq_ep)
    raise ConfigError(f"BYTEPS_TRANSPORT={kind!r} is not available in this build")
