"""`DataParallel`: whole-tensor sharded gradient and parameter sync for one module.

Step protocol (the optimizer drives it):
1. backward: each param's post-accumulate-grad hook adds its grad into the grad buffer; with
   `overlap_grad_reduce` a bucket whose params are all in starts its reduce-scatter right away;
2. `finish_grad_sync()`: every bucket reduced (averaged), so this rank's shard of the grad
   buffer holds the full averaged gradient of every param it owns;
3. the optimizer writes its owned params into the param buffer;
4. `start_param_sync()`: one all-gather per bucket restores every param on every rank. With
   `overlap_param_gather` only the first bucket (in forward order) is dispatched; each module's
   forward pre-hook waits for its params' buckets and prefetches the next one.

[Note: collective order]
Every rank issues the same collectives in the same order whatever it owns: grad buckets are
dispatched strictly in bucket order (a ready bucket waits for its predecessors), param buckets
strictly in forward order.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.profiler import record_function
from torch.distributed import ProcessGroup

from . import collectives
from .buffers import FlatBuffers
from .layout import Bucket, ParamSpec, Placement, plan_layout
from .plan import DEFAULT_STRATEGY, Buffer, Plan, plan_buffers
from .routing import Route, UseMuon, route_params
from .sync import ALLGATHER, BROADCAST, AlignedSync, Pending, PingPongSync

ALIGNED, PING_PONG = "aligned", "ping_pong"
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


@dataclass
class BufferState:
    """One planned flat buffer at run time: its storage and how its buckets sync.

    `plan` is the planned buffer (None for the ping-pong baseline, whose owners come from its
    sync scheme): the one source of what this rank owns.
    """

    kind: str  # "muon" (whole tensors), "stacked", "adamw" (element-wise) or "mixed" (ping-pong)
    buckets: tuple[Bucket, ...]
    placements: tuple[Placement, ...]
    flat: FlatBuffers
    sync: AlignedSync | PingPongSync
    plan: Buffer | None = None

    def owned(self, rank: int) -> Iterator[tuple[Placement, int, int]]:
        """(placement, offset, length) of every piece shard-group rank `rank` updates."""
        if self.plan is not None:
            yield from self.plan.owned(rank)
            return
        for p in self.placements:
            if self.sync.owners[p.name] == rank:
                yield p, 0, p.numel

    def buckets_of(self, placement: Placement) -> range:
        if self.plan is not None:
            return self.plan.buckets_of(placement)
        return range(placement.bucket, placement.bucket + 1)

    def views(self, p: Placement, offset: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(param, grad) views of a piece: shaped like the param when whole, like one matrix
        for a matrix of a stack, 1-D for an element-wise slice."""
        lo, hi = p.start + offset, p.start + offset + length
        if length == p.numel and self.kind != "adamw":
            shape: tuple[int, ...] = p.shape
        elif self.kind == "stacked":
            shape = p.shape[-2:]
        else:
            shape = (length,)
        return self.flat.param[lo:hi].view(shape), self.flat.grad[lo:hi].view(shape)


@dataclass(frozen=True)
class OwnedSlice:
    """Elements `[offset, offset + param.numel())` of a flattened param that this rank updates.

    `param` and `grad` are views of the flat buffers: shaped like the param when the slice is
    the whole tensor, like one matrix when it is a matrix of a stacked param, 1-D otherwise.
    """

    route: Route
    offset: int
    param: torch.Tensor
    grad: torch.Tensor


class DataParallel(nn.Module):
    """Wrap `module` (already on its device) for data-parallel training with whole-tensor owners.

    Every rank must build the same module; construction checks this and raises on every rank,
    naming the first difference. Rank 0's initial values are broadcast to all ranks.
    Muon-routed params live in whole-tensor buffers; the others in element-wise sharded buffers.
    `layout="ping_pong"` and `param_sync="broadcast"` select the legacy baselines.
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
        layout: str = ALIGNED,
        param_sync: str = ALLGATHER,
        layout_strategy: str = DEFAULT_STRATEGY,
        shard_group_size: int | None = None,
    ) -> None:
        super().__init__()
        if not (param_dtype.is_floating_point and grad_reduce_dtype.is_floating_point):
            raise ValueError(
                f"param_dtype and grad_reduce_dtype must be floating point, got "
                f"{param_dtype} and {grad_reduce_dtype}"
            )
        if layout not in (ALIGNED, PING_PONG):
            raise ValueError(f"layout must be {ALIGNED!r} or {PING_PONG!r}, got {layout!r}")
        if param_sync not in (ALLGATHER, BROADCAST):
            raise ValueError(
                f"param_sync must be {ALLGATHER!r} or {BROADCAST!r}, got {param_sync!r}"
            )
        self.module = module
        self.overlap_grad_reduce = overlap_grad_reduce
        self.overlap_param_gather = overlap_param_gather
        self.process_group, self.dp_size, self.rank = _resolve_group(process_group)
        if layout == PING_PONG and shard_group_size not in (None, self.dp_size):
            raise ValueError("layout='ping_pong' has no shard groups: leave shard_group_size unset")
        self.routes: list[Route] = route_params(module, use_muon)
        self.frozen = _cast_frozen(module, param_dtype)
        if self.dp_size > 1:
            _check_same_model(self.routes, self.process_group)
        specs = [ParamSpec(r.name, tuple(r.param.shape), r.muon, r.tied) for r in self.routes]
        route_of = {r.name: r for r in self.routes}
        device = self.routes[0].param.device

        def flat(numel: int, placements: tuple[Placement, ...]) -> FlatBuffers:
            params = [route_of[p.name].param for p in placements]
            return FlatBuffers(
                numel,
                placements,
                params,
                param_dtype=param_dtype,
                grad_dtype=grad_reduce_dtype,
                device=device,
            )

        self.plan: Plan | None = None
        self.buffers: list[BufferState] = []
        if layout == ALIGNED:
            self.plan = plan_buffers(
                specs,
                self.dp_size,
                bucket_size=bucket_size,
                strategy=layout_strategy,
                shard_group_size=shard_group_size,
            )
            self.shard_group_size = self.plan.shard_group_size
            self.shard_group, self.replica_group = _shard_groups(
                self.process_group, self.dp_size, self.shard_group_size
            )
            self.shard_rank = self.plan.shard_rank(self.rank)
            for b in self.plan.buffers:
                storage = flat(b.numel, b.placements)
                sync = AlignedSync(
                    storage,
                    b.buckets,
                    b.placements,
                    self.shard_group,
                    self.shard_rank,
                    self.shard_group_size,
                    param_sync,
                    replica_group=self.replica_group,
                )
                self.buffers.append(
                    BufferState(b.kind, b.buckets, b.placements, storage, sync, plan=b)
                )
        else:  # one unaligned buffer in backprop order; owners come from the snake rule
            lay = plan_layout(specs, 1, bucket_size=bucket_size, align=1)
            self.shard_group_size, self.shard_rank = self.dp_size, self.rank
            self.shard_group, self.replica_group = self.process_group, None
            storage = flat(lay.numel, lay.placements)
            sync = PingPongSync(
                storage,
                lay.buckets,
                lay.placements,
                self.process_group,
                self.rank,
                self.dp_size,
                param_sync,
            )
            self.buffers.append(BufferState("mixed", lay.buckets, lay.placements, storage, sync))
        if self.dp_size > 1:
            for state in self.buffers:
                collectives.broadcast_from_first(state.flat.param, self.process_group)
            for t in [*self.frozen, *module.buffers()]:
                collectives.broadcast_from_first(t.data, self.process_group)

        # Every bucket of every buffer gets one global id: grads are reduced in id order
        # (backprop order: the bucket holding the latest-registered param first) and params
        # gathered in forward order (the bucket holding the earliest-registered param first).
        # A stacked param spread over several buckets is a member of each.
        index = {r.name: i for i, r in enumerate(self.routes)}
        members: dict[tuple[int, int], list[int]] = {}
        self._where: dict[str, tuple[int, Placement]] = {}
        for i, state in enumerate(self.buffers):
            for p in state.placements:
                for b in state.buckets_of(p):
                    members.setdefault((i, b), []).append(index[p.name])
                self._where[p.name] = (i, p)
        order = sorted(members, key=lambda key: (-max(members[key]), key))
        self._buckets: list[tuple[int, Bucket]] = [
            (i, self.buffers[i].buckets[b]) for i, b in order
        ]
        self._bucket_id = {key: n for n, key in enumerate(order)}
        self._bucket_params = [len(members[key]) for key in order]
        self._forward_order = sorted(range(len(order)), key=lambda n: min(members[order[n]]))

        self.comm_wait_s = 0.0  # seconds blocked waiting on collectives since construction
        # gradient state of the current step
        self._sync_grads = True
        self._ready = [0] * len(self._buckets)
        self._grad_pending: list[Pending] = []  # one entry per dispatched bucket, in id order
        self._grads_reduced = False
        # param-gather state: buckets still to dispatch (forward order) and those in flight
        self._gather_todo: deque[int] = deque()
        self._gather_pending: dict[int, Pending] = {}

        self._hooks = [
            r.param.register_post_accumulate_grad_hook(self._make_grad_hook(r)) for r in self.routes
        ]
        if overlap_param_gather and self.dp_size > 1:
            self._hooks += self._register_forward_pre_hooks()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    # -- ownership ------------------------------------------------------------------------

    def owned(self) -> Iterator[OwnedSlice]:
        """What this rank updates, in registration order: whole params, whole matrices of
        stacked params, or flat slices of element-wise ones. Ownership comes from the plan
        alone (`BufferState.owned`)."""
        pieces: dict[str, list[tuple[BufferState, Placement, int, int]]] = {}
        for state in self.buffers:
            for p, offset, length in state.owned(self.shard_rank):
                pieces.setdefault(p.name, []).append((state, p, offset, length))
        for route in self.routes:
            for state, p, offset, length in pieces.get(route.name, ()):
                yield OwnedSlice(route, offset, *state.views(p, offset, length))

    def _bucket_ids(self, route: Route) -> list[int]:
        """Global ids of the buckets holding `route`'s param (several for a spread stack)."""
        i, p = self._where[route.name]
        return [self._bucket_id[(i, b)] for b in self.buffers[i].buckets_of(p)]

    # -- gradients ------------------------------------------------------------------------

    def _make_grad_hook(self, route: Route):
        i, placement = self._where[route.name]
        grad_view = self.buffers[i].flat.grad_view(placement)
        buckets = self._bucket_ids(route)
        first = min(buckets)

        def hook(param: torch.Tensor) -> None:
            if self._grads_reduced or first < len(self._grad_pending):
                raise RuntimeError(
                    f"a gradient for {placement.name!r} arrived after its bucket was reduced: "
                    f"call optimizer.zero_grad() before the next backward, and wrap all but the "
                    f"last micro-batch's backward in ddp.no_sync()"
                )
            grad_view.add_(param.grad)
            param.grad = None
            if self.overlap_grad_reduce and self._sync_grads and self.dp_size > 1:
                for bucket in buckets:
                    self._ready[bucket] += 1
                self._dispatch_ready_grads()

        return hook

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the first backward after the block reduces them all."""
        previous, self._sync_grads = self._sync_grads, False
        try:
            yield
        finally:
            self._sync_grads = previous

    def _dispatch_ready_grads(self) -> None:
        n = len(self._grad_pending)
        while n < len(self._ready) and self._ready[n] == self._bucket_params[n]:
            self._dispatch_grads(n)
            n += 1

    def _dispatch_grads(self, bucket: int) -> None:
        i, b = self._buckets[bucket]
        with record_function("wholeshard.grad_sync.start"):
            self._grad_pending.append(self.buffers[i].sync.reduce_grads(b))

    def start_grad_sync(self) -> None:
        """Dispatch the reduction of every bucket not yet dispatched, in bucket order."""
        if self.dp_size == 1:
            return
        for bucket in range(len(self._grad_pending), len(self._buckets)):
            self._dispatch_grads(bucket)

    def finish_grad_sync(self) -> None:
        """Wait until this rank's grad shards hold the averaged gradients of its owned params.

        Params that got no gradient this step count as zero: readiness is settled here.
        """
        if self._grads_reduced:
            return
        self.start_grad_sync()
        with record_function("wholeshard.grad_sync.finish"):
            for pending in self._grad_pending:
                self._wait(pending)
        self._grads_reduced = True

    def zero_grad_buffer(self) -> None:
        """Zero every gradient and open the next accumulation window."""
        for pending in self._grad_pending:  # never zero under an in-flight reduction
            self._wait(pending)
        for state in self.buffers:
            state.flat.grad.zero_()
        for r in self.routes:
            r.param.grad = None
        self._ready = [0] * len(self._ready)
        self._grad_pending = []
        self._grads_reduced = False

    # -- parameters -----------------------------------------------------------------------

    def start_param_sync(self) -> None:
        """Begin restoring every param from its owner (after the optimizer wrote its own).

        Synchronous mode dispatches every bucket; with `overlap_param_gather` only the first in
        forward order, the rest as the forward reaches them.
        """
        self.finish_param_sync()
        if self.dp_size == 1 or self.shard_group_size == 1:
            return
        self._gather_todo = deque(self._forward_order)
        self._dispatch_gather()
        while self._gather_todo and not self.overlap_param_gather:
            self._dispatch_gather()

    def finish_param_sync(self) -> None:
        """Complete every pending param sync: afterwards every rank holds every updated param."""
        while self._gather_todo:
            self._dispatch_gather()
        for bucket in list(self._gather_pending):
            self._wait_gather(bucket)

    def free_overlap_buffers(self) -> None:
        """Wait for anything in flight, then drop temporary gather buffers (safe to repeat)."""
        self.finish_param_sync()
        for pending in self._grad_pending:
            self._wait(pending)
        for state in self.buffers:
            state.sync.free()

    def _dispatch_gather(self) -> None:
        bucket = self._gather_todo.popleft()
        i, b = self._buckets[bucket]
        with record_function("wholeshard.param_sync.start"):
            self._gather_pending[bucket] = self.buffers[i].sync.gather_params(b)

    def _wait_gather(self, bucket: int) -> None:
        while bucket in self._gather_todo:  # keep the dispatch order identical on every rank
            self._dispatch_gather()
        pending = self._gather_pending.pop(bucket, None)
        if pending is not None:
            with record_function("wholeshard.param_sync.finish"):
                self._wait(pending)

    def _register_forward_pre_hooks(self) -> list:
        buckets_of = {id(r.param): self._bucket_ids(r) for r in self.routes}
        # A compiled module (`torch.compile(m)`, or `m.compile()`) runs its submodules' hooks
        # inside its graph, so it is a leaf: one hook, run eagerly, waits for all its params.
        # A container (ModuleList, ParameterList, ...) is never called: the params it holds
        # itself are used by the forward of its nearest callable ancestor, whose hook waits.
        from torch._dynamo.eval_frame import OptimizedModule

        params_of: dict[int, tuple[nn.Module, list[nn.Parameter]]] = {}
        seen: set[int] = set()
        todo: list[tuple[nn.Module, nn.Module]] = [(self.module, self.module)]
        while todo:
            mod, caller = todo.pop()
            if id(mod) in seen:
                continue
            seen.add(id(mod))
            compiled = (
                isinstance(mod, OptimizedModule)
                or getattr(mod, "_compiled_call_impl", None) is not None
            )
            if not isinstance(mod, _CONTAINERS):
                caller = mod
            params = mod.parameters() if compiled else mod._parameters.values()
            params_of.setdefault(id(caller), (caller, []))[1].extend(
                p for p in params if p is not None
            )
            if not compiled:
                todo.extend((child, caller) for child in reversed(list(mod.children())))
        handles = []
        for mod, params in params_of.values():
            buckets = sorted(
                {bucket for p in params if id(p) in buckets_of for bucket in buckets_of[id(p)]}
            )
            if buckets:
                handles.append(mod.register_forward_pre_hook(self._make_pre_hook(buckets)))
        return handles

    def _make_pre_hook(self, buckets: list[int]):
        # Waiting on a collective cannot be traced: under torch.compile the hook graph-breaks
        # and runs eagerly, and dynamo never guards on this engine's state.
        @torch.compiler.disable
        def pre_hook(module: nn.Module, args: Any) -> None:
            if not (self._gather_todo or self._gather_pending):
                return
            for bucket in buckets:
                self._wait_gather(bucket)
            if self._gather_todo:  # prefetch the next bucket in forward order
                self._dispatch_gather()

        return pre_hook

    def _wait(self, pending: Pending) -> None:
        start = time.perf_counter()
        for h in pending.handles:
            collectives.wait(h)
        if pending.then is not None:
            for h in pending.then() or ():
                collectives.wait(h)
            pending.then = None
        pending.handles = []
        self.comm_wait_s += time.perf_counter() - start


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


def _shard_groups(
    group: ProcessGroup | None, dp_size: int, k: int
) -> tuple[ProcessGroup | None, ProcessGroup | None]:
    """(this rank's shard group, its replica group): consecutive blocks of k ranks shard the
    params; ranks at the same position of every block replicate them. (group, None) if k = dp."""
    if k == dp_size:
        return group, None
    world = [dist.get_global_rank(group or dist.group.WORLD, r) for r in range(dp_size)]
    shard, _ = dist.new_subgroups_by_enumeration(
        [world[g * k : (g + 1) * k] for g in range(dp_size // k)]
    )
    replica, _ = dist.new_subgroups_by_enumeration([world[r::k] for r in range(k)])
    return shard, replica


def _resolve_group(group: ProcessGroup | None) -> tuple[ProcessGroup | None, int, int]:
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


def _check_same_model(routes: list[Route], group: ProcessGroup | None) -> None:
    """Raise on every rank, naming the first difference, if ranks built different models."""
    mine = [(r.name, tuple(r.param.shape), str(r.param.dtype), r.muon) for r in routes]
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    reference = everyone[0]
    for rank, theirs in enumerate(everyone[1:], start=1):
        if theirs == reference:
            continue
        for i in range(max(len(reference), len(theirs))):
            a = reference[i] if i < len(reference) else "<missing>"
            b = theirs[i] if i < len(theirs) else "<missing>"
            if a != b:
                raise RuntimeError(
                    f"ranks built different models: param #{i} is {a} on rank 0 but {b} on "
                    f"rank {rank} (fields: name, shape, dtype, routed to Muon). Build the same "
                    f"model with the same routing on every rank."
                )
