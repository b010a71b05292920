"""The pipelined step's walk over a scheduler's units (`DataParallelConfig.pipelined_step`).

[Note: pipelined step]
With `pipelined_step` the optimizer walks the units in reduce order (`reduced_in_order`): wait
for unit b's reduction, let the caller update b's owned params, dispatch b's gather at once,
then unit b + 1, whose reduction and b's gather are in flight meanwhile. Gathers then leave in
reduce order, which every rank walks alike; they belong on the separate all-gather group, where
they do not queue behind the reductions. Fully sharded, nothing is gathered between steps: the
walk only overlaps the updates with the reductions still in flight, and the next forward gathers
as usual. An exchange plan walks its exchange batches instead of single units: a batch's
reductions and its exchange to the owners, its units' updates, its exchange back to the
holders, its gathers ([Note: exchange buffers] in `planning._exchange`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

from torch.autograd.profiler import record_function

from ._exchange import Exchange
from ._storage import StorageUnit


class Scheduler(Protocol):
    """What the walk reads and drives of an `_schedule.Scheduler` (which imports this)."""

    units: list[StorageUnit]
    exchange: Exchange | None
    grads_reduced: bool
    gathers: bool
    reshard: bool

    def finish_param_sync(self) -> None: ...
    def start_grad_sync(self) -> None: ...
    def release_all(self) -> None: ...
    def start_gather(self, b: StorageUnit, full: bool = False) -> None: ...
    def blocked(self) -> contextlib.AbstractContextManager[None]: ...


def reduced_in_order(s: Scheduler) -> Iterator[int]:
    """`Scheduler.reduced_in_order` ([Note: pipelined step])."""
    s.finish_param_sync()  # a gather still in flight must land before params are written
    s.start_grad_sync()
    ex, exchanged = s.exchange, s.grads_reduced  # (clipping may have reduced them already)
    walk = (
        [(i, b.units) for i, b in enumerate(ex.batches)] if ex else [(None, (u,)) for u in s.units]
    )
    for batch, units in walk:
        if ex is not None and batch is not None and not exchanged:
            with record_function("wholeshard.grad_sync.finish"), s.blocked():
                ex.grads(batch)
        for b in units:
            with record_function(f"wholeshard.step.unit{b.index}"):
                with record_function("wholeshard.grad_sync.finish"), s.blocked():
                    b.finish_reduce()
                yield b.index
                if s.gathers and batch is None:
                    _updated(s, b)
        if ex is not None and batch is not None and s.gathers:
            with s.blocked():
                ex.params(batch)
            for b in units:
                _updated(s, b)
    s.grads_reduced = True
    if s.gathers and s.reshard:
        s.release_all()


def _updated(s: Scheduler, b: StorageUnit) -> None:
    """The walk wrote `b`'s owned params: mark it stale and dispatch its gather (fully sharded:
    the next forward gathers it)."""
    b.mark_stale()
    if not s.reshard:
        s.start_gather(b)
