"""The balanced planner: Newton-Schulz cost balanced across ranks, padding kept low.

[Note: balanced]
The balanced strategy balances Newton-Schulz cost (`ns_cost`) across ranks
while keeping padding low. Working in backprop order, each bucket is planned in four steps:
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

import math
import operator
from dataclasses import dataclass

from ._packing import FirstFit, pack
from ._rows import Row
from .specs import ParamSpec, round_up, spec_cost

Assignment = list[tuple[int, int]]
"""(rank, backprop position) of every param of a bucket."""

BALANCE_TOLERANCE = 0.005  # a bucket padding more than this fraction grows instead
MAX_GROWTH = 8  # a bucket grows to at most this many times its minimal size
COST_CEILING = 1.05  # a rank owning this times the mean cost takes no more costly params
HARD_CEILING_RANKS = 64  # from this many ranks on, the ceiling holds even at a padding cost
FILL_SKIPS = 8  # filling a rank's room gives up after this many too costly params
MAX_MERGE = 4  # a badly padded last bucket of a run may merge with up to 3 before it


def plan_balanced(
    specs: tuple[ParamSpec, ...], dp_size: int, bucket_size: int | None, align: int
) -> list[list[Row]]:
    """Buckets of one row each (width = shard_numel), see [Note: balanced]."""
    n = len(specs)
    order = [specs[n - 1 - p] for p in range(n)]
    plan = _Balancer(
        widths=[round_up(s.numel, align) for s in order],
        costs=[spec_cost(s) for s in order],
        tied=[s.tied for s in order],
        dp_size=dp_size,
        align=align,
    )
    planned: list[tuple[int, Row, Assignment]] = []  # (first position, row, assignment)
    head = 0
    while True:
        while head < n and plan.taken[head]:
            head += 1
        if head == n:
            return [[row] for _, row, _ in planned]
        planned.append((head, *plan.bucket(head, bucket_size)))
        if len(planned) > 1 and plan.finished_run(planned[-2][0], head):
            _merge_tail(plan, planned, bucket_size)


def _merge_tail(
    plan: _Balancer, planned: list[tuple[int, Row, Assignment]], bucket_size: int | None
) -> None:
    """The last bucket ended a run. If it pads more than the tolerance, try one bucket for it
    and the `m - 1` buckets of its run before it (m = 2..MAX_MERGE); keep the first that pads
    less than the buckets it replaces."""
    dp = plan.dp_size
    if plan.padded(planned[-1][1]) <= BALANCE_TOLERANCE * dp * planned[-1][1][0]:
        return
    for m in range(2, MAX_MERGE + 1):
        if m > len(planned) or not plan.finished_run(planned[-m][0], planned[-1][0]):
            return
        tail = planned[-m:]
        for _, _, assignment in reversed(tail):
            plan.undo(assignment)
        merged = plan.bucket(tail[0][0], bucket_size, absorb=True)
        if plan.padded(merged[0]) < sum(plan.padded(row) for _, row, _ in tail):
            planned[-m:] = [(tail[0][0], *merged)]
            return
        plan.undo(merged[1])  # keep the m buckets: take their params again
        for _, _, assignment in tail:
            plan.take(assignment)


@dataclass
class _Try:
    """One packing of a chunk's first `length` params, and its padding after filling."""

    padding: float
    length: int
    items: list[int]  # the chunk's positions in packing order
    ranks: list[int]  # rank of each item
    cost: list[int]  # cost per rank, carried included
    loads: list[int]  # elements per rank, before filling

    def assignment(self) -> Assignment:
        return list(zip(self.ranks, self.items, strict=True))


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

    def padded(self, row: Row) -> int:
        """Padding elements in a bucket of one row."""
        width, entries = row
        return self.dp_size * width - sum(self.widths[q] for _, q, _ in entries)

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

    def bucket(
        self, head: int, bucket_size: int | None, *, absorb: bool = False
    ) -> tuple[Row, Assignment]:
        """Plan the bucket whose first param is the free position `head` and take its params
        (steps 1-4 of [Note: balanced]); with `absorb`, the bucket takes every free param left
        in the run."""
        if self.tied[head]:
            assignment = [(0, head)]
        else:
            wanted = math.inf if bucket_size is None or absorb else bucket_size
            chunk = _Chunk(self, head, wanted)
            chunk.grow(wanted)
            limit = MAX_GROWTH * chunk.total
            best = latest = self._try(head, chunk)
            while latest.padding > BALANCE_TOLERANCE and not chunk.ended and chunk.total < limit:
                chunk.grow(chunk.total * min(4.0, max(1.5, latest.padding / BALANCE_TOLERANCE)))
                latest = self._try(head, chunk)
                if latest.padding < best.padding:
                    best = latest
            chunk.give_back(best.length)
            assignment = best.assignment() + self._fill(head, best.cost, best.loads)
        self.take(assignment)
        return self._row(assignment), assignment

    def _try(self, head: int, chunk: _Chunk) -> _Try:
        """Pack the chunk (step 2) and fill the rooms left (step 3), taking nothing."""
        widths = self.widths
        items = sorted(chunk.positions, key=lambda q: (-self.costs[q], -widths[q], q))
        ranks, cost, loads = self._pack(items, chunk.total, chunk.widest)
        fills = self._fill(head, cost, list(loads))
        for _, q in fills:
            self.fit.put(q, widths[q])
        filled = chunk.total + sum(widths[q] for _, q in fills)
        padding = 1 - filled / (self.dp_size * max(loads))
        return _Try(padding, len(items), items, ranks, cost, loads)

    def _row(self, assignment: Assignment) -> Row:
        """The bucket's one row: each rank's params in backprop order, the widest shard's
        width."""
        offsets = [0] * self.dp_size
        entries = []
        for r, q in sorted(assignment, key=operator.itemgetter(1)):
            entries.append((r, q, offsets[r]))
            offsets[r] += self.widths[q]
        return max(offsets), entries

    def _fill(self, head: int, cost: list[int], loads: list[int]) -> Assignment:
        """Fill each rank's room below the largest load with the first free params (from
        `head` on) that fit and keep it below the cost ceiling (a few misfits are skipped);
        take them out of the fit tree and add them to `loads`."""
        widths, costs = self.widths, self.costs
        shard = max(loads)
        fills = []
        for r in sorted(range(self.dp_size), key=cost.__getitem__):
            lo, spent, skips = head, cost[r], 0
            while loads[r] < shard and skips < FILL_SKIPS:
                q = self.fit.first_fit(lo, shard - loads[r])
                if q < 0:
                    break
                lo = q + 1
                if self.hard and costs[q] and spent + costs[q] > self.ceiling:
                    skips += 1
                    continue
                self.fit.remove(q)
                fills.append((r, q))
                loads[r] += widths[q]
                spent += costs[q]
        return fills

    def _pack(
        self, items: list[int], total: int, widest: int
    ) -> tuple[list[int], list[int], list[int]]:
        """`pack` under the lowest cap, `max(widest, total / dp)`; if a param overflows it
        but not by far, again under caps between it and the largest load that came out. The
        best packing."""
        dp, align = self.dp_size, self.align
        widths = [self.widths[q] for q in items]
        costs = [self.costs[q] for q in items]
        low = max(widest, round_up(-(-total // dp), align))
        best = pack(widths, costs, self.carried, dp, low, self.ceiling, self.hard)
        high = max(best[2])
        hopeless = dp * high - total > 4 * BALANCE_TOLERANCE * dp * high  # it will grow anyway
        for _ in range(0 if hopeless else 2):
            cap = round_up((low + high) // 2, align)
            if high - low <= align or cap >= high:
                break
            packed = pack(widths, costs, self.carried, dp, cap, self.ceiling, self.hard)
            if max(packed[2]) < high:
                best, high = packed, max(packed[2])
            else:
                low = cap
        return best

    def undo(self, assignment: Assignment) -> None:
        """Free the params `take` took, as if their bucket had never been planned."""
        for r, q in assignment:
            self.taken[q] = 0
            self.carried[r] -= self.costs[q]
            if not self.tied[q]:
                self.fit.put(q, self.widths[q])
                self.negated.put(q, -self.widths[q])
                self.run_free[self.run_end[q]] += self.widths[q]

    def take(self, assignment: Assignment) -> None:
        """Take the params of a bucket: (rank, position) pairs."""
        for r, q in assignment:
            self.taken[q] = 1
            self.fit.remove(q)
            self.negated.remove(q)
            self.carried[r] += self.costs[q]
            if not self.tied[q]:
                self.run_free[self.run_end[q]] -= self.widths[q]


class _Chunk:
    """The free params a bucket is planned from (step 1): free positions from `head` on, in
    order, up to the end of head's run. They are out of the balancer's first-fit trees while
    the bucket is planned, so filling does not pick them again."""

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

    def holds(self, target: float) -> bool:
        """Whether the chunk holds `>= target` elements and `>= dp` times its widest param."""
        return self.total >= target and self.total >= self.plan.dp_size * self.widest

    def grow(self, target: float) -> None:
        """Take free params until the chunk `holds(target)`; then, if too little is left in
        the run for a bucket of its own, take the rest of the run too."""
        while not self.ended and not self.holds(target):
            self._step()
        if self.holds(target) and self._too_little_left():
            while not self.ended:
                self._step()

    def give_back(self, length: int) -> None:
        """Return the params after the first `length` to the free trees."""
        for q in self.positions[length:]:
            self.plan.fit.put(q, self.plan.widths[q])
            self.plan.negated.put(q, -self.plan.widths[q])
        del self.positions[length:]

    def _too_little_left(self) -> bool:
        plan = self.plan
        left = plan.run_free[self.run_end] - self.total
        left_widest = -plan.negated.range_min(self.cursor, self.run_end)
        return left < max(self.wanted, plan.dp_size * left_widest)

    def _step(self) -> None:
        q, plan = self.cursor, self.plan
        self.cursor += 1
        if plan.taken[q]:
            return
        self.positions.append(q)
        plan.fit.remove(q)
        plan.negated.remove(q)
        self.total += plan.widths[q]
        self.widest = max(self.widest, plan.widths[q])
