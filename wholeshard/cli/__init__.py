"""`wholeshard` command line: one subcommand per module of this package, dispatched by argparse.

A subcommand module provides `add_parser(subparsers)`, which registers its parser and sets the
default `run=<function(args) -> int>`. Add new subcommands to `SUBCOMMANDS`. The package holds
argparse and printing only; a subcommand imports its machinery (torch among it) when it runs,
so `wholeshard --help` and each subcommand's `--help` answer without importing torch.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
from collections.abc import Callable, Sequence

from . import interrupt

MAX_NPROC = 1024
"""Most local processes `--nproc` starts (`train`, `bench`): each is a full Python + torch
process."""

SUBCOMMANDS = (
    "wholeshard.cli.train",
    "wholeshard.cli.plan",
    "wholeshard.cli.bench",
    "wholeshard.cli.export",
)


def positive_int(high: int | None = None) -> Callable[[str], int]:
    """An argparse `type`: an integer >= 1, and <= `high` when given; anything else is an
    argparse error naming the flag and the accepted range."""
    what = "an integer >= 1" if high is None else f"an integer in [1, {high:,}]"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < 1 or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    parse.__name__ = what
    return parse


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand registered."""
    parser = argparse.ArgumentParser(
        prog="wholeshard",
        description="Data-parallel training for matrix optimizers (Muon), "
        "every matrix whole on one rank.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in SUBCOMMANDS:
        importlib.import_module(module).add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (argparse errors exit with 2 directly). Output cut
    short by its reader (`wholeshard plan | head`) ends quietly with 128 + SIGPIPE, as a
    program killed by SIGPIPE does; Ctrl-C ends it with 130 and one line, `wholeshard train:
    interrupted` (`wholeshard.cli.interrupt`)."""
    prog = "wholeshard"
    try:
        try:
            with interrupt.exits_at_once(lambda: prog):
                args = build_parser().parse_args(argv)  # (--help exits from here)
                prog = f"wholeshard {args.command}"
                return args.run(args)
        finally:
            sys.stdout.flush()  # here, not at exit, where a failed write cannot be caught
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the flush at exit writes nowhere
        return 128 + signal.SIGPIPE
    except KeyboardInterrupt:  # (from work under `interrupt.raises`, once it has cleaned up)
        print(interrupt.line(prog), file=sys.stderr)
        return interrupt.INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
