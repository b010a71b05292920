"""The engine half of the bench's baselines (`baselines`, which names them): the executable
halves of their sync schemes and the storage of the ping-pong baseline's unaligned buffer
([Note: unaligned buffers] in `baselines`).

Every rank holds every unaligned unit whole: gradients are all-reduced; each rank's owned params
are flattened into a staging buffer and synced by one all-gather padded to the largest rank or by
one broadcast per rank, then copied out. Every rank issues the same collectives in the same
order, whatever it owns.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..distributed import collectives
from ..engine.layouts import (
    InFlight,
    StorageUnit,
    SyncHalf,
    place_mine,
    reduce_scatter_half,
    shard_views,
)
from ..planning import Bucket, Placement


def _broadcast_each_shard(full: Tensor, mine: Tensor, b: Bucket, group: Any, rank: int) -> list:
    place_mine(full, mine, b, rank)
    return [collectives.broadcast(t, r, group) for r, t in shard_views(full, b)]


def _all_reduce(full: Tensor, out: Tensor, b: Bucket, group: Any, divide_by: int) -> Any:
    return collectives.all_reduce_sum(full, group, divide_by)


def _by_the_unit(full: Tensor, mine: Tensor, b: Bucket, group: Any, rank: int) -> list:
    raise AssertionError(
        f"an unaligned bucket is gathered by its storage unit ({UnalignedStorage.__name__}), "
        "every owner's params at once, never bucket by bucket"
    )


class UnalignedStorage(StorageUnit):
    """A storage unit of the unaligned buffer: all-reduce for grads, a staging buffer for params
    gathered by one padded all-gather ([Note: unaligned buffers] in `baselines`)."""

    broadcast = False  # gather by one broadcast per owning rank instead

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._staging: torch.Tensor | None = None
        # _owned_in[rank]: the params rank owns in this unit, in buffer order.
        self._owned_in: list[list[Placement]] = [[] for _ in range(self.groups.size)]
        for _, p in sorted(self.params, key=lambda item: item[1].start):
            self._owned_in[p.owner].append(p)

    def owned_views(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._elements(self.param, lo, hi), self._elements(self.grad, lo, hi)

    def _gather(self) -> InFlight:
        group, rank, size = self.groups.gather_group, self.groups.rank, self.groups.size
        sizes = [sum(p.numel for p in ps) for ps in self._owned_in]
        if not self.broadcast:  # equal sizes: pad every rank to the largest
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
            out[offset : offset + p.numel].copy_(self._param_range(self.param, p))
            offset += p.numel

    def _unpack(self, placements: list[Placement], src: torch.Tensor) -> None:
        offset = 0
        for p in placements:
            self._param_range(self.param, p).copy_(src[offset : offset + p.numel])
            offset += p.numel

    def drop_temporaries(self) -> None:
        self._staging = None


class UnalignedBroadcastStorage(UnalignedStorage):
    """`UnalignedStorage` gathering by one broadcast per owning rank."""

    broadcast = True


SHARD_BROADCASTS = SyncHalf(reduce_scatter_half, _broadcast_each_shard)
"""The executable half of `baselines.SHARD_BROADCASTS`."""
UNALIGNED = SyncHalf(_all_reduce, _by_the_unit)
"""The executable half of both ping-pong schemes (their gather is the storage unit's)."""
