"""Pure layout planning: param specs in, one whole-tensor buffer (`Layout`) out.

No torch.distributed here, so every rule is testable with shapes alone. The planner's parts
live in `wholeshard._planning`; this module is its entry point for one whole-tensor buffer.

Invariants every whole-tensor `Layout` keeps (checked by `Layout.check`):
- a bucket is a contiguous range of the buffer cut into `dp_size` equal shards; rank r owns shard r;
- every param lies wholly inside one shard; its owner is `Bucket.owner(start)`, i.e.
  `(start - bucket.start) // shard_numel`;
- params start on `align`-element boundaries; bucket sizes are multiples of `dp_size`;
- buckets are filled in backprop order (reverse registration order).

Two strategies place the params: size matching ([Note: size matching] in
`wholeshard._planning.rows`) and balanced ([Note: balanced] in `wholeshard._planning.balanced`).
With `"balanced"` the size-matching layout of the same params is planned too and taken instead
when it is at least as good on both counts (no more padding and no more imbalance, one strictly
less): a stack of identical blocks tiles exactly by size matching, which balancing cannot beat.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

from ._planning.balanced import plan_balanced
from ._planning.buffer import Layout
from ._planning.records import Bucket, ParamSpec, Placement, cost_imbalance, ns_cost, spec_cost
from ._planning.rows import layout_of_rows, plan_rows

__all__ = [
    "STRATEGIES",
    "Bucket",
    "Layout",
    "ParamSpec",
    "Placement",
    "cost_imbalance",
    "ns_cost",
    "place",
    "plan_layout",
    "spec_cost",
    "validate_inputs",
]

STRATEGIES = ("size_match", "balanced")


def plan_layout(
    params: Sequence[ParamSpec],
    dp_size: int,
    *,
    bucket_size: int | None = None,
    align: int = 64,
    strategy: str = "size_match",
) -> Layout:
    """Place `params` (in registration order) into one whole-tensor buffer for `dp_size` ranks.

    `strategy="size_match"` fills buckets in backprop order by size-matching rows; a bucket is
    closed once it holds `>= bucket_size` elements (None: one bucket).
    `strategy="balanced"` balances Newton-Schulz cost across ranks instead; its buckets hold at
    least `bucket_size` elements and may be larger. With either, a tied param gets a bucket of
    its own: shard 0 holds it, shards 1.. are padding. The result is a `"muon"` (whole-tensor)
    `Layout` that passes `check(params)`; placements come back in the order of `params`.
    """
    specs = tuple(params)
    validate_inputs(specs, dp_size, bucket_size, align, strategy)
    layout = place(specs, dp_size, bucket_size, align, strategy)
    layout.check(specs)
    return layout


def place(
    specs: tuple[ParamSpec, ...], dp_size: int, bucket_size: int | None, align: int, strategy: str
) -> Layout:
    """`plan_layout` on validated inputs, without the final check."""
    matched = layout_of_rows(specs, dp_size, align, plan_rows(specs, dp_size, bucket_size, align))
    if strategy == "size_match":
        return matched
    rows = plan_balanced(specs, dp_size, bucket_size, align)
    balanced = layout_of_rows(specs, dp_size, align, rows)
    b = (balanced.padding_fraction, _imbalance(balanced, specs))
    m = (matched.padding_fraction, _imbalance(matched, specs))
    return matched if m != b and m[0] <= b[0] and m[1] <= b[1] else balanced


def _imbalance(layout: Layout, specs: tuple[ParamSpec, ...]) -> float:
    costs = [0] * layout.shard_group_size
    for spec, p in zip(specs, layout.placements, strict=True):
        costs[p.owner] += spec_cost(spec)
    return cost_imbalance(costs)


def validate_inputs(
    specs: Sequence[ParamSpec],
    dp_size: int,
    bucket_size: int | None,
    align: int,
    strategy: str = "size_match",
) -> None:
    """Raise ValueError, saying how to fix it, for inputs no layout can serve."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if not _is_int(dp_size) or dp_size < 1:
        raise ValueError(
            f"dp_size must be an int >= 1 (the data-parallel world size), got {dp_size!r}"
        )
    if not _is_int(align) or align < 1:
        raise ValueError(f"align must be an int >= 1 (elements; 64 is typical), got {align!r}")
    if bucket_size is not None and (not _is_int(bucket_size) or bucket_size <= 0):
        raise ValueError(
            f"bucket_size must be None (one bucket) or an int > 0 (elements), got {bucket_size!r}"
        )
    seen: set[str] = set()
    for spec in specs:
        if not isinstance(spec, ParamSpec):
            raise ValueError(f"expected ParamSpec, got {type(spec).__name__}: {spec!r}")
        if spec.name in seen:
            raise ValueError(
                f"duplicate param name {spec.name!r}; give each param a unique name (its FQN) "
                "and list a shared tensor only once, with tied=True"
            )
        seen.add(spec.name)
        shape = spec.shape
        if type(shape) is tuple and all(type(d) is int and d > 0 for d in shape):
            continue  # the common case, checked fast
        if not isinstance(spec.shape, tuple) or not all(_is_int(d) for d in spec.shape):
            raise ValueError(
                f"param {spec.name!r}: shape must be a tuple of ints (e.g. tuple(p.shape)), "
                f"got {spec.shape!r}"
            )
        if any(d < 0 for d in spec.shape):
            raise ValueError(f"param {spec.name!r}: shape {spec.shape} has a negative size")
        if any(d == 0 for d in spec.shape):
            raise ValueError(
                f"param {spec.name!r}: shape {spec.shape} has no elements; leave zero-element "
                "params out of the layout (they have nothing to sync)"
            )


def _is_int(x: object) -> bool:
    if isinstance(x, bool):
        return False
    try:
        operator.index(x)  # type: ignore[arg-type]
    except TypeError:
        return False
    return True
