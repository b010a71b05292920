"""The executable half of each sync scheme: the collectives `planning.sync` describes for a
bucket, issued over `distributed.collectives` ([Note: sync schemes] in `planning.sync`).

Each half takes the bucket's range of a full tensor of its storage unit (`full`, buffer
elements `[b.start, b.end)`) and this rank's shard (`mine` or `out`: a view of its range of
`full`, or a separate tensor of its size when resharding) and returns the handles in flight.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor
from torch.distributed import ProcessGroup, Work

from ..distributed import collectives
from ..distributed.groups import TwoLevel
from ..planning import Bucket
from ..planning.sync import EQUAL_SHARDS, EXCHANGE, OWNERS, SyncScheme


@dataclass
class InFlight:
    """Collectives of one storage unit in flight: wait on every handle, then call `then`, which
    may start a second stage and return its handles (waited on too). A failure is raised as a
    `CollectiveError` naming `what` (set by the storage that dispatched them)."""

    handles: list[Work | None]
    then: Callable[[], list[Work | None] | None] | None = None
    what: str = "a collective"

    def wait(self) -> None:
        with collectives.naming(self.what):
            for h in self.handles:
                collectives.wait(h)
            if self.then is not None:
                for h in self.then() or ():
                    collectives.wait(h)


Group = ProcessGroup | TwoLevel | None
Reduce = Callable[[Tensor, Tensor, Bucket, Group, int], Any]
"""(full, out, bucket, shard group, divide_by) -> one handle: the sums of this rank's shard
land in `out`, divided by `divide_by` ([Note: averaging] in `distributed.collectives`)."""
Gather = Callable[[Tensor, Tensor, Bucket, Group, int], list[Any]]
"""(full, mine, bucket, gather group, shard index) -> handles: every shard lands in `full`."""


@dataclass(frozen=True)
class SyncHalf:
    """What the engine runs for one sync scheme: its `reduce` and its `gather`."""

    reduce: Reduce
    gather: Gather


def shard_views(full: Tensor, b: Bucket) -> list[tuple[int, Tensor]]:
    """(rank, view of `full`) of every non-empty shard of `b`."""
    return [(r, full[lo - b.start : hi - b.start]) for r, lo, hi in b.shards()]


def place_mine(full: Tensor, mine: Tensor, b: Bucket, rank: int) -> None:
    """Copy this rank's shard into its range of `full`, unless it is that range already."""
    lo, hi = b.shard(rank)
    own = full[lo - b.start : hi - b.start]
    if own.numel() and own.data_ptr() != mine.data_ptr():
        own.copy_(mine)


def reduce_scatter_half(full: Tensor, out: Tensor, b: Bucket, group: Group, divide_by: int) -> Any:
    return reduce_scatter_shards(out, full, group, divide_by)


def reduce_scatter_shards(out: Tensor, full: Tensor, group: Group, divide_by: int = 1) -> Any:
    """Sum `full` over the shard group; this rank's shard (by shard index) lands in `out` (a
    view of its range of `full`, or a separate tensor), divided by `divide_by`. In two levels
    ([Note: two-level groups] in `planning.plan`): within the node into this rank's chunk of
    `full`, then across nodes from that chunk; the second starts once the first has landed (on
    CUDA a stream's wait, not the host's)."""
    if not isinstance(group, TwoLevel):
        return collectives.reduce_scatter_sum(out, full, group, divide_by)
    chunk = full.chunk(group.node_size)[group.local]
    collectives.wait(collectives.reduce_scatter_sum(chunk, full, group.node))
    return collectives.reduce_scatter_sum(out, chunk, group.cross, divide_by)


def all_gather_shards(full: Tensor, mine: Tensor, group: Group) -> list[Any]:
    """Every rank's shard into `full`, in shard-index order (`mine`: this rank's, which may
    alias its range of `full`). In two levels, across nodes into this rank's chunk of `full`,
    then within the node."""
    if not isinstance(group, TwoLevel):
        return [collectives.all_gather(full, mine, group)]
    chunk = full.chunk(group.node_size)[group.local]
    collectives.wait(collectives.all_gather(chunk, mine, group.cross))
    return [collectives.all_gather(full, chunk, group.node)]


def _reduce_to_owners(full: Tensor, out: Tensor, b: Bucket, group: Group, divide_by: int) -> Any:
    return collectives.reduce_to_owners(shard_views(full, b), group, divide_by, out)


def _all_gather(full: Tensor, mine: Tensor, b: Bucket, group: Group, rank: int) -> list[Any]:
    return all_gather_shards(full, mine, group)


def _broadcast_from_owners(
    full: Tensor, mine: Tensor, b: Bucket, group: Group, rank: int
) -> list[Any]:
    place_mine(full, mine, b, rank)
    return [collectives.broadcast_from_owners(shard_views(full, b), group)]


HALVES = {
    EQUAL_SHARDS.name: SyncHalf(reduce_scatter_half, _all_gather),
    OWNERS.name: SyncHalf(_reduce_to_owners, _broadcast_from_owners),
    # The exchange to and from the owners is the step's, per batch of buckets (`_exchange`).
    EXCHANGE.name: SyncHalf(reduce_scatter_half, _all_gather),
}
"""Each sync scheme's executable half, by the scheme's name: the core's, and those of the
layouts an engine has loaded (`layouts.load`)."""


def half_of(scheme: SyncScheme) -> SyncHalf:
    """The executable half of `scheme`."""
    if scheme.name not in HALVES:
        raise ValueError(
            f"sync scheme {scheme.name!r} has no executable half (loaded: {sorted(HALVES)}); "
            f"build with the layout that names it (Variant(layout=...)), which loads it"
        )
    return HALVES[scheme.name]
