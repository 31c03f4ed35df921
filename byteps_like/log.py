"""Logging setup shared by every role. BytePS's TRACE level maps to DEBUG, FATAL to CRITICAL."""
from __future__ import annotations

import logging
import sys

_LEVELS = {"TRACE": logging.DEBUG, "DEBUG": logging.DEBUG, "INFO": logging.INFO,
           "WARNING": logging.WARNING, "ERROR": logging.ERROR, "FATAL": logging.CRITICAL}


def setup_logging(level: str, who: str) -> logging.Logger:
    """Configure the ``byteps_like`` logger once per process (no effect on the root logger)."""
    logger = logging.getLogger("byteps_like")
    logger.setLevel(_LEVELS.get(level.upper(), logging.WARNING))
    if not any(getattr(h, "_bpsl", False) for h in logger.handlers):
        h: logging.Handler = logging.StreamHandler(sys.stderr)
        h._bpsl = True  # type: ignore[attr-defined]
        logger.addHandler(h)
        logger.propagate = False
    for h in logger.handlers:
        if getattr(h, "_bpsl", False):
            h.setFormatter(logging.Formatter(f"[%(asctime)s %(levelname)s {who}] %(message)s",
                                             "%H:%M:%S"))
    return logger
