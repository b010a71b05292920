"""Automatic choices, from shapes: the strategy (equal shards or owner buckets) and the
shard-group size k a plan should use on dp ranks; `plan_for` is the one planning entry point of
`DataParallel`, `wholeshard plan` and the train job.

[Note: automatic strategy]
`strategy="auto"` (the default) plans the balanced strategy's equal shards, which reduce-scatter
and all-gather each bucket in one collective, and keeps them if they meet every target ([Note:
plan targets] in `targets`); otherwise it plans owner buckets ([Note: owners strategy] in
`_owners`), reduced to and broadcast from each owner, and keeps whichever overshoots less
(balanced on a tie). Past a few dozen ranks equal shards cannot hold the bucket bound (a bucket
holds k times its widest matrix) and owner buckets take over; on small runs nothing changes.
A candidate a cheap bound shows must miss (k x the widest matrix over the bucket limit, or the
padding that forces) is passed over unplanned.

[Note: automatic shard groups]
Shard groups of k < dp ranks (replicated dp / k times) spread fewer matrices over fewer ranks, at
the price of dp / k copies of the optimizer state and an all-reduce across replicas; with owner
buckets only the Newton-Schulz imbalance asks for them (a model with fewer matrices than ranks
cannot balance). `shard_group_size="auto"` picks k:
- candidates: a ladder of divisors of dp: dp, and for each power of two p < dp the largest
  divisor of dp at most p (every power of two dividing dp among them; dp a power of two: its
  powers of two), so at most log2(dp) + 2;
- a k whose costliest matrix alone is over 1.10 x the mean is passed over unplanned (k = 1, the
  last, is always planned);
- the others are planned from the largest down, each with the strategy asked for ("auto": as
  above) and the bucket size `targets.bucket_size_for` unless one is given; the first that
  meets every target is the choice: the largest such k, since a larger k keeps less optimizer
  state per rank, all-reduces less across replicas and spreads the Newton-Schulz work over more
  ranks;
- if none does: the planned candidate with the least overshoot; ties go to the larger k.
The plan returned is the one `plan_buffers(specs, dp, bucket_size=choice.bucket_size,
strategy=choice.plan.strategy, shard_group_size=choice.k)` makes, checked.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from .plan import (
    DEFAULT_STRATEGY,
    Plan,
    Scheme,
    Strategy,
    _group_size,
    plan_buffers,
    validate_specs,
)
from .specs import MatrixCost, ParamSpec, is_int
from .targets import (
    MAX_IMBALANCE,
    Figures,
    Shapes,
    bucket_limit_at,
    bucket_size_for,
    bucket_target,
    optimizer_state,
)

__all__ = ["MAX_IMBALANCE", "ShardGroupChoice", "auto_shard_group_size", "ladder", "plan_for"]


@dataclass(frozen=True)
class ShardGroupChoice:
    """The shard-group size `k` and strategy (`plan.strategy`) chosen for `dp_size` ranks and
    the figures of its plan (`plan`, made with `bucket_size`); `reason` says why. Invariants:
    `k` divides `dp_size`; every figure is the plan's own; `meets_targets` iff `largest_bucket
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


def _candidates(
    shapes: Shapes,
    dp: int,
    k: int,
    bucket_size: int | None,
    strategy: str,
    target: int,
    force: bool,
) -> tuple[list[Figures], list[str]]:
    """The plans at k by `strategy` ("auto": balanced, then owners unless balanced meets every
    target), and why each other one was passed over or missed; `force`: plan at least one (the
    last) even where a bound calls it hopeless."""
    figures: list[Figures] = []
    notes: list[str] = []
    names = ("balanced", "owners") if strategy == "auto" else (strategy,)
    for name in names:
        size = bucket_size_for(shapes.used, k, name) if bucket_size is None else bucket_size
        elementwise = shapes.elementwise(k, size)
        limit = bucket_limit_at(target, elementwise)
        why = shapes.hopeless(k, limit, equal_shards=name != "owners")
        if why is not None and not (force and not figures and name == names[-1]):
            notes.append(f"{name}: {why}")
            continue
        plan = shapes.plan(dp, k, size, name, elementwise)
        figures.append(Figures(k, size, limit, shapes.padding_limit, plan))
        if figures[-1].ok:
            break
        notes.append(f"{name}: {figures[-1].miss()}")
    return figures, notes


