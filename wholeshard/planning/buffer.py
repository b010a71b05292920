"""`Buffer`: one planned buffer, its owner rule, and the invariants every planner keeps.

A buffer is one flat tensor of one kind, cut into buckets; what a rank owns depends on the kind:

- `"matrix"`: whole tensors. Each bucket is `shard_group_size` shards (equal, or an owner
  bucket's of any length: [Note: owner buckets] in `specs`), rank r of the shard group owns
  shard r; every param lies wholly inside one shard and its `owner` is `Bucket.owner(start)`;
  tied params sit alone at the start of their bucket.
- `"stacked"`: whole matrices of stacked params ([Note: stacked buffers] in `_stacked`). A stack
  may spread over consecutive shards; each matrix's owner follows from its offset.
- `"adamw"`: element-wise. Params are packed tightly in backprop order and may straddle shards;
  each bucket is padded to a multiple of `k * align`, no more.
- `"exchange"`: every param of the exchange strategy ([Note: exchange buffers] in `_exchange`):
  per-layer buckets of equal shards; element-wise params owned by their shards' holders, each
  matrix of a Muon param by the rank in `Placement.owners`, wherever its elements lie.
- a layout's kind (`register_kind`, [Note: layouts] in `layouts`): every param whole, owned by
  its `Placement.owner`, in buckets without shards (a bucket is one shard of its own size, held
  by every rank).

Every kind: buckets are contiguous from element 0, params start on `align`-element boundaries,
never overlap, and fill buckets in backprop order (reverse registration order). `Buffer.check`
(`_invariants`) raises AssertionError naming what is broken (explicit raises: they hold under
`python -O`).
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, bisect_right
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

from ._invariants import check_buffer
from .specs import (
    Bucket,
    MatrixCost,
    ParamSpec,
    Placement,
    matrices,
    matrix_shape,
    shape_cost,
)

BufferKind = Literal["matrix", "stacked", "exchange", "adamw"]
KINDS: tuple[BufferKind, ...] = ("matrix", "stacked", "exchange", "adamw")
"""The planners' kinds, in plan order."""
LAYOUT_KINDS: dict[str, str] = {}
"""The kinds layouts registered (`register_kind`), with what a rank owns of one, for reports."""
SHARDING = {
    "matrix": "whole tensors",
    "stacked": "whole matrices",
    "exchange": "whole matrices exchanged to owners, the rest element-wise",
    "adamw": "element-wise",
}


def register_kind(kind: str, sharding: str) -> None:
    """Add a layout's buffer kind ([Note: layouts] in `layouts`; the module docstring says what
    its buffers keep), `sharding` saying what a rank owns of it; a planner's kind is refused."""
    if kind in KINDS or LAYOUT_KINDS.setdefault(kind, sharding) != sharding:
        raise ValueError(f"buffer kind {kind!r} is taken")


