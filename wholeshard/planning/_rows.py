"""The size-matching planner: buckets of rows of same-size params.

[Note: size matching]
The size-matching planner builds each bucket from *rows*. A row takes the next unassigned param
(in backprop order) as its seed and gives it shard 0's slot of width `S = round_up(numel, align)`.
Every other shard r gets, in the same row, the next unassigned param with the seed's numel; when
none is left it gets the following params (backprop order) whose aligned size still fits the
slot, then padding. All shards grow by `S` per row, so they stay equal by construction, and a
stack of identical blocks (every numel's count a multiple of `dp_size`) needs no padding beyond
alignment.
Rank r's shard of a bucket is the concatenation of slot r of the bucket's rows. A tied param
gets a bucket of its own: shard 0 holds it, shards 1.. are padding.

Planners work on backprop positions: position p is registration index `len(specs) - 1 - p`.
"""

from __future__ import annotations

import itertools
import math
from collections import deque

from ._packing import FirstFit
from .buffer import Buffer
from .specs import Bucket, ParamSpec, Placement, round_up

Row = tuple[int, list[tuple[int, int, int]]]
"""A row: (slot width, [(rank, backprop position, offset inside the slot), ...])."""


def plan_rows(
    specs: tuple[ParamSpec, ...], dp_size: int, bucket_size: int | None, align: int
) -> list[list[Row]]:
    """Group params into buckets of size-matching rows; a bucket is closed once it holds
    `>= bucket_size` elements (None: one bucket between tied params)."""
    n = len(specs)
    numels = [specs[n - 1 - p].numel for p in range(n)]
    widths = [round_up(x, align) for x in numels]
    tied = [specs[n - 1 - p].tied for p in range(n)]

    taken = bytearray(n)
    # numel -> pending positions in backprop order; entries taken by packing are skipped lazily.
    same_numel: dict[int, deque[int]] = {}
    for p in range(n):
        if not tied[p]:
            same_numel.setdefault(numels[p], deque()).append(p)
    fit = FirstFit([math.inf if tied[p] else widths[p] for p in range(n)])

    buckets: list[list[Row]] = []
    current: list[Row] = []
    current_shard = 0
    for seed in range(n):
        if taken[seed]:
            continue
        width = widths[seed]
        taken[seed] = 1
        entries = [(0, seed, 0)]
        if tied[seed]:
            if current:
                buckets.append(current)
            buckets.append([(width, entries)])
            current, current_shard = [], 0
            continue

        partners = same_numel[numels[seed]]
        mates: list[int] = []  # the next untaken partners, one per rank 1..
        while partners and len(mates) < dp_size - 1:
            pos = partners.popleft()
            if not taken[pos]:
                taken[pos] = 1
                mates.append(pos)
        entries += zip(range(1, len(mates) + 1), mates, itertools.repeat(0))
        for rank in range(len(mates) + 1, dp_size):
            # No partner left: pack the following params that fit, in backprop order.
            used, lo = 0, seed + 1
            while used < width:
                pos = fit.first_fit(lo, width - used)
                if pos < 0:
                    break
                fit.remove(pos)
                if taken[pos]:  # stale: taken as somebody's partner
                    continue
                taken[pos] = 1
                entries.append((rank, pos, used))
                used += widths[pos]
                lo = pos + 1
            if used == 0:
                break  # nothing fits this slot, so nothing fits the later ones: padding
        current.append((width, entries))
        current_shard += width
        if bucket_size is not None and current_shard * dp_size >= bucket_size:
            buckets.append(current)
            current, current_shard = [], 0
    if current:
        buckets.append(current)
    return buckets


def buffer_of_rows(
    specs: tuple[ParamSpec, ...], dp_size: int, align: int, bucket_rows: list[list[Row]]
) -> Buffer:
    """The whole-tensor (`"matrix"`) `Buffer` of planned bucket rows; placements in the order of
    `specs`."""
    n = len(specs)
    placements: list[Placement | None] = [None] * n
    buckets: list[Bucket] = []
    bucket_start = 0
    for index, rows in enumerate(bucket_rows):
        shard_numel = sum(width for width, _ in rows)
        bucket = Bucket(index, bucket_start, bucket_start + dp_size * shard_numel, shard_numel)
        owner = bucket.owner
        row_offset = 0
        for width, entries in rows:
            for rank, pos, slot_offset in entries:
                spec = specs[n - 1 - pos]
                # bucket.shard(rank)[0] + the offsets in the shard, inlined
                start = bucket_start + rank * shard_numel + row_offset + slot_offset
                placements[n - 1 - pos] = Placement(
                    spec.name, tuple(spec.shape), index, start, start + spec.numel, owner(start)
                )
            row_offset += width
        buckets.append(bucket)
        bucket_start = bucket.end

    if any(p is None for p in placements):
        raise AssertionError("internal error: a param was not placed")
    return Buffer("matrix", dp_size, align, tuple(buckets), tuple(placements))  # type: ignore[arg-type]
