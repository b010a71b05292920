"""Storage units: the flat param and grad tensors of one storage unit, and its collectives.

[Note: storage units]
A `StorageUnit` covers elements `[start, end)` of one planned buffer: one planned bucket, or
several where a stacked param runs across them (a param's `.data` is one view: see
`Buffer.storage_units`). Collectives run per planned bucket, by its sync scheme ([Note: sync
schemes] in `planning.sync`, run by `_sync`): equal shards by one reduce-scatter and one
all-gather, an owner bucket's by one coalesced group of reduces and one of broadcasts, one per
owner's shard; in each, every rank moves as many elements (NCCL needs it).

[Note: resharding]
Without resharding (ZeRO-1/2) the full `param` and `grad` tensors live for the whole run and
this rank's shards are views into them. With `reshard=True` (fully sharded) this rank keeps its
shards in the separate `param_shard` and `grad_shard` tensors, and the full tensors' storage
exists only from `start_gather` to `release_params` (params) and from the first gradient added
in to the end of the reduction (grads: [Note: kept gradients]). The `nn.Parameter` objects never
change: released, each param's `.data` (a DTensor's local tensor) is empty, and the full storage
is freed with `resize_(0)` and regrown in place, so the views autograd saved in forward see the
values in backward. An exchange unit also keeps whole copies of the matrices this rank owns,
their grads (and their params where the optimizer keeps masters) only through the step
([Note: owned copies]).

[Note: unit states]
What the params of a storage unit hold, as a `UnitState`:
- FRESH: every param's current value, readable;
- STALE: this rank's owned values are current (the optimizer wrote them), the others' are not;
- GATHERING: a param sync is in flight; nothing may read or write the params until it lands;
- RELEASED: the full storage is freed (fully sharded); params are empty until gathered.
Transitions: FRESH -> STALE (`mark_stale`, after an update); STALE or RELEASED -> GATHERING
(`start_gather`); GATHERING -> FRESH (`finish_gather`); FRESH or STALE -> RELEASED
(`release_params`, resharding only). Each method asserts the state it starts from.
"""

from __future__ import annotations

import enum

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import Work

from ..distributed import collectives
from ..distributed.dtensor import local, set_local
from ..planning import Bucket, Placement
from ..planning.sync import scheme_of
from . import _resize
from ._comm_groups import CommGroups
from ._kept_grads import KeptGrads
from ._owned_copies import OwnedCopies
from ._sync import InFlight, half_of


class UnitState(enum.Enum):
    """What a storage unit's params hold ([Note: unit states])."""

    FRESH = enum.auto()
    STALE = enum.auto()
    GATHERING = enum.auto()
    RELEASED = enum.auto()


