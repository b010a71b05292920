"""The legacy ping-pong scheme, kept as a baseline: `ping_pong_buckets` builds its buckets.

Owners are dealt by numel in snake order over an unaligned buffer (no shard boundaries);
gradients are all-reduced; each rank's owned params are flattened into a staging buffer and
synced by one all-gather padded to the largest rank or by one broadcast per rank, then copied
out. Every rank issues the same collectives in the same order, whatever it owns.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from . import _collectives as collectives
from ._bucket import ALLGATHER, Comm, CommBucket, InFlight
from .planning import ParamSpec, Placement, plan_buffers


class PingPongBucket(CommBucket):
    """A bucket of the unaligned buffer: all-reduce for grads, a staging buffer for params."""

    def __init__(self, *args, owners: dict[str, int], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.owners = owners
        self._staging: torch.Tensor | None = None
        # _owned_in[rank]: the params rank owns in this bucket, in buffer order.
        self._owned_in: list[list[Placement]] = [[] for _ in range(self.comm.size)]
        for _, p in sorted(self.params, key=lambda item: item[1].start):
            self._owned_in[owners[p.name]].append(p)

    def owned_views(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._range(self.param, lo, hi), self._range(self.grad, lo, hi)

    def _reduce(self) -> InFlight:
        return InFlight([collectives.all_reduce_avg(self.grad, self.comm.group)])

    def _gather(self) -> InFlight:
        group, rank, size = self.comm.gather_group, self.comm.rank, self.comm.size
        sizes = [sum(p.numel for p in ps) for ps in self._owned_in]
        if self.comm.param_sync == ALLGATHER:  # equal sizes: pad every rank to the largest
            width = max(sizes)
            offsets = [r * width for r in range(size)]
            staging = self._staging_for(width * size)
            mine = staging[offsets[rank] : offsets[rank] + width]
            self._pack(self._owned_in[rank], mine)
            handles = [collectives.all_gather(staging, mine, group)]
        else:
            offsets = [sum(sizes[:r]) for r in range(size)]
            staging = self._staging_for(sum(sizes))
            self._pack(self._owned_in[rank], staging[offsets[rank] :])
            handles = [
                collectives.broadcast(staging[offsets[r] : offsets[r] + sizes[r]], r, group)
                for r in range(size)
                if sizes[r] > 0
            ]

        def unpack() -> None:
            for r, ps in enumerate(self._owned_in):
                if r != rank:
                    self._unpack(ps, staging[offsets[r] :])

        return InFlight(handles, unpack)

    def _staging_for(self, numel: int) -> torch.Tensor:
        if self._staging is None or self._staging.numel() != numel:
            # The param dtype, never the grad dtype: ranks must agree on byte sizes.
            self._staging = self.param.new_empty(numel)
        return self._staging

    def _pack(self, placements: list[Placement], out: torch.Tensor) -> None:
        offset = 0
        for p in placements:
            out[offset : offset + p.numel].copy_(self._local(self.param, p))
            offset += p.numel

    def _unpack(self, placements: list[Placement], src: torch.Tensor) -> None:
        offset = 0
        for p in placements:
            self._local(self.param, p).copy_(src[offset : offset + p.numel])
            offset += p.numel

    def drop_temporaries(self) -> None:
        self._staging = None


def ping_pong_buckets(
    specs: Sequence[ParamSpec],
    params: Sequence[nn.Parameter],
    comm: Comm,
    *,
    bucket_size: int | None,
    param_dtype: torch.dtype,
    grad_dtype: torch.dtype,
) -> tuple[list[PingPongBucket], dict[str, int]]:
    """The buckets of one unaligned buffer in backprop order, and every param's owner."""
    lay = plan_buffers(specs, comm.size, bucket_size=bucket_size, scheme="ping_pong").buffers[0]
    owners = {p.name: p.owner for p in lay.placements}
    members: list[list[tuple[nn.Parameter, Placement]]] = [[] for _ in lay.buckets]
    for param, p in zip(params, lay.placements, strict=True):
        members[p.bucket].append((param, p))
    buckets = [
        PingPongBucket(
            "mixed",
            (b,),
            members[b.index],
            comm,
            owners=owners,
            reshard=False,
            param_dtype=param_dtype,
            grad_dtype=grad_dtype,
        )
        for b in lay.buckets
    ]
    return buckets, owners
