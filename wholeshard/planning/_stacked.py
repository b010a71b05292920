"""The stacked buffer: Muon params with more than 2 dims (fused MoE experts, transformers 5's
`gate_up_proj` (E, 2I, H) and `down_proj` (E, H, I)), stacks of matrices over their leading dims.
Muon orthogonalizes each matrix on its own, so the matrix, not the tensor, is owned whole.

[Note: stacked buffers]
The stacks are laid out as one stream, in backprop order (reverse registration), each stack
contiguous (its param is one view of the buffer) and starting on an `align` boundary. The stream
is cut into shards of one width `S`; `k` consecutive shards form a bucket. A matrix never
straddles a shard boundary, and a stack may continue from the end of one shard into the start of
the next, so a stack spreads its matrices over consecutive shards (ranks), even across buckets.
The owner of a matrix is `Bucket.owner(matrix start)`, as in every whole-tensor buffer.

For a stack to continue across a boundary its matrices must tile the shard exactly, so `S` is a
multiple of `L = lcm(align, matrix numel of every stack)`: then every stack fills whole shards,
and e.g. `gate_up_proj` (matrix 2IH) and `down_proj` (IH) share shards without padding. A stack
that starts mid-shard where its matrices would not tile the rest starts on the next shard. If
`L` is unreasonably large (more than `_MAX_LCM_FACTOR` times the largest matrix), `S` is instead
the largest stack's aligned size and every stack sits whole in one shard. `S = c * L` with `c`
chosen so that a bucket holds about `bucket_size` elements (at least one matrix per shard); the
last bucket takes the smallest `c` that still holds what is left, so its padding stays small.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .buffer import Buffer
from .specs import Bucket, ParamSpec, Placement, matrix_count, matrix_shape, round_up

_MAX_LCM_FACTOR = 64


def plan_stacked(specs: Sequence[ParamSpec], k: int, bucket_size: int | None, align: int) -> Buffer:
    """The `"stacked"` buffer of validated `specs` over `k` ranks (not yet checked);
    placements in the order of `specs`."""
    order = list(reversed(specs))  # backprop order = buffer order
    units = [math.prod(matrix_shape(s.shape)) for s in order]
    counts = [matrix_count(s.shape) for s in order]
    widest = max(round_up(u * c, align) for u, c in zip(units, counts, strict=True))
    base = math.lcm(align, *units)
    if base > _MAX_LCM_FACTOR * max(units):
        base, units = widest, [u * c for u, c in zip(units, counts, strict=True)]
        counts = [1] * len(order)  # each stack is placed as one unit
    target = sum(u * c for u, c in zip(units, counts, strict=True))
    if bucket_size is not None:
        target = min(target, bucket_size)
    per_shard = max(1, math.ceil(target / (k * base)))

    filler = _StackFiller(units, counts, align)
    buckets: list[Bucket] = []
    while not filler.done():
        c = per_shard
        while c > 1 and filler.fits(k, (c - 1) * base):  # the tail: smallest width that holds it
            c -= 1
        width = c * base
        start = buckets[-1].end if buckets else 0
        filler.fill(len(buckets), start, k, width)
        buckets.append(Bucket(len(buckets), start, start + k * width, width))
    placements = [
        Placement(s.name, tuple(s.shape), bucket, start, start + s.numel, None)
        for s, (bucket, start) in zip(order, filler.starts, strict=True)
    ]
    return Buffer("stacked", k, align, tuple(buckets), tuple(reversed(placements)))


class _StackFiller:
    """Places stacks (as runs of equal units) shard by shard; see [Note: stacked buffers]."""

    def __init__(self, units: list[int], counts: list[int], align: int) -> None:
        self.units, self.counts, self.align = units, counts, align
        self.stack, self.placed = 0, 0  # next unit to place: `placed` units of `stack` are in
        self.starts: list[tuple[int, int]] = []  # (bucket, start) of every stack begun

    def done(self) -> bool:
        return self.stack == len(self.units)

    def fits(self, k: int, width: int) -> bool:
        """Whether everything left fits in one bucket of `k` shards of `width`."""
        saved = (self.stack, self.placed, len(self.starts))
        try:
            self.fill(-1, 0, k, width)
            return self.done()
        finally:
            self.stack, self.placed = saved[0], saved[1]
            del self.starts[saved[2] :]

    def fill(self, bucket: int, start: int, k: int, width: int) -> None:
        """Fill one bucket of `k` shards of `width` starting at buffer element `start`."""
        for shard in range(k):
            offset = 0  # inside the shard
            while not self.done():
                unit, left = self.units[self.stack], self.counts[self.stack] - self.placed
                room = width - offset
                if self.placed == 0:  # a stack begins: here only if it tiles what is left
                    if left * unit > room and room % unit:
                        break
                    self.starts.append((bucket, start + shard * width + offset))
                n = min(left, room // unit)
                if n == 0:
                    break
                self.placed += n
                offset += n * unit
                if self.placed < self.counts[self.stack]:
                    break  # the stack fills this shard exactly and goes on in the next
                self.stack, self.placed = self.stack + 1, 0
                offset = round_up(offset, self.align)
                if offset >= width:
                    break
            if self.done():
                return
