"""Packing helpers of the balanced planner: `pack` assigns a bucket's params to ranks, and
`FirstFit` finds the first free param that fits a room."""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence

Packing = tuple[list[int], list[int], list[int], tuple[int, float]]
"""`pack`'s result: rank per item, cost per rank, load per rank, and the caps `[lo, hi)` under
which the same packing comes out."""


def pack(
    widths: list[int],
    costs: list[int],
    carried: list[int],
    dp_size: int,
    cap: int,
    cost_ceiling: float = math.inf,
    hard_ceiling: bool = False,
) -> Packing:
    """Assign items (given by width and cost, in assignment order) to ranks: each to the rank
    whose load stays `<= cap` and whose cost stays `<= cost_ceiling` that is furthest below its
    share, i.e. with the least `(cost / cost_share + load / load_share, rank)` (cost: `carried`
    plus what it got here). If there is none: the rank furthest below its share with room
    above the ceiling (unless `hard_ceiling`), else the least-loaded rank, over the cap (below
    the ceiling if any is; ties: the lower rank)."""
    cost = list(carried)
    load = [0] * dp_size
    per_cost = dp_size / ((sum(carried) + sum(costs)) or 1)
    per_load = dp_size / sum(widths)
    # Every step depends on the cap only through `need <= cap` (a load after taking an item):
    # under any cap in [fits, overflows) each comes out the same, and so does the packing.
    fits, overflows = 0, math.inf
    # Runs of like items (same width and cost). Loads and costs only grow, so a rank that
    # cannot take an item cannot take a like item later either: it is parked for the run.
    runs = [
        (w, c, len(list(like)))
        for (w, c), like in itertools.groupby(zip(widths, costs, strict=True))
    ]
    # narrowest[i]: the narrowest item from run i on; a rank with less room is full for good.
    narrowest = list(itertools.accumulate(reversed([w for w, _, _ in runs]), min))[::-1]
    # The ranks not full for good nor parked, furthest below their share first.
    open_ranks = [(cost[r] * per_cost + load[r] * per_load, r) for r in range(dp_size)]
    heapq.heapify(open_ranks)
    parked: list[int] = []
    ranks: list[int] = []
    for (width, item_cost, count), narrow in zip(runs, narrowest, strict=True):
        ceiling = math.inf if item_cost == 0 else cost_ceiling - item_cost
        for r in parked:
            need = load[r] + narrow
            if need <= cap:
                fits = max(fits, need)
                heapq.heappush(open_ranks, (cost[r] * per_cost + load[r] * per_load, r))
            else:
                overflows = min(overflows, need)
        parked = []
        while count and open_ranks:
            rank = open_ranks[0][1]
            need = load[rank] + width
            if need > cap:
                overflows = min(overflows, need)
            else:
                fits = need if need > fits else fits
                if cost[rank] <= ceiling:
                    load[rank] = need
                    cost[rank] += item_cost
                    ranks.append(rank)
                    heapq.heapreplace(open_ranks, (cost[rank] * per_cost + need * per_load, rank))
                    count -= 1
                    continue
            heapq.heappop(open_ranks)
            parked.append(rank)
        # Every rank with room for the rest of the run is parked: over the ceiling.
        spill: list[tuple[bool, int, int]] = []  # see `_least_loaded`
        for _ in range(count):
            roomy = []
            for r in [] if hard_ceiling else parked:
                need = load[r] + width
                if need <= cap:
                    fits = max(fits, need)
                    roomy.append(r)
                else:
                    overflows = min(overflows, need)
            if roomy:
                rank = min(roomy, key=lambda r: (cost[r] * per_cost + load[r] * per_load, r))
            else:  # over the cap, on the least-loaded rank below the ceiling if any
                rank = _least_loaded(spill, cost, load, ceiling)
            load[rank] += width
            cost[rank] += item_cost
            ranks.append(rank)
            if spill:
                heapq.heappush(spill, (cost[rank] > ceiling, load[rank], rank))
    return ranks, cost, load, (fits, overflows)


def _least_loaded(
    spill: list[tuple[bool, int, int]], cost: list[int], load: list[int], ceiling: float
) -> int:
    """The least `(cost > ceiling, load, rank)` of all ranks. `spill` (heap) holds an entry of
    every rank's current state, and stale ones; filled here when empty."""
    if not spill:
        spill += ((c > ceiling, x, r) for r, (c, x) in enumerate(zip(cost, load, strict=True)))
        heapq.heapify(spill)
    while True:
        over, x, r = spill[0]
        if x == load[r] and over == (cost[r] > ceiling):
            return r
        heapq.heappop(spill)


class FirstFit:
    """Min segment tree over backprop positions: the first position >= lo whose aligned size
    fits a capacity, in O(log n). Removed positions hold +inf."""

    def __init__(self, sizes: Sequence[float]) -> None:
        self.n = len(sizes)
        size = 1
        while size < self.n:
            size *= 2
        self.size = size
        self.tree: list[float] = [math.inf] * (2 * size)
        self.tree[size : size + self.n] = sizes
        self._refresh(0, self.n)

    def remove(self, pos: int) -> None:
        tree = self.tree
        i = pos + self.size
        tree[i] = math.inf
        i >>= 1
        while i:
            left, right = tree[2 * i], tree[2 * i + 1]
            smallest = left if left < right else right
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

    def update(self, positions: Sequence[int], sizes: Sequence[float]) -> None:
        """Give each position its size: +inf removes it, another size puts it back (as `put`:
        it must be removed). For a whole bucket at once."""
        lo, hi = min(positions, default=0), max(positions, default=-1) + 1
        if len(positions) < 64 or hi - lo > 4 * len(positions):  # few or spread: one by one
            for pos, size in zip(positions, sizes, strict=True):
                if size == math.inf:
                    self.remove(pos)
                else:
                    self.put(pos, size)
            return
        tree, size = self.tree, self.size
        for pos, x in zip(positions, sizes, strict=True):
            tree[size + pos] = x
        self._refresh(lo, hi)

    def _refresh(self, lo: int, hi: int) -> None:
        """Recompute the minima above positions `[lo, hi)`, a level at a time."""
        tree = self.tree
        lo += self.size
        hi += self.size
        while lo > 1:
            lo, hi = lo >> 1, (hi + 1) >> 1
            pairs = zip(tree[2 * lo : 2 * hi : 2], tree[2 * lo + 1 : 2 * hi : 2], strict=True)
            tree[lo:hi] = [left if left < right else right for left, right in pairs]

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
