"""The bucket-size hint of `wholeshard plan --fabric`: where the projected latency term is a
large share of communication, a `--bucket-size` that brings it down, found by planning again,
with what the larger buckets cost.

[Note: the bucket-size hint]
Each bucket issues a fixed number of collectives (two, whatever its size), so the latency term
of a projection ([Note: the step projection]) falls with the number of buckets while the
bandwidth term stays put: the same bytes go. Where latency is more than `HINT_SHARE` of
`comm_s`, the hint plans again (`planning.plan_for`, with every other setting the plan had),
until latency is at most `TARGET_SHARE` of communication or `MAX_REPLANS` plans are made: first
at the size scaled by latency over its target (`TARGET_SHARE` of `comm_s`, the bandwidth term
held fixed), then where the latency `a + b / size` through the last two plans meets the target
(buckets closed by a layer's end or filled by one wide param do not shrink in number, so
latency does not fall in proportion); each `HEADROOM` over, rounded up to two significant
digits, and the last plan at the limit. The size never passes the bucket limit the automatic
choice holds plans to (`targets.bucket_target`: max(100M, 2 x the largest layer)); there the
hint says so (`meets_target` false). Every figure it reports is the re-planned plan's own: its
projection, its largest storage unit (`targets.largest_unit`), and its fully sharded transient
peak (`Costs.peak_transient` with `reshard_after_forward`): larger buckets mean reductions that
start later in backward and bigger gathered units.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..planning import ParamSpec, Plan, plan_for
from ..planning.targets import bucket_target, largest_unit
from .costs import Costs, fully_sharded, plan_costs, sharded_peak
from .projection import Projection, project

HINT_SHARE = 0.25
"""A hint is given where latency is more than this share of the projected communication."""
TARGET_SHARE = 0.10
"""The share of communication the hinted size brings latency to (at most)."""
MAX_REPLANS = 4
"""Plans made at most for one hint (a moe-256x plan takes about half a second)."""
HEADROOM = 1.2
"""Each estimated size is planned this much larger, so that one plan more often suffices."""


@dataclass(frozen=True)
class BucketSizeHint:
    """A `--bucket-size` and its plan's figures ([Note: the bucket-size hint]): its projection
    (`projection`: latency and bandwidth terms, collectives), its largest storage unit
    (elements) and fully sharded transient peak (bytes), beside the current plan's (`from_*`).
    Invariant: `bucket_size <= bucket_limit`."""

    bucket_size: int
    projection: Projection
    largest_bucket: int
    peak_transient_bytes: int
    bucket_limit: int
    from_bucket_size: int
    from_largest_bucket: int
    from_peak_transient_bytes: int

    @property
    def meets_target(self) -> bool:
        return meets(self.projection)

    @property
    def latency_share(self) -> float:
        return share(self.projection)

    def as_dict(self) -> dict[str, int | float | bool]:
        """Names and figures, `wholeshard plan --json`'s `projection.bucket_size_hint`."""
        p = self.projection
        terms = {"latency_s": p.latency_s, "bandwidth_s": p.bandwidth_s, "comm_s": p.comm_s,
                 "latency_share": self.latency_share, "collectives": p.collectives}  # fmt: skip
        fields = ("largest_bucket", "peak_transient_bytes", "bucket_limit", "meets_target")
        return {"bucket_size": self.bucket_size} | terms | {f: getattr(self, f) for f in fields}

    def describe(self, projected: Projection) -> str:
        """One line for `wholeshard plan`'s table: why (the current plan's `projected` latency
        share), the size and what it gives, and what it costs."""
        why = (
            f"{projected.latency_s:.3g} s is {share(projected):.0%} of "
            f"communication ({projected.collectives:,} collectives at bucket size "
            f"{self.from_bucket_size:,})"
        )
        size = f"--bucket-size {self.bucket_size:,}"
        if not self.meets_target:
            size = (
                f"no --bucket-size up to the planner's bucket limit ({self.bucket_limit:,}) "
                f"brings it under {TARGET_SHARE:.0%}; {size}"
            )
        p = self.projection
        gives = (
            f"gives latency {p.latency_s:.3g} s + bandwidth {p.bandwidth_s:.3g} s "
            f"({self.latency_share:.1%} of communication, {p.collectives:,} collectives)"
        )
        largest = (
            "unchanged"
            if self.largest_bucket == self.from_largest_bucket
            else f"{self.from_largest_bucket:,} now"
        )
        cost = (
            f"buckets closing at {self.bucket_size:,} elements, not {self.from_bucket_size:,} "
            f"(each reduction starts later in backward), a largest bucket of "
            f"{self.largest_bucket:,} elements ({largest})"
        )
        if self.peak_transient_bytes:
            cost += (
                f" and, fully sharded, up to {gib(self.peak_transient_bytes)} of gathered "
                f"buckets ({gib(self.from_peak_transient_bytes)} now)"
            )
        return f"{why}: {size} {gives}, at the price of {cost}"


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def bucket_size_hint(
    costs: Costs,
    projected: Projection,
    specs: Sequence[ParamSpec],
    **settings: Any,
) -> BucketSizeHint | None:
    """The hint for `costs`' plan (planned from `specs` with `plan_for`'s other keywords
    `settings`) whose projection is `projected`, or None where latency is at most `HINT_SHARE`
    of communication or the plan has one bucket per buffer (`ONE_BUCKET`: no larger size)
    ([Note: the bucket-size hint])."""
    plan = costs.plan
    if share(projected) <= HINT_SHARE or not math.isfinite(plan.bucket_size):
        return None
    limit = max(bucket_target(specs), int(plan.bucket_size))
    tried = [(int(plan.bucket_size), plan, projected)]
    while len(tried) <= MAX_REPLANS and not meets(tried[-1][2]):
        size = next_size(tried, limit, last=len(tried) == MAX_REPLANS)
        if size is None:
            break
        replanned = plan_for(specs, plan.dp_size, bucket_size=size, **settings)
        figures = project(plan_costs(replanned, specs, costs.mode), projected.fabric, projected.gpu)
        tried.append((size, replanned, figures))
    size, chosen, figures = tried[-1]
    mode = costs.mode
    now = costs.peak_transient if fully_sharded(plan, mode) else sharded_peak(plan, specs, mode)
    return BucketSizeHint(
        bucket_size=size,
        projection=figures,
        largest_bucket=largest_unit(chosen),
        peak_transient_bytes=sharded_peak(chosen, specs, mode),
        bucket_limit=limit,
        from_bucket_size=int(plan.bucket_size),
        from_largest_bucket=largest_unit(plan),
        from_peak_transient_bytes=now,
    )


