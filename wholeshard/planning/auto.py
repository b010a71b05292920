"""Automatic choices, from shapes: the strategy (equal shards or the exchange) and the
shard-group size k of a plan on dp ranks. `plan_for` (`wholeshard.planning.plan_for`, what
`DataParallel` and the train job call) decides with `DataParallel`'s defaults; `decide` also
returns the record (`Search`) from which `wholeshard.capacity.choice` builds the report.

[Note: automatic strategy]
`strategy="auto"` (the default), below `EXCHANGE_FROM` ranks a shard group, plans the balanced
strategy's equal shards, which reduce-scatter and all-gather each bucket in one collective, and
keeps them if they meet every target ([Note: plan targets] in `targets`); otherwise it plans
owner buckets ([Note: owners strategy] in `_owners`) and keeps whichever overshoots less
(balanced on a tie). A bucket of equal shards of whole matrices holds k times its widest
matrix, so once that passes the bucket bound (two layers, for real models) owner buckets take
over: from 8 ranks for llama3-70b, 16 for llama3-8b (docs/planning.md's table). From
`EXCHANGE_FROM` ranks (or with two-level groups, [Note: two-level groups] in `plan`) it plans
the exchange strategy first ([Note: exchange buffers] in `_exchange`: one buffer in per-layer
equal shards, each matrix's reduced pieces sent to an owner dealt by cost and back), and
balanced only where the exchange misses a target (the exchange on a tie). The three balance the
matrix work alike and bound the bucket; they differ in what the step pays beyond FSDP2's equal
shards: owner buckets 4-6 collectives a layer (latency, growing with the ring: k - 1 hops
each); balanced one a buffer kind a bucket (matrices, expert stacks and AdamW params apart: for
qwen3-30b-a3b at dp 64, 394 collectives and a 59.7 GiB fully sharded peak where the exchange
issues 104 and FSDP2 99); the exchange FSDP2's two a layer plus two all-to-alls a step that
carry each rank's owned share, about 1/k of the matrices, at one NIC's bandwidth. Projected on
every shipped fabric, owner buckets step faster up to 32 ranks and the exchange from 64
(llama3-8b, llama3-70b, qwen2.5-7b on `nvlink4-ndr400`: 3-24% either way; qwen3-30b-a3b at dp
64, 0.586 s against balanced's 0.608), hence the threshold, a rank count because the planner
knows shapes, not the fabric (`wholeshard plan --fabric` prints the three layouts' projected
steps beside the choice).
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
- a k whose costliest matrix alone is over 1.10 x the mean (of the planner's own cost,
  `Plan.rank_costs`) is passed over unplanned (k = 1, the last, is always planned);
- the others are planned from the largest down, each with the strategy asked for ("auto": as
  above) and the bucket size `targets.bucket_size_for` unless one is given; the first that
  meets every target is the choice: the largest such k, since a larger k keeps less optimizer
  state per rank, all-reduces less across replicas and spreads the Newton-Schulz work over more
  ranks;
- if none does: the planned candidate with the least overshoot; ties go to the larger k.
The plan returned is the one `plan_exactly(specs, dp, bucket_size=choice.bucket_size,
strategy=choice.plan.strategy, shard_group_size=choice.k)` makes, checked.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict

from .layouts import laid_out, layout_named
from .plan import (
    DEFAULT_STRATEGY,
    Plan,
    Strategy,
    _group_size,
    plan_exactly,
    two_level,
    validate_specs,
)
from .specs import MatrixCost, ParamSpec, is_int

if TYPE_CHECKING:
    from typing_extensions import Unpack

from .targets import (
    MAX_IMBALANCE,
    Figures,
    Shapes,
    bucket_limit_at,
    bucket_size_for,
    bucket_target,
)

EXCHANGE_FROM = 64
"""The shard-group size from which `auto` falls back on the exchange, not owner buckets
([Note: automatic strategy])."""

__all__ = [
    "EXCHANGE_FROM",
    "MAX_IMBALANCE",
    "Attempt",
    "Search",
    "decide",
    "ladder",
    "plan_for",
    "search",
]


@dataclass(frozen=True)
class Attempt:
    """One candidate the search considered, in order: strategy `strategy` at shard-group size
    `k`, planned (`figures`) or passed over unplanned (`skipped`: why a bound shows it must
    miss). Invariant: exactly one of `figures` and `skipped` is set."""

    k: int
    strategy: str
    figures: Figures | None
    skipped: str | None = None


@dataclass(frozen=True)
class Search:
    """The record of an automatic choice: every attempt in search order and the one chosen
    (`chosen`, whose plan is checked) for `dp_size` ranks, the bucket bound `bucket_target`
    (before the element-wise floor), and whether the ladder was searched (else one k was
    given). Invariant: `chosen` is the figures of one of `attempts`."""

    dp_size: int
    bucket_target: int
    ladder_searched: bool
    chosen: Figures
    attempts: tuple[Attempt, ...]

    @property
    def plan(self) -> Plan:
        return self.chosen.plan

    @property
    def planned(self) -> list[Figures]:
        """The figures of every planned attempt, in search order."""
        return [a.figures for a in self.attempts if a.figures is not None]


def ladder(dp_size: int) -> list[int]:
    """Candidate k, largest first ([Note: automatic shard groups])."""
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
    levels: bool = False,
) -> list[Attempt]:
    """The attempts at k by `strategy` ("auto": from `EXCHANGE_FROM` ranks or with two
    `levels` the exchange, then balanced unless it meets every target; below, balanced, then
    owner buckets unless it does); `force`: plan at least one (the exchange, else the last)
    even where a bound calls it hopeless."""
    attempts: list[Attempt] = []
    if strategy != "auto":
        names: tuple[str, ...] = (strategy,)
    elif k >= EXCHANGE_FROM or levels:
        names = ("exchange", "balanced")
    else:
        names = ("balanced", "owners")
    forced = "exchange" if "exchange" in names else names[-1]  # planned past a hopeless bound
    for name in names:
        size = bucket_size_for(shapes.used, k, name) if bucket_size is None else bucket_size
        elementwise = shapes.elementwise(k, size)
        limit = bucket_limit_at(target, elementwise)
        why = shapes.hopeless(k, limit, equal_shards=name in ("balanced", "size_match"))
        planned_none = not any(a.figures for a in attempts)
        if why is not None and not (force and planned_none and name == forced):
            attempts.append(Attempt(k, name, None, why))
            continue
        plan = shapes.plan(dp, k, size, name, elementwise)
        attempts.append(Attempt(k, name, Figures(k, size, limit, shapes.padding_limit, plan)))
        if attempts[-1].figures.ok:  # type: ignore[union-attr]
            break
    return attempts


def search(
    specs: Sequence[ParamSpec],
    dp_size: int,
    k: int | None = None,
    *,
    bucket_size: int | None = None,
    strategy: Strategy = DEFAULT_STRATEGY,
    align: int = 64,
    bucket_limit: int | None = None,
    matrix_cost: MatrixCost | None = None,
    node_size: int | None = None,
) -> Search:
    """The automatic choice for `specs` (registration order) on `dp_size` ranks at shard-group
    size `k`, or over the ladder (k None), by [Note: automatic shard groups]. `bucket_size`
    None: `targets.bucket_size_for` each candidate; `bucket_limit` None: `bucket_target(specs)`;
    `matrix_cost` given: it, not `ns_cost`, is balanced and measured; `node_size`: two-level
    groups where k exceeds it (the ladder keeps the k it divides), so never owner buckets
    there. Raises ValueError, as
    `plan_exactly` does, on bad input."""
    specs = tuple(specs)
    _group_size(dp_size, k, bucket_size, align, strategy)
    if bucket_limit is not None and (not is_int(bucket_limit) or bucket_limit < 1):
        raise ValueError(f"bucket_limit must be None or an int >= 1, got {bucket_limit!r}")
    validate_specs(specs)
    shapes = Shapes(specs, align, matrix_cost)
    target = bucket_target(specs) if bucket_limit is None else bucket_limit
    attempts: list[Attempt] = []
    candidates = ladder(dp_size) if k is None else [k]
    if k is None and node_size is not None:  # whole nodes, or within one
        candidates = [c for c in candidates if c <= node_size or c % node_size == 0]
    for candidate in candidates:
        force = candidate == 1 or k is not None
        levels = node_size is not None and candidate > node_size
        found = _candidates(
            shapes, dp_size, candidate, bucket_size, strategy, target, force, levels
        )
        attempts += found
        if found[-1].figures is not None and found[-1].figures.ok:
            break
    # the first planned that meets every target, else the least overshoot (ties: the earlier)
    planned = [a.figures for a in attempts if a.figures is not None]
    chosen = next((f for f in planned if f.ok), None) or min(planned, key=lambda f: f.overshoot)
    chosen.plan.check(specs)
    return Search(dp_size, target, k is None, chosen, tuple(attempts))


class PlanSettings(TypedDict, total=False):
    """`plan_for`'s keywords: `decide`'s, with its defaults."""

    bucket_size: int | None
    strategy: Strategy
    shard_group_size: int | str | None
    layout: str | None
    matrix_cost: MatrixCost | None
    node_size: int | None


def decide(
    specs: Sequence[ParamSpec],
    dp_size: int,
    *,
    bucket_size: int | None = None,
    strategy: Strategy = DEFAULT_STRATEGY,
    shard_group_size: int | str | None = None,
    layout: str | None = None,
    matrix_cost: MatrixCost | None = None,
    node_size: int | None = None,
) -> tuple[Plan, Search | None]:
    """The plan `DataParallel` makes for these settings, with the search behind it when the
    strategy or `shard_group_size` is "auto". `bucket_size` None: `targets.bucket_size_for` the
    shard group size (dp when None) and strategy; `matrix_cost`: the cost balanced (None:
    `ns_cost`); `layout`: a registered layout's name, which rewrites the plan ([Note: layouts]
    in `layouts`)."""
    if layout is not None:
        rule = layout_named(layout)
        if strategy == "auto" and rule.strategy is not None:
            strategy = rule.strategy
        plan, found = decide(
            specs,
            dp_size,
            bucket_size=bucket_size,
            strategy=strategy,
            shard_group_size=shard_group_size,
            matrix_cost=matrix_cost,
        )
        return laid_out(rule, plan, specs, node_size), found
    auto_k = shard_group_size == "auto"
    if isinstance(shard_group_size, str) and not auto_k:
        raise ValueError(
            f"shard_group_size must be an int, 'auto' or None, got {shard_group_size!r}"
        )
    common: dict[str, Any] = dict(strategy=strategy, matrix_cost=matrix_cost)
    if auto_k or strategy == "auto":
        k = None if auto_k else (dp_size if shard_group_size is None else shard_group_size)
        found = search(specs, dp_size, k, bucket_size=bucket_size, node_size=node_size, **common)  # type: ignore[arg-type]
        return two_level(found.plan, node_size), found
    if bucket_size is None:
        k = shard_group_size if is_int(shard_group_size) and shard_group_size > 0 else dp_size
        bucket_size = bucket_size_for(sum(s.numel for s in specs), k, strategy)  # type: ignore[arg-type]
    sizes: dict[str, Any] = dict(bucket_size=bucket_size, shard_group_size=shard_group_size)
    plan = plan_exactly(specs, dp_size, node_size=node_size, **sizes, **common)
    return plan, None


def plan_for(specs: Sequence[ParamSpec], dp_size: int, **settings: Unpack[PlanSettings]) -> Plan:
    """The plan `DataParallel` makes for `specs` (registration order) on `dp_size` ranks with
    these settings, whose defaults are `DataParallel`'s (`DataParallelConfig`, `Variant`):
    `bucket_size` None (`targets.bucket_size_for`), `strategy` "auto" and `shard_group_size`
    None (one group of dp ranks; "auto": searched). `decide`'s plan, without its record;
    ValueError, saying how to fix it, on bad input."""
    return decide(specs, dp_size, **settings)[0]
