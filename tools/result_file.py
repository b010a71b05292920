"""How the measuring tools write their results: `write_measured`, `write_results`; and
`per_preset`, the loop over presets they share."""

from __future__ import annotations

import datetime
import json
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any


def write_results(path: str | Path, doc: Any, said: str | None = None) -> Path:
    """Write `doc` to `path` as JSON, indented a space a level and ending in a newline (the
    files under docs/results/), making its folder; then, given `said`, print `said` and the
    path on stderr."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    if said is not None:
        print(f"{said} {path}", file=sys.stderr)
    return path


def write_measured(path: str | Path, machine: Any, said: str, **fields: Any) -> Path:
    """`write_results` of a measurement: today's date, the `machine` it was measured on, then
    `fields`, in that order."""
    doc = {"date": datetime.date.today().isoformat(), "machine": machine, **fields}
    return write_results(path, doc, said)


def per_preset(tool: str, names: Iterable[str], rows_of: Callable[[str], list[Any]]) -> list[Any]:
    """`rows_of(name)` for every preset name, concatenated; prints on stderr how long each took,
    as `tool: name in S s`."""
    rows: list[Any] = []
    for name in names:
        start = time.perf_counter()
        rows += rows_of(name)
        print(f"{tool}: {name} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return rows
