"""The element-wise ("adamw") buffer: params packed tightly, each rank owning a contiguous slice.

Params are packed in backprop order, each starting on an `align`-element boundary (as in
whole-tensor buffers, so every view starts on a 128-byte boundary at bf16, which vectorised
kernels and the 32-element MXFP8 blocks rely on), and cut into buckets that close once they hold
`>= bucket_size` elements or where the next param belongs to another layer (`specs.layer_of`:
each run of params outside numbered modules counts as one), so a bucket completes as backward
leaves its layer: packed across layers, the norms of every layer would share the embedding's
bucket, which completes last and, reduced in order, would hold every later reduction (and, fully
sharded, every full grad bucket) until backward ends. Each bucket is padded to a multiple of
`k * align`, so its `k` equal shards start aligned. Rank r owns the r-th shard of every bucket,
so a param may straddle shards (`owner` is None), and the only padding is alignment (< `align`
per param) plus < `k * align` per bucket: a tied embedding costs nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

from .buffer import Buffer
from .specs import Bucket, ParamSpec, Placement, layer_of, round_up


def plan_elementwise(
    specs: Sequence[ParamSpec], k: int, bucket_size: int | None, align: int
) -> Buffer:
    """The `"adamw"` buffer of validated `specs` over `k` ranks (not yet checked)."""
    n = len(specs)
    placements: list[Placement | None] = [None] * n
    buckets: list[Bucket] = []
    start = 0  # of the open bucket
    cursor = 0  # where the next param goes
    for i in range(n - 1, -1, -1):
        spec = specs[i]
        placements[i] = Placement(
            spec.name, tuple(spec.shape), len(buckets), cursor, cursor + spec.numel, None
        )
        cursor = round_up(cursor + spec.numel, align)
        full = bucket_size is not None and cursor - start >= bucket_size
        if i == 0 or full or layer_of(specs[i - 1].name) != layer_of(spec.name):
            end = start + round_up(cursor - start, k * align)
            buckets.append(Bucket(len(buckets), start, end, (end - start) // k))
            start = cursor = end
    return Buffer("adamw", k, align, tuple(buckets), tuple(placements))  # type: ignore[arg-type]
