"""Shapes files: a model's params from a JSON file, for planning without building the model.

    {"params": [{"name": str, "shape": [int, ...], "matrix": bool, "tied": bool}, ...]}

in registration order. `matrix` is required: a file states each param's route, as
`routing.route_params` would decide it on the model; nothing guesses it from the name. `tied` is
optional (false). `load_shapes` raises `ShapesError` naming the file, the entry and what is
wrong (for a missing `matrix`, what to write). `write_shapes` writes specs as a file
`load_shapes` reads back equal (from a module: `model_shapes.module_specs`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from ..planning.plan import shape_problem
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
    """The specs in the shapes file at `path`, each routed by its `matrix` field. Raises
    ShapesError naming the file, the entry and what is wrong."""
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
            '{"params": [{"name": ..., "shape": [...], "matrix": ...}, ...]}'
        ) from None
    except RecursionError:
        raise ShapesError(f"{path}: JSON nested too deeply to be a shapes file") from None
    if not isinstance(data, dict) or not isinstance(data.get("params"), list):
        raise ShapesError(
            f'{path}: expected an object with a "params" list, e.g. {{"params": [{{"name": '
            f'"fc.weight", "shape": [1024, 256], "matrix": true}}]}}'
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


def write_shapes(path: str, specs: Sequence[ParamSpec]) -> None:
    """Write `specs` (registration order) to `path` as a shapes file, one param a line, that
    `load_shapes` reads back equal."""
    entries = [
        {"name": s.name, "shape": list(s.shape), "matrix": s.matrix}
        | ({"tied": True} if s.tied else {})
        for s in specs
    ]
    lines = ",\n".join(f"  {json.dumps(e)}" for e in entries)
    with open(path, "w", encoding="utf-8") as f:
        f.write(f'{{"params": [\n{lines}\n]}}\n')


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
    if "matrix" not in entry:
        raise ShapesError(f"{where}: {_missing_matrix(shape)}")
    return ParamSpec(name, tuple(shape), matrix=entry["matrix"], tied=entry.get("tied", False))


def _missing_matrix(shape: list[int]) -> str:
    """What to write for a missing `matrix` field: the module rule's answer where the shape alone
    decides it, else the rule itself (`routing.route_params`, [Note: the routing rule])."""
    if len(shape) < 2:
        return (
            f'missing field "matrix"; add "matrix": false (shape {shape} has fewer than 2 dims: '
            "a norm, a bias or a scalar goes to AdamW by the routing rule)"
        )
    return (
        f'missing field "matrix" (the route of this {len(shape)}-D param); add "matrix": true '
        'if it is the weight of a hidden layer (Muon, the matrix rule), or "matrix": false if '
        "it is an embedding, the output head (tied or not) or a convolution kernel (AdamW), as "
        "wholeshard.route_params decides on the model"
    )
