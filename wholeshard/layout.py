"""Pure layout planning: param specs in, buckets and placements out.

No torch.distributed here, so every rule is testable with shapes alone.

Invariants every `Layout` keeps (checked by `Layout.check`):
- a bucket is a contiguous range of the buffer cut into `dp_size` equal shards; rank r owns shard r;
- every param lies wholly inside one shard; its owner is `(start - bucket.start) // shard_numel`;
- params start on `align`-element boundaries; bucket sizes are multiples of `dp_size`;
- buckets are filled in backprop order (reverse registration order).

[Note: size matching]
`plan_layout` builds each bucket from *rows*. A row takes the next unassigned param (in backprop
order) as its seed and gives it shard 0's slot of width `S = round_up(numel, align)`. Every other
shard r gets, in the same row, the next unassigned param with the seed's numel; when none is left
it gets the following params (backprop order) whose aligned size still fits the slot, then
padding. All shards grow by `S` per row, so they stay equal by construction, and a stack of
identical blocks (every numel's count a multiple of `dp_size`) needs no padding beyond alignment.
Rank r's shard of a bucket is the concatenation of slot r of the bucket's rows.

[Note: balanced]
`plan_layout(..., strategy="balanced")` balances Newton-Schulz cost (`ns_cost`) across ranks
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
4. if the bucket still pads more than `_BALANCE_TOLERANCE`, grow it (step 1 with a larger
   target, at most `_MAX_GROWTH` times) and try again; keep the least padded try.
When a bucket ends a run of untied params and pads too much, it is merged with up to
`_MAX_MERGE - 1` buckets before it if one bucket pads less. No rank takes a param that would
lift its cost above the ceiling `_COST_CEILING` x the mean (or the costliest param) while
another rank has room; from `_HARD_CEILING_RANKS` ranks on, padding is accepted instead (one
rank's share of a bucket is then small). Inside a shard params keep backprop order; every bucket
holds the first free param in backprop order, so buckets are filled in backprop order; tied
params are isolated exactly as with size matching. Cost of a non-Muon or non-2-D param: 0.
Last, the size-matching layout of the same params is planned too and taken instead when it is
at least as good on both counts (no more padding and no more imbalance, one strictly less): a
stack of identical blocks tiles exactly by size matching, which balancing cannot beat.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
import operator
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ParamSpec:
    """What the planner needs to know about one parameter."""

    name: str
    shape: tuple[int, ...]
    muon: bool
    tied: bool = False  # the tensor is shared by two modules

    @functools.cached_property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Bucket:
    """Elements `[start, end)` of the buffer, cut into `dp_size` shards of `shard_numel`."""

    index: int
    start: int
    end: int
    shard_numel: int

    @property
    def numel(self) -> int:
        return self.end - self.start

    def shard(self, rank: int) -> tuple[int, int]:
        """Buffer range `[start, end)` of rank's shard."""
        lo = self.start + rank * self.shard_numel
        return lo, lo + self.shard_numel


