"""`wholeshard bench`: wholeshard against the distributed Muon setups users would pick instead.

Register it on a CLI with `add_parser(subparsers)`; `main(args)` runs it. Modules: `workloads`
(the work), `configs` (the registry of configurations), `worker` (one rank's run), `traffic`
(bytes sent), `waits` (blocked time), `memory`, `report` and `plot` (output), `command` (CLI).
"""

from .command import add_parser, build_parser, main

__all__ = ["add_parser", "build_parser", "main"]
