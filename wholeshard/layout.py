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
"""

from __future__ import annotations

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

    @property
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
    owner: int

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


def plan_layout(
    params: Sequence[ParamSpec],
    dp_size: int,
    *,
    bucket_size: int | None = None,
    align: int = 64,
) -> Layout:
    """Place `params` (in registration order) into one buffer for `dp_size` ranks.

    Buckets are filled in backprop order by size-matching rows (see the module note). A bucket
    is closed once it holds `>= bucket_size` elements (None: one bucket). A tied param gets a
    bucket of its own: shard 0 holds it, shards 1.. are padding. The result passes
    `Layout.check(params)`; placements come back in the order of `params`.
    """
    specs = tuple(params)
    _validate(specs, dp_size, bucket_size, align)
    bucket_rows = _plan_rows(specs, dp_size, bucket_size, align)

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
    layout = Layout(dp_size, align, tuple(buckets), tuple(placements))  # type: ignore[arg-type]
    layout.check(specs)
    return layout


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


def _validate(
    specs: tuple[ParamSpec, ...], dp_size: int, bucket_size: int | None, align: int
) -> None:
    """Raise ValueError, saying how to fix it, for inputs no layout can serve."""
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
