"""`Layout`: one planned buffer, its owner rule, and the invariants every planner keeps.

A buffer is one flat tensor of one kind, cut into buckets of `shard_group_size` equal shards;
rank r of the shard group owns shard r of every bucket (`Bucket.owner`). What a shard holds
whole depends on the kind:

- `"muon"`: whole tensors (`wholeshard.layout`). Every param lies wholly inside one shard and
  its `owner` is `Bucket.owner(start)`; tied params sit alone at the start of their bucket.
- `"stacked"`: whole matrices of stacked params (`wholeshard._stacks`, [Note: stacked layout]).
  A stack may spread over consecutive shards; each matrix's owner follows from its offset.
- `"adamw"`: element-wise (`wholeshard.plan`). Params are packed tightly in backprop order and
  may straddle shards; each bucket is padded to a multiple of `k * align`, no more.

Every kind: buckets are contiguous from element 0, shards are positive multiples of `align`,
params start on `align`-element boundaries, never overlap, and fill buckets in backprop order
(reverse registration order). `Layout.check` raises AssertionError naming what is broken.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from .._stacks import matrices, storage_units
from .records import Bucket, ParamSpec, Placement, round_up

KINDS = ("muon", "stacked", "adamw")


@dataclass(frozen=True)
class Layout:
    """One planned buffer of one kind (`KINDS`) over a shard group of `shard_group_size` ranks.
    `placements` are the buffer's params in registration order."""

    kind: str
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
        """Whether every param lies wholly inside one shard (Muon buffers)."""
        return self.kind == "muon"

    @property
    def sharding(self) -> str:
        """What a shard holds whole, for reports."""
        return {"muon": "whole tensors", "stacked": "whole matrices"}.get(self.kind, "element-wise")

    def buckets_of(self, placement: Placement) -> range:
        """Indices of the buckets `placement` overlaps (one, except for a spread stack)."""
        last = placement.bucket
        while last + 1 < len(self.buckets) and self.buckets[last + 1].start < placement.end:
            last += 1
        return range(placement.bucket, last + 1)

    def storage_units(self) -> tuple[range, ...]:
        """Runs of bucket indices a fully sharded buffer materialises together: a param crossing
        a bucket boundary joins the buckets it overlaps (`wholeshard._stacks.storage_units`).
        One bucket each in whole-tensor and element-wise buffers."""
        return storage_units(self.buckets, self.placements)

    def owned_range(self, placement: Placement, rank: int) -> tuple[int, int]:
        """(offset, length): the elements `[offset, offset + length)` of the flattened param
        that lie in shard `rank` of its bucket, i.e. that shard-group rank `rank` owns;
        `(0, 0)` if it owns none of them. A whole tensor is owned all or nothing."""
        if not 0 <= rank < self.shard_group_size:
            raise ValueError(
                f"rank {rank} is not in the shard group 0..{self.shard_group_size - 1}; "
                "pass the rank within the group (Plan.shard_rank(global_rank))"
            )
        if self.kind == "stacked":
            raise ValueError("a stacked param may have several owned ranges: use owned()")
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
            offset, length = self.owned_range(p, rank)
            if length:
                yield p, offset, length

    def check(self, specs: Sequence[ParamSpec] | None = None) -> None:
        """Raise AssertionError naming the bucket or param if an invariant is broken. With
        `specs` (this buffer's specs, registration order) also check names, shapes and order,
        and that every tied param of a whole-tensor buffer sits alone in its bucket."""
        assert self.kind in KINDS, f"buffer kind {self.kind!r} must be one of {KINDS}"
        _check_buckets(self)
        if self.kind == "muon":
            _check_whole(self)
        elif self.kind == "stacked":
            _check_stacked(self)
        else:
            _check_elementwise(self)
        if specs is None:
            return
        assert len(specs) == len(self.placements), (
            f"{len(specs)} specs but {len(self.placements)} placements; place every spec once"
        )
        for spec, p in zip(specs, self.placements, strict=True):
            assert spec.name == p.name and tuple(spec.shape) == p.shape, (
                f"placement {p.name!r} {p.shape} does not match spec {spec.name!r} "
                f"{tuple(spec.shape)}; placements must follow the specs' order (registration order)"
            )
            if spec.tied and self.whole:
                _check_alone(self, p)


def _check_buckets(layout: Layout) -> None:
    """Buckets contiguous from 0, each `k` equal shards of a positive multiple of `align`."""
    k, align = layout.shard_group_size, layout.align
    assert k >= 1, f"shard_group_size is {k}; it must be >= 1"
    assert align >= 1, f"align is {align}; it must be >= 1"
    expected_start = 0
    for i, b in enumerate(layout.buckets):
        where = f"{layout.kind} bucket {i} [{b.start}, {b.end})"
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
        assert b.numel == k * b.shard_numel, (
            f"{where} holds {b.numel} elements but shard_group_size * shard_numel = "
            f"{k} * {b.shard_numel} = {k * b.shard_numel}: shards must be equal"
        )
        expected_start = b.end


def _check_placement(layout: Layout, p: Placement) -> Bucket:
    """The rules every kind's params keep: a real bucket, the shape's size, an aligned start
    inside that bucket. Returns the bucket."""
    where = f"param {p.name!r} [{p.start}, {p.end})"
    n = len(layout.buckets)
    assert 0 <= p.bucket < n, f"{where} names bucket {p.bucket}, but the buffer has {n} buckets"
    assert p.numel == math.prod(p.shape), (
        f"{where} spans {p.numel} elements but shape {p.shape} has {math.prod(p.shape)}"
    )
    assert p.start % layout.align == 0, (
        f"{where} starts at {p.start}, not on an align={layout.align} element boundary"
    )
    b = layout.buckets[p.bucket]
    assert b.start <= p.start < b.end, f"{where} does not start in its bucket {b.index}"
    return b


