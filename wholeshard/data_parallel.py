"""`DataParallel`: whole-tensor sharded gradient and parameter sync for one module.

Step protocol (the optimizer drives it):
1. backward: each param's post-accumulate-grad hook adds its grad into the grad buffer;
2. `finish_grad_sync()`: one reduce-scatter (average) per bucket, so this rank's shard of the
   grad buffer holds the full averaged gradient of every param it owns;
3. the optimizer writes its owned params into the param buffer;
4. `finish_param_sync()`: one all-gather per bucket restores every param on every rank.
"""

from __future__ import annotations

import os
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


class DataParallel(nn.Module):
    """Wrap `module` (already on its device) for data-parallel training with whole-tensor owners.

    Every rank must build the same module; construction checks this and raises on every rank,
    naming the first difference. Rank 0's initial values are broadcast to all ranks.
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
    ) -> None:
        super().__init__()
        if not (param_dtype.is_floating_point and grad_reduce_dtype.is_floating_point):
            raise ValueError(
                f"param_dtype and grad_reduce_dtype must be floating point, got "
                f"{param_dtype} and {grad_reduce_dtype}"
            )
        self.module = module
        self.process_group, self.dp_size, self.rank = _resolve_group(process_group)
        self.routes: list[Route] = route_params(module, use_muon)
        if self.dp_size > 1:
            _check_same_model(self.routes, self.process_group)
        specs = [ParamSpec(r.name, tuple(r.param.shape), r.muon, r.tied) for r in self.routes]
        self.layout: Layout = plan_layout(specs, self.dp_size, bucket_size=bucket_size)
        device = self.routes[0].param.device
        self.buffers = FlatBuffers(
            self.layout,
            self.routes,
            param_dtype=param_dtype,
            grad_dtype=grad_reduce_dtype,
            device=device,
        )
        if self.dp_size > 1:
            collectives.broadcast_from_first(self.buffers.param, self.process_group)
            for buf in module.buffers():
                collectives.broadcast_from_first(buf, self.process_group)
        self._grad_handles: list[Work | None] | None = None
        self._param_handles: list[Work | None] | None = None
        self._hooks = [
            r.param.register_post_accumulate_grad_hook(self._make_grad_hook(p))
            for r, p in zip(self.routes, self.layout.placements, strict=True)
        ]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    # -- ownership ------------------------------------------------------------------------

    def owned(self) -> Iterator[tuple[Route, Placement]]:
        """(route, placement) of each param this rank owns, in registration order."""
        for route, placement in zip(self.routes, self.layout.placements, strict=True):
            if placement.owner == self.rank:
                yield route, placement

    # -- gradients ------------------------------------------------------------------------

    def _make_grad_hook(self, placement: Placement):
        grad_view = self.buffers.grad_view(placement)

        def hook(param: torch.Tensor) -> None:
            if self._grad_handles is not None:
                raise RuntimeError(
                    f"a gradient for {placement.name!r} arrived after this step's gradients "
                    f"were already reduced; call optimizer.zero_grad() before the next backward"
                )
            grad_view.add_(param.grad)
            param.grad = None

        return hook

    def start_grad_sync(self) -> None:
        """Dispatch every bucket's reduce-scatter (averaging) asynchronously; idempotent."""
        if self._grad_handles is not None:
            return
        with record_function("wholeshard.grad_sync.start"):
            self._grad_handles = [self._reduce_scatter(b) for b in self.layout.buckets]

    def finish_grad_sync(self) -> None:
        """Wait until this rank's grad shards hold the averaged gradients of its owned params."""
        self.start_grad_sync()
        with record_function("wholeshard.grad_sync.finish"):
            for h in self._grad_handles:
                collectives.wait(h)
            self._grad_handles = [None] * len(self._grad_handles)

    def _reduce_scatter(self, bucket) -> Work | None:
        if self.dp_size == 1:
            return None
        full = self.buffers.bucket(self.buffers.grad, bucket)
        shard = self.buffers.shard(self.buffers.grad, bucket, self.rank)
        return collectives.reduce_scatter_avg(shard, full, self.process_group)

    def zero_grad_buffer(self) -> None:
        """Zero every gradient and open the next accumulation window."""
        for h in self._grad_handles or ():
            collectives.wait(h)
        self.buffers.grad.zero_()
        for r in self.routes:
            r.param.grad = None
        self._grad_handles = None

    # -- parameters -----------------------------------------------------------------------

    def start_param_sync(self) -> None:
        """Dispatch every bucket's all-gather of the owners' updated params asynchronously."""
        self.finish_param_sync()
        if self.dp_size == 1:
            return
        with record_function("wholeshard.param_sync.start"):
            self._param_handles = [
                collectives.all_gather(
                    self.buffers.bucket(self.buffers.param, b),
                    self.buffers.shard(self.buffers.param, b, self.rank),
                    self.process_group,
                )
                for b in self.layout.buckets
            ]

    def finish_param_sync(self) -> None:
        """Wait for pending all-gathers: afterwards every rank holds every updated param."""
        if self._param_handles is None:
            return
        with record_function("wholeshard.param_sync.finish"):
            for h in self._param_handles:
                collectives.wait(h)
        self._param_handles = None


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
