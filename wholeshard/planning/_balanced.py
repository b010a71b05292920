"""The balanced planner: Newton-Schulz cost balanced across ranks, padding kept low.

[Note: balanced]
The balanced strategy balances the matrix rule's cost (`spec_cost` under a `MatrixCost`; by
default Newton-Schulz's, `ns_cost`) across ranks while keeping padding low. Working in
backprop order, each bucket is planned in four steps:
1. take the next free params, in order, until they hold `>= bucket_size` elements and at least
   `dp` times the widest of them (no smaller bucket avoids padding); if what is left before the
   next tied param could not make such a bucket, take it all;
2. pack: largest cost first (ties: larger first), each param to the rank whose shard still has
   room under the cap `max(widest, total / dp)` and that is furthest below its share of cost
   (carried over all earlier buckets) and of this bucket's elements; a param with no room
   anywhere overflows onto the least-loaded rank, and the shard size is the largest load;
3. fill each rank's room below that shard size with the first free params further on that fit
   (this pulls small params forward, as size matching's packing does);
4. if the bucket still pads more than `BALANCE_TOLERANCE`, grow it (step 1 with a larger
   target, at most `MAX_GROWTH` times) and try again; keep the least padded try.
When a bucket ends a run of untied params and pads too much, it is merged with up to
`MAX_MERGE - 1` buckets before it if one bucket pads less. No rank takes a param that would
lift its cost above the ceiling `COST_CEILING` x the mean (or the costliest param) while
another rank has room; from `HARD_CEILING_RANKS` ranks on, padding is accepted instead (one
rank's share of a bucket is then small). Inside a shard params keep backprop order; every bucket
holds the first free param in backprop order, so buckets are filled in backprop order; tied
params are isolated exactly as with size matching. Cost of a non-Muon or non-2-D param: 0.
Every bucket is one row (`_rows`) whose width is the shard size.
"""

from __future__ import annotations

import itertools
import math
import operator
from dataclasses import dataclass

from ._packing import FirstFit, Packing, pack
from ._rows import Row
from .specs import MatrixCost, ParamSpec, round_up, spec_cost

Assignment = list[tuple[int, int]]
"""(rank, backprop position) of every param of a bucket."""

BALANCE_TOLERANCE = 0.005  # a bucket padding more than this fraction grows instead
MAX_GROWTH = 8  # a bucket grows to at most this many times its minimal size
COST_CEILING = 1.05  # a rank owning this times the mean cost takes no more costly params
HARD_CEILING_RANKS = 64  # from this many ranks on, the ceiling holds even at a padding cost
FILL_SKIPS = 8  # filling a rank's room gives up after this many too costly params
MAX_MERGE = 4  # a badly padded last bucket of a run may merge with up to 3 before it


def plan_balanced(
    specs: tuple[ParamSpec, ...],
    dp_size: int,
    bucket_size: int | None,
    align: int,
    matrix_cost: MatrixCost | None = None,
) -> list[list[Row]]:
    """Buckets of one row each (width = shard_numel), see [Note: balanced]; the cost balanced is
    `matrix_cost`'s (None: Newton-Schulz's)."""
    n = len(specs)
    order = [specs[n - 1 - p] for p in range(n)]
    plan = _Balancer(
        widths=[round_up(s.numel, align) for s in order],
        costs=[spec_cost(s, matrix_cost) for s in order],
        tied=[s.tied for s in order],
        dp_size=dp_size,
        align=align,
    )
    planned: list[_Planned] = []
    for head in range(n):
        if plan.taken[head]:
            continue
        planned.append(plan.bucket(head, bucket_size))
        plan.take(planned[-1].assignment)
        if len(planned) > 1 and plan.finished_run(planned[-2].head, head):
            _merge_tail(plan, planned, bucket_size)
    return [[plan.row(bucket.assignment)] for bucket in planned]