def _best(planned: list[Figures]) -> Figures:
    """The first that meets every target, else the least overshoot (ties: the earlier)."""
    met = [f for f in planned if f.ok]
    return met[0] if met else min(planned, key=lambda f: f.overshoot)


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
    """The shard-group size (and, for `strategy="auto"`, the strategy) for `specs`
    (registration order) on `dp_size` ranks, by [Note: automatic shard groups]. `bucket_size`
    None: `targets.bucket_size_for` each candidate; `bucket_limit` None: `bucket_target(specs)`;
    `matrix_cost` given: it, not Newton-Schulz flops, is balanced and measured. Raises
    ValueError, as `plan_buffers` does, on bad input."""
    return _choose(specs, dp_size, None, bucket_size, strategy, align, bucket_limit, matrix_cost)


def _choose(
    specs: Sequence[ParamSpec],
    dp_size: int,
    k: int | None,
    bucket_size: int | None,
    strategy: Strategy,
    align: int,
    bucket_limit: int | None,
    matrix_cost: MatrixCost | None,
) -> ShardGroupChoice:
    """The choice at the given k, or over the ladder (k None)."""
    specs = tuple(specs)
    _group_size(dp_size, k, bucket_size, align, strategy, "whole")
    if bucket_limit is not None and (not is_int(bucket_limit) or bucket_limit < 1):
        raise ValueError(f"bucket_limit must be None or an int >= 1, got {bucket_limit!r}")
    validate_specs(specs)
    shapes = Shapes(specs, align, matrix_cost)
    target = bucket_target(specs) if bucket_limit is None else bucket_limit
    planned: list[Figures] = []
    notes: dict[int, str] = {}  # candidate k -> why its other plans were passed over or missed
    for candidate in ladder(dp_size) if k is None else [k]:
        force = candidate == 1 or k is not None
        found, why = _candidates(shapes, dp_size, candidate, bucket_size, strategy, target, force)
        planned += found
        notes[candidate] = "; ".join(why)
        if found and found[-1].ok:
            break
    chosen = _best(planned)
    chosen.plan.check(specs)
    return _choice(chosen, planned, dp_size, target, notes, k is None)


def _choice(
    f: Figures,
    planned: list[Figures],
    dp: int,
    target: int,
    notes: dict[int, str],
    ladder_searched: bool,
) -> ShardGroupChoice:
    if not f.ok:
        why = f"no candidate meets every target; the least overshoot ({f.miss()})"
    elif ladder_searched:
        why = "the largest k on the ladder whose plan meets every target"
    else:
        why = "its plan meets every target"
    why = f"strategy {f.plan.strategy}, {why}" + (f" ({notes[f.k]})" if notes[f.k] else "")
    if f.limit > target:
        why += f"; bucket limit {f.limit:.3g}, not {target:.3g}: an element-wise param's bucket"
    groups: list[tuple[list[int], str]] = []  # runs of larger k passed over for one reason
    for k, miss in notes.items():
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
        tried=tuple(dict.fromkeys(c.k for c in planned)),
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
    choice behind it when the strategy or `shard_group_size` is "auto". `bucket_size` None:
    `targets.bucket_size_for` the shard group size (dp when None) and strategy; `matrix_cost`:
    the cost balanced (None: Newton-Schulz's)."""
    auto_k = shard_group_size == "auto"
    if auto_k and scheme != "whole":
        raise ValueError(
            f"shard_group_size='auto' plans whole-tensor buffers: it needs scheme='whole', "
            f"got {scheme!r}"
        )
    if scheme != "whole" and strategy == "auto":
        strategy = "size_match"  # the ping-pong baseline's own, whatever is asked
    if isinstance(shard_group_size, str) and not auto_k:
        raise ValueError(
            f"shard_group_size must be an int, 'auto' or None, got {shard_group_size!r}"
        )
    if auto_k or strategy == "auto":
        k = None if auto_k else (dp_size if shard_group_size is None else shard_group_size)
        choice = _choose(specs, dp_size, k, bucket_size, strategy, 64, None, matrix_cost)  # type: ignore[arg-type]
        return choice.plan, choice
    if bucket_size is None:
        k = shard_group_size if is_int(shard_group_size) and shard_group_size > 0 else dp_size
        bucket_size = bucket_size_for(sum(s.numel for s in specs), k, strategy)  # type: ignore[arg-type]
    plan = plan_buffers(
        specs,
        dp_size,
        bucket_size=bucket_size,
        strategy=strategy,
        shard_group_size=shard_group_size,  # type: ignore[arg-type]
        scheme=scheme,
        matrix_cost=matrix_cost,
    )
    return plan, None
