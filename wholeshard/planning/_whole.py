"""The whole-tensor ("muon") buffer: every param wholly inside one rank's shard.

Two strategies place the params: size matching ([Note: size matching] in `_rows`) and balanced
([Note: balanced] in `_balanced`). With `"balanced"` the size-matching buffer of the same params
is planned too and taken instead when it is at least as good on both counts (no more padding and
no more imbalance, one strictly less): a stack of identical blocks tiles exactly by size
matching, which balancing cannot beat.
"""

from __future__ import annotations

from ._balanced import plan_balanced
from ._rows import buffer_of_rows, plan_rows
from .buffer import Buffer
from .specs import ParamSpec, cost_imbalance


def plan_whole(
    specs: tuple[ParamSpec, ...], k: int, bucket_size: int | None, align: int, strategy: str
) -> Buffer:
    """The `"muon"` buffer of validated `specs` over `k` ranks (not yet checked)."""
    matched = buffer_of_rows(specs, k, align, plan_rows(specs, k, bucket_size, align))
    if strategy == "size_match":
        return matched
    balanced = buffer_of_rows(specs, k, align, plan_balanced(specs, k, bucket_size, align))
    b = (balanced.padding_fraction, cost_imbalance(balanced.rank_costs()))
    m = (matched.padding_fraction, cost_imbalance(matched.rank_costs()))
    return matched if m != b and m[0] <= b[0] and m[1] <= b[1] else balanced
