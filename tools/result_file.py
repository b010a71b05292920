"""How the measuring tools write their results: `write_results`."""

from __future__ import annotations

import json
import sys
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
