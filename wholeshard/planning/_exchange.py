"""The exchange strategy: one buffer of every param, in per-layer buckets of equal shards, each
matrix stepped whole by an owner dealt apart from the layout.

[Note: exchange buffers]
FSDP2 spends one reduce-scatter and one all-gather per transformer block. An exchange buffer
does the same: every trainable param (matrices, stacks, element-wise params) is packed tightly
in backprop order, each starting on an `align`-element boundary, and cut into buckets that close
where the next param belongs to another layer (`specs.layer_of`; each run of params outside
numbered modules counts as one) once they hold `bucket_size` elements, or around a param that
sits alone: a tied one, or one outside the numbered modules that holds `bucket_size` elements
at least (an embedding, a head: the element-wise planner keeps such a one alone too); each
bucket is padded to a multiple of `k * align` and cut into k equal shards (`Bucket.exchanged`).
A param never spans buckets; a matrix may span shards. Element-wise params are owned as in an
"adamw" buffer: rank r steps what its shard holds. Each matrix of a Muon
param (a 2-D param, or each matrix of a stack) is owned whole by the rank `buffer.deal` gives
it over the whole buffer, costliest first to the rank with the least cost so far, which is the
owners strategy's rule, so the busiest rank's matrix work is the same. After the
reduce-scatter, the pieces of each matrix that other ranks' shards hold are sent to its owner
(`segments`, an all-to-all in the engine), and after the update the owner sends them back
before the all-gather: each reduced element crosses once each way. Fully sharded, the owner has
a copy of each matrix it owns beside its shards, through the step ([Note: owned copies] in
`engine._owned_copies`), and the pieces its own shard holds (`pieces` with holder == owner) are
copied between the two on the owner alone; the gathers then run from the shards as usual.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from .buffer import Buffer, deal
from .specs import (
    Bucket,
    MatrixCost,
    ParamSpec,
    Placement,
    layer_of,
    matrix_count,
    round_up,
    shape_cost,
)


def plan_exchange(
    order: list[ParamSpec], k: int, limit: float, align: int, matrix_cost: MatrixCost | None
) -> Buffer:
    """The "exchange" buffer of validated specs in buffer `order` (backprop order, every param)
    over `k` ranks, buckets closing at `limit` elements ([Note: exchange buffers]; `math.inf`:
    one bucket between params that sit alone); not yet checked. `_owners.plan_owned` calls it."""
    owners = _owners(order, k, matrix_cost)
    placements: list[Placement] = []
    buckets: list[Bucket] = []
    start = cursor = 0  # of the open bucket; where the next param goes

    def close() -> None:
        nonlocal start, cursor
        end = start + round_up(cursor - start, k * align)
        buckets.append(Bucket(len(buckets), start, end, (end - start) // k, exchanged=True))
        start = cursor = end

    def alone(spec: ParamSpec) -> bool:  # tied, or a wide param outside the layers (a head)
        return spec.tied or (spec.numel >= limit and layer_of(spec.name) is None)

    for j, spec in enumerate(order):
        if alone(spec) and cursor > start:
            close()
        mine = owners[j]
        owner = mine[0] if mine and len(spec.shape) == 2 else None
        end = cursor + spec.numel
        placements.append(
            Placement(spec.name, tuple(spec.shape), len(buckets), cursor, end, owner, mine)
        )
        cursor = round_up(end, align)
        after = order[j + 1] if j + 1 < len(order) else None
        layer_ends = after is None or layer_of(after.name) != layer_of(spec.name)
        if after is None or alone(spec) or alone(after) or (cursor - start >= limit and layer_ends):
            close()
    return Buffer("exchange", k, align, tuple(buckets), tuple(reversed(placements)))


def _owners(
    order: Sequence[ParamSpec], k: int, matrix_cost: MatrixCost | None
) -> list[tuple[int, ...]]:
    """Per spec of buffer `order`, the owner of each of its matrices (none for an element-wise
    param; one for a Muon param of fewer than two dims, whole, as a "matrix" buffer owns it),
    dealt in that order by the owners strategy's rule (`buffer.deal`)."""
    items: list[tuple[int, int, int]] = []  # (position, cost, elements) of every matrix
    for j, s in enumerate(order):
        if s.matrix:
            shape = tuple(s.shape[-2:])  # one matrix's (the whole param below two dims)
            count = matrix_count(s.shape) if len(s.shape) > 2 else 1
            items += [(j, shape_cost(shape, matrix_cost), math.prod(shape))] * count
    dealt = deal([c for _, c, _ in items], [n for _, _, n in items], k)
    owners: list[list[int]] = [[] for _ in order]
    for (j, _, _), rank in zip(items, dealt, strict=True):
        owners[j].append(rank)
    return [tuple(o) for o in owners]


@dataclass(frozen=True)
class Segment:
    """Elements `[start, end)` of a bucket's matrix that the shard of `holder` holds and
    `owner` steps. Where holder != owner (`segments`), the exchange moves it, holder to owner
    for gradients and back for params; where holder == owner, a fully sharded owner copies it
    between its shard and its whole copy of the matrix (`pieces`)."""

    bucket: int
    start: int
    end: int
    holder: int
    owner: int

    @property
    def numel(self) -> int:
        return self.end - self.start


def matrix_ranges(buffer: Buffer) -> Iterator[tuple[Placement, int, int, int]]:
    """(placement, start, end, owner) of every matrix of an exchange buffer, in registration
    order of the params (a stack's matrices in order)."""
    for p in buffer.placements:
        yield from ((p, lo, hi, owner) for lo, hi, owner in placement_matrices(p))


def placement_matrices(p: Placement) -> Iterator[tuple[int, int, int]]:
    """(start, end, owner) of each matrix of an exchange buffer's param (none if element-wise)."""
    if p.owners:
        unit = p.numel // len(p.owners)
        for j, owner in enumerate(p.owners):
            yield p.start + j * unit, p.start + (j + 1) * unit, owner


def pieces(buffer: Buffer) -> tuple[Segment, ...]:
    """Every piece of an exchange buffer's matrices that one shard holds, its owner's own
    included, in buffer order ([Note: exchange buffers])."""
    out = [s for p in buffer.placements for s in placement_pieces(p, buffer.buckets[p.bucket])]
    out.sort(key=lambda s: s.start)
    return tuple(out)


def placement_pieces(p: Placement, b: Bucket) -> Iterator[Segment]:
    """The pieces of the matrices of param `p`, which lies in bucket `b`, one per shard."""
    for lo, hi, owner in placement_matrices(p):
        for holder in range(b.owner(lo), b.owner(hi - 1) + 1):
            s_lo, s_hi = b.shard(holder)
            yield Segment(b.index, max(lo, s_lo), min(hi, s_hi), holder, owner)


def segments(buffer: Buffer) -> tuple[Segment, ...]:
    """The pieces the exchange moves: those held by a rank other than the matrix's owner."""
    return tuple(s for s in pieces(buffer) if s.holder != s.owner)
