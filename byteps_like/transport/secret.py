"""The job's shared secret (BYTEPS_AUTH_SECRET, BYTEPS_AUTH_SECRET_FILE), which the ZeroMQ
endpoints (CURVE keys) and the native data plane's handshake (:func:`byteps_like.transport.native.
auth_key`) both derive their keys from: a module of its own, so neither imports the other for it.
"""
from __future__ import annotations

from ..errors import ConfigError


def auth_secret(cfg) -> str:
    """The job's shared secret: BYTEPS_AUTH_SECRET, else the contents of
    BYTEPS_AUTH_SECRET_FILE, else "" (authentication off)."""
    if cfg.auth.secret:
        return cfg.auth.secret
    if cfg.auth.secret_file:
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