def _check_disjoint(placements: Sequence[Placement]) -> None:
    spans = sorted((p.start, p.end, p.name) for p in placements)
    for (_, prev_end, prev_name), (start, _, name) in zip(spans, spans[1:], strict=False):
        assert prev_end <= start, f"params {prev_name!r} and {name!r} overlap"


def _check_whole(layout: Layout) -> None:
    """Every param wholly inside the shard of its owner, the owner by `Bucket.owner`; every
    bucket holds the last-registered param not in earlier buckets (backprop order)."""
    n_buckets = len(layout.buckets)
    last_registered = [-1] * n_buckets  # highest placement index per bucket
    names: set[str] = set()
    for i, p in enumerate(layout.placements):
        where = f"param {p.name!r} [{p.start}, {p.end})"
        assert p.name not in names, f"{where}: name placed twice; names must be unique"
        names.add(p.name)
        b = _check_placement(layout, p)
        owner = b.owner(p.start)
        assert p.owner == owner, (
            f"{where} says owner {p.owner}, but (start - bucket.start) // shard_numel = "
            f"{owner}; derive the owner from the offsets, never separately"
        )
        shard_lo, shard_hi = b.shard(owner)
        assert p.end <= shard_hi, (
            f"{where} straddles shards {owner} [{shard_lo}, {shard_hi}) and {owner + 1} of "
            f"bucket {b.index}; every param must lie wholly inside one shard"
        )
        last_registered[p.bucket] = i
    _check_disjoint(layout.placements)
    for i in range(n_buckets):
        assert last_registered[i] >= 0, f"bucket {i} holds no params; drop it"
        assert i == 0 or last_registered[i] < last_registered[i - 1], (
            f"bucket {i} holds the last-registered param not in earlier buckets "
            f"(placement {last_registered[i]}), but bucket {i - 1} does not; buckets must be "
            "filled in backprop order (reverse registration order)"
        )


def _check_alone(layout: Layout, p: Placement) -> None:
    """A tied param sits alone at the start of a bucket whose shards are its aligned size."""
    b = layout.buckets[p.bucket]
    members = sum(q.bucket == p.bucket for q in layout.placements)
    assert members == 1 and p.start == b.start, (
        f"tied param {p.name!r} must sit alone at the start of bucket {b.index}"
    )
    expected = round_up(p.numel, layout.align)
    assert b.shard_numel == expected, (
        f"tied param {p.name!r}: bucket {b.index} has shard_numel {b.shard_numel}, "
        f"expected {expected} (its aligned size)"
    )


def _check_elementwise(layout: Layout) -> None:
    """Params packed tightly in backprop order, each bucket padded only up to `k * align`."""
    k, align = layout.shard_group_size, layout.align
    last_end: dict[int, int] = {}  # bucket -> end of its last param so far, in buffer order
    previous: Placement | None = None
    for p in reversed(layout.placements):  # backprop order = buffer order
        where = f"param {p.name!r} [{p.start}, {p.end})"
        assert p.owner is None, f"{where}: element-wise params have owner None"
        b = _check_placement(layout, p)
        assert p.end <= b.end, f"{where} is not inside bucket {b.index}"
        if previous is None or previous.bucket != p.bucket:
            assert p.start == b.start, f"{where} must open bucket {b.index} at {b.start}"
            assert previous is None or p.bucket == previous.bucket + 1, (
                f"{where}: buckets must be filled in backprop order (reverse registration)"
            )
        else:
            assert p.start == round_up(previous.end, align), (
                f"{where} must follow {previous.name!r} at the next aligned element: "
                "pack params tightly in backprop order"
            )
        last_end[p.bucket] = p.end
        previous = p
    for b in layout.buckets:
        assert b.index in last_end, f"adamw bucket {b.index} holds no params; drop it"
        assert b.end - round_up(last_end[b.index], align) < k * align, (
            f"adamw bucket {b.index} pads {b.end - last_end[b.index]} elements at its end; "
            f"round it up to a multiple of k * align = {k * align}, no more"
        )


def _check_stacked(layout: Layout) -> None:
    """Whole-tensor rules, but with whole matrices: see [Note: stacked layout]."""
    used = set()
    for p in layout.placements:
        where = f"stacked param {p.name!r} [{p.start}, {p.end})"
        assert p.owner is None, f"{where}: stacked params have owner None (matrices own)"
        assert len(p.shape) > 2, f"{where}: shape {p.shape} is not a stack of matrices"
        _check_placement(layout, p)
        assert p.end <= layout.numel, f"{where} runs past the buffer's end"
        for m in matrices(p, layout.buckets):
            lo, hi = layout.buckets[m.bucket].shard(m.owner)
            assert lo <= m.start and m.end <= hi, (
                f"{where}: matrix {m.index} [{m.start}, {m.end}) straddles a shard boundary"
            )
            used.add(m.bucket)
    _check_disjoint(layout.placements)
    order = [p.start for p in reversed(layout.placements)]
    assert order == sorted(order), "stacks must be laid out in backprop order"
    empty = sorted(set(range(len(layout.buckets))) - used)
    assert not empty, f"stacked buckets {empty} hold no matrix; drop them"
