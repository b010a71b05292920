"""The legacy baselines the bench compares wholeshard against, registered as layouts ([Note:
layouts] in `wholeshard.planning.layouts`): importing this module registers them; no torch here
(their engine half, `baseline_storage`, is loaded where an engine builds one).

- "shard_broadcasts": the design's plan, its equal-shard buckets gathered by one broadcast per
  shard instead of an all-gather (owner buckets broadcast anyway; exchange buckets keep their
  all-gather).
- "ping_pong" and "ping_pong_broadcasts": the scheme wholeshard replaces ([Note: unaligned
  buffers]), gathering each bucket's params by one padded all-gather, or by one broadcast per
  owning rank.

Ask for one by name: `DataParallel(..., _variant=Variant(layout="ping_pong"))`.

[Note: unaligned buffers]
The scheme wholeshard replaces, kept as a baseline: every param, Muon or AdamW, in one buffer
without shard boundaries and without alignment (kind "unaligned"), its buckets filled in
backprop order as the size-matching planner fills them for one rank. Owners are dealt by numel
in snake order (largest first, to ranks 0..k-1, then k-1..0, ...). Every rank holds every
bucket whole: gradients are all-reduced, and each owner's params reach the others through a
staging buffer (one all-gather padded to the rank owning most of the bucket, or one broadcast
per rank owning any of it). It has no shard groups, cannot be fully sharded and has no FP8
gather; its costs are not modelled (`wholeshard.capacity.costs`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..planning import ONE_BUCKET, Buffer, Plan
from ..planning.layouts import Layout, register_layout
from ..planning.plan import plan_buffer
from ..planning.specs import Bucket, ParamSpec
from ..planning.sync import EQUAL_SHARDS, Collective, SyncScheme

KIND = "unaligned"
"""The ping-pong baseline's buffer kind ([Note: unaligned buffers])."""


@dataclass(frozen=True)
class WholeBucket(Bucket):
    """A bucket of the unaligned buffer: one shard, held whole by every rank; `owned[r]`: the
    elements of its params that rank r owns."""

    owned: tuple[int, ...] = ()


def _broadcast_each_shard(b: Bucket, k: int, dtype: str) -> list[Collective]:
    shards = b.shards()
    return [Collective("broadcast", k, hi - lo, dtype, "params", "shard") for _, lo, hi in shards]


def _all_reduce(b: Bucket, k: int, dtype: str) -> list[Collective]:
    return [Collective("all_reduce", k, b.numel, dtype, "grads", "shard")]


def _padded_all_gather(b: WholeBucket, k: int, dtype: str) -> list[Collective]:
    return [Collective("all_gather", k, k * max(b.owned), dtype, "params", "shard")]


def _broadcast_each_owner(b: WholeBucket, k: int, dtype: str) -> list[Collective]:
    return [Collective("broadcast", k, n, dtype, "params", "shard") for n in b.owned if n]


SHARD_BROADCASTS = SyncScheme(
    "shard_broadcasts", EQUAL_SHARDS.reduce, _broadcast_each_shard, "reduce_scatter/broadcast"
)
# The ping-pong schemes describe `WholeBucket`s only (their `owned` sizes).
PING_PONG = SyncScheme(
    "ping_pong",
    _all_reduce,
    _padded_all_gather,
    "all_reduce/padded all_gather",
)
PING_PONG_BROADCASTS = SyncScheme(
    "ping_pong_broadcasts",
    _all_reduce,
    _broadcast_each_owner,
    "all_reduce/broadcast",
)


def _broadcast_shards(plan: Plan, specs: tuple[ParamSpec, ...]) -> Plan:
    """`plan` with its equal-shard buckets synced by `SHARD_BROADCASTS`."""

    def rename(b: Bucket) -> Bucket:
        equal = b.sync == EQUAL_SHARDS.name
        return dataclasses.replace(b, scheme=SHARD_BROADCASTS.name) if equal else b

    buffers = tuple(
        dataclasses.replace(f, buckets=tuple(map(rename, f.buckets))) for f in plan.buffers
    )
    return dataclasses.replace(plan, buffers=buffers)


def _ping_pong(scheme: SyncScheme) -> Any:
    def relayout(plan: Plan, specs: tuple[ParamSpec, ...]) -> Plan:
        """The unaligned buffer of `specs` over the plan's ranks, by its bucket size ([Note:
        unaligned buffers]); owners by snake order (ties keep registration order)."""
        k = plan.shard_group_size
        if k != plan.dp_size:
            raise ValueError(
                f"layout {scheme.name!r} has no shard groups: leave shard_group_size unset"
            )
        size = None if plan.bucket_size == ONE_BUCKET else int(plan.bucket_size)
        one_rank = plan_buffer("matrix", specs, 1, size, 1, "size_match")
        placements = list(one_rank.placements)
        by_size = sorted(range(len(placements)), key=lambda n: -placements[n].numel)
        for i, n in enumerate(by_size):
            lap, pos = divmod(i, k)
            owner = pos if lap % 2 == 0 else k - 1 - pos
            placements[n] = dataclasses.replace(placements[n], owner=owner)
        owned = [[0] * k for _ in one_rank.buckets]
        for p in placements:
            owned[p.bucket][p.owner] += p.numel
        buckets = tuple(
            WholeBucket(**{**vars(b), "scheme": scheme.name}, owned=tuple(mine))
            for b, mine in zip(one_rank.buckets, owned, strict=True)
        )
        buffer = Buffer(KIND, k, 1, buckets, tuple(placements))
        return Plan(plan.dp_size, k, "size_match", 1, plan.bucket_size, (buffer,))

    return relayout


# Each layout's engine half: torch, imported only where an engine builds the baseline.
def _shard_broadcasts_engine() -> Any:
    from ..engine.layouts import Executable
    from . import baseline_storage as run

    return Executable({SHARD_BROADCASTS.name: run.SHARD_BROADCASTS})


def _ping_pong_engine() -> Any:
    from ..engine.layouts import Executable
    from . import baseline_storage as run

    return Executable({PING_PONG.name: run.UNALIGNED}, run.UnalignedStorage)


def _ping_pong_broadcasts_engine() -> Any:
    from ..engine.layouts import Executable
    from . import baseline_storage as run

    return Executable({PING_PONG_BROADCASTS.name: run.UNALIGNED}, run.UnalignedBroadcastStorage)


_REFUSES = (
    ("reshard_after_forward", "its owners' params are not in equal shards"),
    ("fp8_param_gather", "it has no shards"),
)
_UNALIGNED = (KIND, "whole tensors, unaligned", "size_match", _REFUSES)
_BF16_GATHER = (("fp8_param_gather", "the baseline broadcasts params as they are, never FP8"),)
LAYOUTS = (
    Layout(
        SHARD_BROADCASTS.name,
        _broadcast_shards,
        (SHARD_BROADCASTS,),
        _shard_broadcasts_engine,
        refuses=_BF16_GATHER,
    ),
    Layout(PING_PONG.name, _ping_pong(PING_PONG), (PING_PONG,), _ping_pong_engine, *_UNALIGNED),
    Layout(
        PING_PONG_BROADCASTS.name,
        _ping_pong(PING_PONG_BROADCASTS),
        (PING_PONG_BROADCASTS,),
        _ping_pong_broadcasts_engine,
        *_UNALIGNED,
    ),
)
"""The baselines, each a layout named as its sync scheme."""
for _layout in LAYOUTS:
    register_layout(_layout)
