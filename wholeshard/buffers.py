"""Flat param and grad storage for one planned buffer.

Invariant: every param placed in the buffer has its `.data` as a view of `FlatBuffers.param`,
and its gradient accumulates into the same range of `FlatBuffers.grad`. Collectives read and
write bucket and shard slices of these two tensors directly: no flatten/unflatten copies.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .layout import Bucket, Placement


class FlatBuffers:
    """One param buffer (`param_dtype`) and one grad buffer (`grad_dtype`) of `numel` elements."""

    def __init__(
        self,
        numel: int,
        placements: Sequence[Placement],
        params: Sequence[nn.Parameter],
        *,
        param_dtype: torch.dtype,
        grad_dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.param = torch.zeros(numel, dtype=param_dtype, device=device)
        self.grad = torch.zeros(numel, dtype=grad_dtype, device=device)
        for placement, param in zip(placements, params, strict=True):
            view = self.param_view(placement)
            view.copy_(param.detach())
            param.data = view

    def param_view(self, p: Placement) -> torch.Tensor:
        return self.param[p.start : p.end].view(p.shape)

    def grad_view(self, p: Placement) -> torch.Tensor:
        return self.grad[p.start : p.end].view(p.shape)

    def bucket(self, buf: torch.Tensor, b: Bucket) -> torch.Tensor:
        return buf[b.start : b.end]

    def shard(self, buf: torch.Tensor, b: Bucket, rank: int) -> torch.Tensor:
        lo, hi = b.shard(rank)
        return buf[lo:hi]
