"""The unaligned ("unaligned") buffer of the legacy ping-pong baseline.

[Note: unaligned buffers]
The scheme wholeshard replaces, kept as a baseline (`DataParallelConfig(scheme="ping_pong")`):
every param, Muon or AdamW, in one buffer without shard boundaries and without alignment, its
buckets filled in backprop order as the size-matching planner fills them for one rank. Owners
are dealt by numel in snake order (largest first, to ranks 0..k-1, then k-1..0, ...). Every rank
holds every bucket whole: gradients are all-reduced, and each owner's params reach the others
through a staging buffer (one padded all-gather, or one broadcast per rank).
"""

from __future__ import annotations

import dataclasses

from ._rows import buffer_of_rows, plan_rows
from .buffer import Buffer
from .specs import ParamSpec


def plan_unaligned(specs: tuple[ParamSpec, ...], k: int, bucket_size: int | None) -> Buffer:
    """The `"unaligned"` buffer of validated `specs` (every param) over `k` ranks; owners dealt
    by snake order (ties keep registration order)."""
    one_rank = buffer_of_rows(specs, 1, 1, plan_rows(specs, 1, bucket_size, 1))
    placements = list(one_rank.placements)
    by_size = sorted(range(len(placements)), key=lambda n: -placements[n].numel)
    for i, n in enumerate(by_size):
        lap, pos = divmod(i, k)
        owner = pos if lap % 2 == 0 else k - 1 - pos
        placements[n] = dataclasses.replace(placements[n], owner=owner)
    return Buffer("unaligned", k, 1, one_rank.buckets, tuple(placements))