@dataclass(frozen=True)
class Placement:
    """Where one param lives: elements `[start, end)` of the buffer, inside `bucket`."""

    name: str
    shape: tuple[int, ...]
    bucket: int
    start: int
    end: int
    owner: int | None  # None only in element-wise sharded buffers (`wholeshard.plan`)

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Layout:
    """A planned buffer. `placements` are in the order the specs were given."""

    dp_size: int
    align: int
    buckets: tuple[Bucket, ...]
    placements: tuple[Placement, ...]

    @property
    def numel(self) -> int:
        return self.buckets[-1].end if self.buckets else 0

    @property
    def padding_fraction(self) -> float:
        used = sum(p.numel for p in self.placements)
        return 0.0 if self.numel == 0 else 1.0 - used / self.numel

    def owned_by(self, rank: int) -> list[Placement]:
        return [p for p in self.placements if p.owner == rank]

    def shard_of(self, placement: Placement) -> int:
        """The rank owning `placement`: `(start - bucket.start) // shard_numel`, the only rule."""
        bucket = self.buckets[placement.bucket]
        return (placement.start - bucket.start) // bucket.shard_numel

    def check(self, specs: Sequence[ParamSpec] | None = None) -> None:
        """Raise AssertionError naming the bucket or param if any layout invariant is broken.

        With `specs` (the list the layout was planned from) also check that placements follow
        the specs' order, names and shapes, and that every tied param sits alone in its bucket.
        """
        dp, align = self.dp_size, self.align
        assert dp >= 1, f"dp_size is {dp}; it must be >= 1"
        assert align >= 1, f"align is {align}; it must be >= 1"

        expected_start = 0
        for i, b in enumerate(self.buckets):
            where = f"bucket {i} [{b.start}, {b.end})"
            assert b.index == i, f"{where} has index {b.index}; number buckets 0.. in buffer order"
            assert b.start == expected_start, (
                f"{where} starts at {b.start} but must start at {expected_start}, where the "
                "previous bucket ends: buckets are contiguous from element 0"
            )
            assert b.shard_numel > 0, f"{where} has shard_numel {b.shard_numel}; it must be > 0"
            assert b.shard_numel % align == 0, (
                f"{where} has shard_numel {b.shard_numel}, not a multiple of align={align}, "
                "so shards after the first would start unaligned"
            )
            assert b.numel == dp * b.shard_numel, (
                f"{where} holds {b.numel} elements but dp_size * shard_numel = "
                f"{dp} * {b.shard_numel} = {dp * b.shard_numel}: shards must be equal"
            )
            expected_start = b.end

        n_buckets = len(self.buckets)
        members = [0] * n_buckets
        last_registered = [-1] * n_buckets  # highest placement index per bucket
        names: set[str] = set()
        for i, p in enumerate(self.placements):
            where = f"param {p.name!r} [{p.start}, {p.end})"
            assert p.name not in names, f"{where}: name placed twice; names must be unique"
            names.add(p.name)
            assert 0 <= p.bucket < n_buckets, (
                f"{where} names bucket {p.bucket}, but the layout has {n_buckets} buckets"
            )
            b = self.buckets[p.bucket]
            assert p.numel == math.prod(p.shape), (
                f"{where} spans {p.numel} elements but shape {p.shape} has {math.prod(p.shape)}"
            )
            assert p.start % align == 0, (
                f"{where} starts at {p.start}, not on an align={align} element boundary"
            )
            assert b.start <= p.start and p.end <= b.end, (
                f"{where} is not inside its bucket {b.index} [{b.start}, {b.end})"
            )
            owner = (p.start - b.start) // b.shard_numel
            assert p.owner == owner, (
                f"{where} says owner {p.owner}, but (start - bucket.start) // shard_numel = "
                f"{owner}; derive the owner from the offsets, never separately"
            )
            shard_lo, shard_hi = b.shard(owner)
            assert p.end <= shard_hi, (
                f"{where} straddles shards {owner} [{shard_lo}, {shard_hi}) and {owner + 1} of "
                f"bucket {b.index}; every param must lie wholly inside one shard"
            )
            members[p.bucket] += 1
            last_registered[p.bucket] = i

        spans = sorted((p.start, p.end, p.name) for p in self.placements)
        for (_, prev_end, prev_name), (start, _, name) in zip(spans, spans[1:], strict=False):
            assert prev_end <= start, f"params {prev_name!r} and {name!r} overlap"

        for i in range(n_buckets):
            assert members[i] > 0, f"bucket {i} holds no params; drop it"
            assert i == 0 or last_registered[i] < last_registered[i - 1], (
                f"bucket {i} holds the last-registered param not in earlier buckets "
                f"(placement {last_registered[i]}), but bucket {i - 1} does not; buckets must be "
                "filled in backprop order (reverse registration order)"
            )

        if specs is None:
            return
        assert len(specs) == len(self.placements), (
            f"{len(specs)} specs but {len(self.placements)} placements; place every spec once"
        )
        for spec, p in zip(specs, self.placements, strict=True):
            assert spec.name == p.name and tuple(spec.shape) == p.shape, (
                f"placement {p.name!r} {p.shape} does not match spec {spec.name!r} "
                f"{tuple(spec.shape)}; placements must follow the specs' order"
            )
            if spec.tied:
                b = self.buckets[p.bucket]
                assert members[p.bucket] == 1 and p.start == b.start, (
                    f"tied param {p.name!r} must sit alone at the start of bucket {b.index}"
                )
                assert b.shard_numel == _round_up(p.numel, align), (
                    f"tied param {p.name!r}: bucket {b.index} has shard_numel {b.shard_numel}, "
                    f"expected {_round_up(p.numel, align)} (its aligned size)"
                )


STRATEGIES = ("size_match", "balanced")


