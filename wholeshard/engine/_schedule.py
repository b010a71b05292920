"""When each unit's collectives run: gradient reductions as backward completes units, param
gathers before the modules that use them, and (fully sharded) releases after.

[Note: collective order]
Every rank issues the same collectives in the same order, whatever it owns and whichever of its
modules run. Gradients are reduced strictly in unit order (backprop order; a complete unit
waits for its predecessors). Param gathers are dispatched from one queue in a fixed order:
forward order after an optimizer step (overlapped ZeRO) or at the start of a forward (fully
sharded), backprop order at the start of a backward (fully sharded). A hook that needs a unit
further down the queue first dispatches everything before it, and whatever is left is dispatched
when the forward or backward ends, so a module that runs on one rank only (an MoE expert no
token chose) changes no rank's sequence. Gathers outside the queue happen only when a module
needs a released unit again (a module called twice; activation checkpointing), which all ranks
do alike when they run the same modules. Reductions and gathers interleave alike too, on one
group or two. Fully sharded with `overlap_grad_reduce`, reductions run while backward gathers,
and a unit holding a module that one rank skipped completes at another point on each rank;
so at the end of every forward the ranks agree (one small all-reduce, read once in backward)
on which units every rank ran all the modules of, and backward reduces only up to the first
unit some rank skipped a module of: that one and those after it are reduced at the step,
in order, on every rank alike. Across groups: a separate all-gather group
(`separate_all_gather_group`) lets gathers progress beside reductions, but on NCCL two
communicators may serialise (`CUDA_DEVICE_MAX_CONNECTIONS=1`, or compute filling the GPU), so
it does not excuse a different order. The optimizer's step check follows every reduction of the
step on every rank ([Note: step check order] in `optim/_step_check.py`).
`tests/engine/test_collective_order.py` records every collective of every rank (op, group,
elements, dtype) through steps of every mode, with a block one rank skips and activation
checkpointing, and checks the sequences are identical.

[Note: fully sharded lifetimes]
A unit's full params exist from its gather until every module holding one of its params has
finished forward (module post-hooks count down `Scheduler.forward_left`), and again from the
backward pre-hook of such a module (a hook on its outputs' gradients) until all its gradients
are final.
Two exceptions keep a unit across the forward/backward boundary when grad is enabled: the first
unit in backprop order (it would be gathered again at once, as FSDP2 keeps its root's params),
and a unit one of whose modules returned nothing autograd can hook (its backward could not be
announced). The end of the root's forward and of every backward releases whatever is left.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterable, Iterator, Sequence

import torch
from torch.autograd import Variable
from torch.autograd.profiler import record_function
from torch.distributed import ProcessGroup

from ._exchange import Exchange
from ._pipelined import reduced_in_order
from ._skips import RanEverywhere
from ._storage import StorageUnit, UnitState
from ._waits import WaitTimer

REDUCES_IN_FLIGHT = 1
"""Fully sharded: dispatching a reduction first finishes the one this many places earlier, so
at most this many full grad units wait on the network (FSDP2 keeps one reduce-scatter in
flight while the next unit's gradients are computed)."""


class Scheduler:
    """The step's state machine over `units` (in backprop order, which is reduce order).

    `gathers`: params need gathering at all (more than one rank per shard group);
    `reduces`: gradients need reducing (more than one rank).
    `exchange`: an exchange plan's exchanges ([Note: exchange buffers] in `planning._exchange`):
    a unit counts as reduced once its batch's pieces reached their owners, and is gathered once
    the owners' updated pieces are back in their holders' shards.
    """

    units: list[StorageUnit]  # in reduce order: units[i].index == i
    forward_order: list[StorageUnit]
    users: list[int]  # per unit: hooked modules holding its params
    forward_left: list[int]  # per unit: of those, modules yet to finish this forward
    wait_timer: WaitTimer  # time held up by waits on collectives since construction
    sync_grads: bool  # False inside no_sync
    grads_reduced: bool  # this step's reductions (and exchanges) have all landed
    exchange: Exchange | None

    def __init__(
        self,
        units: Sequence[StorageUnit],
        forward_order: Sequence[int],
        *,
        reduces: bool,
        gathers: bool,
        overlap_grad_reduce: bool,
        overlap_param_gather: bool,
        reshard: bool,
        agree_group: ProcessGroup | None = None,
        exchange: Exchange | None = None,
    ) -> None:
        self.units = list(units)
        self.exchange = exchange
        if [b.index for b in self.units] != list(range(len(self.units))):
            raise AssertionError("units must come in reduce order, numbered 0, 1, ...")
        self.forward_order = [self.units[i] for i in forward_order]
        self.reduces, self.gathers = reduces, gathers
        self.overlap_grad_reduce = overlap_grad_reduce
        self.overlap_param_gather = overlap_param_gather
        self.reshard = reshard
        self.users = [0] * len(self.units)
        self.forward_left = [0] * len(self.units)
        self.wait_timer = WaitTimer(self.units[0].param.device)
        self.sync_grads = True
        self._next_reduce = 0  # units whose reduction was dispatched this step
        self.grads_reduced = False
        self._queue: deque[StorageUnit] = deque()
        self._queued: set[int] = set()
        self._gathering = 0  # gathers in flight
        self._backward_task: int | None = None
        self._kept: set[int] = set()  # units kept gathered across forward/backward
        self.ran = RanEverywhere(len(self.units), self.units[0].param.device, agree_group)

    # -- gradients --------------------------------------------------------------------------

    def receive_grad(self, unit: StorageUnit, i: int, param: torch.Tensor, name: str) -> None:
        """Receive a param's gradient, complete for this backward: add it into its unit's grad."""
        if self.grads_reduced or unit.index < self._next_reduce:
            raise RuntimeError(
                f"a gradient for {name!r} was received after its unit was reduced: call "
                f"optimizer.zero_grad() before the next backward, and wrap all but the last "
                f"micro-batch's backward in ddp.no_sync()"
            )
        if self.sync_grads and unit.final[i]:
            raise RuntimeError(
                f"a second final gradient for {name!r} was received before the optimizer step "
                f"(backward called twice): call step() and zero_grad() of the wholeshard "
                f"LayerwiseOptimizer between backwards (it owns the step: a torch optimizer "
                f"over ddp.parameters() sees no .grad and steps nothing), and wrap all but the "
                f"last micro-batch's backward in ddp.no_sync()"
            )
        self._enter_backward()
        unit.accumulate(i, param.grad)
        param.grad = None
        if not self.sync_grads:
            return
        unit.mark_final(i)
        if not unit.complete:
            return
        if self.reshard:  # no backward node needs these params any more
            self._release(unit)
        if self.overlap_grad_reduce and self.reduces:
            n = len(self.units)
            while self._next_reduce < n and self._reducible(self.units[self._next_reduce]):
                self._start_reduce()

    def _reducible(self, unit: StorageUnit) -> bool:
        """Whether backward may reduce `unit` now: complete, and (resharding) no rank skipped
        a module holding its params in this forward ([Note: collective order])."""
        if not unit.complete:
            return False
        if self.ran.pending:  # time only the one wait, not every lookup
            with self.blocked():
                self.ran.read_agreement()
        return self.ran[unit.index]

    def _start_reduce(self) -> None:
        n = self._next_reduce
        if self.reshard and n >= REDUCES_IN_FLIGHT:
            # Bound the full grads alive at once: finish the oldest reduction still in flight.
            with self.blocked():
                self.units[n - REDUCES_IN_FLIGHT].finish_reduce()
        if self.exchange is not None and n:  # the batches before unit n leave first, so the
            with self.blocked():  # order is the same on a rank that reduces n only at the step
                self.exchange.dispatch(n - 1)
        with record_function("wholeshard.grad_sync.start"):
            self.units[n].start_reduce()
        self._next_reduce += 1

    def start_grad_sync(self) -> None:
        """Dispatch the reduction of every unit not yet dispatched, in unit order."""
        if self.exchange is not None:
            self.exchange.check_grads()
        if self.reduces:
            while self._next_reduce < len(self.units):
                self._start_reduce()

    def reduced_in_order(self) -> Iterator[int]:
        """The pipelined step ([Note: pipelined step] in `_pipelined`): yield each unit's index
        in reduce order once this rank's grad shards hold its averages; when the caller comes
        back, having written the unit's owned params, dispatch the unit's gather (fully sharded:
        mark it stale for the next forward). Every rank must walk it to the end."""
        return reduced_in_order(self)

    def finish_grad_sync(self) -> None:
        """Wait until every owned grad shard holds its average; params that got no gradient
        count as zero (readiness is decided here)."""
        if self.exchange is not None:
            self.exchange.check_grads()
        if self.grads_reduced:
            return
        self.start_grad_sync()
        with record_function("wholeshard.grad_sync.finish"), self.blocked():
            if self.exchange is not None:
                self.exchange.grads()
            for b in self.units:
                b.finish_reduce()
        self.grads_reduced = True

    def zero_grads(self) -> None:
        """Zero every gradient and open the next accumulation window."""
        with self.blocked():  # never zero under an in-flight reduction
            for b in self.units:
                b.finish_reduce()
        if self.exchange is not None:
            with self.blocked():
                self.exchange.reset()
        for b in self.units:
            b.zero_grads()
        self._next_reduce = 0
        self.grads_reduced = False

    # -- params -----------------------------------------------------------------------------

    def params_updated(self) -> None:
        """The optimizer wrote the owned params: gather them back (all now; with
        `overlap_param_gather` the first in forward order now, the rest as forward reaches them;
        fully sharded: at the next forward)."""
        self.finish_param_sync()
        if not self.gathers:
            return
        if self.exchange is not None:
            with self.blocked():
                self.exchange.params()
        for b in self.units:
            b.mark_stale()
        if self.reshard:
            self.release_all()
            return
        self._set_queue(self.forward_order)
        self._dispatch_next()
        while self._queue and not self.overlap_param_gather:
            self._dispatch_next()

    def finish_param_sync(self) -> None:
        """Dispatch everything queued and wait for every gather in flight."""
        while self._queue:
            self._dispatch_next()
        for b in self.units:
            if b.state is UnitState.GATHERING:
                self._finish_gather(b)

    def gather_all(self) -> list[StorageUnit]:
        """Gather every unit whose params are not all materialised and up to date, in forward
        order, in full precision; return them."""
        self.finish_param_sync()
        return self.gather(self.forward_order)

    def gather(self, units: Iterable[StorageUnit]) -> list[StorageUnit]:
        """Gather those of `units` whose params are not all materialised and up to date, in
        full precision (no param sync pending); return them."""
        todo = [b for b in units if not b.readable]
        for b in todo:
            self.start_gather(b, full=True)
        for b in todo:
            self._finish_gather(b)
        return todo

    def wait_gathers(self, units: Iterable[StorageUnit]) -> None:
        """Wait for the gathers of `units` already in flight (dispatches nothing)."""
        for b in units:
            if b.state is UnitState.GATHERING:
                self._finish_gather(b)

    def release(self, units: Iterable[StorageUnit]) -> None:
        for b in units:
            self._release(b)

    def release_all(self) -> None:
        """Fully sharded: free every full param unit still materialised."""
        self.finish_param_sync()
        self._kept.clear()
        for b in self.units:
            if b.params_materialised:
                self._release(b)

    # -- hooks --------------------------------------------------------------------------------

    def root_pre_forward(self) -> None:
        """Fully sharded: a forward begins; queue every released unit in forward order."""
        if _in_backward():
            return
        self.finish_param_sync()
        self.forward_left = list(self.users)
        self._set_queue(b for b in self.forward_order if b.state is not UnitState.FRESH)
        if self.overlap_param_gather:
            self._dispatch_next()

    def root_post_forward(self) -> None:
        """Fully sharded: the forward ended; release all but what backward needs at once."""
        if _in_backward():
            return
        self.finish_param_sync()
        grad = torch.is_grad_enabled()
        for b in self.units:
            keep = grad and (b.index == 0 or b.index in self._kept)
            if b.params_materialised and not keep:
                self._release(b)
        self.ran.clear()
        if grad and self.gathers and self.overlap_grad_reduce and self.reduces and self.sync_grads:
            self.ran.exchange(self.forward_left)

    def pre_forward(self, units: Sequence[StorageUnit]) -> None:
        """A module is about to run: its units must be gathered."""
        if self._queue or any(b.state is not UnitState.FRESH for b in units):
            self._ensure(units)

    def post_forward(self, units: Sequence[StorageUnit], hookable: bool) -> None:
        """Fully sharded: a module finished forward; `hookable`: its backward is announced."""
        if _in_backward():  # recomputation: backward releases by gradients
            return
        grad = torch.is_grad_enabled()
        for b in units:
            self.forward_left[b.index] -= 1
            if grad and not hookable:
                self._kept.add(b.index)
            keep = grad and (b.index == 0 or b.index in self._kept)
            if self.forward_left[b.index] <= 0 and not keep and b.params_materialised:
                self._release(b)

    def pre_backward(self, units: Sequence[StorageUnit]) -> None:
        """Fully sharded: the gradient of a module's output is computed; gather its units."""
        self._enter_backward()
        self._ensure(units)

    def _enter_backward(self) -> None:
        if not self.reshard:
            return
        task = torch._C._current_graph_task_id()
        if task == self._backward_task:
            return
        self._backward_task = task
        Variable._execution_engine.queue_callback(self._backward_done)
        self.finish_param_sync()
        self._set_queue(b for b in self.units if b.state is not UnitState.FRESH)

    def _backward_done(self) -> None:
        self._backward_task = None
        self.release_all()

    # -- mechanics ------------------------------------------------------------------------------

    def _set_queue(self, units: Iterable[StorageUnit]) -> None:
        self._queue = deque(b for b in units if b.state is not UnitState.GATHERING)
        self._queued = {b.index for b in self._queue}

    def _dispatch_next(self) -> None:
        if self._queue:
            b = self._queue.popleft()
            self._queued.discard(b.index)
            self.start_gather(b)

    def _ensure(self, units: Sequence[StorageUnit]) -> None:
        for b in units:
            if b.state is UnitState.FRESH:
                continue
            if b.state is not UnitState.GATHERING:
                if b.index in self._queued:  # keep the dispatch order identical on every rank
                    while b.state is not UnitState.GATHERING:
                        self._dispatch_next()
                else:
                    self.start_gather(b)
            self._finish_gather(b)
        if self.overlap_param_gather and not self._gathering:  # prefetch one, in queue order
            self._dispatch_next()

    def start_gather(self, b: StorageUnit, full: bool = False) -> None:
        with record_function("wholeshard.param_sync.start"):
            b.start_gather(full)
        self._gathering += 1

    def _finish_gather(self, b: StorageUnit) -> None:
        with record_function("wholeshard.param_sync.finish"), self.blocked():
            b.finish_gather()
        self._gathering -= 1
        self.forward_left[b.index] = self.users[b.index]

    def _release(self, b: StorageUnit) -> None:
        if b.state is UnitState.GATHERING:
            self._finish_gather(b)
        b.release_params()

    def blocked(self) -> contextlib.AbstractContextManager[None]:
        """Count the time spent inside as held up by collectives."""
        return self.wait_timer.blocked()


def _in_backward() -> bool:
    """Whether the autograd engine is running a backward on this thread (e.g. recomputation)."""
    return torch._C._current_graph_task_id() != -1
