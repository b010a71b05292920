"""`Buffer`: one planned buffer, its owner rule, and the invariants every planner keeps.

A buffer is one flat tensor of one kind, cut into buckets; what a rank owns depends on the kind:

- `"muon"`: whole tensors. Each bucket is `shard_group_size` equal shards, rank r of the shard
  group owns shard r; every param lies wholly inside one shard and its `owner` is
  `Bucket.owner(start)`; tied params sit alone at the start of their bucket.
- `"stacked"`: whole matrices of stacked params ([Note: stacked buffers] in `_stacked`). A stack
  may spread over consecutive shards; each matrix's owner follows from its offset.
- `"adamw"`: element-wise. Params are packed tightly in backprop order and may straddle shards;
  each bucket is padded to a multiple of `k * align`, no more.
- `"unaligned"`: the legacy ping-pong baseline ([Note: unaligned buffers] in `_unaligned`):
  every param whole, no shards (a bucket is one shard of its own size, held by every rank),
  owners dealt by size over the `shard_group_size` ranks, no alignment.

Every kind: buckets are contiguous from element 0, params start on `align`-element boundaries,
never overlap, and fill buckets in backprop order (reverse registration order). `Buffer.check`
raises AssertionError naming what is broken (explicit raises: they hold under `python -O`).
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

from .specs import (
    Bucket,
    MatrixCost,
    ParamSpec,
    Placement,
    matrices,
    matrix_shape,
    round_up,
    shape_cost,
)

BufferKind = Literal["muon", "stacked", "adamw", "unaligned"]
KINDS: tuple[BufferKind, ...] = ("muon", "stacked", "adamw", "unaligned")


@dataclass(frozen=True)
class Buffer:
    """One planned buffer of one kind (`KINDS`) over a shard group of `shard_group_size` ranks.
    `placements` are the buffer's params in registration order."""

    kind: BufferKind
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
        """Whether every param is owned whole by one rank (`owner` set on every placement)."""
        return self.kind in ("muon", "unaligned")

    @property
    def sharding(self) -> str:
        """What a rank owns, for reports."""
        return {
            "muon": "whole tensors",
            "stacked": "whole matrices",
            "adamw": "element-wise",
            "unaligned": "whole tensors, unaligned",
        }[self.kind]

    def buckets_of(self, placement: Placement) -> range:
        """Indices of the buckets `placement` overlaps (one, except for a spread stack)."""
        last = placement.bucket
        while last + 1 < len(self.buckets) and self.buckets[last + 1].start < placement.end:
            last += 1
        return range(placement.bucket, last + 1)

    def storage_units(self) -> tuple[range, ...]:
        """The buffer's storage units: runs of consecutive bucket indices, in order, covering
        every bucket once, where buckets b and b + 1 share a unit iff some placement crosses the
        boundary between them. A param's data is one view of its buffer, so every param lies
        inside one unit, and a fully sharded buffer materialises a unit's buckets together.
        Only a stacked buffer has units of more than one bucket."""
        starts = [b.start for b in self.buckets]
        joined = [False] * len(self.buckets)  # joined[b]: bucket b is in the unit of b - 1
        for p in self.placements:
            for b in range(bisect_right(starts, p.start), bisect_left(starts, p.end)):
                joined[b] = True
        firsts = [b for b in range(len(self.buckets)) if not joined[b]]
        return tuple(map(range, firsts, [*firsts[1:], len(self.buckets)]))

    def owned_range(self, placement: Placement, rank: int) -> tuple[int, int]:
        """(offset, length): the elements `[offset, offset + length)` of the flattened param
        that shard-group rank `rank` owns; `(0, 0)` if it owns none of them. A whole tensor is
        owned all or nothing."""
        if not 0 <= rank < self.shard_group_size:
            raise ValueError(
                f"rank {rank} is not in the shard group 0..{self.shard_group_size - 1}; "
                "pass the rank within the group (Plan.shard_rank(global_rank))"
            )
        if self.kind == "stacked":
            raise ValueError("a stacked param may have several owned ranges: use owned()")
        if self.kind == "unaligned":
            return (0, placement.numel) if placement.owner == rank else (0, 0)
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

    def rank_costs(self, matrix_cost: MatrixCost | None = None) -> list[int]:
        """`matrix_cost` (None: Newton-Schulz cost, `ns_cost`) of the matrices each shard-group
        rank owns (Muon params only: zeros for an element-wise buffer)."""
        costs = [0] * self.shard_group_size
        if self.kind == "stacked":
            for p in self.placements:
                cost = shape_cost(matrix_shape(p.shape), matrix_cost)
                for m in matrices(p, self.buckets):
                    costs[m.owner] += cost
        elif self.kind == "muon":
            for p in self.placements:
                costs[p.owner] += shape_cost(p.shape, matrix_cost)
        return costs

    def check(self, specs: Sequence[ParamSpec] | None = None) -> None:
        """Raise AssertionError naming the bucket or param if an invariant is broken. With
        `specs` (this buffer's specs, registration order) also check names, shapes and order,
        and that every tied param of a whole-tensor buffer sits alone in its bucket."""
        _expect(self.kind in KINDS, f"buffer kind {self.kind!r} must be one of {KINDS}")
        _check_buckets(self)
        {
            "muon": _check_whole,
            "stacked": _check_stacked,
            "adamw": _check_elementwise,
            "unaligned": _check_unaligned,
        }[self.kind](self)
        if specs is None:
            return
        if len(specs) != len(self.placements):
            raise AssertionError(
                f"{len(specs)} specs but {len(self.placements)} placements; place every spec once"
            )
        for spec, p in zip(specs, self.placements, strict=True):
            if spec.name != p.name or tuple(spec.shape) != p.shape:
                raise AssertionError(
                    f"placement {p.name!r} {p.shape} does not match spec {spec.name!r} "
                    f"{tuple(spec.shape)}; placements must follow the specs' order (registration "
                    f"order)"
                )
            if spec.tied and self.kind == "muon":
                _check_alone(self, p)