def ns_cost(shape: Sequence[int]) -> int:
    """Newton-Schulz cost of one matrix, `max(m, n) * min(m, n) ** 2`; 0 for non-2-D shapes."""
    if len(shape) != 2:
        return 0
    m, n = shape
    return max(m, n) * min(m, n) ** 2


def spec_cost(spec: ParamSpec) -> int:
    """The Newton-Schulz cost the owner of `spec` pays: `ns_cost` for a Muon param, else 0
    (an element-wise AdamW update is negligible next to Newton-Schulz)."""
    return ns_cost(spec.shape) if spec.muon else 0


def plan_layout(
    params: Sequence[ParamSpec],
    dp_size: int,
    *,
    bucket_size: int | None = None,
    align: int = 64,
    strategy: str = "size_match",
) -> Layout:
    """Place `params` (in registration order) into one buffer for `dp_size` ranks.

    `strategy="size_match"` fills buckets in backprop order by size-matching rows (module note);
    a bucket is closed once it holds `>= bucket_size` elements (None: one bucket).
    `strategy="balanced"` balances Newton-Schulz cost across ranks instead ([Note: balanced]);
    its buckets hold at least `bucket_size` elements and may be larger. With either, a tied
    param gets a bucket of its own: shard 0 holds it, shards 1.. are padding. The result passes
    `Layout.check(params)`; placements come back in the order of `params`.
    """
    specs = tuple(params)
    validate_inputs(specs, dp_size, bucket_size, align, strategy)
    layout = _place(specs, dp_size, bucket_size, align, strategy)
    layout.check(specs)
    return layout


def _place(
    specs: tuple[ParamSpec, ...], dp_size: int, bucket_size: int | None, align: int, strategy: str
) -> Layout:
    """`plan_layout` on validated inputs, without the final check."""
    if strategy == "size_match":
        return _layout(specs, dp_size, align, _plan_rows(specs, dp_size, bucket_size, align))
    balanced = _layout(specs, dp_size, align, _plan_balanced(specs, dp_size, bucket_size, align))
    matched = _layout(specs, dp_size, align, _plan_rows(specs, dp_size, bucket_size, align))
    b = (balanced.padding_fraction, _imbalance(balanced, specs))
    m = (matched.padding_fraction, _imbalance(matched, specs))
    return matched if m != b and m[0] <= b[0] and m[1] <= b[1] else balanced


def cost_imbalance(costs: Sequence[int]) -> float:
    """Max / mean of per-rank Newton-Schulz costs (1.0 when there is no Muon work)."""
    total = sum(costs)
    return 1.0 if total == 0 else max(costs) * len(costs) / total


def _imbalance(layout: Layout, specs: tuple[ParamSpec, ...]) -> float:
    costs = [0] * layout.dp_size
    for spec, p in zip(specs, layout.placements, strict=True):
        costs[p.owner] += spec_cost(spec)
    return cost_imbalance(costs)


def _layout(
    specs: tuple[ParamSpec, ...], dp_size: int, align: int, bucket_rows: list[list[_Row]]
) -> Layout:
    """The layout of planned bucket rows."""
    n = len(specs)
    placements: list[Placement | None] = [None] * n
    buckets: list[Bucket] = []
    bucket_start = 0
    for index, rows in enumerate(bucket_rows):
        shard_numel = sum(width for width, _ in rows)
        row_offset = 0
        for width, entries in rows:
            for rank, pos, slot_offset in entries:
                spec = specs[n - 1 - pos]
                start = bucket_start + rank * shard_numel + row_offset + slot_offset
                owner = (start - bucket_start) // shard_numel
                placements[n - 1 - pos] = Placement(
                    spec.name, tuple(spec.shape), index, start, start + spec.numel, owner
                )
            row_offset += width
        end = bucket_start + dp_size * shard_numel
        buckets.append(Bucket(index, bucket_start, end, shard_numel))
        bucket_start = end

    assert all(p is not None for p in placements), "internal error: a param was not placed"
    return Layout(dp_size, align, tuple(buckets), tuple(placements))  # type: ignore[arg-type]


# A row: (slot width, [(rank, backprop position, offset inside the slot), ...]).
_Row = tuple[int, list[tuple[int, int, int]]]


