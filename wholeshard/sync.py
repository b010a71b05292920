"""How one bucket's gradients are reduced and its params gathered, per ownership scheme.

- `AlignedSync` (the default): buckets are cut into equal shards, one per rank of the shard
  group; a reduce-scatter hands each rank the averaged gradient of its shard and the param
  all-gather runs in place on the param buffer. Nothing is staged or copied. In whole-tensor
  (Muon) buffers every param lies inside its owner's shard; in element-wise (AdamW) buffers a
  rank owns whatever part of a param falls in its shard. With shard groups smaller than the
  data-parallel group, the reduced shard is then averaged across the replica group.
- `PingPongSync` (the legacy scheme, kept as a baseline): owners assigned by numel in snake
  order over an unaligned buffer; gradients are all-reduced; each rank's owned params are
  flattened into a staging buffer and synced by one all-gather padded to the largest rank or by
  one broadcast per rank, then copied out.

Both issue the same collectives in the same order on every rank, whatever a rank owns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.distributed import ProcessGroup, Work

from . import collectives
from .buffers import FlatBuffers
from .layout import Bucket, Placement

ALLGATHER, BROADCAST = "allgather", "broadcast"


@dataclass
class Pending:
    """Dispatched collectives of one bucket: wait on every handle, then call `then`, which may
    dispatch a second stage and return its handles (to wait on too)."""

    handles: list[Work | None]
    then: Callable[[], list[Work | None] | None] | None = None


@dataclass
class _Scheme:
    """Sync of one flat buffer among the `dp_size` ranks of `group` (this rank is `rank`)."""

    buffers: FlatBuffers
    buckets: tuple[Bucket, ...]
    placements: tuple[Placement, ...]
    group: ProcessGroup | None
    rank: int
    dp_size: int
    param_sync: str
    replica_group: ProcessGroup | None = None  # ranks holding the same shard, if any
    owners: dict[str, int | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Subclasses fill `owners` (the generated __init__ calls this only if the base has it)."""

    def free(self) -> None:
        """Drop temporary buffers (none by default)."""


class AlignedSync(_Scheme):
    """Reduce-scatter grads, all-gather (or per-rank broadcast) params, all in place."""

    def __post_init__(self) -> None:
        self.owners = {p.name: p.owner for p in self.placements}

    def reduce_grads(self, b: Bucket) -> Pending:
        grad = self.buffers.grad
        full, mine = self.buffers.bucket(grad, b), self.buffers.shard(grad, b, self.rank)
        handles = [collectives.reduce_scatter_avg(mine, full, self.group)]
        if self.replica_group is None:
            return Pending(handles)
        # The second stage reads the reduce-scatter's output, so it starts once that is done.
        return Pending(handles, lambda: [collectives.all_reduce_avg(mine, self.replica_group)])

    def gather_params(self, b: Bucket) -> Pending:
        param = self.buffers.param
        if self.param_sync == ALLGATHER:
            full, mine = self.buffers.bucket(param, b), self.buffers.shard(param, b, self.rank)
            return Pending([collectives.all_gather(full, mine, self.group)])
        return Pending(
            [
                collectives.broadcast(self.buffers.shard(param, b, r), r, self.group)
                for r in range(self.dp_size)
            ]
        )


class PingPongSync(_Scheme):
    """All-reduce grads; sync owned params through a per-bucket staging buffer."""

    def __post_init__(self) -> None:
        self.owners = snake_owners(self.placements, self.dp_size)
        self._staging: dict[int, torch.Tensor] = {}
        # _owned_in[bucket][rank]: the params rank owns in bucket, in buffer order.
        self._owned_in = [[[] for _ in range(self.dp_size)] for _ in self.buckets]
        for p in sorted(self.placements, key=lambda p: p.start):
            self._owned_in[p.bucket][self.owners[p.name]].append(p)

    def reduce_grads(self, b: Bucket) -> Pending:
        grad = self.buffers.bucket(self.buffers.grad, b)
        return Pending([collectives.all_reduce_avg(grad, self.group)])

    def gather_params(self, b: Bucket) -> Pending:
        per_rank = self._owned_in[b.index]
        sizes = [sum(p.numel for p in ps) for ps in per_rank]
        if self.param_sync == ALLGATHER:  # equal sizes: pad every rank to the largest
            width = max(sizes)
            offsets = [r * width for r in range(self.dp_size)]
            staging = self._staging_for(b, width * self.dp_size)
            mine = staging[offsets[self.rank] : offsets[self.rank] + width]
            self._pack(per_rank[self.rank], mine)
            handles = [collectives.all_gather(staging, mine, self.group)]
        else:
            offsets = [sum(sizes[:r]) for r in range(self.dp_size)]
            staging = self._staging_for(b, sum(sizes))
            self._pack(per_rank[self.rank], staging[offsets[self.rank] :])
            handles = [
                collectives.broadcast(staging[offsets[r] : offsets[r] + sizes[r]], r, self.group)
                for r in range(self.dp_size)
                if sizes[r] > 0
            ]

        def unpack() -> None:
            for r, ps in enumerate(per_rank):
                if r != self.rank:
                    self._unpack(ps, staging[offsets[r] :])

        return Pending(handles, unpack)

    def _staging_for(self, b: Bucket, numel: int) -> torch.Tensor:
        buf = self._staging.get(b.index)
        if buf is None or buf.numel() != numel:
            # The param dtype, never the grad dtype: ranks must agree on byte sizes.
            buf = self.buffers.param.new_empty(numel)
            self._staging[b.index] = buf
        return buf

    def _pack(self, placements: list[Placement], out: torch.Tensor) -> None:
        offset = 0
        for p in placements:
            out[offset : offset + p.numel].copy_(self.buffers.param[p.start : p.end])
            offset += p.numel

    def _unpack(self, placements: list[Placement], src: torch.Tensor) -> None:
        offset = 0
        for p in placements:
            self.buffers.param[p.start : p.end].copy_(src[offset : offset + p.numel])
            offset += p.numel

    def free(self) -> None:
        self._staging.clear()


def snake_owners(placements: tuple[Placement, ...], dp_size: int) -> dict[str, int | None]:
    """Largest params first, dealt to ranks 0..N-1, N-1..0, 0..N-1, ... (the legacy rule)."""
    by_size = sorted(placements, key=lambda p: -p.numel)  # stable: ties keep registration order
    owners = {}
    for i, p in enumerate(by_size):
        lap, pos = divmod(i, dp_size)
        owners[p.name] = pos if lap % 2 == 0 else dp_size - 1 - pos
    return owners
