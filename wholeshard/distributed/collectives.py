"""The few collectives wholeshard issues, in one place, with per-torch-version fallbacks.

Every collective here moves equal-size per-rank chunks (what NCCL requires; a reduce or broadcast
moves one tensor of the same size on every rank) and returns an async work handle (or None when
there is nothing to wait for). An owner bucket's reduces, and its broadcasts, are issued as one
coalesced group ([Note: owner collectives]).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, Work
from torch.distributed.distributed_c10d import _coalescing_manager

# torch >= 2.13 names the flat (1-D concatenation) forms *_single and deprecates the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def reduce_scatter_sum(
    shard: torch.Tensor, full: torch.Tensor, group: ProcessGroup | None, divide_by: int = 1
) -> Work | _Finish | None:
    """Sum `full` over the group, then divide by `divide_by` (once, after the sum: [Note:
    averaging]); this rank's chunk of the result lands in `shard`, which is either a view of
    that chunk of `full` (in place) or a separate tensor of its size. The rest of `full` is left
    unspecified."""
    if dist.get_backend(group) == "gloo":
        # gloo implements reduce-scatter as a synchronous clone, an all-reduce and a copy; an
        # in-place all-reduce computes the same sums in about half the time (measured 85 -> 48
        # ms for 32 MB) and leaves the summed chunk where a shard view points.
        work = dist.all_reduce(full, group=group, async_op=True)
        chunk = full.chunk(dist.get_world_size(group))[dist.get_rank(group)]
        in_place = chunk.data_ptr() == shard.data_ptr()
        return _Finish(work, shard, None if in_place else chunk, divide_by)
    work = _reduce_scatter(shard, full, group=group, async_op=True)
    return _Finish(work, shard, None, divide_by) if divide_by != 1 else work


def reduce_to_owners(
    parts: Sequence[tuple[int, torch.Tensor]],
    group: ProcessGroup | None,
    divide_by: int = 1,
    out: torch.Tensor | None = None,
) -> Work | _Finish | _All | None:
    """Sum each `(group_rank, tensor)` of `parts` over the group onto that rank, as one
    coalesced group ([Note: owner collectives]); this rank's own part, if listed, is then
    divided by `divide_by` ([Note: averaging]) and, given `out` (a separate tensor of its size),
    copied there. The other parts are left unspecified; `out` is untouched unless listed.
    Every rank passes the same ranks and sizes, ranks ascending."""
    me = dist.get_rank(group)
    pg = group or dist.group.WORLD

    def reduce(rank: int, t: torch.Tensor) -> Work | None:
        dst = dist.get_global_rank(pg, rank)
        return dist.reduce(t, dst=dst, op=dist.ReduceOp.SUM, group=group, async_op=True)

    work = _coalesced([(reduce, part) for part in parts], pg)
    mine = [t for rank, t in parts if rank == me]
    in_place = not mine or out is None or out.data_ptr() == mine[0].data_ptr()
    if not mine or (in_place and divide_by == 1):
        return work
    return _Finish(work, mine[0] if in_place else out, None if in_place else mine[0], divide_by)


def broadcast_from_owners(
    parts: Sequence[tuple[int, torch.Tensor]], group: ProcessGroup | None
) -> Work | _All | None:
    """Overwrite each `(group_rank, tensor)` of `parts` on every rank with that rank's copy, as
    one coalesced group ([Note: owner collectives]). Every rank passes the same ranks and sizes,
    ranks ascending."""
    pg = group or dist.group.WORLD

    def broadcast_one(rank: int, t: torch.Tensor) -> Work | None:
        src = dist.get_global_rank(pg, rank)
        return dist.broadcast(t, src=src, group=group, async_op=True)

    return _coalesced([(broadcast_one, part) for part in parts], pg)


def _coalesced(
    calls: Sequence[tuple[Callable[[int, torch.Tensor], Work | None], tuple[int, torch.Tensor]]],
    group: ProcessGroup,
) -> Work | _All | None:
    """Issue `fn(rank, tensor)` for each call as one coalesced group where the backend coalesces
    (NCCL: one ncclGroupStart/End, one launch), else one after the other; one handle for all.

    [Note: owner collectives]
    An owner bucket's gradients go to each owner by a reduce of its shard, and its params back
    by a broadcast of it ([Note: owner buckets] in `planning.specs`); the reduces of one bucket,
    and its broadcasts, are issued as one coalesced group: on NCCL one launch per bucket and
    direction, whatever the number of owners, as torch itself issues an uneven reduce-scatter
    or all-gather (and `batch_isend_irecv`, whose mechanism this is). Each reduce is a ring (a
    pipelined chain) over the k ranks: per rank (k-1)/k of the bucket sent, the ring
    reduce-scatter's volume, summed in the ring's fixed order, in place (no receive buffer).
    An all-to-all of unreduced gradients (each rank sends every owner its range, the owner sums
    the k copies; or grouped point-to-point, the same exchange) was measured and rejected: an
    owner receives k copies of its shard, and owner buckets have 1-3 owners (their matrices are
    wider than an equal shard), so at the presets' dp 8-1024 the owner's link carries 8-1000
    times the ring's bytes per bucket, and a receive buffer bounded by the bucket would take
    3,200 to 5.2 million all-to-alls a step; on gloo at 4 ranks it took 1.7-3.2 times as long as
    these groups for 16-64 MB buckets, faster only at 1 MB (tools/measure_owner_sync.py). That
    holds of unreduced gradients only: after a reduce-scatter each element is summed, and an
    all-to-all of the reduced pieces to their owners moves each once (the exchange strategy,
    [Note: exchange buffers] in `planning._exchange`). gloo does not coalesce: there a group is
    its collectives one after the other, summed alike.
    """
    if not calls:
        return None
    device = calls[0][1][1].device
    if len(calls) > 1 and group._get_backend(device).supports_coalescing:
        with _coalescing_manager(group, device, async_ops=True) as cm:
            for fn, (rank, t) in calls:
                fn(rank, t)
        return _All(cm.works)
    return _All([fn(rank, t) for fn, (rank, t) in calls])


class _All:
    """One handle for several: `wait()` waits for each."""

    def __init__(self, works: Sequence[Work | None]) -> None:
        self.works = [w for w in works if w is not None]

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self) -> bool:
        for w in self.works:
            w.wait()
        return True


def all_reduce_sum(
    tensor: torch.Tensor, group: ProcessGroup | None, divide_by: int = 1
) -> Work | _Finish | None:
    """Sum `tensor` over the group in place, then divide by `divide_by` ([Note: averaging])."""
    work = dist.all_reduce(tensor, group=group, async_op=True)
    return _Finish(work, tensor, None, divide_by) if divide_by != 1 else work


def all_reduce_min(tensor: torch.Tensor, group: ProcessGroup | None) -> Work | None:
    """The elementwise minimum of `tensor` over the group, in place (async)."""
    return dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=group, async_op=True)


class _Finish:
    """A work handle whose `wait()` also puts the collective's output where it belongs (copies
    `src` to `dst`) and divides it by `divide_by`.

    [Note: averaging]
    Gradients are averaged as a SUM followed by one division of the sum (computed in fp32 for
    bf16 and rounded once), not with `ReduceOp.AVG`: NCCL's AVG multiplies every input by 1/N
    in the element type first, so a bf16 average at N = 3 is biased by bf16(1/3) * 3 - 1 =
    +0.2%, once per stage in hybrid mode. gloo's AVG is a sum and a division, so on gloo the
    two agree bit for bit; hybrid mode divides once, by the shard group size times the
    replicas, after both sums. The division runs after the wait, on the stream that waits.
    """

    def __init__(
        self, work: Work, dst: torch.Tensor, src: torch.Tensor | None, divide_by: int
    ) -> None:
        self.work, self.dst, self.src, self.divide_by = work, dst, src, divide_by

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def wait(self) -> bool:
        self.work.wait()
        if self.src is not None:
            self.dst.copy_(self.src)
        if self.divide_by != 1:
            self.dst.div_(self.divide_by)
        return True


class AllToAll:
    """An all-to-all in flight: `wait()` waits, then copies what arrived into the receiving
    views, in order."""

    def __init__(self, work: Work | None, got: torch.Tensor, into: Sequence[torch.Tensor]) -> None:
        self.work, self.got, self.into = work, got, into

    def is_completed(self) -> bool:
        return self.work is None or self.work.is_completed()

    def wait(self) -> bool:
        if self.work is not None:
            self.work.wait()
        at = 0
        for view in self.into:
            n = view.numel()
            view.copy_(self.got[at : at + n].view_as(view))
            at += n
        return True


def all_to_all(
    sends: Sequence[torch.Tensor],
    into: Sequence[torch.Tensor],
    send_splits: Sequence[int],
    recv_splits: Sequence[int],
    group: ProcessGroup | None,
    *,
    like: torch.Tensor,
) -> AllToAll:
    """Send `sends`, concatenated in order, `send_splits[r]` elements to each group rank r, and
    receive `recv_splits[r]` from each, written into `into` in order (`all_to_all_single` with
    split sizes; a rank's zero-size peers move nothing). Dtype and device: `like`'s. Every rank
    of the group calls it, whether or not it moves anything (its splits are all 0)."""
    flat = [t.reshape(-1) for t in sends]
    out = torch.cat(flat) if flat else like.new_empty(0)
    got = like.new_empty(sum(recv_splits))
    try:
        work = dist.all_to_all_single(
            got, out, list(recv_splits), list(send_splits), group=group, async_op=True
        )
    except (NotImplementedError, RuntimeError) as e:
        if "all_to_all" not in str(e).lower() and "alltoall" not in str(e).lower():
            raise
        raise RuntimeError(
            f"the {dist.get_backend(group)} process group has no all-to-all with split sizes "
            f"for {like.device.type} tensors, which strategy='exchange' needs: use a backend "
            f"that has one (NCCL on CUDA, gloo on CPU) or another strategy ('balanced', "
            f"'owners'). Backend error: {e}"
        ) from e
    return AllToAll(work, got, into)


def all_gather(full: torch.Tensor, shard: torch.Tensor, group: ProcessGroup | None) -> Work | None:
    """Concatenate every rank's `shard` into `full` (`shard` may alias its own chunk of `full`)."""
    return _all_gather(full, shard, group=group, async_op=True)


def broadcast(tensor: torch.Tensor, group_rank: int, group: ProcessGroup | None) -> Work | None:
    """Overwrite `tensor` on every rank with the copy of the rank `group_rank` of the group."""
    src = dist.get_global_rank(group or dist.group.WORLD, group_rank)
    return dist.broadcast(tensor, src=src, group=group, async_op=True)


def all_reduce(tensor: torch.Tensor, group: ProcessGroup | None, op=dist.ReduceOp.SUM) -> None:
    dist.all_reduce(tensor, op=op, group=group)


def broadcast_from_first(tensor: torch.Tensor, group: ProcessGroup | None) -> None:
    """Overwrite `tensor` on every rank with group rank 0's copy."""
    wait(broadcast(tensor, 0, group))


def wait(handle: Work | _Finish | None) -> None:
    if handle is not None:
        handle.wait()


class CollectiveError(RuntimeError):
    """A collective failed or timed out on this rank: most likely a peer rank died or stalled.

    [Note: dead peers]
    gloo reports a peer that died at once ("Connection closed by peer"); a peer that stalls
    (or died without closing its sockets, e.g. on another host) is reported when the process
    group's timeout expires. Either way the survivors raise this and exit; under torchrun that
    tears the job down. (NCCL's watchdog may abort the process at the timeout before a wait
    raises, with its own message naming the collective's sequence number.)
    """


@contextlib.contextmanager
def naming(what: str) -> Iterator[None]:
    """Re-raise a backend error inside as a `CollectiveError` that names `what`."""
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as e:  # gloo raises RuntimeError, NCCL DistBackendError (a subclass)
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise CollectiveError(
            f"{what} failed on rank {rank}: a peer rank likely died or stalled (its connection "
            f"closed, or it did not answer within the process group's timeout). Look for the "
            f"first error in the other ranks' logs. Backend error: {e}"
        ) from e
