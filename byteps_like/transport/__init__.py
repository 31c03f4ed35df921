"""Transports: how frames move between nodes.

:class:`~byteps_like.transport.base.Endpoint` is the interface every transport implements;
:class:`~byteps_like.transport.zmq_transport.ZmqEndpoint` is the ZeroMQ implementation. Over
``inproc://`` addresses the same class is the in-process transport the unit tests use.
"""
from .base import Endpoint, Route
from .zmq_transport import CurveKeys, ZmqEndpoint, derive_curve_keys

__all__ = ["CurveKeys", "Endpoint", "Route", "ZmqEndpoint", "auth_secret", "derive_curve_keys",
           "make_endpoint"]


def auth_secret(cfg) -> str:
    """The job's shared secret: BYTEPS_AUTH_SECRET, else the contents of
    BYTEPS_AUTH_SECRET_FILE, else "" (authentication off)."""
    if cfg.auth.secret:
        return cfg.auth.secret
    if cfg.auth.secret_file:
        from ..errors import ConfigError
        try:
            with open(cfg.auth.secret_file, encoding="utf-8") as f:
                secret = f.read().strip()
        except OSError as exc:
            raise ConfigError(f"BYTEPS_AUTH_SECRET_FILE={cfg.auth.secret_file!r}: cannot read "
                              f"the secret ({exc.strerror})") from None
        if not secret:
            raise ConfigError(f"BYTEPS_AUTH_SECRET_FILE={cfg.auth.secret_file!r} is empty")
        return secret
    return ""


def make_endpoint(name: str, cfg, *, context=None) -> Endpoint:
    """The endpoint for ``cfg.transport.transport`` (only ``zmq`` for now)."""
    kind = cfg.transport.transport
    if kind == "zmq":
        secret = auth_secret(cfg)
        curve = derive_curve_keys(secret) if secret else None
        return ZmqEndpoint(name, max_message_bytes=cfg.transport.max_message_bytes,
                           context=context, curve=curve)
    from ..errors import ConfigError
    raise ConfigError(f"BYTEPS_TRANSPORT={kind!r} is not available in this build")
