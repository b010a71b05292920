"""Shapes files: a model's params from a JSON file, for planning without building the model.

    {"params": [{"name": str, "shape": [int, ...], "matrix": bool, "tied": bool}, ...]}

in registration order; `matrix` and `tied` are optional (`tied` defaults to false, `matrix` to
`routing.matrix_by_name`). `load_shapes` raises `ShapesError` naming the file, the entry and what
is wrong.
"""

from __future__ import annotations

import json
import math
from typing import Any

from ..planning.plan import shape_problem
from ..planning.routing import matrix_by_name
from ..planning.specs import ParamSpec, matrix_count

MAX_NUMEL = (1 << 63) - 1
"""Elements a param, and the model's buffers, can hold at most: torch counts them in int64."""
MAX_MATRICES = 1 << 20
"""Matrices all stacked (Muon, more than 2 dims) params may hold together: the plan places
each one, and real MoE models have thousands."""
_FIELDS = {"name", "shape", "matrix", "tied"}


class ShapesError(ValueError):
    """A shapes file that cannot be read or does not describe params."""


def load_shapes(path: str) -> list[ParamSpec]:
    """The specs in the shapes file at `path`, routed by `matrix_by_name` where `matrix` is absent.
    Raises ShapesError naming the file, the entry and what is wrong."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ShapesError(f"cannot read shapes file {path!r}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ShapesError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ShapesError(
            f"{path}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}); expected "
            '{"params": [{"name": ..., "shape": [...]}, ...]}'
        ) from None
    except RecursionError:
        raise ShapesError(f"{path}: JSON nested too deeply to be a shapes file") from None
    if not isinstance(data, dict) or not isinstance(data.get("params"), list):
        raise ShapesError(
            f'{path}: expected an object with a "params" list, e.g. {{"params": [{{"name": '
            f'"fc.weight", "shape": [1024, 256]}}]}}'
        )
    specs = [_spec(path, i, entry) for i, entry in enumerate(data["params"])]
    total = sum(spec.numel for spec in specs)
    if total > MAX_NUMEL:
        raise ShapesError(
            f"{path}: the params hold {total:,} elements together, more than a torch buffer can "
            f"(2**63 - 1)"
        )
    stacked = sum(matrix_count(s.shape) for s in specs if s.matrix and len(s.shape) > 2)
    if stacked > MAX_MATRICES:
        raise ShapesError(
            f"{path}: the stacked (Muon, more than 2 dims) params hold {stacked:,} matrices "
            f'together, more than {MAX_MATRICES:,}; route some to AdamW with "matrix": false'
        )
    return specs


def _spec(path: str, i: int, entry: Any) -> ParamSpec:
    where = f"{path}: params[{i}]"
    if not isinstance(entry, dict):
        raise ShapesError(f"{where}: expected an object with name and shape, got {entry!r}")
    unknown = sorted(set(entry) - _FIELDS)
    if unknown:
        raise ShapesError(f"{where}: unknown field(s) {unknown}; the fields are {sorted(_FIELDS)}")
    for field in ("name", "shape"):
        if field not in entry:
            raise ShapesError(f"{where}: missing field {field!r}")
    name, shape = entry["name"], entry["shape"]
    if not isinstance(name, str) or not name:
        raise ShapesError(f"{where}: name must be a non-empty string, got {name!r}")
    where = f"{where} ({name!r})"
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) for d in shape
    ):
        raise ShapesError(f"{where}: shape must be a list of ints, got {shape!r}")
    problem = shape_problem(shape)
    if problem is not None:
        raise ShapesError(f"{where}: {problem}")
    if math.prod(shape) > MAX_NUMEL:
        raise ShapesError(
            f"{where}: shape {shape} has {math.prod(shape):,} elements, more than a torch "
            f"tensor can hold (2**63 - 1)"
        )
    for field in ("matrix", "tied"):
        if field in entry and not isinstance(entry[field], bool):
            raise ShapesError(f"{where}: {field} must be true or false, got {entry[field]!r}")
    tied = entry.get("tied", False)
    matrix = entry.get("matrix", matrix_by_name(name, shape, tied))
    return ParamSpec(name, tuple(shape), matrix=matrix, tied=tied)
