"""Process groups of a `DataParallel`: the data-parallel group, shard and replica groups, and the
all-gather group.

[Note: making groups]
torch makes a new group in one of three ways, and which one is safe depends on who calls:
- `new_subgroups_by_enumeration` (or `new_group` without local synchronization) must be called
  by every rank of the world: right when `group` is the whole world;
- when NCCL is initialised eagerly (a device bound to the default group: `init_process_group(
  device_id=...)`, as the train job does), every new communicator is split from the world's,
  which also needs every world rank: for a strict subgroup, `split_group` splits `group`'s own
  communicator instead, which needs only its ranks;
- otherwise `new_group(ranks, use_local_synchronization=True)`, called by the members alone.
So a `DataParallel` over a strict subgroup (pipeline stages, ranks that only evaluate) never
waits for ranks outside it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from torch.distributed import ProcessGroup


def make_groups(
    group: ProcessGroup | None,
    dp_size: int,
    k: int,
    separate_gather: bool,
    timeout: timedelta | None = None,
) -> tuple[ProcessGroup | None, ProcessGroup | None, ProcessGroup | None]:
    """(this rank's shard group, its replica group, its all-gather group).

    Consecutive blocks of k ranks shard the params; ranks at the same position of every block
    replicate them (no replica group if k = dp). The all-gather group is the shard group, or a
    second group over the same ranks when `separate_gather`. Only the ranks of `group` call this,
    in the same order ([Note: making groups]). New groups get `timeout`, or else `group`'s own
    (torch would give them its backend default, 30 minutes for gloo, whatever
    `init_process_group` was told).
    """
    if dp_size == 1:
        return group, None, group
    timeout = timeout or group_timeout(group)
    world = [dist.get_global_rank(group or dist.group.WORLD, r) for r in range(dp_size)]
    blocks = [world[g * k : (g + 1) * k] for g in range(dp_size // k)]
    if k == dp_size:
        gather = _split(group, world, [world], timeout) if separate_gather else group
        return group, None, gather
    shard = _split(group, world, blocks, timeout)
    replica = _split(group, world, [world[r::k] for r in range(k)], timeout)
    gather = _split(group, world, blocks, timeout) if separate_gather else shard
    return shard, replica, gather


@dataclass(frozen=True)
class TwoLevel:
    """This rank's groups of a shard group in two levels ([Note: two-level groups] in
    `planning.plan`): `node`, the `node_size` ranks of its node in the shard group; `cross`, the
    ranks at its local index on every node of the shard group; `local`, its rank in `node`."""

    node: ProcessGroup
    cross: ProcessGroup
    node_size: int
    local: int


def make_levels(
    group: ProcessGroup | None, dp_size: int, k: int, node_size: int, timeout: timedelta | None
) -> TwoLevel:
    """This rank's two-level groups of its shard group (k consecutive ranks of `group`) in
    nodes of `node_size` consecutive ranks, `node_size` dividing k. Every rank of `group` calls
    this, in the same order ([Note: making groups])."""
    timeout = timeout or group_timeout(group)
    world = [dist.get_global_rank(group or dist.group.WORLD, r) for r in range(dp_size)]
    nodes = [world[i : i + node_size] for i in range(0, dp_size, node_size)]
    blocks = [world[g : g + k] for g in range(0, dp_size, k)]
    cross = [block[local::node_size] for block in blocks for local in range(node_size)]
    node_group = _split(group, world, nodes, timeout)
    cross_group = _split(group, world, cross, timeout)
    me = world.index(dist.get_rank())
    return TwoLevel(node_group, cross_group, node_size, me % node_size)


def _split(
    parent: ProcessGroup | None,
    parent_ranks: list[int],
    splits: list[list[int]],
    timeout: timedelta | None,
) -> ProcessGroup:
    """This rank's group among `splits`: disjoint lists of global ranks covering `parent`'s
    ranks `parent_ranks` ([Note: making groups])."""
    if len(parent_ranks) == dist.get_world_size():
        return dist.new_subgroups_by_enumeration(splits, timeout=timeout)[0]
    if comms_split_from_world():
        local = [[parent_ranks.index(r) for r in ranks] for ranks in splits]
        return dist.split_group(parent, local, timeout=timeout)
    me = dist.get_rank()
    mine = next(ranks for ranks in splits if me in ranks)
    return dist.new_group(mine, timeout=timeout, use_local_synchronization=True)


def gloo_group(group: ProcessGroup | None) -> ProcessGroup:
    """A gloo group over the ranks of `group` (None: the world), with `group`'s timeout: for
    collectives on host memory off the main thread (a background checkpoint write), which must
    not share a group with the training's. Only the ranks of `group` call it, in the same order
    ([Note: making groups]: a gloo group is never split from NCCL's communicators)."""
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    timeout = group_timeout(group)
    return dist.new_group(ranks, timeout=timeout, backend="gloo", use_local_synchronization=True)


def comms_split_from_world() -> bool:
    """Whether torch makes every new communicator by splitting the world's (NCCL initialised
    eagerly: a device bound to the default group), which every world rank must join."""
    return dist.distributed_c10d._get_default_group().bound_device_id is not None


def group_timeout(group: ProcessGroup | None) -> timedelta | None:
    """The collective timeout `group` (None: the default group) was created with, or None if
    this torch does not expose it."""
    pg = group or dist.group.WORLD
    for device in getattr(pg, "_device_types", ()):
        try:
            return pg._get_backend(device).options._timeout
        except (AttributeError, RuntimeError):
            continue
    return None


def resolve_group(group: ProcessGroup | None) -> tuple[ProcessGroup | None, int, int]:
    if group is not None:
        return group, dist.get_world_size(group), dist.get_rank(group)
    if dist.is_available() and dist.is_initialized():
        return None, dist.get_world_size(), dist.get_rank()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        raise RuntimeError(
            f"WORLD_SIZE={world} but torch.distributed is not initialised: call "
            f"torch.distributed.init_process_group(...) before wrapping the model in "
            f"wholeshard.DataParallel (or pass process_group=...)"
        )
    return None, 1, 0
