"""``python -m byteps_like.scheduler``: run the scheduler from the BytePS environment contract."""
from __future__ import annotations

import sys


def main() -> int:
    from ..config import load
    from ..errors import ConfigError
    from ..log import setup_logging
    try:
        cfg = load(overrides={"cluster.role": "scheduler"})
    except ConfigError as exc:
        print(f"byteps_like scheduler: {exc}", file=sys.stderr)
        return 2
    setup_logging(cfg.log.level, "scheduler")
    from .core import run
    code = run(cfg)
    if code:
        from .core import log
        log.error("scheduler: job failed")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