def _expect(condition: bool, message: str) -> None:
    """An invariant check that survives `python -O` (for messages cheap to build)."""
    if not condition:
        raise AssertionError(message)


def _check_buckets(buffer: Buffer) -> None:
    """Buckets contiguous from 0; sharded kinds: `k` equal shards of a positive multiple of
    `align`."""
    k, align = buffer.shard_group_size, buffer.align
    _expect(k >= 1, f"shard_group_size is {k}; it must be >= 1")
    _expect(align >= 1, f"align is {align}; it must be >= 1")
    shards = 1 if buffer.kind == "unaligned" else k
    expected_start = 0
    for i, b in enumerate(buffer.buckets):
        where = f"{buffer.kind} bucket {i} [{b.start}, {b.end})"
        if b.index != i:
            raise AssertionError(f"{where} has index {b.index}; number buckets 0.. in buffer order")
        if b.start != expected_start:
            raise AssertionError(
                f"{where} starts at {b.start} but must start at {expected_start}, where the "
                "previous bucket ends: buckets are contiguous from element 0"
            )
        if b.shard_numel <= 0:
            raise AssertionError(f"{where} has shard_numel {b.shard_numel}; it must be > 0")
        if b.shard_numel % align:
            raise AssertionError(
                f"{where} has shard_numel {b.shard_numel}, not a multiple of align={align}, "
                "so shards after the first would start unaligned"
            )
        if b.numel != shards * b.shard_numel:
            raise AssertionError(
                f"{where} holds {b.numel} elements but {shards} shard(s) of {b.shard_numel} = "
                f"{shards * b.shard_numel}: shards must be equal"
            )
        expected_start = b.end


