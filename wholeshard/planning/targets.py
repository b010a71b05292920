"""What a good plan is, measured from shapes: the targets every automatic choice (strategy and
shard-group size, in `auto`) holds a plan to, and one planned candidate's figures against them.

[Note: plan targets]
- largest storage unit (a bucket, or the buckets a stacked param runs across: they complete
  and are materialised together) <= the bucket limit, max(100M elements, 2 x the largest layer,
  `specs.layer_of`, MoE experts included), or, where larger, the element-wise bucket of a param
  wider than that (the element-wise planner keeps a param inside one bucket, so no plan shrinks
  it);
- padding <= 1% beyond the alignment padding every plan has (each param rounded up to `align`
  elements: none for the presets, a few % for toy models);
- Newton-Schulz imbalance (max / mean over the shard group of the cost of owned matrices, the
  very cost the planners balance: `Plan.rank_costs`) <= 1.10.
A candidate misses by its overshoot, max(largest bucket / bucket limit, (1 - padding limit) /
(1 - padding), imbalance / 1.10): each the factor by which what its target protects grows
(bucket bytes, buffer memory, the busiest rank's Newton-Schulz time).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

from ._elementwise import plan_elementwise
from .buffer import KINDS, Buffer
from .plan import Plan, default_bucket_size, plan_buffer, specs_by_kind
from .specs import (
    MatrixCost,
    ParamSpec,
    cost_imbalance,
    layer_of,
    matrix_count,
    matrix_shape,
    round_up,
    shape_cost,
)

MIN_BUCKET_LIMIT = 100_000_000
"""The bucket limit is never below this many elements: smaller buckets cost latency."""
LAYERS_PER_BUCKET = 2
"""The bucket limit is at least this many of the largest layer."""
MAX_PADDING = 0.01
MAX_IMBALANCE = 1.10


def largest_layer(specs: Sequence[ParamSpec]) -> int:
    """Elements of the largest layer (`specs.layer_of`; params outside numbered modules belong
    to none); with no numbered module at all, the largest param. 0 for no specs."""
    groups: dict[str, int] = {}
    for s in specs:
        layer = layer_of(s.name)
        if layer is not None:
            groups[layer] = groups.get(layer, 0) + s.numel
    return max(groups.values()) if groups else max((s.numel for s in specs), default=0)


def bucket_target(specs: Sequence[ParamSpec]) -> int:
    """max(`MIN_BUCKET_LIMIT`, `LAYERS_PER_BUCKET` x `largest_layer`): the bucket bound."""
    return max(MIN_BUCKET_LIMIT, LAYERS_PER_BUCKET * largest_layer(specs))


def bucket_limit_at(target: int, elementwise: Buffer | None) -> int:
    """The bucket limit of a plan whose element-wise buffer is `elementwise`: `target`, or the
    largest element-wise bucket holding a param wider than `target` ([Note: plan targets])."""
    if elementwise is None:
        return target
    wide = {p.bucket for p in elementwise.placements if p.numel > target}
    return max([target, *(elementwise.buckets[b].numel for b in wide)])


def largest_unit(plan: Plan) -> int:
    """Elements of the plan's largest storage unit (`Buffer.storage_units`)."""
    return max(
        (
            buffer.buckets[run.stop - 1].end - buffer.buckets[run.start].start
            for buffer in plan.buffers
            for run in buffer.storage_units()
        ),
        default=0,
    )


def bucket_size_for(used: int, k: int, strategy: str) -> int:
    """The default bucket size of a plan at k: `default_bucket_size(used, k)` for equal shards
    of whole matrices (a bucket is reduce-scattered over k ranks, so it is sized for k); with
    owner buckets, which need no room per rank, and exchange buckets, which close at a layer's
    end once they hold it (so a large model's layer is a bucket), the size for one rank."""
    return default_bucket_size(used, 1 if strategy in ("owners", "exchange") else k)


