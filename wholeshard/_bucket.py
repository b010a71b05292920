"""One communication bucket: its storage, readiness, in-flight collectives, start and finish.

[Note: storage units]
A `CommBucket` covers elements `[start, end)` of one planned buffer: one planned bucket, or
several consecutive ones where a stacked param runs across them (a param's `.data` is one view,
so the planned buckets it spans share one storage unit: `Buffer.storage_units`). Each planned
bucket (a "part") is cut into `k` equal shards, one per rank of the shard group, and every
collective runs per part, so every rank moves the same number of elements (what NCCL needs).

[Note: resharding]
Without resharding (ZeRO-1/2) the full `param` and `grad` tensors live for the whole run and
this rank's shards are views into them. With `reshard=True` (fully sharded) this rank keeps its
shards in the separate `param_shard` and `grad_shard` tensors, and the full tensors' storage
exists only from `start_gather` to `release_params` (params) and from the first gradient to the
end of the reduction (grads). The `nn.Parameter` objects never change: while released, each
param's `.data` is an empty tensor, and the full storage is freed with `resize_(0)` and regrown
in place, so the views autograd saved during forward see the re-gathered values in backward.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed import ProcessGroup, Work

from . import _collectives as collectives
from .planning import Bucket, Placement, Plan
from .routing import Route

ALLGATHER, BROADCAST = "allgather", "broadcast"


@dataclass
class InFlight:
    """Collectives of one bucket in flight: wait on every handle, then call `then`, which may
    start a second stage and return its handles (waited on too)."""

    handles: list[Work | None]
    then: Callable[[], list[Work | None] | None] | None = None

    def done(self) -> bool:
        """Whether every handle has completed and no second stage is left (never blocks)."""
        return self.then is None and all(h is None or h.is_completed() for h in self.handles)

    def wait(self) -> None:
        for h in self.handles:
            collectives.wait(h)
        if self.then is not None:
            for h in self.then() or ():
                collectives.wait(h)


@dataclass(frozen=True)
class Comm:
    """Who a bucket syncs with: `size` ranks of `group`, this one being `rank`; gradients are
    then averaged across `replica_group` (shard groups), params gathered on `gather_group`."""

    group: ProcessGroup | None
    rank: int
    size: int
    gather_group: ProcessGroup | None
    replica_group: ProcessGroup | None = None
    param_sync: str = ALLGATHER


class CommBucket:
    """Storage and collectives of one communication bucket ([Note: storage units]).

    `params` are the bucket's params with their placements; each param's `.data` is a view of
    `param` (while gathered) and its gradient is added into the same range of `grad`. The state a
    step walks through: `arrived` counts gradients landed in the current backward, `reducing`
    and `gathering` hold in-flight collectives, `fresh` says `param` holds every param's current
    value (False after an optimizer update until the next gather, and while released).
    """

    def __init__(
        self,
        kind: str,
        parts: Sequence[Bucket],
        params: Sequence[tuple[nn.Parameter, Placement]],
        comm: Comm,
        *,
        reshard: bool,
        param_dtype: torch.dtype,
        grad_dtype: torch.dtype,
    ) -> None:
        self.index = -1  # position in reduce (backprop) order, set by the scheduler
        self.kind = kind
        self.parts = tuple(parts)
        self.start, self.end = self.parts[0].start, self.parts[-1].end
        self.params = list(params)
        self.comm = comm
        self.reshard = reshard
        device = self.params[0][0].device
        numel = self.end - self.start
        self.param = torch.zeros(numel, dtype=param_dtype, device=device)
        # Resharding, the grads are materialised by the first gradient ([Note: resharding]).
        make = torch.empty if reshard else torch.zeros
        self.grad = make(numel, dtype=grad_dtype, device=device)
        self._param_views = [self._local(self.param, p).view(p.shape) for _, p in self.params]
        self._grad_views = [self._local(self.grad, p).view(p.shape) for _, p in self.params]
        if reshard:
            _free(self.grad)
        for (param, _), view in zip(self.params, self._param_views, strict=True):
            view.copy_(param.detach())
            param.data = view
        # Where each part's shard of this rank starts in the shard tensors.
        self._shard_at = [0]
        for b in self.parts[:-1]:
            self._shard_at.append(self._shard_at[-1] + b.shard_numel)
        self.param_shard: torch.Tensor | None = None
        self.grad_shard: torch.Tensor | None = None
        self._empty = torch.empty(0, dtype=param_dtype, device=device)
        self.reset_arrivals()
        self.forward_left = 0  # modules holding this bucket's params yet to finish forward
        self.reducing: InFlight | None = None
        self.gathering: InFlight | None = None
        self.fresh = True

    # -- geometry ---------------------------------------------------------------------------

    def _range(self, full: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """Buffer elements `[lo, hi)` of a full bucket tensor."""
        return full[lo - self.start : hi - self.start]

    def _local(self, full: torch.Tensor, p: Placement) -> torch.Tensor:
        return self._range(full, p.start, p.end)

    def _part(self, full: torch.Tensor, b: Bucket) -> torch.Tensor:
        return self._range(full, b.start, b.end)

    def _slot(self, full: torch.Tensor, b: Bucket, rank: int) -> torch.Tensor:
        return self._range(full, *b.shard(rank))

    def _mine(self, full: torch.Tensor, shard: torch.Tensor | None, i: int) -> torch.Tensor:
        """This rank's shard of part `i`: in the separate shard tensor when resharding."""
        b = self.parts[i]
        if shard is None:
            return self._slot(full, b, self.comm.rank)
        return shard[self._shard_at[i] : self._shard_at[i] + b.shard_numel]

    def owned_views(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat (param, grad) views of buffer elements `[lo, hi)`, which lie in this rank's shard
        of one part: storage that persists between steps in every mode."""
        for i, b in enumerate(self.parts):
            s_lo, s_hi = b.shard(self.comm.rank)
            if s_lo <= lo and hi <= s_hi:
                param = self._mine(self.param, self.param_shard, i)
                grad = self._mine(self.grad, self.grad_shard, i)
                return param[lo - s_lo : hi - s_lo], grad[lo - s_lo : hi - s_lo]
        raise AssertionError(f"[{lo}, {hi}) is not inside this rank's shard of one part")

    def persistent_bytes(self) -> tuple[int, int]:
        """(param, grad) bytes this bucket holds between steps."""
        if self.param_shard is None:
            return _nbytes(self.param), _nbytes(self.grad)
        return _nbytes(self.param_shard), _nbytes(self.grad_shard)

    def full_bytes(self) -> int:
        """Bytes of the full param and grad tensors when materialised."""
        return _nbytes(self.param) + _nbytes(self.grad)

    # -- resharding ([Note: resharding]) ----------------------------------------------------

    def keep_shards(self) -> None:
        """Start resharding: copy this rank's shards out of the full tensors, then free them."""
        if self.param_shard is not None:
            return
        numel = self._shard_at[-1] + self.parts[-1].shard_numel
        self.param_shard = self.param.new_empty(numel)
        self.grad_shard = self.grad.new_zeros(numel)
        for i, b in enumerate(self.parts):
            self._mine(self.param, self.param_shard, i).copy_(
                self._slot(self.param, b, self.comm.rank)
            )
        self.release_params()
        _free(self.grad)

    @property
    def params_materialised(self) -> bool:
        return _allocated(self.param)

    @property
    def grads_materialised(self) -> bool:
        return _allocated(self.grad)

    def release_params(self) -> None:
        """Free the full param storage (resharding only); params become empty until gathered."""
        assert self.gathering is None, "finish the gather before releasing its storage"
        if not self.reshard:
            return
        for param, _ in self.params:
            param.data = self._empty
        _free(self.param)
        self.fresh = False

    def _materialise_grads(self) -> None:
        if not _allocated(self.grad):
            _alloc(self.grad)
            self.grad.zero_()

    # -- gradients --------------------------------------------------------------------------

    @property
    def complete(self) -> bool:
        """Every param's gradient has landed (counted in synchronising backwards only)."""
        return self.arrived == len(self.params)

    def land(self, i: int) -> None:
        """Count `self.params[i]`'s gradient as landed in this accumulation window."""
        self.landed[i] = True
        self.arrived += 1

    def reset_arrivals(self) -> None:
        """Open a new accumulation window: no gradient has landed."""
        self.arrived = 0
        self.landed = [False] * len(self.params)  # which params `arrived` counts

    def accumulate(self, i: int, grad: torch.Tensor) -> None:
        """Add `grad` into the grad range of `self.params[i]`."""
        self._materialise_grads()
        self._grad_views[i].add_(grad)

    def start_reduce(self) -> None:
        """Dispatch the reduction: afterwards this rank's grad shards hold the averages."""
        assert self.reducing is None
        self._materialise_grads()  # a bucket that got no gradient reduces zeros
        self.reducing = self._reduce()

    def finish_reduce(self) -> None:
        if self.reducing is None:
            return
        with collectives.naming(f"grad sync (reduction) of bucket {self.index}"):
            self.reducing.wait()
        self.reducing = None
        if self.reshard:
            _free(self.grad)

    def zero_grads(self) -> None:
        """Zero every gradient: the shards, and the full grads unless resharding frees them."""
        assert self.reducing is None, "never zero under an in-flight reduction"
        self.reset_arrivals()
        if self.grad_shard is not None:
            self.grad_shard.zero_()
            _free(self.grad)
        else:
            self.grad.zero_()

    def _reduce(self) -> InFlight:
        """Reduce-scatter every part (average over the group), then average across replicas."""
        group, replicas = self.comm.group, self.comm.replica_group
        mine = [self._mine(self.grad, self.grad_shard, i) for i in range(len(self.parts))]
        handles = [
            collectives.reduce_scatter_avg(out, self._part(self.grad, b), group)
            for out, b in zip(mine, self.parts, strict=True)
        ]
        if replicas is None:
            return InFlight(handles)
        # The second stage reads the reduce-scatter's output, so it starts once that is done.
        return InFlight(handles, lambda: [collectives.all_reduce_avg(m, replicas) for m in mine])

    # -- params -----------------------------------------------------------------------------

    def start_gather(self, full: bool = False) -> None:
        """Dispatch the param sync that restores every param of the bucket from its owner.
        (`full`: the full-precision values even where a subclass syncs another form.)"""
        assert self.gathering is None
        if self.reshard and not _allocated(self.param):
            _alloc(self.param)
        self.gathering = self._gather()

    def finish_gather(self) -> None:
        if self.gathering is None:
            return
        with collectives.naming(f"param sync ({self.comm.param_sync}) of bucket {self.index}"):
            self.gathering.wait()
        self.gathering = None
        self._gathered()

    def _gathered(self) -> None:
        """A gather has landed: the params are up to date (resharding: point them at it)."""
        if self.reshard:
            self._point_params_at_full()
        self.fresh = True

    def _point_params_at_full(self) -> None:
        for (param, _), view in zip(self.params, self._param_views, strict=True):
            param.data = view

    def _gather(self) -> InFlight:
        group, k, rank = self.comm.gather_group, self.comm.size, self.comm.rank
        handles = []
        for i, b in enumerate(self.parts):
            mine = self._mine(self.param, self.param_shard, i)
            if self.comm.param_sync == ALLGATHER:
                handles.append(collectives.all_gather(self._part(self.param, b), mine, group))
                continue
            own = self._slot(self.param, b, rank)
            if own.data_ptr() != mine.data_ptr():
                own.copy_(mine)
            handles += [
                collectives.broadcast(self._slot(self.param, b, r), r, group) for r in range(k)
            ]
        return InFlight(handles)

    def drop_temporaries(self) -> None:
        """Free temporary buffers a scheme keeps between steps (none here)."""


def aligned_buckets(
    plan: Plan,
    routes: list[Route],
    comm: Comm,
    *,
    reshard: bool,
    param_dtype: torch.dtype,
    grad_dtype: torch.dtype,
    factory: Callable[..., CommBucket] | None = None,
) -> Iterator[CommBucket]:
    """One bucket per storage unit of every planned buffer ([Note: storage units]), built as
    the caller asks for them."""
    param_of = {r.name: r.param for r in routes}
    for buffer in plan.buffers:
        units = buffer.storage_units()
        unit_of = {b: n for n, unit in enumerate(units) for b in unit}
        members: list[list[tuple[nn.Parameter, Placement]]] = [[] for _ in units]
        for p in buffer.placements:
            members[unit_of[p.bucket]].append((param_of[p.name], p))
        for unit, params in zip(units, members, strict=True):
            yield (factory or CommBucket)(
                buffer.kind,
                buffer.buckets[unit.start : unit.stop],
                params,
                comm,
                reshard=reshard,
                param_dtype=param_dtype,
                grad_dtype=grad_dtype,
            )


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _allocated(t: torch.Tensor) -> bool:
    return t.untyped_storage().size() > 0


def _alloc(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(t.numel() * t.element_size())


def _free(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(0)