class StorageUnit:
    """Storage and collectives of one storage unit ([Note: storage units]). `params` are the
    unit's params with their placements; each param's `.data` is a view of `param` (while
    gathered) and its gradient is added into the same range of `grad`."""

    index: int  # position in reduce (backprop) order among the model's storage units
    kind: str  # the buffer kind ("matrix", "stacked", "exchange", "adamw", or a layout's)
    buckets: tuple[Bucket, ...]  # the planned buckets the unit spans, in buffer order
    start: int  # first buffer element of the unit
    end: int  # one past its last
    params: list[tuple[nn.Parameter, Placement]]
    groups: CommGroups
    reshard: bool  # fully sharded ([Note: resharding])
    param: torch.Tensor  # 1D, [start, end) of the buffer (param dtype); freed while RELEASED
    grad: torch.Tensor  # 1D, the same range (grad-reduce dtype); freed when resharding
    param_shard: torch.Tensor | None  # 1D, this rank's shards of every bucket; resharding only
    grad_shard: torch.Tensor | None  # 1D, likewise
    owned_copies: OwnedCopies | None  # an exchange unit's owned matrices; resharding only
    # ([Note: owned copies]: grads, and params with masters, have storage only in a step)
    state: UnitState
    received: list[bool]  # per param: a gradient came this window (any backward), added or kept
    final: list[bool]  # per param: its gradient is final (received in a synchronising backward)
    n_final: int  # how many of `final` are True; `complete` once all are
    reducing: InFlight | None  # the reduction in flight
    gathering: InFlight | None  # the param sync in flight (state GATHERING)

    def __init__(
        self,
        index: int,
        kind: str,
        buckets: tuple[Bucket, ...],
        params: list[tuple[nn.Parameter, Placement]],
        groups: CommGroups,
        *,
        reshard: bool,
        param_dtype: torch.dtype,
        grad_dtype: torch.dtype,
    ) -> None:
        self.index = index
        self.kind = kind
        self.buckets = tuple(buckets)
        self.start, self.end = self.buckets[0].start, self.buckets[-1].end
        self.params = list(params)
        self.groups = groups
        self.reshard = reshard
        device = self.params[0][0].device
        numel = self.end - self.start
        self.param = torch.zeros(numel, dtype=param_dtype, device=device)
        # Resharding, the grads are materialised by the first gradient ([Note: resharding]).
        make = torch.empty if reshard else torch.zeros
        self.grad = make(numel, dtype=grad_dtype, device=device)
        self._param_views = [self._param_range(self.param, p).view(p.shape) for _, p in params]
        self._grad_views = [self._param_range(self.grad, p).view(p.shape) for _, p in params]
        if reshard:
            _resize.free(self.grad)
        for (param, _), view in zip(self.params, self._param_views, strict=True):
            view.copy_(local(param.detach()))
            set_local(param, view)
        # Where each bucket's shard of this rank starts in the shard tensors.
        self._shard_at = [0]
        for b in self.buckets[:-1]:
            self._shard_at.append(self._shard_at[-1] + b.shard_len(groups.rank))
        self.param_shard = self.grad_shard = None
        self.owned_copies = None
        if reshard and kind == "exchange":
            placements = (p for _, p in self.params)
            self.owned_copies = OwnedCopies(placements, groups.rank, self.param, self.grad)
        self._halves = [half_of(scheme_of(b)) for b in self.buckets]
        self._empty = torch.empty(0, dtype=param_dtype, device=device)
        self.open_window()
        self.reducing = self.gathering = None
        self.state = UnitState.FRESH

    # -- geometry ---------------------------------------------------------------------------
    def _elements(self, full: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """Buffer elements `[lo, hi)` of a full tensor of this unit."""
        return full[lo - self.start : hi - self.start]

    def _param_range(self, full: torch.Tensor, p: Placement) -> torch.Tensor:
        return self._elements(full, p.start, p.end)

    def _bucket_range(self, full: torch.Tensor, b: Bucket) -> torch.Tensor:
        return self._elements(full, b.start, b.end)

    def _shard_range(self, full: torch.Tensor, b: Bucket, rank: int) -> torch.Tensor:
        return self._elements(full, *b.shard(rank))

    def _own_shard(self, full: torch.Tensor, shard: torch.Tensor | None, i: int) -> torch.Tensor:
        """This rank's shard of bucket `i`: in the separate shard tensor when resharding."""
        b = self.buckets[i]
        if shard is None:
            return self._shard_range(full, b, self.groups.rank)
        return shard[self._shard_at[i] : self._shard_at[i] + b.shard_len(self.groups.rank)]

    def owned_views(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat (param, grad) views of buffer elements `[lo, hi)` that this rank owns: in its
        shard of one bucket (`held_views`), or, in an exchange unit, of a matrix it owns
        wherever it lies: in the full tensors, or fully sharded in its owned copies ([Note:
        owned copies] in `_owned_copies`), which get their storage back here if the step freed
        it (a view needs it; `free_owned` frees it again)."""
        if self.owned_copies is not None:
            views = self.owned_copies.views(lo, hi)
            if views is not None:
                return views
        elif self.kind == "exchange":
            return self._elements(self.param, lo, hi), self._elements(self.grad, lo, hi)
        return self.held_views(lo, hi)

    def owned_param(self, lo: int, hi: int) -> torch.Tensor:
        """The param view of `owned_views`, giving no grad copy storage."""
        if self.owned_copies is not None:
            view = self.owned_copies.param_view(lo, hi)
            if view is not None:
                return view
        return self.owned_views(lo, hi)[0]

    def free_owned(self) -> None:
        """Free the owned copies' storage that lives only through a step: the params went back
        to their holders, or the window was zeroed ([Note: owned copies])."""
        if self.owned_copies is not None:
            self.owned_copies.free()

    def held_views(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat (param, grad) views of buffer elements `[lo, hi)`, which lie in this rank's shard
        of one bucket: storage that persists between steps in every mode."""
        for i, b in enumerate(self.buckets):
            s_lo, s_hi = b.shard(self.groups.rank)
            if s_lo <= lo and hi <= s_hi:
                param = self._own_shard(self.param, self.param_shard, i)
                grad = self._own_shard(self.grad, self.grad_shard, i)
                return param[lo - s_lo : hi - s_lo], grad[lo - s_lo : hi - s_lo]
        raise AssertionError(f"[{lo}, {hi}) is not inside this rank's shard of one bucket")

    def persistent_bytes(self) -> tuple[int, int]:
        """(param, grad) bytes this unit holds between steps: fully sharded, its shards and
        the param copies of its owned matrices."""
        if self.param_shard is None or self.grad_shard is None:
            return self.param.nbytes, self.grad.nbytes
        param = self.owned_copies.nbytes() if self.owned_copies else 0
        return self.param_shard.nbytes + param, self.grad_shard.nbytes

    def full_bytes(self) -> int:
        """Bytes of the full param and grad tensors when materialised."""
        return self.param.nbytes + self.grad.nbytes

    # -- states ([Note: unit states]) -----------------------------------------------------

    def _expect(self, *states: UnitState) -> None:
        if self.state not in states:
            raise AssertionError(
                f"unit {self.index} is {self.state.name}, expected "
                f"{' or '.join(s.name for s in states)}"
            )

    def mark_stale(self) -> None:
        """The optimizer wrote this rank's owned values: the others are now out of date."""
        self._expect(UnitState.FRESH, UnitState.STALE, UnitState.RELEASED)
        if self.state is UnitState.FRESH:
            self.state = UnitState.STALE

    @property
    def params_materialised(self) -> bool:
        """Whether the full param storage exists (every state but RELEASED, in this class)."""
        return _resize.allocated(self.param)

    @property
    def readable(self) -> bool:
        """Whether every param holds its current full-precision value now."""
        return self.state is UnitState.FRESH and self.params_materialised

    # -- resharding ([Note: resharding]) ----------------------------------------------------

    def keep_shards(self) -> None:
        """Start resharding: keep this rank's shards and owned copies, then free the full ones."""
        if self.param_shard is not None:
            return
        numel = self._shard_at[-1] + self.buckets[-1].shard_len(self.groups.rank)
        self.param_shard = self.param.new_empty(numel)
        self.grad_shard = self.grad.new_zeros(numel)
        for i, b in enumerate(self.buckets):
            self._own_shard(self.param, self.param_shard, i).copy_(
                self._shard_range(self.param, b, self.groups.rank)
            )
        if self.owned_copies is not None:
            self.owned_copies.take(self.param, self.start)
        self.release_params()
        _resize.free(self.grad)

    def release_params(self) -> None:
        """Free the full param storage (resharding only); params become empty until gathered."""
        self._expect(UnitState.FRESH, UnitState.STALE, UnitState.RELEASED)
        if not self.reshard:
            return
        for param, _ in self.params:
            set_local(param, self._empty)
        _resize.free(self.param)
        self.state = UnitState.RELEASED

    def _materialise_grads(self) -> None:
        """Give the full grads storage (zeros), adding in the gradients kept."""
        if not _resize.allocated(self.grad):
            _resize.alloc(self.grad)
            self.grad.zero_()
        self.kept.add_into(self._grad_views)

    # -- gradients --------------------------------------------------------------------------

    @property
    def complete(self) -> bool:
        """Every param's gradient is final, so the unit may be reduced."""
        return self.n_final == len(self.params)

    def mark_final(self, i: int) -> None:
        """Mark `self.params[i]`'s gradient final for this accumulation window."""
        self.final[i] = True
        self.n_final += 1

    def open_window(self) -> None:
        """Open a new accumulation window: no gradient received, none final."""
        self.n_final = 0
        self.final = [False] * len(self.params)
        self.received = [False] * len(self.params)
        self.kept = KeptGrads()

    def accumulate(self, i: int, grad: torch.Tensor) -> None:
        """Add `grad` (a DTensor's: its local shard) into the grad range of `self.params[i]`, or
        keep it until the full grads have storage ([Note: kept gradients])."""
        grad, first = local(grad), not self.received[i]
        self.received[i] = True
        keepable = first and self.reshard and not _resize.allocated(self.grad)
        if keepable and self.kept.keep(i, grad, self.grad):
            return
        self._materialise_grads()
        self._grad_views[i].add_(grad)

    def start_reduce(self) -> None:
        """Dispatch the reduction: afterwards this rank's grad shards hold the averages."""
        if self.reducing is not None:
            raise AssertionError(f"unit {self.index}: a reduction is already in flight")
        self._materialise_grads()  # a unit that got no gradient reduces zeros
        self.reducing = self._reduce()
        self.reducing.what = f"grad sync (reduction) of unit {self.index}"

    def finish_reduce(self) -> None:
        if self.reducing is not None:
            self.reducing.wait()
            self.reducing = None
            if self.reshard:
                _resize.free(self.grad)

    def zero_grads(self) -> None:
        """Zero every gradient: the shards, and the full grads unless resharding frees them
        (owned grad copies are freed: every exchange overwrites them whole)."""
        if self.reducing is not None:
            raise AssertionError("never zero gradients under an in-flight reduction")
        self.open_window()
        self.free_owned()
        if self.grad_shard is not None:
            self.grad_shard.zero_()
            _resize.free(self.grad)
        else:
            self.grad.zero_()

    def _reduce(self) -> InFlight:
        """Reduce every bucket by its sync scheme (`planning.sync.unit_reduce` describes it),
        then sum across replicas; the average divides once, at the end ([Note: averaging])."""
        group, replicas = self.groups.reduce_on, self.groups.replica_group
        mine = [self._own_shard(self.grad, self.grad_shard, i) for i in range(len(self.buckets))]
        n = 1 if replicas is None else dist.get_world_size(replicas)
        total = self.groups.divide_by or self.groups.size * n
        stage1 = total if replicas is None else 1
        handles = []
        for out, b, half in zip(mine, self.buckets, self._halves, strict=True):
            handles.append(half.reduce(self._bucket_range(self.grad, b), out, b, group, stage1))
        if replicas is None:
            return InFlight(handles)
        mine = [m for m in mine if m.numel()]  # the replicas hold the same (empty) shards
        # The second stage reads the first's output, so it starts once that is done.
        return InFlight(
            handles, lambda: [collectives.all_reduce_sum(m, replicas, total) for m in mine]
        )

    # -- params -----------------------------------------------------------------------------

    def start_gather(self, full: bool = False) -> None:
        """Dispatch the param sync that restores every param of the unit from its owner.
        (`full`: the full-precision values even where a subclass syncs another form.)"""
        self._expect(UnitState.STALE, UnitState.RELEASED)
        if not _resize.allocated(self.param):
            _resize.alloc(self.param)
        self._dispatched(self._gather())

    def _dispatched(self, gathering: InFlight) -> None:
        gathering.what = f"param sync of unit {self.index}"
        self.gathering, self.state = gathering, UnitState.GATHERING

    def finish_gather(self) -> None:
        if self.gathering is not None:
            self.gathering.wait()
            self.gathering = None
            self._gathered()

    def _gathered(self) -> None:
        """A gather has landed: the params are up to date (resharding: point them at it)."""
        if self.reshard:
            self._point_params_at_full()
        self.state = UnitState.FRESH

    def _point_params_at_full(self) -> None:
        for (param, _), view in zip(self.params, self._param_views, strict=True):
            set_local(param, view)

    def _gather(self) -> InFlight:
        handles = []
        for i, b in enumerate(self.buckets):
            mine = self._own_shard(self.param, self.param_shard, i)
            handles += self._share(self.param, b, mine)
        return InFlight(handles)

    def _share(self, full: torch.Tensor, b: Bucket, mine: torch.Tensor) -> list[Work | None]:
        """Dispatch the sync of bucket `b` of `full` (a full tensor of this unit) by its sync
        scheme: `mine` (this rank's shard, which may alias its range of `full`) and the others'
        land in `full`."""
        half = half_of(scheme_of(b))
        group, rank = self.groups.gather_on, self.groups.rank
        return half.gather(self._bucket_range(full, b), mine, b, group, rank)

    def drop_temporaries(self) -> None:
        """Free temporary buffers a storage kind keeps between steps (none here)."""
