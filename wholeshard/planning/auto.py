"""Automatic shard groups: the shard-group size k a plan should use on dp ranks, from shapes.

[Note: automatic shard groups]
A whole-tensor bucket of k shards holds each of its matrices whole in one shard, so a bucket
holding a matrix of w elements has at least k * w: past a few dozen ranks one bucket is most of
the model, and padding and Newton-Schulz imbalance grow with k. Shard groups of k < dp ranks
(replicated dp / k times) bound the buckets, at the price of dp / k copies of the optimizer state
and an all-reduce across replicas. `auto_shard_group_size` picks k:

- targets of a plan: largest bucket <= the bucket limit, max(100M elements, 2 x the largest
  layer) (a layer: the params sharing a name prefix up to the first numbered module,
  `model.layers.7`, MoE experts included), or, where larger, the element-wise bucket of a param
  wider than that (the element-wise planner keeps a param inside one bucket, so no k shrinks
  it); padding <= 1% beyond the alignment padding every plan has (each param rounded up to
  `align` elements: none for the presets, a few % for toy models); Newton-Schulz imbalance (max
  / mean over the shard group of the flops of owned matrices, `projection.ns_flops`) <= 1.10;
- candidates: a ladder of divisors of dp: dp, and for each power of two p < dp the largest
  divisor of dp at most p (every power of two dividing dp among them; dp a power of two: its
  powers of two), so at most log2(dp) + 2;
- a candidate that a cheap bound shows must miss a target is passed over unplanned: k x the
  widest 2-D Muon param over the bucket limit, the padding that bucket forces over the padding
  limit, the costliest matrix over 1.10 x the mean (k = 1, the last, is always planned);
- the others are planned from the largest down with the bucket size `default_bucket_size(numel,
  k)` (a bucket is reduce-scattered over k ranks, so it is sized for k, not dp) unless one is
  given; the first that meets every target is the choice: the largest such k, since a larger k
  keeps less optimizer state per rank, all-reduces less across replicas and spreads the
  Newton-Schulz work over more ranks;
- if none does: the planned candidate with the least worst overshoot, max(largest bucket /
  bucket limit, (1 - padding limit) / (1 - padding), imbalance / 1.10), each the factor by which
  what its target protects grows (bucket bytes, buffer memory, the busiest rank's Newton-Schulz
  time); ties go to the larger k.
The plan returned is the one `plan_buffers(specs, dp, bucket_size=choice.bucket_size,
strategy=..., shard_group_size=choice.k)` makes, checked.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from ._elementwise import plan_elementwise
from ._stacked import plan_stacked
from ._whole import plan_whole
from .buffer import KINDS, Buffer, BufferKind
from .costs import owned
from .plan import (
    DEFAULT_STRATEGY,
    Plan,
    Scheme,
    Strategy,
    _group_size,
    buffer_kind,
    default_bucket_size,
    plan_buffers,
    validate_specs,
)
from .projection import matrix_flops, rank_ns_flops
from .specs import MatrixCost, ParamSpec, cost_imbalance, is_int, layer_of, matrix_shape, round_up

MIN_BUCKET_LIMIT = 100_000_000
"""The bucket limit is never below this many elements: smaller buckets cost latency."""
LAYERS_PER_BUCKET = 2
"""The bucket limit is at least this many of the largest layer."""
MAX_PADDING = 0.01
MAX_IMBALANCE = 1.10


@dataclass(frozen=True)
class ShardGroupChoice:
    """The shard-group size `k` chosen for `dp_size` ranks and the figures of its plan (`plan`,
    made with `bucket_size`). Invariants: `k` divides `dp_size`; every figure is the plan's own;
    `meets_targets` iff `largest_bucket <= bucket_limit`, `padding_fraction <= padding_limit`
    and `ns_imbalance <= MAX_IMBALANCE`; `tried` lists the planned candidates, largest first."""

    k: int
    dp_size: int
    bucket_size: int
    buckets: int
    largest_bucket: int
    bucket_limit: int  # what the largest bucket was held to at k
    bucket_target: int  # max(100M, 2 x largest layer), before the element-wise floor
    padding_fraction: float
    padding_limit: float  # 1% beyond the alignment padding of the specs
    ns_imbalance: float  # of the plan's `matrix_cost` when it has one
    ns_flops: int  # Newton-Schulz flops (or `matrix_cost`) per step of the busiest rank
    optimizer_state: int  # fp32 values the busiest rank keeps (Muon: 1, AdamW: 2 per element)
    meets_targets: bool
    reason: str
    tried: tuple[int, ...]
    plan: Plan = field(repr=False, compare=False)

    @property
    def replicas(self) -> int:
        """Copies of each shard: shard groups in dp."""
        return self.dp_size // self.k


def largest_layer(specs: Sequence[ParamSpec]) -> int:
    """Elements of the largest layer: params grouped by their name's prefix up to the first
    numbered module (`model.layers.7.mlp.experts.3.up.weight` -> `model.layers.7`). Params
    outside numbered modules (embeddings, final norm, head) belong to no layer; with no
    numbered module at all, the largest param. 0 for no specs."""
    groups: dict[str, int] = {}
    for s in specs:
        layer = layer_of(s.name)
        if layer is not None:
            groups[layer] = groups.get(layer, 0) + s.numel
    return max(groups.values()) if groups else max((s.numel for s in specs), default=0)


def bucket_target(specs: Sequence[ParamSpec]) -> int:
    """max(`MIN_BUCKET_LIMIT`, `LAYERS_PER_BUCKET` x `largest_layer`): issue 20's bound."""
    return max(MIN_BUCKET_LIMIT, LAYERS_PER_BUCKET * largest_layer(specs))