def _plan_rows(
    specs: tuple[ParamSpec, ...], dp_size: int, bucket_size: int | None, align: int
) -> list[list[_Row]]:
    """Group params into buckets of size-matching rows. Works on backprop positions:
    position p is registration index `len(specs) - 1 - p`."""
    n = len(specs)
    numels = [specs[n - 1 - p].numel for p in range(n)]
    widths = [_round_up(x, align) for x in numels]
    tied = [specs[n - 1 - p].tied for p in range(n)]

    taken = bytearray(n)
    # numel -> pending positions in backprop order; entries taken by packing are skipped lazily.
    same_numel: dict[int, deque[int]] = {}
    for p in range(n):
        if not tied[p]:
            same_numel.setdefault(numels[p], deque()).append(p)
    fit = _FirstFit([math.inf if tied[p] else widths[p] for p in range(n)])

    buckets: list[list[_Row]] = []
    current: list[_Row] = []
    current_shard = 0
    head = 0
    while True:
        while head < n and taken[head]:
            head += 1
        if head == n:
            break
        seed = head
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
        for rank in range(1, dp_size):
            while partners and taken[partners[0]]:
                partners.popleft()
            if partners:
                pos = partners.popleft()
                taken[pos] = 1
                entries.append((rank, pos, 0))
                continue
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


_Assignment = list[tuple[int, int]]  # (rank, backprop position) of every param of a bucket
_BALANCE_TOLERANCE = 0.005  # a bucket padding more than this fraction grows instead
_MAX_GROWTH = 8  # a bucket grows to at most this many times its minimal size
_COST_CEILING = 1.05  # a rank owning this times the mean cost takes no more costly params
_HARD_CEILING_RANKS = 64  # from this many ranks on, the ceiling holds even at a padding cost
_FILL_SKIPS = 8  # filling a rank's room gives up after this many too costly params
_MAX_MERGE = 4  # a badly padded last bucket of a run may merge with up to 3 before it


