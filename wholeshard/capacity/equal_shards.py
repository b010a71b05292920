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
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..planning.specs import ParamSpec
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
