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
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.profiler import record_function
from torch.distributed import ProcessGroup, Work

from . import collectives
from .buffers import FlatBuffers
from .layout import Layout, ParamSpec, Placement, plan_layout
from .routing import Route, UseMuon, route_params
from .sync import ALLGATHER, BROADCAST, AlignedSync, PendingGather, PingPongSync

ALIGNED, PING_PONG = "aligned", "ping_pong"


class DataParallel(nn.Module):
    """Wrap `module` (already on its device) for data-parallel training with whole-tensor owners.

    Every rank must build the same module; construction checks this and raises on every rank,
    naming the first difference. Rank 0's initial values are broadcast to all ranks.
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
        self.routes: list[Route] = route_params(module, use_muon)
        if self.dp_size > 1:
            _check_same_model(self.routes, self.process_group)
        specs = [ParamSpec(r.name, tuple(r.param.shape), r.muon, r.tied) for r in self.routes]
        if layout == ALIGNED:
            self.layout: Layout = plan_layout(specs, self.dp_size, bucket_size=bucket_size)
        else:  # one unaligned buffer in backprop order; owners come from the snake rule
            self.layout = plan_layout(specs, 1, bucket_size=bucket_size, align=1)
        self.buffers = FlatBuffers(
            self.layout,
            self.routes,
            param_dtype=param_dtype,
            grad_dtype=grad_reduce_dtype,
            device=self.routes[0].param.device,
        )
        scheme = AlignedSync if layout == ALIGNED else PingPongSync
        self._sync = scheme(
            self.buffers, self.layout, self.process_group, self.rank, self.dp_size, param_sync
        )
        if self.dp_size > 1:
            collectives.broadcast_from_first(self.buffers.param, self.process_group)
            for buf in module.buffers():
                collectives.broadcast_from_first(buf, self.process_group)

        buckets = self.layout.buckets
        self._bucket_size = [0] * len(buckets)
        for p in self.layout.placements:
            self._bucket_size[p.bucket] += 1
        self.comm_wait_s = 0.0  # seconds blocked waiting on collectives since construction
        # gradient state of the current step
        self._sync_grads = True
        self._ready = [0] * len(buckets)
        self._grad_handles: list[list[Work | None]] = []  # one entry per dispatched bucket
        self._grads_reduced = False
        # param-gather state: buckets still to dispatch (forward order) and those in flight
        first_use: dict[int, None] = {}
        for p in self.layout.placements:
            first_use.setdefault(p.bucket, None)
        self._forward_order = list(first_use)
        self._gather_todo: deque[int] = deque()
        self._gather_pending: dict[int, PendingGather] = {}

        self._hooks = [
            r.param.register_post_accumulate_grad_hook(self._make_grad_hook(p))
            for r, p in zip(self.routes, self.layout.placements, strict=True)
        ]
        if overlap_param_gather and self.dp_size > 1:
            self._hooks += self._register_forward_pre_hooks()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    # -- ownership ------------------------------------------------------------------------

    @property
    def owners(self) -> dict[str, int]:
        """The rank that updates each param (one source: the layout's sync scheme)."""
        return self._sync.owners

    def owned(self) -> Iterator[tuple[Route, Placement]]:
        """(route, placement) of each param this rank owns, in registration order."""
        owners = self._sync.owners
        for route, placement in zip(self.routes, self.layout.placements, strict=True):
            if owners[placement.name] == self.rank:
                yield route, placement

    # -- gradients ------------------------------------------------------------------------

    def _make_grad_hook(self, placement: Placement):
        grad_view = self.buffers.grad_view(placement)
        bucket = placement.bucket

        def hook(param: torch.Tensor) -> None:
            if self._grads_reduced or bucket < len(self._grad_handles):
                raise RuntimeError(
                    f"a gradient for {placement.name!r} arrived after its bucket was reduced: "
                    f"call optimizer.zero_grad() before the next backward, and wrap all but the "
                    f"last micro-batch's backward in ddp.no_sync()"
                )
            grad_view.add_(param.grad)
            param.grad = None
            if self.overlap_grad_reduce and self._sync_grads and self.dp_size > 1:
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
        n = len(self._grad_handles)
        while n < len(self._ready) and self._ready[n] == self._bucket_size[n]:
            self._dispatch_grads(n)
            n += 1

    def _dispatch_grads(self, bucket: int) -> None:
        with record_function("wholeshard.grad_sync.start"):
            self._grad_handles.append(self._sync.reduce_grads(self.layout.buckets[bucket]))

    def start_grad_sync(self) -> None:
        """Dispatch the reduction of every bucket not yet dispatched, in bucket order."""
        if self.dp_size == 1:
            return
        for bucket in range(len(self._grad_handles), len(self.layout.buckets)):
            self._dispatch_grads(bucket)

    def finish_grad_sync(self) -> None:
        """Wait until this rank's grad shards hold the averaged gradients of its owned params.

        Params that got no gradient this step count as zero: readiness is settled here.
        """
        if self._grads_reduced:
            return
        self.start_grad_sync()
        with record_function("wholeshard.grad_sync.finish"):
            for handles in self._grad_handles:
                self._wait(handles)
        self._grads_reduced = True

    def zero_grad_buffer(self) -> None:
        """Zero every gradient and open the next accumulation window."""
        for handles in self._grad_handles:  # never zero under an in-flight reduction
            self._wait(handles)
        self.buffers.grad.zero_()
        for r in self.routes:
            r.param.grad = None
        self._ready = [0] * len(self._ready)
        self._grad_handles = []
        self._grads_reduced = False

    # -- parameters -----------------------------------------------------------------------

    def start_param_sync(self) -> None:
        """Begin restoring every param from its owner (after the optimizer wrote its own).

        Synchronous mode dispatches every bucket; with `overlap_param_gather` only the first in
        forward order, the rest as the forward reaches them.
        """
        self.finish_param_sync()
        if self.dp_size == 1:
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
        for handles in self._grad_handles:
            self._wait(handles)
        self._sync.free()

    def _dispatch_gather(self) -> None:
        bucket = self._gather_todo.popleft()
        with record_function("wholeshard.param_sync.start"):
            self._gather_pending[bucket] = self._sync.gather_params(self.layout.buckets[bucket])

    def _wait_gather(self, bucket: int) -> None:
        while bucket in self._gather_todo:  # keep the dispatch order identical on every rank
            self._dispatch_gather()
        pending = self._gather_pending.pop(bucket, None)
        if pending is None:
            return
        with record_function("wholeshard.param_sync.finish"):
            self._wait(pending.handles)
            if pending.unpack is not None:
                pending.unpack()

    def _register_forward_pre_hooks(self) -> list:
        bucket_of = {p.name: p.bucket for p in self.layout.placements}
        routed = {id(r.param): bucket_of[r.name] for r in self.routes}
        handles = []
        for mod in self.module.modules():
            buckets = sorted(
                {
                    routed[id(p)]
                    for p in mod._parameters.values()
                    if p is not None and id(p) in routed
                }
            )
            if buckets:
                handles.append(mod.register_forward_pre_hook(self._make_pre_hook(buckets)))
        return handles

    def _make_pre_hook(self, buckets: list[int]):
        def pre_hook(module: nn.Module, args: Any) -> None:
            if not (self._gather_todo or self._gather_pending):
                return
            for bucket in buckets:
                self._wait_gather(bucket)
            if self._gather_todo:  # prefetch the next bucket in forward order
                self._dispatch_gather()

        return pre_hook

    def _wait(self, handles: list[Work | None]) -> None:
        start = time.perf_counter()
        for h in handles:
            collectives.wait(h)
        self.comm_wait_s += time.perf_counter() - start


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