def _plan_balanced(
    specs: tuple[ParamSpec, ...], dp_size: int, bucket_size: int | None, align: int
) -> list[list[_Row]]:
    """Buckets of one row each (width = shard_numel), see [Note: balanced]. Works on backprop
    positions, like `_plan_rows`."""
    n = len(specs)
    order = [specs[n - 1 - p] for p in range(n)]
    plan = _Balancer(
        widths=[_round_up(s.numel, align) for s in order],
        costs=[spec_cost(s) for s in order],
        tied=[s.tied for s in order],
        dp_size=dp_size,
        align=align,
    )
    planned: list[tuple[int, _Row, _Assignment]] = []  # (first position, row, assignment)
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
    plan: _Balancer, planned: list[tuple[int, _Row, _Assignment]], bucket_size: int | None
) -> None:
    """The last bucket ended a run. If it pads more than the tolerance, try one bucket for it
    and the `m - 1` buckets of its run before it (m = 2.._MAX_MERGE); keep the first that pads
    less than the buckets it replaces."""
    dp = plan.dp_size
    if plan.padded(planned[-1][1]) <= _BALANCE_TOLERANCE * dp * planned[-1][1][0]:
        return
    for m in range(2, _MAX_MERGE + 1):
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
        self.fit = _FirstFit([math.inf if t else w for t, w in zip(tied, widths, strict=True)])
        # Minus the widths of free untied params: range minima give the widest free param.
        self.negated = _FirstFit([math.inf if t else -w for t, w in zip(tied, widths, strict=True)])
        self.carried = [0] * dp_size
        # No rank should own more Newton-Schulz cost than this (nor can, if one param costs it).
        self.ceiling = max(_COST_CEILING * sum(costs) / dp_size, max(costs, default=0))
        self.hard = dp_size >= _HARD_CEILING_RANKS
        self.run_end = [n] * (n + 1)  # run_end[p]: the first tied position >= p
        for p in range(n - 1, -1, -1):
            self.run_end[p] = p if tied[p] else self.run_end[p + 1]
        self.run_free: dict[int, int] = {}  # run end -> free elements left in that run
        for p in range(n):
            if not tied[p]:
                self.run_free[self.run_end[p]] = self.run_free.get(self.run_end[p], 0) + widths[p]

    def padded(self, row: _Row) -> int:
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
    ) -> tuple[_Row, _Assignment]:
        """Plan the bucket whose first param is the free position `head` and take its params;
        with `absorb`, the bucket takes every free param left in the run."""
        widths, dp = self.widths, self.dp_size
        if self.tied[head]:
            self.take([(0, head)])
            return (widths[head], [(0, head, 0)]), [(0, head)]

        chunk: list[int] = []  # free positions from head on, in order, up to the run's end
        cursor, total, widest = head, 0, 0
        run_end = self.run_end[head]
        wanted = math.inf if bucket_size is None or absorb else bucket_size

        def grow_to(target: float) -> None:
            nonlocal cursor, total, widest
            rest = False
            while cursor < run_end and (rest or total < target or total < dp * widest):
                if not self.taken[cursor]:
                    chunk.append(cursor)
                    self.fit.remove(cursor)
                    self.negated.remove(cursor)
                    total += widths[cursor]
                    widest = max(widest, widths[cursor])
                cursor += 1
                if not rest and total >= target and total >= dp * widest:
                    # Too little left in the run for a bucket of its own: take it all.
                    left = self.run_free[run_end] - total
                    left_widest = -self.negated.range_min(cursor, run_end)
                    rest = left < max(wanted, dp * left_widest)

        grow_to(wanted)
        limit = _MAX_GROWTH * total
        best: tuple[float, int, list[int], list[int], list[int], list[int]] | None = None
        while True:
            items = sorted(chunk, key=lambda q: (-self.costs[q], -widths[q], q))
            ranks, cost, loads = self._pack(items, total, widest)
            fills = self._fill(head, cost, list(loads))
            for _, q in fills:  # only trying
                self.fit.put(q, widths[q])
            filled = total + sum(widths[q] for _, q in fills)
            padding = 1 - filled / (dp * max(loads))
            if best is None or padding < best[0]:
                best = (padding, len(chunk), items, ranks, cost, loads)
            if padding <= _BALANCE_TOLERANCE or cursor == run_end or total >= limit:
                break
            grow_to(total * min(4.0, max(1.5, padding / _BALANCE_TOLERANCE)))

        _, length, items, ranks, cost, loads = best
        for q in chunk[length:]:
            self.fit.put(q, widths[q])
            self.negated.put(q, -widths[q])
        assignment = list(zip(ranks, items, strict=True)) + self._fill(head, cost, loads)
        shard = max(loads)
        self.take(assignment)
        offsets = [0] * dp
        entries = []
        for r, q in sorted(assignment, key=operator.itemgetter(1)):  # backprop order in shards
            entries.append((r, q, offsets[r]))
            offsets[r] += widths[q]
        return (shard, entries), assignment

    def _fill(self, head: int, cost: list[int], loads: list[int]) -> _Assignment:
        """Fill each rank's room below the largest load with the first free params (from
        `head` on) that fit and keep it below the cost ceiling (a few misfits are skipped);
        take them out of the fit tree and add them to `loads`."""
        widths, costs = self.widths, self.costs
        shard = max(loads)
        fills = []
        for r in sorted(range(self.dp_size), key=cost.__getitem__):
            lo, spent, skips = head, cost[r], 0
            while loads[r] < shard and skips < _FILL_SKIPS:
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
        """`_pack` under the lowest cap, `max(widest, total / dp)`; if a param overflows it
        but not by far, again under caps between it and the largest load that came out. The
        best packing."""
        dp, align = self.dp_size, self.align
        widths = [self.widths[q] for q in items]
        costs = [self.costs[q] for q in items]
        low = max(widest, _round_up(-(-total // dp), align))
        best = _pack(widths, costs, self.carried, dp, low, self.ceiling, self.hard)
        high = max(best[2])
        hopeless = dp * high - total > 4 * _BALANCE_TOLERANCE * dp * high  # it will grow anyway
        for _ in range(0 if hopeless else 2):
            cap = _round_up((low + high) // 2, align)
            if high - low <= align or cap >= high:
                break
            packed = _pack(widths, costs, self.carried, dp, cap, self.ceiling, self.hard)
            if max(packed[2]) < high:
                best, high = packed, max(packed[2])
            else:
                low = cap
        return best

    def undo(self, assignment: _Assignment) -> None:
        """Free the params `take` took, as if their bucket had never been planned."""
        for r, q in assignment:
            self.taken[q] = 0
            self.carried[r] -= self.costs[q]
            if not self.tied[q]:
                self.fit.put(q, self.widths[q])
                self.negated.put(q, -self.widths[q])
                self.run_free[self.run_end[q]] += self.widths[q]

    def take(self, assignment: _Assignment) -> None:
        """Take the params of a bucket: (rank, position) pairs."""
        for r, q in assignment:
            self.taken[q] = 1
            self.fit.remove(q)
            self.negated.remove(q)
            self.carried[r] += self.costs[q]
            if not self.tied[q]:
                self.run_free[self.run_end[q]] -= self.widths[q]


def _pack(
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
    ranks = [0] * len(widths)
    per_cost = dp_size / ((sum(carried) + sum(costs)) or 1)
    per_load = dp_size / sum(widths)
    heap = [(c * per_cost, r) for r, c in enumerate(cost)]
    heapq.heapify(heap)
    # smallest[i]: the narrowest of items i..; a rank with less room than that is full for good.
    smallest = list(itertools.accumulate(reversed(widths), min))[::-1] + [0]
    pop, push, replace = heapq.heappop, heapq.heappush, heapq.heapreplace
    for i, w in enumerate(widths):
        c = costs[i]
        ceiling = math.inf if c == 0 else cost_ceiling - c
        aside = None
        top = heap[0][1] if heap else -1
        if top >= 0 and load[top] + w <= cap and cost[top] <= ceiling:  # the usual case
            rank = top
        else:
            aside = []
            rank = fallback = -1
            while heap:
                entry = pop(heap)
                r = entry[1]
                if load[r] + w <= cap:
                    if cost[r] <= ceiling:
                        push(heap, entry)  # back on top, so the update below replaces it
                        rank = r
                        break
                    if fallback < 0:
                        fallback = r  # has room, but is over the cost ceiling
                if cap - load[r] >= smallest[i]:
                    aside.append(entry)
            if rank < 0 and fallback >= 0 and not hard_ceiling:
                rank = fallback
            elif rank < 0:  # over the cap, on the least-loaded rank below the ceiling if any
                rank = min(range(dp_size), key=lambda r: (cost[r] > ceiling, load[r]))
            aside = [entry for entry in aside if entry[1] != rank]
        load[rank] += w
        cost[rank] += costs[i]
        ranks[i] = rank
        on_top = bool(heap) and heap[0][1] == rank
        if cap - load[rank] >= smallest[i + 1]:
            entry = (cost[rank] * per_cost + load[rank] * per_load, rank)
            replace(heap, entry) if on_top else push(heap, entry)
        elif on_top:
            pop(heap)
        for entry in aside or ():
            push(heap, entry)
    return ranks, cost, load


class _FirstFit:
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


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def validate_inputs(
    specs: Sequence[ParamSpec],
    dp_size: int,
    bucket_size: int | None,
    align: int,
    strategy: str = "size_match",
) -> None:
    """Raise ValueError, saying how to fix it, for inputs no layout can serve."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if not _is_int(dp_size) or dp_size < 1:
        raise ValueError(
            f"dp_size must be an int >= 1 (the data-parallel world size), got {dp_size!r}"
        )
    if not _is_int(align) or align < 1:
        raise ValueError(f"align must be an int >= 1 (elements; 64 is typical), got {align!r}")
    if bucket_size is not None and (not _is_int(bucket_size) or bucket_size <= 0):
        raise ValueError(
            f"bucket_size must be None (one bucket) or an int > 0 (elements), got {bucket_size!r}"
        )
    seen: set[str] = set()
    for spec in specs:
        if not isinstance(spec, ParamSpec):
            raise ValueError(f"expected ParamSpec, got {type(spec).__name__}: {spec!r}")
        if spec.name in seen:
            raise ValueError(
                f"duplicate param name {spec.name!r}; give each param a unique name (its FQN) "
                "and list a shared tensor only once, with tied=True"
            )
        seen.add(spec.name)
        shape = spec.shape
        if type(shape) is tuple and all(type(d) is int and d > 0 for d in shape):
            continue  # the common case, checked fast
        if not isinstance(spec.shape, tuple) or not all(_is_int(d) for d in spec.shape):
            raise ValueError(
                f"param {spec.name!r}: shape must be a tuple of ints (e.g. tuple(p.shape)), "
                f"got {spec.shape!r}"
            )
        if any(d < 0 for d in spec.shape):
            raise ValueError(f"param {spec.name!r}: shape {spec.shape} has a negative size")
        if any(d == 0 for d in spec.shape):
            raise ValueError(
                f"param {spec.name!r}: shape {spec.shape} has no elements; leave zero-element "
                "params out of the layout (they have nothing to sync)"
            )


def _is_int(x: object) -> bool:
    if isinstance(x, bool):
        return False
    try:
        operator.index(x)  # type: ignore[arg-type]
    except TypeError:
        return False
    return True