def share(figures: Projection) -> float:
    """The latency term's share of communication (0 without any)."""
    return figures.latency_s / figures.comm_s if figures.comm_s else 0.0


def meets(figures: Projection) -> bool:
    """Whether latency is at most `TARGET_SHARE` of communication."""
    return share(figures) <= TARGET_SHARE


def next_size(tried: list[tuple[int, Plan, Projection]], limit: int, last: bool) -> int | None:
    """The size to plan next after the sizes `tried` (each with its plan and projection), or
    None at `limit`: from one plan, latency scaled to its target; from two, the size at which
    the latency `a + b / size` through the last two meets it (the bucket limit where no size
    does, and for the `last` plan, so that a hint that misses says what the limit gives)."""
    size, _, figures = tried[-1]
    target = TARGET_SHARE / (1 - TARGET_SHARE) * figures.bandwidth_s
    wanted = size * figures.latency_s / target * HEADROOM if target > 0 else math.inf
    if len(tried) > 1:
        (s0, _, f0), (s1, _, f1) = tried[-2], tried[-1]
        b = (f0.latency_s - f1.latency_s) / (1 / s0 - 1 / s1)
        a = f1.latency_s - b / s1
        wanted = b / (target - a) * HEADROOM if b > 0 and a < target else math.inf
    wanted = limit if last else min(limit, round_up(min(wanted, 1e18)))
    return None if wanted <= size else wanted


def round_up(n: float) -> int:
    """`n` rounded up to two significant digits (576,320,000 -> 580,000,000)."""
    step = 10 ** max(0, math.floor(math.log10(n)) - 1)
    return math.ceil(n / step) * step
