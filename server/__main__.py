"""``python -m byteps_like.server``: run a summation server from the BytePS environment contract."""
from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    from ..roles import role_main
    from .core import run
    return role_main("server", run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