class Shapes:
    """What the bounds and the planners need, read once from validated specs."""

    def __init__(
        self, specs: tuple[ParamSpec, ...], align: int, matrix_cost: MatrixCost | None
    ) -> None:
        self.align, self.matrix_cost = align, matrix_cost
        self.specs = specs
        self.by_kind = specs_by_kind(specs)
        whole = self.by_kind.get("matrix", [])
        self.used = sum(s.numel for s in specs)
        aligned = sum(round_up(s.numel, align) for s in specs)
        # 1% beyond the alignment padding every plan has (each param starts aligned)
        self.padding_limit = MAX_PADDING + (aligned - self.used) / aligned if aligned else 1.0
        self.whole_used = sum(s.numel for s in whole)
        self.widest = max((round_up(s.numel, align) for s in whole), default=0)
        self.widest_tied = max((round_up(s.numel, align) for s in whole if s.tied), default=0)
        stacked = self.by_kind.get("stacked", [])
        self.widest_matrix = max(
            (round_up(math.prod(matrix_shape(s.shape)), align) for s in stacked), default=0
        )
        muon = [s for s in specs if s.matrix and len(s.shape) >= 2]
        # the planners' own cost of one matrix (`Plan.rank_costs`), per Muon spec
        cache = {
            shape: shape_cost(shape, matrix_cost) for shape in {matrix_shape(s.shape) for s in muon}
        }
        costs = [cache[matrix_shape(s.shape)] for s in muon]
        self.total_cost = sum(c * matrix_count(s.shape) for c, s in zip(costs, muon, strict=True))
        self.costliest = max(costs, default=0)

    def elementwise(self, k: int, bucket_size: int) -> Buffer | None:
        """The element-wise buffer at k (cheap: no search), None without element-wise specs."""
        specs = self.by_kind.get("adamw")
        return None if specs is None else plan_elementwise(tuple(specs), k, bucket_size, self.align)

    def hopeless(self, k: int, limit: int, equal_shards: bool) -> str | None:
        """Why no plan at k (`equal_shards`: of equal-shard buckets) can meet the targets (a
        lower bound over its limit), or None."""
        if self.total_cost and self.costliest * k / self.total_cost > MAX_IMBALANCE:
            return "the costliest matrix alone > 1.10 x the mean"
        if not equal_shards:
            return None
        if k * max(self.widest, self.widest_matrix) > limit:
            return "k x the widest matrix > the bucket limit"
        padded = max(k * self.widest - self.whole_used, (k - 1) * self.widest_tied, 0)
        if padded and padded / (self.used + padded) > self.padding_limit:
            return "the widest matrix's bucket pads over the limit"
        return None

    def plan(
        self, dp: int, k: int, bucket_size: int, strategy: str, elementwise: Buffer | None
    ) -> Plan:
        """What `plan_exactly` makes of the specs at k with `strategy` (not "auto"), not yet
        checked (the specs are validated), given its element-wise buffer."""
        cost = self.matrix_cost
        by_kind = specs_by_kind(self.specs, strategy) if strategy == "exchange" else self.by_kind
        buffers = tuple(
            elementwise
            if kind == "adamw"
            else plan_buffer(kind, tuple(by_kind[kind]), k, bucket_size, self.align, strategy, cost)  # type: ignore[arg-type]
            for kind in KINDS
            if kind in by_kind
        )
        return Plan(dp, k, strategy, self.align, bucket_size, buffers, cost)  # type: ignore[arg-type]


class Figures:
    """A planned candidate and its figures against [Note: plan targets]; the per-rank matrix
    costs only when asked (a plan that misses the bucket or padding target fails without
    them). Invariant: `imbalance` is `plan.ns_cost_imbalance`, the figure the planner balanced."""

    def __init__(
        self, k: int, bucket_size: int, limit: int, padding_limit: float, plan: Plan
    ) -> None:
        self.k, self.bucket_size, self.limit, self.plan = k, bucket_size, limit, plan
        self.padding_limit = padding_limit
        self.largest = largest_unit(plan)
        self.padding = plan.padding_fraction

    @functools.cached_property
    def costs(self) -> list[int]:
        """`Plan.rank_costs`: each rank's cost of its matrices, as the planner counts it."""
        return self.plan.rank_costs()

    @property
    def imbalance(self) -> float:
        return cost_imbalance(self.costs)

    @property
    def ok(self) -> bool:
        return (
            self.largest <= self.limit
            and self.padding <= self.padding_limit
            and self.imbalance <= MAX_IMBALANCE
        )

    @property
    def overshoot(self) -> float:
        """The worst factor by which a figure exceeds its target (<= 1: every target met)."""
        memory = (1 - self.padding_limit) / (1 - self.padding) if self.padding < 1 else math.inf
        return max(self.largest / self.limit, memory, self.imbalance / MAX_IMBALANCE)
