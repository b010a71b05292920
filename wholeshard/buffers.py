"""Flat param and grad storage built from a layout.

Invariant: every routed param's `.data` is a view of `FlatBuffers.param`, and its gradient
accumulates into the same range of `FlatBuffers.grad`. Collectives read and write bucket and
shard slices of these two tensors directly: no flatten/unflatten copies.
"""

from __future__ import annotations

import torch

from .layout import Bucket, Layout, Placement
from .routing import Route


class FlatBuffers:
    """One param buffer (`param_dtype`) and one grad buffer (`grad_dtype`) for `layout`."""

    def __init__(
        self,
        layout: Layout,
        routes: list[Route],
        *,
        param_dtype: torch.dtype,
        grad_dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.layout = layout
        self.param = torch.zeros(layout.numel, dtype=param_dtype, device=device)
        self.grad = torch.zeros(layout.numel, dtype=grad_dtype, device=device)
        for route, placement in zip(routes, layout.placements, strict=True):
            assert route.name == placement.name, (route.name, placement.name)
            view = self.param_view(placement)
            view.copy_(route.param.detach())
            route.param.data = view

    def param_view(self, p: Placement) -> torch.Tensor:
        return self.param[p.start : p.end].view(p.shape)

    def grad_view(self, p: Placement) -> torch.Tensor:
        return self.grad[p.start : p.end].view(p.shape)

    def bucket(self, buf: torch.Tensor, b: Bucket) -> torch.Tensor:
        return buf[b.start : b.end]

    def shard(self, buf: torch.Tensor, b: Bucket, rank: int) -> torch.Tensor:
        lo, hi = b.shard(rank)
        return buf[lo:hi]
