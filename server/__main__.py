"""``python -m byteps_like.server``: run a summation server from the BytePS environment contract."""
from __future__ import annotations

import sys


def main() -> int:
    from ..config import load
    from ..errors import ConfigError
    from ..log import setup_logging
    try:
        cfg = load(overrides={"cluster.role": "server"})
    except ConfigError as exc:
        print(f"byteps_like server: {exc}", file=sys.stderr)
        return 2
    setup_logging(cfg.log.level, "server")
    from .core import run
    return run(cfg)


if __name__ == "__main__":
    raise SystemExit(main())
