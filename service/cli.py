"""The ``bitserve`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of the ``bitserve`` command."""
    parser = argparse.ArgumentParser(prog="bitserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("serve", help="run the inference server")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``bitserve`` console script."""
    args = build_parser().parse_args(argv)
    print(f"bitserve {args.command}: not implemented yet", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
