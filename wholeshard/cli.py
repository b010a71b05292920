"""`wholeshard` command line: one subcommand per module, dispatched by argparse subparsers.

A subcommand module provides `add_parser(subparsers)`, which registers its parser and sets the
default `run=<function(args) -> int>`. Add new subcommands to `SUBCOMMANDS`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

SUBCOMMANDS = (
    "wholeshard.train.command",
    "wholeshard.layout_tool",
    "wholeshard.bench",
    "wholeshard.export",
)


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand registered."""
    parser = argparse.ArgumentParser(
        prog="wholeshard",
        description="Data-parallel training for matrix optimizers (Muon), "
        "every tensor whole on one rank.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in SUBCOMMANDS:
        importlib.import_module(module).add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (argparse errors exit with 2 directly)."""
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
