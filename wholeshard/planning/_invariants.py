"""The invariants every planned buffer keeps (module docstring of `buffer`), checked with
explicit raises (they hold under `python -O`): `check_buffer` raises AssertionError naming what
is broken."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Protocol

from .specs import Bucket, ParamSpec, Placement, matrices, round_up


class Buffer(Protocol):
    """What the checks read of a `buffer.Buffer` (which imports them)."""

    @property
    def kind(self) -> str: ...
    @property
    def shard_group_size(self) -> int: ...
    @property
    def align(self) -> int: ...
    @property
    def buckets(self) -> tuple[Bucket, ...]: ...
    @property
    def placements(self) -> tuple[Placement, ...]: ...
    @property
    def numel(self) -> int: ...


def check_buffer(
    buffer: Buffer, specs: Sequence[ParamSpec] | None = None, whole_buckets: bool = False
) -> None:
    """`Buffer.check`: the invariants of its kind (`whole_buckets`: a layout's kind, whose
    buckets have no shards and whose params are whole); with `specs`, also their names,
    shapes and order, and tied params alone in their buckets."""
    _check_buckets(buffer, whole_buckets)
    if whole_buckets:
        _check_whole(buffer, whole_buckets)
    else:
        {
            "matrix": _check_whole,
            "stacked": _check_stacked,
            "exchange": _check_exchange,
            "adamw": _check_elementwise,
        }[buffer.kind](buffer)
    if specs is None:
        return
    if len(specs) != len(buffer.placements):
        raise AssertionError(
            f"{len(specs)} specs but {len(buffer.placements)} placements; place every spec once"
        )
    for spec, p in zip(specs, buffer.placements, strict=True):
        if spec.name != p.name or tuple(spec.shape) != p.shape:
            raise AssertionError(
                f"placement {p.name!r} {p.shape} does not match spec {spec.name!r} "
                f"{tuple(spec.shape)}; placements must follow the specs' order (registration "
                f"order)"
            )
        if spec.tied and buffer.kind in ("matrix", "exchange"):
            _check_alone(buffer, p)


def _expect(condition: bool, message: str) -> None:
    """An invariant check that survives `python -O` (for messages cheap to build)."""
    if not condition:
        raise AssertionError(message)


def _check_buckets(buffer: Buffer, whole_buckets: bool = False) -> None:
    """Buckets contiguous from 0, each `k` equal shards (`whole_buckets`: one) of a positive
    multiple of `align`."""
    k, align = buffer.shard_group_size, buffer.align
    _expect(k >= 1, f"shard_group_size is {k}; it must be >= 1")
    _expect(align >= 1, f"align is {align}; it must be >= 1")
    shards = 1 if whole_buckets else k
    expected_start = 0
    for i, b in enumerate(buffer.buckets):
        where = f"{buffer.kind} bucket {i} [{b.start}, {b.end})"
        _expect(b.index == i, f"{where} has index {b.index}; number buckets 0.. in buffer order")
        if b.start != expected_start:
            raise AssertionError(
                f"{where} starts at {b.start} but must start at {expected_start}, where the "
                "previous bucket ends: buckets are contiguous from element 0"
            )
        if b.owners:
            _check_owners(buffer, b, where)
            expected_start = b.end
            continue
        _expect(b.shard_numel > 0, f"{where} has shard_numel {b.shard_numel}; it must be > 0")
        if b.shard_numel % align:
            raise AssertionError(
                f"{where} has shard_numel {b.shard_numel}, not a multiple of align={align}, "
                "so shards after the first would start off the alignment"
            )
        if b.numel != shards * b.shard_numel:
            raise AssertionError(
                f"{where} holds {b.numel} elements but {shards} shard(s) of {b.shard_numel} = "
                f"{shards * b.shard_numel}: shards must be equal"
            )
        expected_start = b.end


def _check_owners(buffer: Buffer, b: Bucket, where: str) -> None:
    """An owner bucket ([Note: owner buckets]): owners listed by ascending rank (within the
    group) and strictly ascending start, the first at the bucket's start, the last before its
    end, `shard_numel` 0; only whole-tensor and stacked buffers have them, and a whole-tensor
    one's shards start aligned."""
    k = buffer.shard_group_size
    if buffer.kind not in ("matrix", "stacked"):
        raise AssertionError(f"{where}: a {buffer.kind} buffer has equal shards, not owners")
    listed = b.owner_starts
    ranks = [r for r, _ in listed]
    starts = [x for _, x in listed]
    if starts[0] != b.start or starts[-1] >= b.end:
        raise AssertionError(
            f"{where}: owner starts {starts} must run from its start to before its end"
        )
    if not all(r < r2 and x < x2 for (r, x), (r2, x2) in itertools.pairwise(listed)):
        raise AssertionError(f"{where}: owners {listed} must ascend in rank and start")
    if ranks[0] < 0 or ranks[-1] >= k:
        raise AssertionError(f"{where}: owners {ranks} are not ranks of the group 0..{k - 1}")
    _expect(b.shard_numel == 0, f"{where} lists owners and has shard_numel {b.shard_numel}; 0")
    if buffer.kind == "matrix" and any(x % buffer.align for x in starts):
        raise AssertionError(f"{where}: owner starts {starts} not on align={buffer.align} elements")


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


