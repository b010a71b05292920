"""The owners strategy: every matrix's owner chosen over the whole buffer, buckets of any size.

[Note: owners strategy]
With equal shards a bucket of whole matrices over k ranks holds at least k times its widest
matrix, so at a few dozen ranks one bucket is most of the model. The owners strategy plans
owner buckets instead ([Note: owner buckets] in `specs`), whose shards may have any length:
- "matrix" (whole tensors): owners are dealt over the whole buffer, costliest first, each to the
  rank with the least cost so far (ties: fewest elements, then the lowest rank); then the params
  are cut, in backprop order, into buckets that close once they hold `bucket_size` elements (a
  tied param alone in its own), and inside a bucket laid out by owner (rank 0's first, each
  rank's in backprop order), so rank r's shard is one contiguous range.
- "stacked" (whole matrices of stacks): a stack's matrices cannot be reordered, so owners are
  contiguous runs of the buffer's matrices (in buffer order), cut where the running cost passes
  r / k of the total; buckets close at every stack's start and at the first aligned matrix
  boundary once they hold `bucket_size` elements, so a long stack spans several buckets of one
  storage unit, and a storage unit is one stack.
Either way there is no padding beyond each param's alignment, and load balance comes from the
owners over the buffer, not from each bucket.
"""

from __future__ import annotations

import bisect
import math
import operator
from collections.abc import Sequence

from ._exchange import plan_exchange
from .buffer import Buffer, deal
from .specs import (
    Bucket,
    MatrixCost,
    ParamSpec,
    Placement,
    matrix_count,
    matrix_shape,
    round_up,
    shape_cost,
    spec_cost,
)


def plan_owned(
    kind: str,
    specs: Sequence[ParamSpec],
    k: int,
    bucket_size: int | None,
    align: int,
    matrix_cost: MatrixCost | None = None,
) -> Buffer:
    """The `kind` buffer of validated `specs` (registration order) over `k` ranks, its matrices
    dealt to owners: "matrix" or "stacked" in owner buckets ([Note: owners strategy]), or
    "exchange" ([Note: exchange buffers] in `_exchange`); not yet checked."""
    order = list(reversed(specs))  # backprop order = buffer order
    limit = math.inf if bucket_size is None else bucket_size
    plan = {"matrix": _whole, "stacked": _stacked, "exchange": plan_exchange}[kind]
    return plan(order, k, limit, align, matrix_cost)


def _whole(
    order: list[ParamSpec], k: int, limit: float, align: int, matrix_cost: MatrixCost | None
) -> Buffer:
    """The "matrix" buffer of params in buffer `order`, buckets closing at `limit` elements."""
    owners = _deal(order, k, matrix_cost)
    groups: list[list[int]] = [[]]  # backprop positions of each bucket's params
    size = 0
    for pos, s in enumerate(order):
        if s.tied and groups[-1]:  # a tied param sits alone in its bucket
            groups.append([])
        groups[-1].append(pos)
        size += round_up(s.numel, align)
        if s.tied or size >= limit:
            groups.append([])
            size = 0

    buckets: list[Bucket] = []
    placed: dict[int, Placement] = {}
    start = 0
    for index, members in enumerate(filter(None, groups)):
        listed: list[tuple[int, int]] = []
        at = start
        for pos in sorted(members, key=lambda pos: (owners[pos], pos)):
            s, rank = order[pos], owners[pos]
            if not listed or listed[-1][0] != rank:
                listed.append((rank, at))
            placed[pos] = Placement(s.name, tuple(s.shape), index, at, at + s.numel, rank)
            at = round_up(at + s.numel, align)
        buckets.append(Bucket(index, start, at, 0, tuple(listed)))
        start = at
    placements = [placed[pos] for pos in reversed(range(len(order)))]
    return Buffer("matrix", k, align, tuple(buckets), tuple(placements))


def _deal(order: Sequence[ParamSpec], k: int, matrix_cost: MatrixCost | None) -> list[int]:
    """Each param's owner: costliest first to the rank of least (cost, elements, rank)."""
    return deal([spec_cost(s, matrix_cost) for s in order], [s.numel for s in order], k)


def _stacked(
    order: list[ParamSpec], k: int, limit: float, align: int, matrix_cost: MatrixCost | None
) -> Buffer:
    """The "stacked" buffer of params in buffer `order`, buckets closing at `limit` elements."""
    starts, at = [], 0
    for s in order:
        starts.append(at)
        at = round_up(at + s.numel, align)
    # Every matrix in buffer order: (start, end, cost).
    mats: list[tuple[int, int, int]] = []
    for s, lo in zip(order, starts, strict=True):
        unit = math.prod(matrix_shape(s.shape))
        cost = shape_cost(matrix_shape(s.shape), matrix_cost)
        mats += [(lo + j * unit, lo + (j + 1) * unit, cost) for j in range(matrix_count(s.shape))]
    owner_starts = _runs(mats, k)  # owner_starts[r]: index of rank r's first matrix

    # Bucket cuts: every stack's start, and aligned matrix starts where the bucket so far holds
    # >= bucket_size, so a storage unit (the buckets a stack joins) is one stack.
    stack_starts = set(starts)
    cuts = [0]
    for lo, _, _ in mats[1:]:
        if lo in stack_starts or (lo - cuts[-1] >= limit and lo % align == 0):
            cuts.append(lo)
    cuts.append(at)  # the buffer's end

    # (rank, start) of every rank's run, its first matrix's start; empty runs left out.
    runs = [(r, mats[f][0]) for r, f in enumerate(owner_starts) if f < len(mats)]
    runs = [run for i, run in enumerate(runs) if i + 1 == len(runs) or runs[i + 1][1] > run[1]]
    buckets = []
    for i, (lo, hi) in enumerate(zip(cuts, cuts[1:], strict=False)):
        first = bisect.bisect_right(runs, lo, key=operator.itemgetter(1)) - 1
        last = bisect.bisect_left(runs, hi, key=operator.itemgetter(1))
        listed = [(runs[first][0], lo), *runs[first + 1 : last]]
        buckets.append(Bucket(i, lo, hi, 0, tuple(listed)))
    placements = [
        Placement(s.name, tuple(s.shape), bisect.bisect_right(cuts, lo) - 1, lo, lo + s.numel, None)
        for s, lo in zip(order, starts, strict=True)
    ]
    return Buffer("stacked", k, align, tuple(buckets), tuple(reversed(placements)))


def _runs(mats: Sequence[tuple[int, int, int]], k: int) -> list[int]:
    """The first matrix of each rank's run: matrix i goes to the rank in whose 1/k of the total
    cost (of elements where every cost is 0) its midpoint falls, so runs are contiguous and each
    within half a matrix of its share."""
    weights = [c for _, _, c in mats]
    if not any(weights):
        weights = [hi - lo for lo, hi, _ in mats]
    total = sum(weights)
    firsts = [0] + [len(mats)] * (k - 1)  # a rank no matrix reaches starts past the last
    before = owner = 0
    for i, w in enumerate(weights):
        mine = min(k - 1, (2 * before + w) * k // (2 * total))
        while owner < mine:
            owner += 1
            firsts[owner] = i
        before += w
    return firsts
