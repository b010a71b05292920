"""What FSDP2-style equal shards would cost the same model per step, for comparison with a
plan's collectives (`costs.step_collectives`): the baseline of `wholeshard plan`'s latency
table in docs/planning.md.

FSDP2 (`fully_shard`) cuts every param along its first dim into dp equal rows, padding the dim
to a multiple of dp, and syncs one unit per `fully_shard` call: here one per transformer block
(the params under the first numbered module of their name, `layers.<i>`) and one for the rest
(the root: embeddings, final norm, head). Per step each unit is reduce-scattered over all dp
ranks (grad dtype) and all-gathered (param dtype; before forward, and again before backward
when resharding after forward, except the root's, which FSDP2 keeps); clipping adds one
all-reduce of the norm. A matrix optimizer over those shards would still need every matrix
whole for Newton-Schulz: that traffic is not counted, so the baseline is a floor.
`megabatch_all_to_alls` adds the traffic of one that does (dion's dense all-to-alls of
same-shape matrices padded to a multiple of dp), for docs/planning.md's comparison.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..planning.specs import ParamSpec, matrix_count, matrix_shape
from ..planning.sync import Collective
from .costs import Mode

ROOT = ""
"""The unit of params outside every numbered block."""


def unit_of(name: str) -> str:
    """The block a param belongs to: its name up to its first numeric component (`layers.3`),
    or `ROOT`."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ROOT


def padded_numel(shape: Sequence[int], dp: int) -> int:
    """Elements of a param of `shape` whose first dim is padded to a multiple of `dp`."""
    if not shape:
        return dp
    rows = math.ceil(shape[0] / dp) * dp
    return rows * math.prod(shape[1:])


def equal_shard_collectives(
    specs: Sequence[ParamSpec], dp: int, mode: Mode | None = None
) -> list[Collective]:
    """Every collective one rank issues in a step of FSDP2-style equal shards of `specs` over
    `dp` ranks in `mode` (its dtypes, resharding and clipping); empty at dp 1."""
    mode = mode or Mode()
    if dp == 1:
        return []
    units: dict[str, int] = {}
    for s in specs:
        units[unit_of(s.name)] = units.get(unit_of(s.name), 0) + padded_numel(s.shape, dp)
    grad, param = mode.grad_reduce_dtype, mode.param_dtype
    out = []
    for name, numel in units.items():
        out.append(Collective("reduce_scatter", dp, numel, grad, "grads", "dp"))
        gathers = 2 if mode.reshard_after_forward and name != ROOT else 1
        out += [Collective("all_gather", dp, numel, param, "params", "dp")] * gathers
    if mode.clip_grad_norm:
        out.append(Collective("all_reduce", dp, 1, "float32", "grad norm", "dp"))
    return out


def megabatch_all_to_alls(
    specs: Sequence[ParamSpec], dp: int, mode: Mode | None = None
) -> list[Collective]:
    """The dense all-to-alls a dion-style matrix optimizer adds to FSDP2's equal shards
    (microsoft/dion's `megabatch_orthogonalize_async`, which torchtitan vendors) in a step over
    `dp` ranks: per shape of Muon matrix (a stack counts each of its matrices), ceil(count / dp)
    megabatches of dp matrices (the last padded with zero matrices); per megabatch one dense
    all-to-all in the grad dtype brings matrix i whole to rank i (each rank sends its dim-0
    padded row shard of every other rank's matrix and receives the dp - 1 other shards of its
    own), and one in the param dtype sends the results back. Empty at dp 1."""
    mode = mode or Mode()
    if dp == 1:
        return []
    out = []
    for (m, n), count in matrix_shapes(specs).items():
        moved = (dp - 1) * math.ceil(m / dp) * n
        for dtype, what in ((mode.grad_reduce_dtype, "grads"), (mode.param_dtype, "params")):
            one = Collective("all_to_all", dp, moved, dtype, what, "dp", moved, dp - 1)
            out += [one] * math.ceil(count / dp)
    return out


def matrix_shapes(specs: Sequence[ParamSpec]) -> dict[tuple[int, int], int]:
    """How many Muon matrices of each (rows, cols) shape `specs` hold (a stack's each)."""
    out: dict[tuple[int, int], int] = {}
    for s in specs:
        if s.matrix and len(s.shape) >= 2:
            shape = matrix_shape(s.shape)
            out[shape] = out.get(shape, 0) + matrix_count(s.shape)
    return out
