"""The ``recompile`` command line."""
from __future__ import annotations

import argparse
import sys

from recompile.frontends import cli as frontends_cli


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="recompile", description="the rec_ascend compiler's command line")
    subparsers = parser.add_subparsers(dest="command", required=True)
    frontends_cli.register(subparsers)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
