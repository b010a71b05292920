"""Who a storage unit syncs with (`CommGroups`): its shard group, replica group and gather
group, and with two-level groups the node and cross groups of each."""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed import ProcessGroup

from ..distributed.groups import TwoLevel
from ..planning.plan import shard_holder


@dataclass(frozen=True)
class CommGroups:
    """Who a storage unit syncs with: `size` ranks of `group` (the shard group), this one
    holding shard index `rank`; gradients are then summed across `replica_group` (shard groups)
    and divided by `divide_by`, params synced on `gather_group`. With two-level
    groups ([Note: two-level groups] in `planning.plan`), buckets reduce on `levels` and gather
    on `gather_levels` (the all-to-alls stay on the flat groups, peers by `group_rank`)."""

    group: ProcessGroup | None
    rank: int
    size: int
    gather_group: ProcessGroup | None
    replica_group: ProcessGroup | None = None
    divide_by: int = 0  # 0: the ranks the gradients are summed over (experts': dp x ep)
    levels: TwoLevel | None = None
    gather_levels: TwoLevel | None = None

    @property
    def reduce_on(self) -> ProcessGroup | TwoLevel | None:
        """Where buckets reduce-scatter: the two levels, or the shard group."""
        return self.levels or self.group

    @property
    def gather_on(self) -> ProcessGroup | TwoLevel | None:
        """Where buckets all-gather: the two levels, or the gather group."""
        return self.gather_levels or self.gather_group

    def group_rank(self, shard: int) -> int:
        """The rank of the shard group holding shard index `shard`."""
        if self.levels is None:
            return shard
        return shard_holder(shard, self.size, self.levels.node_size)