def _check_placement(buffer: Buffer, p: Placement) -> Bucket:
    """The rules every kind's params keep: a real bucket, the shape's size, an aligned start
    inside that bucket. Returns the bucket."""
    n = len(buffer.buckets)
    if not 0 <= p.bucket < n:
        raise AssertionError(
            f"param {p.name!r} [{p.start}, {p.end}) names bucket {p.bucket}, but the buffer has "
            f"{n} buckets"
        )
    if p.numel != math.prod(p.shape):
        raise AssertionError(
            f"param {p.name!r} [{p.start}, {p.end}) spans {p.numel} elements but shape "
            f"{p.shape} has {math.prod(p.shape)}"
        )
    if p.start % buffer.align:
        raise AssertionError(
            f"param {p.name!r} [{p.start}, {p.end}) starts at {p.start}, not on an "
            f"align={buffer.align} element boundary"
        )
    b = buffer.buckets[p.bucket]
    if not b.start <= p.start < b.end:
        raise AssertionError(
            f"param {p.name!r} [{p.start}, {p.end}) does not start in its bucket {b.index}"
        )
    return b


def _check_disjoint(placements: Sequence[Placement]) -> None:
    spans = sorted((p.start, p.end, p.name) for p in placements)
    for (_, prev_end, prev_name), (start, _, name) in zip(spans, spans[1:], strict=False):
        if prev_end > start:
            raise AssertionError(f"params {prev_name!r} and {name!r} overlap")


def _check_backprop_order(buffer: Buffer, last_registered: list[int]) -> None:
    """`last_registered[i]`: the highest placement index in bucket i. Every bucket holds the
    last-registered param not in earlier buckets (backprop order)."""
    for i, last in enumerate(last_registered):
        if last < 0:
            raise AssertionError(f"bucket {i} holds no params; drop it")
        if i and last >= last_registered[i - 1]:
            raise AssertionError(
                f"bucket {i} holds the last-registered param not in earlier buckets "
                f"(placement {last}), but bucket {i - 1} does not; buckets must be filled in "
                "backprop order (reverse registration order)"
            )


def _check_whole(buffer: Buffer) -> None:
    """Every param wholly inside the shard of its owner, the owner by `Bucket.owner`; buckets
    in backprop order."""
    last_registered = [-1] * len(buffer.buckets)
    names: set[str] = set()
    for i, p in enumerate(buffer.placements):
        if p.name in names:
            raise AssertionError(f"param {p.name!r}: name placed twice; names must be unique")
        names.add(p.name)
        b = _check_placement(buffer, p)
        owner = b.owner(p.start)
        if p.owner != owner:
            raise AssertionError(
                f"param {p.name!r} [{p.start}, {p.end}) says owner {p.owner}, but (start - "
                f"bucket.start) // shard_numel = {owner}; derive the owner from the offsets, "
                "never separately"
            )
        shard_lo, shard_hi = b.shard(owner)
        if p.end > shard_hi:
            raise AssertionError(
                f"param {p.name!r} [{p.start}, {p.end}) straddles shards {owner} [{shard_lo}, "
                f"{shard_hi}) and {owner + 1} of bucket {b.index}; every param must lie wholly "
                "inside one shard"
            )
        last_registered[p.bucket] = i
    _check_disjoint(buffer.placements)
    _check_backprop_order(buffer, last_registered)


def _check_unaligned(buffer: Buffer) -> None:
    """Every param whole inside its bucket, owned by a rank of the group; buckets in backprop
    order."""
    last_registered = [-1] * len(buffer.buckets)
    for i, p in enumerate(buffer.placements):
        b = _check_placement(buffer, p)
        if p.end > b.end:
            raise AssertionError(f"param {p.name!r} runs past the end of bucket {b.index}")
        if p.owner is None or not 0 <= p.owner < buffer.shard_group_size:
            raise AssertionError(
                f"param {p.name!r} has owner {p.owner}, not a rank of the shard group "
                f"0..{buffer.shard_group_size - 1}"
            )
        last_registered[p.bucket] = i
    _check_disjoint(buffer.placements)
    _check_backprop_order(buffer, last_registered)