def _check_whole(buffer: Buffer, whole_buckets: bool = False) -> None:
    """Every param whole: inside the shard of its owner, the owner by `Bucket.owner`
    (`whole_buckets`: inside its bucket, owned by a rank of the group); buckets in backprop
    order."""
    last_registered = [-1] * len(buffer.buckets)
    names: set[str] = set()
    for i, p in enumerate(buffer.placements):
        if p.name in names:
            raise AssertionError(f"param {p.name!r}: name placed twice; names must be unique")
        names.add(p.name)
        b = _check_placement(buffer, p)
        if whole_buckets:
            if p.end > b.end:
                raise AssertionError(f"param {p.name!r} runs past the end of bucket {b.index}")
            if p.owner is None or not 0 <= p.owner < buffer.shard_group_size:
                raise AssertionError(
                    f"param {p.name!r} has owner {p.owner}, not a rank of the shard group "
                    f"0..{buffer.shard_group_size - 1}"
                )
            last_registered[p.bucket] = i
            continue
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


def _check_alone(buffer: Buffer, p: Placement) -> None:
    """A tied param sits alone at the start of a bucket whose shards are its aligned size."""
    b = buffer.buckets[p.bucket]
    members = sum(q.bucket == p.bucket for q in buffer.placements)
    if members != 1 or p.start != b.start:
        raise AssertionError(
            f"tied param {p.name!r} must sit alone at the start of bucket {b.index}"
        )
    expected = round_up(p.numel, buffer.align)
    if buffer.kind == "exchange":  # equal shards of the padded param
        expected = round_up(p.numel, buffer.shard_group_size * buffer.align)
        expected //= buffer.shard_group_size
    if not b.owners and b.shard_numel != expected:
        raise AssertionError(
            f"tied param {p.name!r}: bucket {b.index} has shard_numel {b.shard_numel}, "
            f"expected {expected} (its aligned size)"
        )


def _check_exchange(buffer: Buffer) -> None:
    """Packed as element-wise params are, in exchange buckets; each Muon param lists one owner
    in the group per matrix ([Note: exchange buffers] in `_exchange`)."""
    k = buffer.shard_group_size
    for b in buffer.buckets:
        _expect(b.exchanged, f"exchange bucket {b.index} is not marked exchanged")
    for p in buffer.placements:
        where = f"param {p.name!r} [{p.start}, {p.end})"
        if not all(0 <= o < k for o in p.owners):
            raise AssertionError(f"{where}: owners {p.owners} are not ranks 0..{k - 1}")
        if p.owners and p.numel % len(p.owners):
            raise AssertionError(f"{where}: {len(p.owners)} owners do not split its matrices")
        whole = p.owners[0] if len(p.owners) == 1 and len(p.shape) == 2 else None
        _expect(p.owner == whole, f"{where}: owner {p.owner}, expected {whole}")
    _check_elementwise(buffer, owned_apart=True)


def _check_elementwise(buffer: Buffer, owned_apart: bool = False) -> None:
    """Params packed tightly in backprop order, each bucket padded only up to `k * align`
    (`owned_apart`: an exchange buffer, whose matrices' owners `_check_exchange` checks)."""
    k, align = buffer.shard_group_size, buffer.align
    last_end: dict[int, int] = {}  # bucket -> end of its last param so far, in buffer order
    previous: Placement | None = None
    for p in reversed(buffer.placements):  # backprop order = buffer order
        where = f"param {p.name!r} [{p.start}, {p.end})"
        if p.owner is not None and not owned_apart:
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
            raise AssertionError(f"{buffer.kind} bucket {b.index} holds no params; drop it")
        if b.end - round_up(last_end[b.index], align) >= k * align:
            raise AssertionError(
                f"{buffer.kind} bucket {b.index} pads {b.end - last_end[b.index]} elements at "
                f"its end; round it up to a multiple of k * align = {k * align}, no more"
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
