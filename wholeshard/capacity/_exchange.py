"""An exchange buffer's all-to-alls, for every rank at once ([Note: plan costs] in `costs`).

`planning.sync.exchange` describes the all-to-all one rank issues for a batch's segments by
filtering them all; a dp-1024 plan of moe-256x has about 100K segments, so the costs and the
projection (which prices every rank's) group them by batch and by the ranks each touches once,
cached per buffer, and hand `exchange` only the segments that touch the rank: the same records.
Fully sharded, each batch's exchange to the owners also gives their whole grad copies (and
param copies, where the masters are separate) storage until the step ends ([Note: owned
copies] in the engine's `_owned_copies`): `owned_by_batch`.
"""

from __future__ import annotations

import functools
from typing import Protocol

from ..planning import Segment, placement_matrices, segments
from ..planning.buffer import Buffer
from ..planning.plan import Plan
from ..planning.sync import Collective, exchange, exchange_batches


class Mode(Protocol):
    """What the exchange reads of a `costs.Mode` (which imports this module)."""

    @property
    def exchange_every(self) -> int | None: ...
    @property
    def grad_reduce_dtype(self) -> str: ...
    @property
    def param_dtype(self) -> str: ...


@functools.lru_cache(maxsize=8)
def _touching(buffer: Buffer, every: int | None) -> tuple[tuple[tuple[Segment, ...], ...], ...]:
    """Per batch of `buffer`'s buckets (`exchange_batches`), per shard-group rank, the
    segments it holds or owns."""
    batches = exchange_batches(len(buffer.buckets), every)
    batch_of = {b: i for i, run in enumerate(batches) for b in run}
    k = buffer.shard_group_size
    out: list[list[list[Segment]]] = [[[] for _ in range(k)] for _ in batches]
    for s in segments(buffer):
        ranks = out[batch_of[s.bucket]]
        ranks[s.holder].append(s)
        ranks[s.owner].append(s)
    return tuple(tuple(map(tuple, ranks)) for ranks in out)


@functools.lru_cache(maxsize=8)
def _slots(
    buffer: Buffer, every: int | None, grad: str, param: str
) -> tuple[tuple[Collective, ...], ...]:
    k = buffer.shard_group_size
    out = []
    for ranks in _touching(buffer, every):
        out.append(tuple(exchange(mine, k, r, grad, True) for r, mine in enumerate(ranks)))
        out.append(tuple(exchange(mine, k, r, param, False) for r, mine in enumerate(ranks)))
    return tuple(out)


def exchange_slots(plan: Plan, mode: Mode) -> tuple[tuple[Collective, ...], ...]:
    """Every all-to-all of a step of `plan` in `mode`, in order (per batch of each exchange
    buffer, `Mode.exchange_every`: to the owners in the grad dtype, then back in the param
    dtype), each as the collective of every shard-group rank, rank by rank; none at dp 1 or
    k 1 (nothing to exchange)."""
    if plan.dp_size == 1 or plan.shard_group_size == 1:
        return ()
    every, grad, param = mode.exchange_every, mode.grad_reduce_dtype, mode.param_dtype
    return tuple(
        slot
        for buffer in plan.buffers
        if buffer.kind == "exchange"
        for slot in _slots(buffer, every, grad, param)
    )


@functools.lru_cache(maxsize=8)
def owned_by_batch(buffer: Buffer, every: int | None) -> tuple[tuple[int, ...], ...]:
    """Per shard-group rank, the elements of the matrices it owns in each batch of `buffer`'s
    buckets (`exchange_batches`): what its owned copies take as the batch is exchanged."""
    batches = exchange_batches(len(buffer.buckets), every)
    batch_of = {b: i for i, run in enumerate(batches) for b in run}
    out = [[0] * len(batches) for _ in range(buffer.shard_group_size)]
    for p in buffer.placements:
        for lo, hi, owner in placement_matrices(p):
            out[owner][batch_of[p.bucket]] += hi - lo
    return tuple(map(tuple, out))
