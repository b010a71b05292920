"""Multi-buffer plans: Muon params in whole-tensor buffers, AdamW params in element-wise ones.

Pure planning, like `layout`: param specs in, plain data out. One routing decision
(`ParamSpec.muon`) puts every param in exactly one buffer:

- `"muon"` buffer: a `Layout` (size-matching or balanced) over the shard group's `k` ranks.
  Every param lies wholly inside one shard; its `owner` is a rank within the shard group.
- `"stacked"` buffer: Muon params with more than 2 dims (fused MoE experts), each a stack of
  matrices; every matrix lies wholly inside one shard and a stack spreads over consecutive
  shards (`wholeshard.stacks`, [Note: stacked layout]). Placements have `owner` None; each
  matrix's owner follows from its offset.
- `"adamw"` buffer: element-wise sharded. Params are packed in backprop order (reverse
  registration order), each starting on an `align`-element boundary, and cut into buckets that
  close once they hold `>= bucket_size` elements; each bucket is then padded to a multiple of
  `k * align`, so its `k` equal shards start aligned. Rank r owns the contiguous r-th shard of
  every bucket, so a param may straddle shards (`owner` is None), and the only padding is
  alignment (< `align` per param) plus < `k * align` per bucket: a tied embedding costs nothing.

[Note: shard groups]
With `shard_group_size=k` (k divides dp) the dp ranks form dp/k shard groups of k consecutive
ranks (global rank g*k + r is rank r of group g). Every group uses the same plan: owners and
shards are numbered 0..k-1 within the group, gradients are reduce-scattered within a group and
all-reduced across groups. `Plan.shard_rank(rank)` maps a global rank to its rank in the group.

Why params in element-wise buffers start aligned: every param view then starts on a 64-element
(128-byte at bf16) boundary, as in whole-tensor buffers, which vectorised kernels and the
32-element MXFP8 blocks of later FP8 work rely on; it costs < `align` elements per param.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from .layout import (
    Bucket,
    Layout,
    ParamSpec,
    Placement,
    _place,
    cost_imbalance,
    ns_cost,
    validate_inputs,
)
from .stacks import matrices, matrix_shape, plan_stacked, storage_units

KINDS = ("muon", "stacked", "adamw")
DEFAULT_STRATEGY = "balanced"


@dataclass(frozen=True)
class Buffer:
    """One flat buffer of one kind, cut into buckets of `shard_group_size` equal shards.

    `placements` are this buffer's params in registration order. Whole-tensor (`"muon"`)
    buffers keep every `Layout` invariant; stacked (`"stacked"`) and element-wise (`"adamw"`)
    ones are described in the module docstring and checked by `check`.
    """

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
        a bucket boundary joins the buckets it overlaps (`wholeshard.stacks.storage_units`).
        One bucket each in whole-tensor and element-wise buffers."""
        return storage_units(self.buckets, self.placements)

    def layout(self) -> Layout:
        """This whole-tensor buffer as a `Layout` over the shard group's ranks."""
        if not self.whole:
            raise ValueError(f"a {self.kind!r} buffer is element-wise; it has no Layout")
        return Layout(self.shard_group_size, self.align, self.buckets, self.placements)

    def owned_range(self, placement: Placement, rank: int) -> tuple[int, int]:
        """(offset, length): the elements `[offset, offset + length)` of the flattened param
        that shard-group rank `rank` owns; `(0, 0)` if it owns none of them."""
        if not 0 <= rank < self.shard_group_size:
            raise ValueError(
                f"rank {rank} is not in the shard group 0..{self.shard_group_size - 1}; "
                "pass the rank within the group (Plan.shard_rank(global_rank))"
            )
        if self.whole:
            return (0, placement.numel) if placement.owner == rank else (0, 0)
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
        `specs` (this buffer's specs, registration order) also check names, shapes and order."""
        assert self.kind in KINDS, f"buffer kind {self.kind!r} must be one of {KINDS}"
        if self.whole:
            self.layout().check(specs)
            return
        if self.kind == "stacked":
            _check_stacked(self)
        else:
            _check_elementwise(self)
        if specs is not None:
            assert [(s.name, tuple(s.shape)) for s in specs] == [
                (p.name, p.shape) for p in self.placements
            ], "placements must be the buffer's specs (names, shapes) in registration order"


@dataclass(frozen=True)
class Plan:
    """Every param's buffer, bucket, range and owner, for `dp_size` ranks in shard groups of
    `shard_group_size`. `buffers` holds at most one buffer per kind ("muon" first), none empty."""

    dp_size: int
    shard_group_size: int
    strategy: str
    align: int
    bucket_size: int | None
    buffers: tuple[Buffer, ...]

    @property
    def numel(self) -> int:
        return sum(b.numel for b in self.buffers)

    @property
    def padding_fraction(self) -> float:
        """Padded elements / all buffer elements, over all buffers."""
        total = self.numel
        return 0.0 if total == 0 else 1.0 - sum(b.used for b in self.buffers) / total

    def rank_costs(self) -> list[int]:
        """Newton-Schulz cost (`ns_cost`) of the Muon params each shard-group rank owns."""
        costs = [0] * self.shard_group_size
        for buffer in self.buffers:
            if buffer.whole:
                for p in buffer.placements:
                    costs[p.owner] += ns_cost(p.shape)
            elif buffer.kind == "stacked":
                for p in buffer.placements:
                    cost = ns_cost(matrix_shape(p.shape))
                    for m in matrices(p, buffer.buckets):
                        costs[m.owner] += cost
        return costs

    @property
    def ns_cost_imbalance(self) -> float:
        """Max over shard-group ranks of owned Newton-Schulz cost / mean (1.0: no Muon work)."""
        return cost_imbalance(self.rank_costs())

    def shard_rank(self, rank: int) -> int:
        """The rank within its shard group of global rank `rank` (see [Note: shard groups])."""
        if not 0 <= rank < self.dp_size:
            raise ValueError(f"rank {rank} is not in 0..{self.dp_size - 1}")
        return rank % self.shard_group_size

    def find(self, name: str) -> tuple[int, Placement]:
        """(buffer index, placement) of the param called `name`; KeyError if there is none."""
        for i, buffer in enumerate(self.buffers):
            for p in buffer.placements:
                if p.name == name:
                    return i, p
        raise KeyError(f"no param named {name!r} in the plan")

    def check(self, specs: Sequence[ParamSpec] | None = None) -> None:
        """Raise AssertionError if any buffer breaks an invariant; with `specs` (registration
        order) also check every spec sits once in the buffer of its kind, in order."""
        k = self.shard_group_size
        assert self.dp_size >= 1 and k >= 1 and self.dp_size % k == 0, (
            f"shard_group_size {k} must divide dp_size {self.dp_size}"
        )
        kinds = [b.kind for b in self.buffers]
        assert kinds == [kind for kind in KINDS if kind in kinds], (
            f"buffers {kinds}: at most one per kind, 'muon' first"
        )
        for b in self.buffers:
            assert b.shard_group_size == k and b.align == self.align, (
                f"{b.kind} buffer has shard_group_size {b.shard_group_size} and align "
                f"{b.align}, the plan {k} and {self.align}"
            )
            assert b.placements, f"{b.kind} buffer holds no params; leave it out"
        if specs is None:
            for b in self.buffers:
                b.check()
            return
        for b in self.buffers:
            mine = [s for s in specs if _kind(s) == b.kind]
            b.check(mine)
        placed = sum(len(b.placements) for b in self.buffers)
        assert placed == len(specs), f"{len(specs)} specs but {placed} placements"


DEFAULT_BUCKETS = 8
"""How many buckets `default_bucket_size` aims for: overlap needs several, each a collective."""
MIN_BUCKET_SIZE = 1 << 16
"""Below this many elements a collective's fixed cost outweighs its bytes."""


def default_bucket_size(numel: int, dp_size: int) -> int:
    """Elements per bucket when none is given, for `numel` params over `dp_size` ranks.

    About `DEFAULT_BUCKETS` buckets, so a reduce-scatter can start while backward runs and a
    gather while forward runs, but never below `MIN_BUCKET_SIZE` and never above Megatron's
    bucket size, `max(40M, 1M x dp)` elements (which keeps each rank's shard at >= 1M elements
    on large runs). torch DDP's default, 25 MB of fp32 gradients, is 6.5M elements.
    """
    megatron = max(40_000_000, 1_000_000 * dp_size)
    return min(max(-(-numel // DEFAULT_BUCKETS), MIN_BUCKET_SIZE), megatron)


def plan_buffers(
    params: Sequence[ParamSpec],
    dp_size: int,
    *,
    bucket_size: int | None = None,
    align: int = 64,
    strategy: str = DEFAULT_STRATEGY,
    shard_group_size: int | None = None,
) -> Plan:
    """Plan the buffers for `params` (registration order) on `dp_size` ranks.

    Muon params (`spec.muon`) go to a whole-tensor buffer planned as by `plan_layout(...,
    strategy=strategy)` over `k = shard_group_size or dp_size` ranks; the others to an
    element-wise buffer (module docstring). Both cut buckets near `bucket_size` elements (None:
    one bucket per buffer). Raises ValueError on bad input; the result passes
    `Plan.check(params)`.
    """
    specs = tuple(params)
    k = dp_size if shard_group_size is None else shard_group_size
    validate_inputs(specs, dp_size, bucket_size, align, strategy)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1 or dp_size % k:
        divisors = [d for d in range(1, dp_size + 1) if dp_size % d == 0]
        raise ValueError(
            f"shard_group_size must be an int dividing dp_size={dp_size} (params are sharded "
            f"within groups of that many ranks and replicated across groups), got {k!r}; "
            f"choose one of {divisors}"
        )
    buffers = []
    muon = [s for s in specs if _kind(s) == "muon"]
    if muon:
        layout = _place(tuple(muon), k, bucket_size, align, strategy)  # checked below
        buffers.append(Buffer("muon", k, align, layout.buckets, layout.placements))
    stacked = [s for s in specs if _kind(s) == "stacked"]
    if stacked:
        buffers.append(Buffer("stacked", k, align, *plan_stacked(stacked, k, bucket_size, align)))
    adamw = [s for s in specs if not s.muon]
    if adamw:
        buffers.append(_plan_elementwise(adamw, k, bucket_size, align))
    plan = Plan(dp_size, k, strategy, align, bucket_size, tuple(buffers))
    plan.check(specs)
    return plan


def _kind(spec: ParamSpec) -> str:
    if not spec.muon:
        return "adamw"
    return "stacked" if len(spec.shape) > 2 else "muon"


def _plan_elementwise(
    specs: Sequence[ParamSpec], k: int, bucket_size: int | None, align: int
) -> Buffer:
    """Pack `specs` in backprop order into buckets of `k` equal aligned shards."""
    n = len(specs)
    placements: list[Placement | None] = [None] * n
    buckets: list[Bucket] = []
    start = 0  # of the open bucket
    cursor = 0  # where the next param goes
    for i in range(n - 1, -1, -1):
        spec = specs[i]
        placements[i] = Placement(
            spec.name, tuple(spec.shape), len(buckets), cursor, cursor + spec.numel, None
        )
        cursor = _round_up(cursor + spec.numel, align)
        if i == 0 or (bucket_size is not None and cursor - start >= bucket_size):
            end = start + _round_up(cursor - start, k * align)
            buckets.append(Bucket(len(buckets), start, end, (end - start) // k))
            start = cursor = end
    return Buffer("adamw", k, align, tuple(buckets), tuple(placements))  # type: ignore[arg-type]


def _check_buckets(buffer: Buffer) -> None:
    """Buckets contiguous from 0, each `k` equal shards of a positive multiple of `align`."""
    k, align = buffer.shard_group_size, buffer.align
    position = 0
    for i, b in enumerate(buffer.buckets):
        where = f"{buffer.kind} bucket {i} [{b.start}, {b.end})"
        assert b.index == i and b.start == position, f"{where}: buckets must be contiguous from 0"
        assert b.shard_numel > 0 and b.shard_numel % align == 0, (
            f"{where}: shard_numel {b.shard_numel} must be a positive multiple of align={align}"
        )
        assert b.numel == k * b.shard_numel, f"{where}: must be {k} shards of {b.shard_numel}"
        position = b.end


def _check_elementwise(buffer: Buffer) -> None:
    k, align = buffer.shard_group_size, buffer.align
    _check_buckets(buffer)
    last_end: dict[int, int] = {}  # bucket -> end of its last param so far, in buffer order
    previous: Placement | None = None
    for p in reversed(buffer.placements):  # backprop order = buffer order
        where = f"param {p.name!r} [{p.start}, {p.end})"
        assert p.owner is None, f"{where}: element-wise params have owner None"
        assert p.numel == math.prod(p.shape), f"{where} does not match its shape {p.shape}"
        assert 0 <= p.bucket < len(buffer.buckets), f"{where}: no bucket {p.bucket}"
        b = buffer.buckets[p.bucket]
        assert b.start <= p.start and p.end <= b.end, f"{where} is not inside bucket {b.index}"
        assert p.start % align == 0, f"{where} does not start on an align={align} boundary"
        if previous is None or previous.bucket != p.bucket:
            assert p.start == b.start, f"{where} must open bucket {b.index} at {b.start}"
            assert previous is None or p.bucket == previous.bucket + 1, (
                f"{where}: buckets must be filled in backprop order (reverse registration)"
            )
        else:
            assert p.start == _round_up(previous.end, align), (
                f"{where} must follow {previous.name!r} at the next aligned element: "
                "pack params tightly in backprop order"
            )
        last_end[p.bucket] = p.end
        previous = p
    for b in buffer.buckets:
        assert b.index in last_end, f"adamw bucket {b.index} holds no params; drop it"
        assert b.end - _round_up(last_end[b.index], align) < k * align, (
            f"adamw bucket {b.index} pads {b.end - last_end[b.index]} elements at its end; "
            f"round it up to a multiple of k * align = {k * align}, no more"
        )


def _check_stacked(buffer: Buffer) -> None:
    """Whole-tensor bucket rules, but with whole matrices: see [Note: stacked layout]."""
    _check_buckets(buffer)
    spans, used = [], set()
    for p in buffer.placements:
        where = f"stacked param {p.name!r} [{p.start}, {p.end})"
        assert p.owner is None, f"{where}: stacked params have owner None (matrices own)"
        assert len(p.shape) > 2 and p.numel == math.prod(p.shape), f"{where}: bad shape {p.shape}"
        assert p.start % buffer.align == 0, f"{where} does not start on an align boundary"
        assert 0 <= p.bucket < len(buffer.buckets), f"{where}: no bucket {p.bucket}"
        b = buffer.buckets[p.bucket]
        assert b.start <= p.start < b.end, f"{where} does not start in its bucket {p.bucket}"
        assert p.end <= buffer.numel, f"{where} runs past the buffer's end"
        for m in matrices(p, buffer.buckets):
            lo, hi = buffer.buckets[m.bucket].shard(m.owner)
            assert lo <= m.start and m.end <= hi, (
                f"{where}: matrix {m.index} [{m.start}, {m.end}) straddles a shard boundary"
            )
            used.add(m.bucket)
        spans.append((p.start, p.end, p.name))
    spans.sort()
    for (_, prev_end, prev), (start, _, name) in zip(spans, spans[1:], strict=False):
        assert prev_end <= start, f"stacked params {prev!r} and {name!r} overlap"
    order = [p.start for p in reversed(buffer.placements)]
    assert order == sorted(order), "stacks must be laid out in backprop order"
    empty = sorted(set(range(len(buffer.buckets))) - used)
    assert not empty, f"stacked buckets {empty} hold no matrix; drop them"


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple
