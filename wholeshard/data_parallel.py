"""`DataParallel`: whole-tensor sharded gradient and parameter sync for one module.

Step protocol (the optimizer drives it; `wholeshard._schedule` decides when collectives run):
1. backward: each param's post-accumulate-grad hook adds its grad into its bucket's grad buffer;
   with `overlap_grad_reduce` a bucket whose params are all in starts its reduce-scatter;
2. `finish_grad_sync()`: every bucket reduced (averaged), so this rank's grad shards hold the
   full averaged gradient of every param it owns;
3. the optimizer writes its owned params (`owned()`: views of this rank's param shards);
4. `start_param_sync()`: each bucket's all-gather restores every param on every rank: all at
   once; with `overlap_param_gather` as the next forward reaches them; fully sharded
   (`reshard_after_forward=True`): before each module's forward and backward, released after.
With `pipelined_step` the optimizer does 2-4 bucket by bucket instead (`reduced_buckets()`):
each bucket is updated as soon as its reduction lands and gathered at once.

Buckets are `wholeshard._bucket.CommBucket`s; the legacy ping-pong baseline builds its own in
`wholeshard._ping_pong`. This file is longer than the others because it is the one public
wrapper: its constructor is a sequence of named steps over the machinery modules, and the step
protocol above reads best in one place.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed import ProcessGroup

from . import _collectives as collectives
from . import _guard as guard
from . import _hooks as hooks
from ._bucket import ALLGATHER, BROADCAST, Comm, CommBucket, aligned_buckets
from ._groups import check_same_model, make_groups, resolve_group
from ._ping_pong import ping_pong_buckets
from ._schedule import Scheduler
from .fp8 import _gather as fp8_gather
from .planning import (
    DEFAULT_STRATEGY,
    ParamSpec,
    Placement,
    Plan,
    default_bucket_size,
    plan_buffers,
)
from .routing import Route, UseMuon, route_params

ALIGNED, PING_PONG = "aligned", "ping_pong"


@dataclass(frozen=True)
class OwnedSlice:
    """Elements `[offset, offset + param.numel())` of a flattened param that this rank updates.

    `param` and `grad` are views of storage this rank keeps between steps: shaped like the param
    when the slice is the whole tensor, like one matrix when it is a matrix of a stacked param,
    1-D otherwise.
    """

    route: Route
    offset: int
    param: torch.Tensor
    grad: torch.Tensor
    bucket: int
    """Index of the bucket holding the slice in `DataParallel.buckets` (reduce order)."""


class StateHolder(Protocol):
    """What `DataParallel.memory` asks the optimizer attached to it."""

    def state_bytes(self) -> dict[str, int]: ...


class DataParallel(nn.Module):
    """Wrap `module` (already on its device) for data-parallel training with whole-tensor owners.

    Every rank must build the same module; construction checks this and raises on every rank,
    naming the first difference. Rank 0's initial values are broadcast to all ranks.
    Muon-routed params live in whole-tensor buffers; the others in element-wise sharded buffers.
    `bucket_size=None` takes `wholeshard.planning.default_bucket_size`. `reshard_after_forward=True`
    keeps only this rank's shards between steps (fully sharded); `separate_all_gather_group`
    puts param gathers on a second process group (None: on iff fully sharded or pipelined).
    `pipelined_step=True` makes the optimizer update each bucket as soon as its reduction lands
    and dispatch its gather at once (`reduced_buckets()`); the results are bitwise the same. The
    process groups it creates (shard, replica, all-gather) get `timeout`, or else
    `process_group`'s.
    `scheme="ping_pong"` and `param_sync="broadcast"` select the legacy baselines (`layout=` is
    the old spelling of `scheme=`, deprecated).
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        process_group: ProcessGroup | None = None,
        bucket_size: int | None = None,
        use_muon: UseMuon | None = None,
        param_dtype: torch.dtype = torch.float32,
        grad_reduce_dtype: torch.dtype = torch.float32,
        overlap_grad_reduce: bool = False,
        overlap_param_gather: bool = False,
        scheme: str = ALIGNED,
        param_sync: str = ALLGATHER,
        layout_strategy: str = DEFAULT_STRATEGY,
        shard_group_size: int | None = None,
        reshard_after_forward: bool = False,
        separate_all_gather_group: bool | None = None,
        fp8_param_gather: bool = False,
        pipelined_step: bool = False,
        timeout: timedelta | None = None,
        layout: str | None = None,
    ) -> None:
        super().__init__()
        if layout is not None:
            warnings.warn(
                "DataParallel(layout=...) is deprecated: pass scheme=... (same values)",
                DeprecationWarning,
                stacklevel=2,
            )
            scheme = layout
        _check_modes(param_dtype, grad_reduce_dtype, scheme, param_sync, reshard_after_forward)
        if fp8_param_gather and scheme == PING_PONG:
            raise ValueError("fp8_param_gather needs scheme='aligned' (ping_pong has no shards)")
        if fp8_param_gather and not fp8_gather.has_fp8_weights(module):
            raise ValueError(
                "fp8_param_gather=True but the model has no FP8 layers: convert it first with "
                "wholeshard.fp8.convert(model, recipe) (before wrapping)"
            )
        self.module = module
        self.overlap_grad_reduce = overlap_grad_reduce
        self.overlap_param_gather = overlap_param_gather
        self.pipelined_step = pipelined_step
        self.process_group, self.dp_size, self.rank = resolve_group(process_group)
        if scheme == PING_PONG and shard_group_size not in (None, self.dp_size):
            raise ValueError("scheme='ping_pong' has no shard groups: leave shard_group_size unset")
        self.routes: list[Route] = route_params(module, use_muon)
        self.frozen = _cast_frozen(module, param_dtype)
        problem = guard.placement_problem(module)
        if self.dp_size > 1:
            check_same_model(self.routes, self.process_group, problem)
        elif problem is not None:
            raise ValueError(f"cannot wrap the model: {problem}")
        specs = [ParamSpec(r.name, r.shape, r.muon, r.tied) for r in self.routes]
        if bucket_size is None:
            bucket_size = default_bucket_size(sum(s.numel for s in specs), self.dp_size)
        self.bucket_size = bucket_size

        self.plan: Plan | None = None
        self.fp8_param_gather = False
        self._owners: dict[str, int] = {}  # ping-pong only: the plan has no owners for it
        if scheme == ALIGNED:
            self.plan = plan_buffers(
                specs,
                self.dp_size,
                bucket_size=bucket_size,
                strategy=layout_strategy,
                shard_group_size=shard_group_size,
            )
            self.shard_group_size = self.plan.shard_group_size
            self.shard_rank = self.plan.shard_rank(self.rank)
        else:
            self.shard_group_size, self.shard_rank = self.dp_size, self.rank
        gathers = self.dp_size > 1 and self.shard_group_size > 1
        self.reshard_after_forward = reshard_after_forward and gathers
        if separate_all_gather_group is None:
            separate_all_gather_group = reshard_after_forward or pipelined_step
        self.shard_group, self.replica_group, self.gather_group = make_groups(
            self.process_group,
            self.dp_size,
            self.shard_group_size,
            separate_all_gather_group and gathers,
            timeout,
        )
        comm = Comm(
            self.shard_group,
            self.shard_rank,
            self.shard_group_size,
            self.gather_group,
            self.replica_group,
            param_sync,
        )
        dtypes = dict(param_dtype=param_dtype, grad_dtype=grad_reduce_dtype)
        built: Iterable[CommBucket]
        if self.plan is not None:
            self.fp8_param_gather = fp8_param_gather and gathers
            factory = fp8_gather.bucket_factory(module) if self.fp8_param_gather else None
            built = aligned_buckets(
                self.plan,
                self.routes,
                comm,
                reshard=self.reshard_after_forward,
                factory=factory,
                **dtypes,
            )
        else:
            params = [r.param for r in self.routes]
            built, self._owners = ping_pong_buckets(
                specs, params, comm, bucket_size=bucket_size, **dtypes
            )
        buckets = [self._settle(b) for b in built]
        if self.dp_size > 1:
            for t in [*self.frozen, *module.buffers()]:
                collectives.broadcast_from_first(t.data, self.process_group)

        reduce_order, forward_order = _orders(buckets, self.routes)
        position = {n: i for i, n in enumerate(reduce_order)}
        self.scheduler = Scheduler(
            [buckets[n] for n in reduce_order],
            [position[n] for n in forward_order],
            reduces=self.dp_size > 1,
            gathers=gathers,
            overlap_grad_reduce=overlap_grad_reduce,
            overlap_param_gather=overlap_param_gather,
            reshard=self.reshard_after_forward,
        )
        self._where = {p.name: (b, p) for b in buckets for _, p in b.params}
        self._hooks = [
            param.register_post_accumulate_grad_hook(self._grad_hook(b, i, p.name))
            for b in buckets
            for i, (param, p) in enumerate(b.params)
        ]
        bucket_of = {id(param): b for b in buckets for param, _ in b.params}
        if gathers and (overlap_param_gather or self.reshard_after_forward):
            self._hooks += hooks.register(
                self.scheduler, self.module, bucket_of, reshard=self.reshard_after_forward
            )
        if self.reshard_after_forward or self.fp8_param_gather:
            self._hooks += hooks.refuse_released_reads(self.module, bucket_of)
        self._optimizer: weakref.ref[StateHolder] | None = None
        self._signature = guard.ParamSignature(module)
        if self.fp8_param_gather:  # the first FP8 weights, before any forward
            self.scheduler.params_updated()
            self.scheduler.finish_param_sync()

    def _settle(self, bucket: CommBucket) -> CommBucket:
        """Give a new bucket rank 0's values and, fully sharded, keep only this rank's shards:
        buckets are settled one at a time, so one full bucket exists beside the model."""
        if self.dp_size > 1:
            collectives.broadcast_from_first(bucket.param, self.process_group)
        if bucket.reshard:
            bucket.keep_shards()
        return bucket

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @property
    def buckets(self) -> list[CommBucket]:
        """Communication buckets in reduce (backprop) order."""
        return self.scheduler.buckets

    @property
    def comm_wait_s(self) -> float:
        """Seconds blocked waiting on collectives since construction."""
        return self.scheduler.comm_wait_s

    # -- ownership ------------------------------------------------------------------------

    def owned(self) -> Iterator[OwnedSlice]:
        """What this rank updates, in registration order: whole params, whole matrices of
        stacked params, or flat slices of element-wise ones. Ownership comes from the plan."""
        pieces: dict[str, list[tuple[Placement, int, int, str]]] = {}
        for p, offset, length, kind in self._owned_ranges():
            pieces.setdefault(p.name, []).append((p, offset, length, kind))
        for route in self.routes:
            for p, offset, length, kind in pieces.get(route.name, ()):
                bucket = self._where[p.name][0]
                lo = p.start + offset
                param, grad = bucket.owned_views(lo, lo + length)
                if length == p.numel and kind != "adamw":
                    shape: tuple[int, ...] = p.shape
                elif kind == "stacked":
                    shape = p.shape[-2:]
                else:
                    shape = (length,)
                yield OwnedSlice(route, offset, param.view(shape), grad.view(shape), bucket.index)

    def _owned_ranges(self) -> Iterator[tuple[Placement, int, int, str]]:
        if self.plan is not None:
            for buffer in self.plan.buffers:
                for p, offset, length in buffer.owned(self.shard_rank):
                    yield p, offset, length, buffer.kind
            return
        for _, p in self._where.values():
            if self._owners[p.name] == self.rank:
                yield p, 0, p.numel, "mixed"

    # -- gradients ------------------------------------------------------------------------

    def _grad_hook(self, bucket: CommBucket, i: int, name: str):
        def hook(param: torch.Tensor) -> None:
            self.scheduler.grad_arrived(bucket, i, param, name)

        return hook

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the first backward after the block reduces them all."""
        previous, self.scheduler.sync_grads = self.scheduler.sync_grads, False
        try:
            yield
        finally:
            self.scheduler.sync_grads = previous

    def start_grad_sync(self) -> None:
        """Dispatch the reduction of every bucket not yet dispatched, in bucket order."""
        self.scheduler.start_grad_sync()

    def finish_grad_sync(self) -> None:
        """Wait until this rank's grad shards hold the averaged gradients of its owned params.

        Params that got no gradient this step count as zero: readiness is settled here.
        """
        self.scheduler.finish_grad_sync()

    def zero_grad_buffer(self) -> None:
        """Zero every gradient and open the next accumulation window."""
        self.scheduler.zero_grads()
        for r in self.routes:
            r.param.grad = None

    def reduced_buckets(self) -> Iterator[int]:
        """The pipelined step: yield each bucket's index (in `buckets`) once its grads are
        reduced; when the caller, having written its owned params, comes back, its param sync
        is dispatched. Every rank walks it to the end (`wholeshard._schedule.Scheduler`)."""
        return self.scheduler.reduced_in_order()

    # -- parameters -----------------------------------------------------------------------

    def start_param_sync(self) -> None:
        """Begin restoring every param from its owner (after the optimizer wrote its own).

        Synchronous mode dispatches every bucket; with `overlap_param_gather` only the first in
        forward order, the rest as the forward reaches them; fully sharded, nothing until the
        next forward (the buckets are released).
        """
        self.scheduler.params_updated()

    def finish_param_sync(self) -> None:
        """Complete every pending param sync: afterwards every param outside a released bucket
        is up to date (in ZeRO-1/2 mode: every param)."""
        self.scheduler.finish_param_sync()

    @contextlib.contextmanager
    def full_params(self) -> Iterator[None]:
        """Every param materialised and up to date on every rank inside the block, for reading
        outside a forward (comparisons, export, `model.state_dict()`). Fully sharded, what it
        gathered is released on exit (writes to params are not kept); otherwise it completes
        pending gathers. Every rank must enter it."""
        gathered = self.scheduler.gather_all()
        try:
            yield
        finally:
            self.scheduler.release(gathered)

    def free_overlap_buffers(self) -> None:
        """Wait for anything in flight, then drop temporary buffers and (fully sharded) full
        buckets. Safe to repeat; call it before a checkpoint save."""
        self.scheduler.finish_param_sync()
        for b in self.buckets:
            b.finish_reduce()
            b.drop_temporaries()
        if self.reshard_after_forward:
            self.scheduler.release_all()

    def model_changes(self) -> str | None:
        """What changed in the wrapped module's params since wrapping (a param frozen,
        unfrozen, replaced, added or removed), or None. `LayerwiseOptimizer.step` raises on
        every rank when any rank's answer is not None."""
        return self._signature.changes(self.module)

    # -- memory -----------------------------------------------------------------------------

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds between steps, by kind.

        `params` and `grads`: the bucket storage kept between steps (this rank's shards when
        fully sharded, the full buffers otherwise); `masters` and `optimizer_state`: from the
        attached `LayerwiseOptimizer` (0 without one); `frozen_params`: params outside the
        buffers; `transient_bucket`: the largest full param + grad bucket that exists only
        during forward and backward (0 unless fully sharded).
        """
        params = grads = 0
        for b in self.buckets:
            p, g = b.persistent_bytes()
            params, grads = params + p, grads + g
        out = {
            "params": params,
            "grads": grads,
            "masters": 0,
            "optimizer_state": 0,
            "frozen_params": sum(p.numel() * p.element_size() for p in self.frozen),
            "transient_bucket": max(b.full_bytes() for b in self.buckets)
            if self.reshard_after_forward
            else 0,
        }
        optimizer = self._optimizer() if self._optimizer is not None else None
        if optimizer is not None:
            out.update(optimizer.state_bytes())
        return out

    def attach_optimizer(self, optimizer: StateHolder) -> None:
        """Let `memory()` report `optimizer`'s masters and state (held by weak reference)."""
        self._optimizer = weakref.ref(optimizer)


def _check_modes(
    param_dtype: torch.dtype,
    grad_reduce_dtype: torch.dtype,
    scheme: str,
    param_sync: str,
    reshard_after_forward: bool,
) -> None:
    if not (param_dtype.is_floating_point and grad_reduce_dtype.is_floating_point):
        raise ValueError(
            f"param_dtype and grad_reduce_dtype must be floating point, got "
            f"{param_dtype} and {grad_reduce_dtype}"
        )
    if scheme not in (ALIGNED, PING_PONG):
        raise ValueError(f"scheme must be {ALIGNED!r} or {PING_PONG!r}, got {scheme!r}")
    if param_sync not in (ALLGATHER, BROADCAST):
        raise ValueError(f"param_sync must be {ALLGATHER!r} or {BROADCAST!r}, got {param_sync!r}")
    if scheme == PING_PONG and reshard_after_forward:
        raise ValueError(
            "scheme='ping_pong' cannot be fully sharded (its owners' params are not in "
            "equal shards): use the default scheme='aligned' with reshard_after_forward=True"
        )


def _orders(buckets: list[CommBucket], routes: list[Route]) -> tuple[list[int], list[int]]:
    """(reduce order, gather order) of `buckets`, as indices. Reduce order is backprop order:
    the bucket holding the latest-registered param first; gather order is forward order: the
    bucket holding the earliest-registered param first."""
    index = {r.name: i for i, r in enumerate(routes)}
    last = [max(index[p.name] for _, p in b.params) for b in buckets]
    first = [min(index[p.name] for _, p in b.params) for b in buckets]
    return (
        sorted(range(len(buckets)), key=lambda n: -last[n]),
        sorted(range(len(buckets)), key=lambda n: first[n]),
    )


def _cast_frozen(module: nn.Module, dtype: torch.dtype) -> list[nn.Parameter]:
    """Cast every floating-point param with `requires_grad=False` to `dtype` in place (same
    Parameter objects) and return them. Buffers keep their dtype, as with FSDP2's
    `MixedPrecisionPolicy`."""
    frozen = []
    for p in module.parameters():
        if not p.requires_grad:
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)
            frozen.append(p)
    return frozen
