"""`python -m wholeshard.bench ...` runs the benchmark without the `wholeshard` command."""

import sys

from .command import build_parser, main

if __name__ == "__main__":
    sys.exit(main(build_parser().parse_args()))
