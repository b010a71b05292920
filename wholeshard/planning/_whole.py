"""The whole-tensor ("matrix") buffer: every param wholly inside one rank's shard.

Two strategies place the params: size matching ([Note: size matching] in `_rows`) and balanced
([Note: balanced] in `_balanced`). With `"balanced"` the size-matching buffer of the same params
is planned too and taken instead when it is at least as good on both counts (no more padding and
no more imbalance, one strictly less): a stack of identical blocks tiles exactly by size
matching, which balancing cannot beat.
"""

from __future__ import annotations

from ._balanced import plan_balanced
from ._rows import Row, buffer_of_rows, plan_rows
from .buffer import Buffer
from .specs import MatrixCost, ParamSpec, cost_imbalance, shape_cost


def plan_whole(
    specs: tuple[ParamSpec, ...],
    k: int,
    strategy: str,
    bucket_size: int | None,
    align: int,
    matrix_cost: MatrixCost | None,
) -> Buffer:
    """The `"matrix"` buffer of validated `specs` over `k` ranks (not yet checked); "balanced"
    balances `matrix_cost` (None: Newton-Schulz cost)."""
    matched = plan_rows(specs, k, bucket_size, align)
    if strategy == "size_match":
        return buffer_of_rows(specs, k, align, matched)
    balanced = plan_balanced(specs, k, bucket_size, align, matrix_cost)
    b, m = _scores(specs, k, matrix_cost, balanced, matched)
    chosen = matched if m != b and m[0] <= b[0] and m[1] <= b[1] else balanced
    return buffer_of_rows(specs, k, align, chosen)


def _scores(
    specs: tuple[ParamSpec, ...], k: int, matrix_cost: MatrixCost | None, *plans: list[list[Row]]
) -> list[tuple[float, float]]:
    """`(padding_fraction, cost_imbalance(rank_costs()))` of the buffer `buffer_of_rows` would
    make of each plan, without making it: every param is placed, and its owner is its rank."""
    used = sum(s.numel for s in specs)
    cost_of = {shape: shape_cost(shape, matrix_cost) for shape in {s.shape for s in specs}}
    costs = [cost_of[s.shape] for s in reversed(specs)]  # by backprop position
    scores = []
    for bucket_rows in plans:
        numel = k * sum(width for rows in bucket_rows for width, _ in rows)
        rank_costs = [0] * k
        for rows in bucket_rows:
            for _, entries in rows:
                for rank, pos, _ in entries:
                    rank_costs[rank] += costs[pos]
        scores.append((0.0 if numel == 0 else 1.0 - used / numel, cost_imbalance(rank_costs)))
    return scores
