"""Transports: how frames move between nodes.

:class:`~byteps_like.transport.base.Endpoint` is the interface every transport implements;
:class:`~byteps_like.transport.zmq_transport.ZmqEndpoint` is the ZeroMQ implementation. Over
``inproc://`` addresses the same class is the in-process transport the unit tests use.
"""
from .base import Endpoint, Route
from .secret import auth_secret
from .zmq_transport import CurveKeys, ZmqEndpoint, derive_curve_keys

__all__ = ["CurveKeys", "Endpoint", "Route", "ZmqEndpoint", "auth_secret", "data_scheme",
           "derive_curve_keys", "make_endpoint", "uses_ucxx"]


def uses_ucxx(cfg) -> bool:
    """Whether a node's endpoint next to the native data plane (a server's listening socket
    for the server-held tables, a worker's connections to it) is the ucxx endpoint: only in
    a UCX job without a secret whose nodes are not on loopback. The ucxx endpoint can neither
    authenticate its peers nor listen on one address (it listens on every interface), so a
    UCX job with a secret, or on loopback, keeps that endpoint on ZeroMQ (CURVE with a
    secret); its data plane's UCX streams prove the secret themselves (issue 41)."""
    from .native import loopback_job
    return (cfg.transport.transport == "ucx" and not auth_secret(cfg)
            and not loopback_job(cfg))


def data_scheme(cfg) -> str:
    """The address scheme of a server's endpoint next to the data plane (servers bind it,
    workers connect with it): ``ucx`` where it is the ucxx endpoint (uses_ucxx), else ``tcp``."""
    return "ucx" if uses_ucxx(cfg) else "tcp"


def make_endpoint(name: str, cfg, *, context=None, data_plane: bool = True,
                  recv_hwm: int | None = None) -> Endpoint:
    """The endpoint for ``cfg.transport.transport``: ``zmq``, or ``ucx`` where uses_ucxx (the
    ucxx endpoint for ``ucx://`` addresses; ZeroMQ for the scheduler's ``tcp://`` control
    traffic). A node without data traffic (the scheduler: ``data_plane=False``) and a UCX job
    with a secret or on loopback get ZeroMQ, with CURVE when there is a secret.
    ``recv_hwm``: messages a client of a listening ZeroMQ socket may have waiting to be read,
    when fewer than BYTEPS_SOCKET_HWM (a server's: its clients' messages are large)."""
    from .native import zmq_max_connections
    kind = cfg.transport.transport if data_plane else "zmq"
    if kind == "ucx" and not uses_ucxx(cfg):
        kind = "zmq"   # the data plane's UCX streams are the native plane's (uses_ucxx)
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
        from ..config import ucx_environment
        from .ucx_transport import UcxEndpoint, UcxZmqEndpoint
        ucx = UcxEndpoint(name, max_message_bytes=cfg.transport.max_message_bytes,
                          ucx_env=ucx_environment(),
                          device_memory=cfg.transport.ucx_device_memory)
        zmq_ep = ZmqEndpoint(name, max_message_bytes=cfg.transport.max_message_bytes,
                             context=context, **bounds)
        return UcxZmqEndpoint(name, ucx, zmq_ep)
    raise ConfigError(f"BYTEPS_TRANSPORT={kind!r} is not available in this build")