def ladder(dp_size: int) -> list[int]:
    """Candidate k, largest first: dp, and for each power of two p < dp the largest divisor of
    dp at most p (so every power of two dividing dp; at most log2(dp) + 2 candidates)."""
    small = [d for d in range(1, math.isqrt(dp_size) + 1) if dp_size % d == 0]
    divisors = sorted({*small, *(dp_size // d for d in small)})
    out = [dp_size]
    p = 1 << (dp_size.bit_length() - 1)  # the largest power of two <= dp
    while p >= 1:
        d = divisors[bisect.bisect_right(divisors, p) - 1]
        if d < out[-1]:
            out.append(d)
        p //= 2
    return out


def ns_imbalance(plan: Plan) -> float:
    """Max / mean over the shard group of the Newton-Schulz flops of owned matrices."""
    return cost_imbalance(rank_ns_flops(plan))


def optimizer_state(plan: Plan) -> int:
    """fp32 optimizer values the busiest shard-group rank keeps: a Muon momentum per owned Muon
    element, two AdamW moments per owned element-wise one."""
    return max((o.muon + 2 * o.adamw for o in owned(plan)), default=0)


class _Shapes:
    """What the bounds need, read once from validated specs."""

    def __init__(
        self, specs: tuple[ParamSpec, ...], align: int, matrix_cost: MatrixCost | None
    ) -> None:
        self.matrix_cost = matrix_cost
        self.by_kind: dict[BufferKind, list[ParamSpec]] = {}
        for s in specs:
            self.by_kind.setdefault(buffer_kind(s), []).append(s)
        whole = self.by_kind.get("muon", [])
        self.used = sum(s.numel for s in specs)
        aligned = sum(round_up(s.numel, align) for s in specs)
        # 1% beyond the alignment padding every plan has (each param starts aligned)
        self.padding_limit = MAX_PADDING + (aligned - self.used) / aligned if aligned else 1.0
        self.whole_used = sum(s.numel for s in whole)
        self.widest = max((round_up(s.numel, align) for s in whole), default=0)
        self.widest_tied = max((round_up(s.numel, align) for s in whole if s.tied), default=0)
        self.widest_matrix = max(
            (round_up(math.prod(matrix_shape(s.shape)), align) for s in self.by_kind["stacked"])
            if "stacked" in self.by_kind
            else (),
            default=0,
        )
        muon = [s for s in specs if s.muon and len(s.shape) >= 2]
        cache = {
            shape: matrix_flops(shape, matrix_cost)
            for shape in {matrix_shape(s.shape) for s in muon}
        }
        flops = [cache[matrix_shape(s.shape)] for s in muon]
        self.total_flops = sum(
            f * math.prod(s.shape[:-2]) for f, s in zip(flops, muon, strict=True)
        )
        self.costliest = max(flops, default=0)

    def elementwise(self, k: int, bucket_size: int, align: int) -> Buffer | None:
        """The element-wise buffer at k (cheap: no search), None without element-wise specs."""
        specs = self.by_kind.get("adamw")
        return None if specs is None else plan_elementwise(tuple(specs), k, bucket_size, align)

    def hopeless(self, k: int, limit: int) -> str | None:
        """Why no plan at k can meet the targets (a lower bound over its limit), or None."""
        floor = k * max(self.widest, self.widest_matrix)
        if floor > limit:
            return "k x the widest matrix > the bucket limit"
        padded = max(k * self.widest - self.whole_used, (k - 1) * self.widest_tied, 0)
        if padded and padded / (self.used + padded) > self.padding_limit:
            return "the widest matrix's bucket pads over the limit"
        if self.total_flops and self.costliest * k / self.total_flops > MAX_IMBALANCE:
            return "the costliest matrix alone > 1.10 x the mean"
        return None


def bucket_limit_at(target: int, elementwise: Buffer | None) -> int:
    """The bucket limit of a plan whose element-wise buffer is `elementwise`: `target`, or the
    largest element-wise bucket holding a param wider than `target` (the element-wise planner
    keeps a param inside one bucket, so no k makes that bucket smaller than the param)."""
    if elementwise is None:
        return target
    wide = {p.bucket for p in elementwise.placements if p.numel > target}
    return max([target, *(elementwise.buckets[b].numel for b in wide)])


def _plan(
    shapes: _Shapes,
    dp: int,
    k: int,
    bucket_size: int,
    align: int,
    strategy: str,
    elementwise: Buffer | None,
) -> Plan:
    """What `plan_buffers` makes of the specs at k, not yet checked (the specs are validated),
    given its element-wise buffer."""
    by_kind = shapes.by_kind
    planners = {
        "muon": lambda s: plan_whole(s, k, bucket_size, align, strategy, shapes.matrix_cost),
        "stacked": lambda s: plan_stacked(s, k, bucket_size, align),
        "adamw": lambda s: elementwise,
    }
    buffers = tuple(planners[kind](tuple(by_kind[kind])) for kind in KINDS if kind in by_kind)
    return Plan(dp, k, strategy, align, bucket_size, buffers, shapes.matrix_cost)  # type: ignore[arg-type]


class _Figures:
    """A planned candidate and its figures; the Newton-Schulz flops only when asked (a plan
    that misses the bucket or padding target fails without them)."""

    def __init__(
        self, k: int, bucket_size: int, limit: int, padding_limit: float, plan: Plan
    ) -> None:
        self.k, self.bucket_size, self.limit, self.plan = k, bucket_size, limit, plan
        self.padding_limit = padding_limit
        self.largest = max((b.numel for buffer in plan.buffers for b in buffer.buckets), default=0)
        self.padding = plan.padding_fraction
        self._flops: list[int] | None = None

    @property
    def flops(self) -> list[int]:
        if self._flops is None:
            plan = self.plan
            self._flops = rank_ns_flops(plan) if plan.matrix_cost is None else plan.rank_costs()
        return self._flops

    @property
    def imbalance(self) -> float:
        return cost_imbalance(self.flops)

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

    def miss(self) -> str:
        """The figures that miss their targets."""
        out = []
        if self.largest > self.limit:
            out.append(f"largest bucket {self.largest:.3g} > {self.limit:.3g}")
        if self.padding > self.padding_limit:
            out.append(f"padding {self.padding:.2%} > {self.padding_limit:.2%}")
        if self.imbalance > MAX_IMBALANCE:
            out.append(f"imbalance {self.imbalance:.3f}")
        return ", ".join(out)


def auto_shard_group_size(
    specs: Sequence[ParamSpec],
    dp_size: int,
    *,
    bucket_size: int | None = None,
    strategy: Strategy = DEFAULT_STRATEGY,
    align: int = 64,
    bucket_limit: int | None = None,
    matrix_cost: MatrixCost | None = None,
) -> ShardGroupChoice:
    """The shard-group size for `specs` (registration order) on `dp_size` ranks, by [Note:
    automatic shard groups]. `bucket_size` None: `default_bucket_size(numel, k)` for each
    candidate k (not one bucket per buffer, as in `plan_buffers`); `bucket_limit` None:
    `bucket_target(specs)`; `matrix_cost` given: it, not Newton-Schulz flops, is balanced and
    measured. Raises ValueError, as `plan_buffers` does, on bad input."""
    specs = tuple(specs)
    _group_size(dp_size, None, bucket_size, align, strategy, "whole")
    if bucket_limit is not None and (not is_int(bucket_limit) or bucket_limit < 1):
        raise ValueError(f"bucket_limit must be None or an int >= 1, got {bucket_limit!r}")
    validate_specs(specs)
    shapes = _Shapes(specs, align, matrix_cost)
    target = bucket_target(specs) if bucket_limit is None else bucket_limit
    planned: list[_Figures] = []
    passed_over: list[tuple[int, str]] = []  # (k, why), largest k first
    for k in ladder(dp_size):
        size = default_bucket_size(shapes.used, k) if bucket_size is None else bucket_size
        elementwise = shapes.elementwise(k, size, align)
        limit = bucket_limit_at(target, elementwise)
        why = shapes.hopeless(k, limit)
        if why is not None and k != 1:
            passed_over.append((k, why))
            continue
        plan = _plan(shapes, dp_size, k, size, align, strategy, elementwise)
        planned.append(_Figures(k, size, limit, shapes.padding_limit, plan))
        if planned[-1].ok:
            break
        passed_over.append((k, planned[-1].miss()))
    chosen = planned[-1] if planned[-1].ok else min(planned, key=lambda f: (f.overshoot, -f.k))
    chosen.plan.check(specs)
    return _choice(chosen, dp_size, target, passed_over, tuple(f.k for f in planned))


def _choice(
    f: _Figures, dp: int, target: int, passed_over: list[tuple[int, str]], tried: tuple[int, ...]
) -> ShardGroupChoice:
    if f.ok:
        why = "the largest k on the ladder whose plan meets every target"
    else:
        why = f"no candidate meets every target; the least overshoot ({f.miss()})"
    if f.limit > target:
        why += f"; bucket limit {f.limit:.3g}, not {target:.3g}: an element-wise param's bucket"
    groups: list[tuple[list[int], str]] = []  # runs of larger k passed over for one reason
    for k, miss in passed_over:
        if k > f.k:
            if groups and groups[-1][1] == miss:
                groups[-1][0].append(k)
            else:
                groups.append(([k], miss))
    larger = "; ".join(f"{', '.join(map(str, ks))}: {miss}" for ks, miss in groups)
    return ShardGroupChoice(
        k=f.k,
        dp_size=dp,
        bucket_size=f.bucket_size,
        buckets=sum(len(b.buckets) for b in f.plan.buffers),
        largest_bucket=f.largest,
        bucket_limit=f.limit,
        bucket_target=target,
        padding_fraction=f.padding,
        padding_limit=f.padding_limit,
        ns_imbalance=f.imbalance,
        ns_flops=max(f.flops, default=0),
        optimizer_state=optimizer_state(f.plan),
        meets_targets=f.ok,
        reason=f"k={f.k} of dp {dp}: {why}" + (f" (larger k: {larger})" if larger else ""),
        tried=tried,
        plan=f.plan,
    )


def plan_for(
    specs: Sequence[ParamSpec],
    dp_size: int,
    *,
    bucket_size: int | None = None,
    strategy: Strategy = DEFAULT_STRATEGY,
    shard_group_size: int | str | None = None,
    scheme: Scheme = "whole",
    matrix_cost: MatrixCost | None = None,
) -> tuple[Plan, ShardGroupChoice | None]:
    """The plan `DataParallel` makes (and `wholeshard plan` shows) for these settings, with the
    choice behind it when `shard_group_size="auto"`. `bucket_size` None:
    `default_bucket_size(numel, k)`, k the shard group size (dp when None); `matrix_cost`: the
    cost balanced (None: Newton-Schulz's)."""
    if shard_group_size == "auto":
        if scheme != "whole":
            raise ValueError(
                f"shard_group_size='auto' plans whole-tensor buffers: it needs scheme='whole', "
                f"got {scheme!r}"
            )
        choice = auto_shard_group_size(
            specs, dp_size, bucket_size=bucket_size, strategy=strategy, matrix_cost=matrix_cost
        )
        return choice.plan, choice
    if isinstance(shard_group_size, str):
        raise ValueError(
            f"shard_group_size must be an int, 'auto' or None, got {shard_group_size!r}"
        )
    if bucket_size is None:
        k = shard_group_size if is_int(shard_group_size) and shard_group_size > 0 else dp_size
        bucket_size = default_bucket_size(sum(s.numel for s in specs), k)
    plan = plan_buffers(
        specs,
        dp_size,
        bucket_size=bucket_size,
        strategy=strategy,
        shard_group_size=shard_group_size,
        scheme=scheme,
        matrix_cost=matrix_cost,
    )
    return plan, None