@dataclass(frozen=True)
class Buffer:
    """One planned buffer of one kind (`KINDS`) over a shard group of `shard_group_size` ranks.
    `placements` are the buffer's params in registration order."""

    kind: str  # a `BufferKind`, or a layout's (`LAYOUT_KINDS`)
    shard_group_size: int
    align: int
    buckets: tuple[Bucket, ...]
    placements: tuple[Placement, ...]

    @property
    def numel(self) -> int:
        return self.buckets[-1].end if self.buckets else 0

    @property
    def used(self) -> int:
        """Elements that belong to a param (the rest is padding)."""
        return sum(p.numel for p in self.placements)

    @property
    def padding_fraction(self) -> float:
        return 0.0 if self.numel == 0 else 1.0 - self.used / self.numel

    @property
    def whole(self) -> bool:
        """Whether every param is owned whole by one rank (`owner` set on every placement)."""
        return self.kind == "matrix" or self.kind in LAYOUT_KINDS

    @property
    def sharding(self) -> str:
        """What a rank owns, for reports."""
        return SHARDING.get(self.kind) or LAYOUT_KINDS[self.kind]

    def buckets_of(self, placement: Placement) -> range:
        """Indices of the buckets `placement` overlaps (one, except for a spread stack)."""
        last = placement.bucket
        while last + 1 < len(self.buckets) and self.buckets[last + 1].start < placement.end:
            last += 1
        return range(placement.bucket, last + 1)

    def storage_units(self) -> tuple[range, ...]:
        """The buffer's storage units: runs of consecutive bucket indices, in order, covering
        every bucket once, where buckets b and b + 1 share a unit iff some placement crosses the
        boundary between them. A param's data is one view of its buffer, so every param lies
        inside one unit, and a fully sharded buffer materialises a unit's buckets together.
        Only a stacked buffer has units of more than one bucket."""
        starts = [b.start for b in self.buckets]
        joined = [False] * len(self.buckets)  # joined[b]: bucket b is in the unit of b - 1
        for p in self.placements:
            for b in range(bisect_right(starts, p.start), bisect_left(starts, p.end)):
                joined[b] = True
        firsts = [b for b in range(len(self.buckets)) if not joined[b]]
        return tuple(map(range, firsts, [*firsts[1:], len(self.buckets)]))

    def owned_range(self, placement: Placement, rank: int) -> tuple[int, int]:
        """(offset, length): the elements `[offset, offset + length)` of the flattened param
        that shard-group rank `rank` owns; `(0, 0)` if it owns none of them. A whole tensor is
        owned all or nothing."""
        if not 0 <= rank < self.shard_group_size:
            raise ValueError(
                f"rank {rank} is not in the shard group 0..{self.shard_group_size - 1}; "
                "pass the rank within the group (Plan.shard_rank(global_rank))"
            )
        if self.kind == "stacked" or placement.owners:
            if len(placement.owners) == 1:
                return (0, placement.numel) if placement.owners[0] == rank else (0, 0)
            raise ValueError("a stacked param may have several owned ranges: use owned()")
        if self.kind in LAYOUT_KINDS:
            return (0, placement.numel) if placement.owner == rank else (0, 0)
        lo, hi = self.buckets[placement.bucket].shard(rank)
        start, end = max(placement.start, lo), min(placement.end, hi)
        return (start - placement.start, end - start) if start < end else (0, 0)

    def owned(self, rank: int) -> Iterator[tuple[Placement, int, int]]:
        """(placement, offset, length) of every param piece shard-group rank `rank` owns, in
        registration order; a stacked param yields one piece per owned matrix."""
        if self.kind == "stacked":
            for p in self.placements:
                for m in matrices(p, self.buckets):
                    if m.owner == rank:
                        yield p, m.start - p.start, m.end - m.start
            return
        for p in self.placements:
            if p.owners:  # an exchange buffer's matrices
                unit = p.numel // len(p.owners)
                yield from ((p, j * unit, unit) for j, o in enumerate(p.owners) if o == rank)
                continue
            offset, length = self.owned_range(p, rank)
            if length:
                yield p, offset, length

    def rank_costs(self, matrix_cost: MatrixCost | None = None) -> list[int]:
        """`matrix_cost` (None: Newton-Schulz cost, `ns_cost`) of the matrices each shard-group
        rank owns (Muon params only: zeros for an element-wise buffer)."""
        costs = [0] * self.shard_group_size
        if self.kind == "stacked":
            for p in self.placements:
                cost = shape_cost(matrix_shape(p.shape), matrix_cost)
                for m in matrices(p, self.buckets):
                    costs[m.owner] += cost
        elif self.kind == "matrix":
            for p in self.placements:
                costs[p.owner] += shape_cost(p.shape, matrix_cost)
        elif self.kind == "exchange":
            for p in self.placements:
                for owner in p.owners:
                    costs[owner] += shape_cost(p.shape[-2:], matrix_cost)  # 0 below 2-D
        return costs

    def piece_shape(self, placement: Placement, length: int) -> tuple[int, ...]:
        """The shape of an owned range of `length` elements of `placement` (from `owned`): the
        param's for a whole tensor, one matrix's for a matrix of a stack, else flat."""
        if length == placement.numel and (self.whole or len(placement.owners) == 1):
            return placement.shape
        if self.kind == "stacked" or placement.owners:
            return matrix_shape(placement.shape)
        return (length,)

    def check(self, specs: Sequence[ParamSpec] | None = None) -> None:
        """Raise AssertionError naming the bucket or param if an invariant is broken. With
        `specs` (this buffer's specs, registration order) also check names, shapes and order,
        and that every tied param of a whole-tensor buffer sits alone in its bucket."""
        if self.kind not in KINDS and self.kind not in LAYOUT_KINDS:
            raise AssertionError(
                f"buffer kind {self.kind!r} must be one of {KINDS} or a layout's "
                f"({sorted(LAYOUT_KINDS)})"
            )
        check_buffer(self, specs, whole_buckets=self.kind in LAYOUT_KINDS)


def deal(costs: Sequence[int], sizes: Sequence[int], k: int) -> list[int]:
    """The owner of each item of `costs` and `sizes` (elements) over `k` ranks, the one owner
    rule of the owners and exchange strategies: costliest first (ties: larger, then earlier), each
    to the rank of least (cost, elements, rank) so far."""
    ranked = sorted(range(len(costs)), key=lambda i: (-costs[i], -sizes[i], i))
    loads = [(0, 0, r) for r in range(k)]
    owners = [0] * len(costs)
    for i in ranked:
        cost, numel, rank = heapq.heappop(loads)
        owners[i] = rank
        heapq.heappush(loads, (cost + costs[i], numel + sizes[i], rank))
    return owners