def _merge_tail(plan: _Balancer, planned: list[_Planned], bucket_size: int | None) -> None:
    """The last bucket ended a run. If it pads more than the tolerance, try one bucket for it
    and the `m - 1` buckets of its run before it (m = 2..MAX_MERGE); keep the first that pads
    less than the buckets it replaces."""
    if planned[-1].padded <= BALANCE_TOLERANCE * plan.dp_size * planned[-1].shard:
        return
    for m in range(2, MAX_MERGE + 1):
        if m > len(planned) or not plan.finished_run(planned[-m].head, planned[-1].head):
            return
        tail = planned[-m:]
        for bucket in reversed(tail):
            plan.take(bucket.assignment, undo=True)
        merged = plan.bucket(tail[0].head, bucket_size, absorb=True)
        if merged.padded < sum(bucket.padded for bucket in tail):
            plan.take(merged.assignment)
            planned[-m:] = [merged]
            return
        for bucket in tail:  # keep the m buckets: take their params again
            plan.take(bucket.assignment)


@dataclass
class _Planned:
    """A planned bucket of one row: its first (backprop) position, its params, its shard size
    and how many elements of it are padding."""

    head: int
    assignment: Assignment
    shard: int
    padded: int


@dataclass
class _Try:
    """One packing of a chunk's first `length` params, and its padding after filling."""

    padding: float
    length: int
    total: int  # elements of the `length` params
    items: list[int]  # the chunk's positions in packing order
    ranks: list[int]  # rank of each item
    cost: list[int]  # cost per rank, carried included
    loads: list[int]  # elements per rank, before filling


