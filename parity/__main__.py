"""Entry point of ``python -m parity`` and the ``parity`` console script."""

from __future__ import annotations

import sys

from .runner.cli import main as _main


def main(argv=None) -> int:
    return _main(argv)


if __name__ == "__main__":
    sys.exit(main())
