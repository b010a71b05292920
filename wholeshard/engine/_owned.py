"""What a rank updates: the ranges of params it owns under the plan, as views of its storage."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..planning import Buffer, Placement, Plan
from ..planning.routing import Route

if TYPE_CHECKING:
    from ._storage import StorageUnit


@dataclass(frozen=True)
class OwnedRange:
    """Elements `[offset, offset + param.numel())` of a flattened param that this rank updates.

    `param` and `grad` are views of storage this rank keeps between steps: shaped like the param
    when the range is the whole tensor, like one matrix when it is a matrix of a stacked param,
    1-D otherwise.
    """

    route: Route
    offset: int
    param: torch.Tensor
    grad: torch.Tensor
    unit: int
    """Index of the unit holding the range in `DataParallel.units` (reduce order)."""


def owned_ranges(
    plan: Plan, routes: list[Route], shard_rank: int, units: Mapping[str, StorageUnit]
) -> Iterator[OwnedRange]:
    """The ranges shard rank `shard_rank` owns, in the order of `routes`; `units` maps each
    param name to the storage of its unit."""
    ranges: dict[str, list[tuple[Placement, int, int, Buffer]]] = {}
    for buffer in plan.buffers:
        for p, offset, length in buffer.owned(shard_rank):
            ranges.setdefault(p.name, []).append((p, offset, length, buffer))
    for route in routes:
        for p, offset, length, buffer in ranges.get(route.name, ()):
            unit = units[p.name]
            lo = p.start + offset
            param, grad = unit.owned_views(lo, lo + length)
            shape = buffer.piece_shape(p, length)
            yield OwnedRange(route, offset, param.view(shape), grad.view(shape), unit.index)
