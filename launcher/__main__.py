"""``bpslaunch`` / ``python -m byteps_like.launcher``: see docs/launcher.md."""
from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Console-script entry point; returns the exit status."""
    from .cli import main as cli_main
    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
