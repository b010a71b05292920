"""The report of an automatic choice (the reason on `wholeshard plan`'s `plan` line and its JSON
`shard_group_choice`): built from the record `planning.auto.decide` returns, after deciding, so
`DataParallel`, which calls only the decision, never computes it.

Invariant: the plan of `plan_and_choice` is the plan `planning.plan_for` (what `DataParallel`
calls) makes for the same arguments.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..planning.auto import Search, decide, search
from ..planning.plan import Plan
from ..planning.specs import ParamSpec
from ..planning.targets import MAX_IMBALANCE, Figures
from .costs import owned
from .projection import rank_ns_flops


@dataclass(frozen=True)
class ShardGroupChoice:
    """The shard-group size `k` and strategy (`plan.strategy`) chosen for `dp_size` ranks and
    the figures of its plan (`plan`, made with `bucket_size`); `reason` says why. Invariants:
    `k` divides `dp_size`; every figure is the plan's own (`ns_imbalance` the very
    `Plan.ns_cost_imbalance` the planner balanced); `meets_targets` iff `largest_bucket
    <= bucket_limit`, `padding_fraction <= padding_limit` and `ns_imbalance <= MAX_IMBALANCE`;
    `tried` lists the candidate k, largest first."""

    k: int
    dp_size: int
    bucket_size: int
    buckets: int
    largest_bucket: int
    bucket_limit: int  # what the largest bucket was held to at k
    bucket_target: int  # max(100M, 2 x largest layer), before the element-wise floor
    padding_fraction: float
    padding_limit: float  # 1% beyond the alignment padding of the specs
    ns_imbalance: float
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


def optimizer_state(plan: Plan) -> int:
    """fp32 optimizer values the busiest shard-group rank keeps: a Muon momentum per owned Muon
    element, two AdamW moments per owned element-wise one."""
    return max((o.matrix + 2 * o.adamw for o in owned(plan)), default=0)


def miss(f: Figures) -> str:
    """The figures of a candidate that miss their targets ([Note: plan targets])."""
    out = []
    if f.largest > f.limit:
        out.append(f"largest bucket {f.largest:.3g} > {f.limit:.3g}")
    if f.padding > f.padding_limit:
        out.append(f"padding {f.padding:.2%} > {f.padding_limit:.2%}")
    if f.imbalance > MAX_IMBALANCE:
        out.append(f"imbalance {f.imbalance:.3f}")
    return ", ".join(out)


def notes(found: Search) -> dict[int, str]:
    """Candidate k -> why its attempts were passed over or missed ("" where none did)."""
    out: dict[int, list[str]] = {}
    for a in found.attempts:
        why = out.setdefault(a.k, [])
        if a.figures is None:
            why.append(f"{a.strategy}: {a.skipped}")
        elif not a.figures.ok:
            why.append(f"{a.strategy}: {miss(a.figures)}")
    return {k: "; ".join(v) for k, v in out.items()}


def report(found: Search) -> ShardGroupChoice:
    """The `ShardGroupChoice` of a search: its chosen plan's figures and the reason."""
    f, dp, target, why_not = found.chosen, found.dp_size, found.bucket_target, notes(found)
    if not f.ok:
        why = f"no candidate meets every target; the least overshoot ({miss(f)})"
    elif found.ladder_searched:
        why = "the largest k on the ladder whose plan meets every target"
    else:
        why = "its plan meets every target"
    why = f"strategy {f.plan.strategy}, {why}" + (f" ({why_not[f.k]})" if why_not[f.k] else "")
    if f.limit > target:
        why += f"; bucket limit {f.limit:.3g}, not {target:.3g}: an element-wise param's bucket"
    # runs of larger k passed over for one reason
    runs = itertools.groupby([(k, m) for k, m in why_not.items() if k > f.k], key=lambda km: km[1])
    larger = "; ".join(f"{', '.join(str(k) for k, _ in run)}: {missed}" for missed, run in runs)
    plan = f.plan
    flops = rank_ns_flops(plan) if plan.matrix_cost is None else f.costs
    return ShardGroupChoice(
        k=f.k,
        dp_size=dp,
        bucket_size=f.bucket_size,
        buckets=sum(len(b.buckets) for b in plan.buffers),
        largest_bucket=f.largest,
        bucket_limit=f.limit,
        bucket_target=target,
        padding_fraction=f.padding,
        padding_limit=f.padding_limit,
        ns_imbalance=f.imbalance,
        ns_flops=max(flops, default=0),
        optimizer_state=optimizer_state(plan),
        meets_targets=f.ok,
        reason=f"k={f.k} of dp {dp}: {why}" + (f" (larger k: {larger})" if larger else ""),
        tried=tuple(dict.fromkeys(c.k for c in found.planned)),
        plan=plan,
    )


def auto_shard_group_size(
    specs: Sequence[ParamSpec], dp_size: int, **settings: Any
) -> ShardGroupChoice:
    """The report of `planning.auto.search` over the ladder (its keywords): the shard-group
    size (and, for `strategy="auto"`, the strategy) for `specs` on `dp_size` ranks. Raises
    ValueError, as `plan_exactly` does, on bad input."""
    return report(search(specs, dp_size, **settings))


def plan_and_choice(
    specs: Sequence[ParamSpec], dp_size: int, **settings: Any
) -> tuple[Plan, ShardGroupChoice | None]:
    """The plan `planning.plan_for` makes for these settings (`planning.auto.decide`'s
    keywords; what `DataParallel` and `wholeshard plan` use), with the report of the choice
    behind it when the strategy or `shard_group_size` is "auto"."""
    plan, found = decide(specs, dp_size, **settings)
    return plan, None if found is None else report(found)