def _check_alone(buffer: Buffer, p: Placement) -> None:
    """A tied param sits alone at the start of a bucket whose shards are its aligned size."""
    b = buffer.buckets[p.bucket]
    members = sum(q.bucket == p.bucket for q in buffer.placements)
    if members != 1 or p.start != b.start:
        raise AssertionError(
            f"tied param {p.name!r} must sit alone at the start of bucket {b.index}"
        )
    expected = round_up(p.numel, buffer.align)
    if b.shard_numel != expected:
        raise AssertionError(
            f"tied param {p.name!r}: bucket {b.index} has shard_numel {b.shard_numel}, "
            f"expected {expected} (its aligned size)"
        )


def _check_elementwise(buffer: Buffer) -> None:
    """Params packed tightly in backprop order, each bucket padded only up to `k * align`."""
    k, align = buffer.shard_group_size, buffer.align
    last_end: dict[int, int] = {}  # bucket -> end of its last param so far, in buffer order
    previous: Placement | None = None
    for p in reversed(buffer.placements):  # backprop order = buffer order
        where = f"param {p.name!r} [{p.start}, {p.end})"
        if p.owner is not None:
            raise AssertionError(f"{where}: element-wise params have owner None")
        b = _check_placement(buffer, p)
        if p.end > b.end:
            raise AssertionError(f"{where} is not inside bucket {b.index}")
        if previous is None or previous.bucket != p.bucket:
            if p.start != b.start:
                raise AssertionError(f"{where} must open bucket {b.index} at {b.start}")
            if previous is not None and p.bucket != previous.bucket + 1:
                raise AssertionError(
                    f"{where}: buckets must be filled in backprop order (reverse registration)"
                )
        elif p.start != round_up(previous.end, align):
            raise AssertionError(
                f"{where} must follow {previous.name!r} at the next aligned element: pack "
                "params tightly in backprop order"
            )
        last_end[p.bucket] = p.end
        previous = p
    for b in buffer.buckets:
        if b.index not in last_end:
            raise AssertionError(f"adamw bucket {b.index} holds no params; drop it")
        if b.end - round_up(last_end[b.index], align) >= k * align:
            raise AssertionError(
                f"adamw bucket {b.index} pads {b.end - last_end[b.index]} elements at its end; "
                f"round it up to a multiple of k * align = {k * align}, no more"
            )


def _check_stacked(buffer: Buffer) -> None:
    """Whole-tensor rules, but with whole matrices: see [Note: stacked buffers]."""
    used = set()
    for p in buffer.placements:
        where = f"stacked param {p.name!r} [{p.start}, {p.end})"
        if p.owner is not None:
            raise AssertionError(f"{where}: stacked params have owner None (matrices own)")
        if len(p.shape) <= 2:
            raise AssertionError(f"{where}: shape {p.shape} is not a stack of matrices")
        _check_placement(buffer, p)
        if p.end > buffer.numel:
            raise AssertionError(f"{where} runs past the buffer's end")
        for m in matrices(p, buffer.buckets):
            lo, hi = buffer.buckets[m.bucket].shard(m.owner)
            if not (lo <= m.start and m.end <= hi):
                raise AssertionError(
                    f"{where}: matrix {m.index} [{m.start}, {m.end}) straddles a shard boundary"
                )
            used.add(m.bucket)
    _check_disjoint(buffer.placements)
    order = [p.start for p in reversed(buffer.placements)]
    if order != sorted(order):
        raise AssertionError("stacks must be laid out in backprop order")
    empty = sorted(set(range(len(buffer.buckets))) - used)
    if empty:
        raise AssertionError(f"stacked buckets {empty} hold no matrix; drop them")