class _Balancer:
    """State of a balanced plan over backprop positions: which are taken, first-fit trees over
    the free ones, the free elements left in each run (params between tied ones), and the
    Newton-Schulz cost each rank carries from earlier buckets."""

    def __init__(
        self, widths: list[int], costs: list[int], tied: list[bool], dp_size: int, align: int
    ) -> None:
        self.widths, self.costs, self.tied = widths, costs, tied
        self.dp_size, self.align = dp_size, align
        n = len(widths)
        self.taken = bytearray(n)
        # Widths of the free untied params (chunks included: filling starts after its chunk).
        self.fit = FirstFit([math.inf if t else w for t, w in zip(tied, widths, strict=True)])
        # Minus the widths of free untied params: range minima give the widest free param.
        self.negated = FirstFit([math.inf if t else -w for t, w in zip(tied, widths, strict=True)])
        self.carried = [0] * dp_size
        # No rank should own more Newton-Schulz cost than this (nor can, if one param costs it).
        self.ceiling = max(COST_CEILING * sum(costs) / dp_size, max(costs, default=0))
        self.hard = dp_size >= HARD_CEILING_RANKS
        self.run_end = [n] * (n + 1)  # run_end[p]: the first tied position >= p
        for p in range(n - 1, -1, -1):
            self.run_end[p] = p if tied[p] else self.run_end[p + 1]
        self.run_free: dict[int, int] = {}  # run end -> free elements left in that run
        for p in range(n):
            if not tied[p]:
                self.run_free[self.run_end[p]] = self.run_free.get(self.run_end[p], 0) + widths[p]
        # packing_order[q]: where position q comes in step 2's order (largest cost first).
        by_width = sorted(range(n), key=widths.__getitem__, reverse=True)  # stable: ties by q
        by_cost = sorted(by_width, key=costs.__getitem__, reverse=True)
        self.packing_order = {q: i for i, q in enumerate(by_cost)}
        # `_pack` results by input, for the run planned last: `_merge_tail` packs again what
        # its buckets packed (same params and carried cost).
        self.packed: dict[tuple[tuple[int, ...], tuple[int, ...]], Packing] = {}
        self.packed_run = -1

    def finished_run(self, previous: int, head: int) -> bool:
        """Whether the buckets starting at free positions `previous` and `head` are untied
        buckets of one run that no free param is left in."""
        end = self.run_end[head]
        return (
            not self.tied[previous]
            and not self.tied[head]
            and self.run_end[previous] == end
            and self.run_free[end] == 0
        )

    def bucket(self, head: int, bucket_size: int | None, *, absorb: bool = False) -> _Planned:
        """Plan the bucket whose first param is the free position `head` (steps 1-4 of [Note:
        balanced]), taking nothing; with `absorb`, the bucket holds every free param left in
        the run."""
        if self.tied[head]:
            assignment, shard, used = [(0, head)], self.widths[head], self.widths[head]
        else:
            if self.packed_run != self.run_end[head]:
                self.packed.clear()
                self.packed_run = self.run_end[head]
            wanted = math.inf if bucket_size is None or absorb else bucket_size
            chunk = _Chunk(self, head, wanted)
            chunk.grow(wanted)
            limit = MAX_GROWTH * chunk.total
            best = latest = self._try(chunk)
            while latest.padding > BALANCE_TOLERANCE and not chunk.ended and chunk.total < limit:
                chunk.grow(chunk.total * min(4.0, max(1.5, latest.padding / BALANCE_TOLERANCE)))
                latest = self._try(chunk)
                if latest.padding < best.padding:
                    best = latest
            fills = self._fill(chunk.positions[best.length - 1] + 1, best.cost, best.loads)
            assignment = [*zip(best.ranks, best.items, strict=True), *fills]
            shard = max(best.loads)  # filling stays below it
            used = best.total + sum(self.widths[q] for _, q in fills)
        return _Planned(head, assignment, shard, self.dp_size * shard - used)

    def _try(self, chunk: _Chunk) -> _Try:
        """Pack the chunk (step 2) and fill the rooms left (step 3), taking nothing."""
        widths = self.widths
        items = sorted(chunk.positions, key=self.packing_order.__getitem__)
        ranks, cost, loads, _ = self._pack(items, chunk.total, chunk.widest)
        fills = self._fill(chunk.positions[-1] + 1, cost, loads)
        filled = chunk.total + sum(widths[q] for _, q in fills)
        padding = 1 - filled / (self.dp_size * max(loads))
        return _Try(padding, len(items), chunk.total, items, ranks, cost, loads)

    def row(self, assignment: Assignment) -> Row:
        """The bucket's one row: each rank's params in backprop order, the widest shard's
        width."""
        offsets = [0] * self.dp_size
        entries = []
        for r, q in sorted(assignment, key=operator.itemgetter(1)):
            entries.append((r, q, offsets[r]))
            offsets[r] += self.widths[q]
        return max(offsets), entries

    def _fill(self, lo: int, cost: list[int], loads: list[int]) -> Assignment:
        """Fill each rank's room below the largest of `loads` with the first free params from
        `lo` on (the chunk's params come before it) that fit and keep it below the cost
        ceiling (a few misfits are skipped), taking nothing."""
        widths, costs = self.widths, self.costs
        loads = list(loads)
        shard = max(loads)
        fills = []
        for r in sorted(range(self.dp_size), key=cost.__getitem__):
            start, spent, skips = lo, cost[r], 0
            while loads[r] < shard and skips < FILL_SKIPS:
                q = self.fit.first_fit(start, shard - loads[r])
                if q < 0:
                    break
                start = q + 1
                if self.hard and costs[q] and spent + costs[q] > self.ceiling:
                    skips += 1
                    continue
                self.fit.remove(q)
                fills.append((r, q))
                loads[r] += widths[q]
                spent += costs[q]
        self.fit.update([q for _, q in fills], [widths[q] for _, q in fills])
        return fills

    def _pack(self, items: list[int], total: int, widest: int) -> Packing:
        """`pack` under the lowest cap, `max(widest, total / dp)`; if a param overflows it
        but not by far, again under caps between it and the largest load that came out. The
        best packing (remembered; callers do not change it)."""
        key = (tuple(items), tuple(self.carried))
        if key in self.packed:
            return self.packed[key]
        dp, align = self.dp_size, self.align
        widths = [self.widths[q] for q in items]
        costs = [self.costs[q] for q in items]
        low = max(widest, round_up(-(-total // dp), align))
        best = pack(widths, costs, self.carried, dp, low, self.ceiling, self.hard)
        high = max(best[2])
        hopeless = dp * high - total > 4 * BALANCE_TOLERANCE * dp * high  # it will grow anyway
        # The caps under which each packing made comes out again (so no lower largest load).
        same_caps = [best[3]]
        for _ in range(0 if hopeless else 2):
            cap = round_up((low + high) // 2, align)
            if high - low <= align or cap >= high:
                break
            if any(lo <= cap < hi for lo, hi in same_caps):
                low = cap
                continue
            packed = pack(widths, costs, self.carried, dp, cap, self.ceiling, self.hard)
            same_caps.append(packed[3])
            if max(packed[2]) < high:
                best, high = packed, max(packed[2])
            else:
                low = cap
        self.packed[key] = best
        return best

    def take(self, assignment: Assignment, undo: bool = False) -> None:
        """Take the params of a bucket: (rank, position) pairs; `undo`: free them, as if their
        bucket had never been planned."""
        taken, carried, costs = self.taken, self.carried, self.costs
        sign = -1 if undo else 1
        for r, q in assignment:
            taken[q] = 0 if undo else 1
            carried[r] += sign * costs[q]
        untied = [q for _, q in assignment if not self.tied[q]]
        for end, run in itertools.groupby(untied, key=self.run_end.__getitem__):
            self.run_free[end] -= sign * sum(map(self.widths.__getitem__, run))
        removed = [math.inf] * len(untied)
        self.fit.update(untied, [self.widths[q] for q in untied] if undo else removed)
        self.negated.update(untied, [-self.widths[q] for q in untied] if undo else removed)


class _Chunk:
    """The free params a bucket is planned from (step 1): free positions from `head` on, in
    order, up to the end of head's run."""

    def __init__(self, plan: _Balancer, head: int, wanted: float) -> None:
        self.plan, self.wanted = plan, wanted
        self.positions: list[int] = []
        self.cursor = head  # the next position to look at
        self.run_end = plan.run_end[head]
        self.total = 0  # elements held
        self.widest = 0

    @property
    def ended(self) -> bool:
        """Whether the chunk reaches the end of the run."""
        return self.cursor == self.run_end

    def grow(self, target: float) -> None:
        """Take free params until the chunk holds `>= target` elements and `>= dp` times its
        widest param; then, if too little is left in the run for a bucket of its own, take the
        rest of the run too. Its params stay free (in the trees) until the bucket is taken."""
        self._take_until(target)
        plan = self.plan
        if self.total < target or self.total < plan.dp_size * self.widest:
            return
        left = plan.run_free[self.run_end] - self.total
        left_widest = -plan.negated.range_min(self.cursor, self.run_end)
        if left < max(self.wanted, plan.dp_size * left_widest):
            self._take_until(math.inf)

    def _take_until(self, target: float) -> None:
        """Take the next free params until the chunk holds `target` (as `grow` says) or the
        run ends."""
        taken, widths, dp = self.plan.taken, self.plan.widths, self.plan.dp_size
        positions, q, end = self.positions, self.cursor, self.run_end
        total, widest = self.total, self.widest
        if target == math.inf:  # the rest of the run, at once
            rest = [p for p in range(q, end) if not taken[p]]
            positions += rest
            total += sum(map(widths.__getitem__, rest))
            widest = max([widest, *map(widths.__getitem__, rest)])
            q = end
        while q < end and (total < target or total < dp * widest):
            if not taken[q]:
                positions.append(q)
                total += widths[q]
                widest = widths[q] if widths[q] > widest else widest
            q += 1
        self.cursor, self.total, self.widest = q, total, widest
