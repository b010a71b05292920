"""The few collectives wholeshard issues, in one place, with per-torch-version fallbacks.

Every collective here moves equal-size per-rank chunks (what NCCL requires) and returns an
async work handle (or None when there is nothing to wait for).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, Work

# torch >= 2.13 names the flat (1-D concatenation) forms *_single and deprecates the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def reduce_scatter_avg(
    shard: torch.Tensor, full: torch.Tensor, group: ProcessGroup | None
) -> Work | None:
    """Average `full` over the group; this rank's chunk lands in `shard`, which must be a view
    of that chunk of `full`. The rest of `full` is left unspecified."""
    if dist.get_backend(group) == "gloo":
        # gloo implements reduce-scatter as a synchronous clone, an all-reduce and a copy; an
        # in-place all-reduce computes the same sums in about half the time (measured 85 -> 48
        # ms for 32 MB) and leaves the averaged chunk exactly where the shard view points.
        return dist.all_reduce(full, op=dist.ReduceOp.AVG, group=group, async_op=True)
    return _reduce_scatter(shard, full, op=dist.ReduceOp.AVG, group=group, async_op=True)


def all_gather(full: torch.Tensor, shard: torch.Tensor, group: ProcessGroup | None) -> Work | None:
    """Concatenate every rank's `shard` into `full` (`shard` may alias its own chunk of `full`)."""
    return _all_gather(full, shard, group=group, async_op=True)


def all_reduce_avg(tensor: torch.Tensor, group: ProcessGroup | None) -> Work | None:
    """Average `tensor` over the group in place."""
    return dist.all_reduce(tensor, op=dist.ReduceOp.AVG, group=group, async_op=True)


def broadcast(tensor: torch.Tensor, group_rank: int, group: ProcessGroup | None) -> Work | None:
    """Overwrite `tensor` on every rank with the copy of the rank `group_rank` of the group."""
    src = dist.get_global_rank(group or dist.group.WORLD, group_rank)
    return dist.broadcast(tensor, src=src, group=group, async_op=True)


def all_reduce(tensor: torch.Tensor, group: ProcessGroup | None, op=dist.ReduceOp.SUM) -> None:
    dist.all_reduce(tensor, op=op, group=group)


def broadcast_from_first(tensor: torch.Tensor, group: ProcessGroup | None) -> None:
    """Overwrite `tensor` on every rank with group rank 0's copy."""
    wait(broadcast(tensor, 0, group))


def wait(handle: Work | None) -> None:
    if handle is not None:
        handle.wait()
