"""The ``recompile`` command line.

Subcommands come from the modules in ``COMMAND_MODULES``. Each has ``register(subparsers)``, which adds
its parser(s) with ``subparsers.add_parser(...)`` and sets ``run`` on each with ``set_defaults(run=fn)``;
``fn(args) -> int`` is the exit code. A bad input from the command line raises ``UsageError``: it is
printed as one line and the exit code is 2, as for argparse's own errors.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

COMMAND_MODULES: list[str] = ["recompile.commands", "recompile.frontends.cli"]


class UsageError(Exception):
    """Bad input named on the command line (a model target, a file); reported as one line, exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="recompile", description="Inspect what the rec_ascend torch.compile backend does to a model."
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except UsageError as exc:
        print(f"recompile {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
