"""Process groups of a `DataParallel`: the data-parallel group, shard and replica groups, and the
all-gather group."""

from __future__ import annotations

import os
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
    second group over the same ranks when `separate_gather`. Every rank creates the groups in
    the same order. New groups get `timeout`, or else `group`'s own (torch would give them its
    backend default, 30 minutes for gloo, whatever `init_process_group` was told).
    """
    if dp_size == 1:
        return group, None, group
    timeout = timeout or group_timeout(group)
    world = [dist.get_global_rank(group or dist.group.WORLD, r) for r in range(dp_size)]
    blocks = [world[g * k : (g + 1) * k] for g in range(dp_size // k)]
    if k == dp_size:
        shard, replica = group, None
        if separate_gather:
            gather = dist.new_group(world, timeout=timeout, use_local_synchronization=True)
        else:
            gather = group
        return shard, replica, gather
    shard, _ = dist.new_subgroups_by_enumeration(blocks, timeout=timeout)
    replica, _ = dist.new_subgroups_by_enumeration([world[r::k] for r in range(k)], timeout=timeout)
    gather = (
        dist.new_subgroups_by_enumeration(blocks, timeout=timeout)[0] if separate_gather else shard
    )
    return shard, replica, gather


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
