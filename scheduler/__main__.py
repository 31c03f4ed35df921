"""``python -m byteps_like.scheduler``: run the scheduler from the BytePS environment contract."""
from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    from ..roles import role_main
    from .core import log, run

    def run_and_report(cfg) -> int:
        code = run(cfg)
        if code:
            log.error("scheduler: job failed")
        return code
    return role_main("scheduler", run_and_report, argv)


if __name__ == "__main__":
    raise SystemExit(main())
