"""Packing helpers of the balanced planner: `pack` assigns a bucket's params to ranks, and
`FirstFit` finds the first free param that fits a room."""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence


def pack(
    widths: list[int],
    costs: list[int],
    carried: list[int],
    dp_size: int,
    cap: int,
    cost_ceiling: float = math.inf,
    hard_ceiling: bool = False,
) -> tuple[list[int], list[int], list[int]]:
    """Assign items (given by width and cost, in assignment order) to ranks: each to the rank
    whose load stays `<= cap` and whose cost stays `<= cost_ceiling` that is furthest below its
    share, i.e. with the least `cost / cost_share + load / load_share` (cost: `carried` plus
    what it got here). If there is none: a rank with room above the ceiling (unless
    `hard_ceiling`), else the least-loaded rank, over the cap (below the ceiling if any is).
    Returns (rank per item, cost per rank, load per rank)."""
    cost = list(carried)
    load = [0] * dp_size
    per_cost = dp_size / ((sum(carried) + sum(costs)) or 1)
    per_load = dp_size / sum(widths)

    def below_share(r: int) -> tuple[float, int]:
        return cost[r] * per_cost + load[r] * per_load, r

    # smallest[i]: the narrowest of items i..; a rank with less room than that is full for good.
    smallest = list(itertools.accumulate(reversed(widths), min))[::-1] + [0]
    # The ranks not full for good, furthest below their share first.
    open_ranks = [below_share(r) for r in range(dp_size)]
    heapq.heapify(open_ranks)
    ranks = []
    for i, (width, item_cost) in enumerate(zip(widths, costs, strict=True)):
        ceiling = math.inf if item_cost == 0 else cost_ceiling - item_cost
        looked_at = []  # open ranks popped, furthest below their share first
        rank = -1
        while open_ranks and rank < 0:
            r = heapq.heappop(open_ranks)[1]
            looked_at.append(r)
            if load[r] + width <= cap and cost[r] <= ceiling:
                rank = r
        if rank < 0:
            roomy = [r for r in looked_at if load[r] + width <= cap]  # over the cost ceiling
            if roomy and not hard_ceiling:
                rank = roomy[0]
            else:  # over the cap, on the least-loaded rank below the ceiling if any
                rank = min(range(dp_size), key=lambda r: (cost[r] > ceiling, load[r]))
        load[rank] += width
        cost[rank] += item_cost
        ranks.append(rank)
        for r in {rank, *looked_at}:
            if cap - load[r] >= smallest[i + 1]:
                heapq.heappush(open_ranks, below_share(r))
    return ranks, cost, load


class FirstFit:
    """Min segment tree over backprop positions: the first position >= lo whose aligned size
    fits a capacity, in O(log n). Removed positions hold +inf."""

    def __init__(self, sizes: Sequence[float]) -> None:
        self.n = len(sizes)
        size = 1
        while size < self.n:
            size *= 2
        self.size = size
        tree: list[float] = [math.inf] * (2 * size)
        tree[size : size + self.n] = sizes
        for i in range(size - 1, 0, -1):
            tree[i] = min(tree[2 * i], tree[2 * i + 1])
        self.tree = tree

    def remove(self, pos: int) -> None:
        tree = self.tree
        i = pos + self.size
        tree[i] = math.inf
        i >>= 1
        while i:
            smallest = min(tree[2 * i], tree[2 * i + 1])
            if tree[i] == smallest:
                break
            tree[i] = smallest
            i >>= 1

    def put(self, pos: int, size: float) -> None:
        """Give the removed position `pos` the size `size` again (undo `remove`)."""
        tree = self.tree
        i = pos + self.size
        tree[i] = size
        i >>= 1
        while i and tree[i] > size:
            tree[i] = size
            i >>= 1

    def range_min(self, lo: int, hi: int) -> float:
        """The smallest size among positions `[lo, hi)` (+inf if none)."""
        tree = self.tree
        best = math.inf
        lo += self.size
        hi += self.size
        while lo < hi:
            if lo & 1:
                best = min(best, tree[lo])
                lo += 1
            if hi & 1:
                hi -= 1
                best = min(best, tree[hi])
            lo >>= 1
            hi >>= 1
        return best

    def first_fit(self, lo: int, capacity: int) -> int:
        """The smallest position >= lo with size <= capacity, or -1."""
        tree = self.tree
        if lo >= self.n or tree[1] > capacity:
            return -1
        i = lo + self.size
        while tree[i] > capacity:
            while i & 1:  # a right child: climb until we can step right
                i >>= 1
            if i == 0:
                return -1
            i += 1
        while i < self.size:
            i *= 2
            if tree[i] > capacity:
                i += 1
        return i - self.size
