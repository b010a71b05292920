"""When each bucket's collectives run: gradient reductions as backward completes buckets, param
gathers before the modules that use them, and (fully sharded) releases after.

[Note: collective order]
Every rank issues the same collectives in the same order, whatever it owns and whichever of its
modules run. Gradients are reduced strictly in bucket order (backprop order; a complete bucket
waits for its predecessors). Param gathers are dispatched from one queue in a fixed order:
forward order after an optimizer step (overlapped ZeRO) or at the start of a forward (fully
sharded), backprop order at the start of a backward (fully sharded). A hook that needs a bucket
further down the queue first dispatches everything before it, and whatever is left is dispatched
when the forward or backward ends, so a module that runs on one rank only (an MoE expert no
token chose) changes no rank's sequence. Gathers outside the queue happen only when a module
needs a released bucket again (a module called twice; activation checkpointing), which all ranks
do alike when they run the same modules. Reductions and gathers interleave alike too, on one
group or two. Fully sharded with `overlap_grad_reduce`, reductions run while backward gathers,
and a bucket holding a module that one rank skipped completes at another point on each rank;
so at the end of every forward the ranks agree (one small all-reduce, read once in backward)
on which buckets every rank ran all the modules of, and backward reduces only up to the first
bucket some rank skipped a module of: that one and those after it are reduced at the step,
in order, on every rank alike. Across groups: a separate all-gather group
(`separate_all_gather_group`) lets gathers progress beside reductions, but on NCCL two
communicators may serialise (`CUDA_DEVICE_MAX_CONNECTIONS=1`, or compute filling the GPU), so
it does not excuse a different order.
`tests/engine/test_collective_order.py` records every collective of every rank (op, group,
elements, dtype) through steps of every mode, with a block one rank skips and activation
checkpointing, and checks the sequences are identical.

[Note: fully sharded lifetimes]
A bucket's full params exist from its gather until every module holding one of its params has
finished forward (module post-hooks count down `Scheduler.forward_left`), and again from the
backward pre-hook of such a module (a hook on its outputs' gradients) until all its gradients
have landed.
Two exceptions keep a bucket across the forward/backward boundary when grad is enabled: the first
bucket in backprop order (it would be gathered again at once, as FSDP2 keeps its root's params),
and a bucket one of whose modules returned nothing autograd can hook (its backward could not be
announced). The end of the root's forward and of every backward releases whatever is left.

[Note: pipelined step]
With `pipelined_step` the optimizer walks the buckets in reduce order (`reduced_in_order`): wait
for bucket b's reduction, let the caller update b's owned params, dispatch b's gather at once,
then bucket b + 1, whose reduction and b's gather are in flight meanwhile. Gathers then leave in
reduce order, which every rank walks alike; they belong on the separate all-gather group, where
they do not queue behind the reductions. Fully sharded, nothing is gathered between steps: the
walk only overlaps the updates with the reductions still in flight, and the next forward gathers
as usual.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterable, Iterator, Sequence

import torch
from torch.autograd import Variable
from torch.autograd.profiler import record_function
from torch.distributed import ProcessGroup

from ._skips import RanEverywhere
from ._storage import BucketState, BucketStorage
from ._waits import WaitTimer

REDUCES_IN_FLIGHT = 1
"""Fully sharded: dispatching a reduction first finishes the one this many places earlier, so
at most this many full grad buckets wait on the network (FSDP2 keeps one reduce-scatter in
flight while the next bucket's gradients are computed)."""


class Scheduler:
    """The step's state machine over `buckets` (in backprop order, which is reduce order).

    `gathers`: params need gathering at all (more than one rank per shard group);
    `reduces`: gradients need reducing (more than one rank).
    """

    buckets: list[BucketStorage]  # in reduce order: buckets[i].index == i
    forward_order: list[BucketStorage]
    users: list[int]  # per bucket: hooked modules holding its params
    forward_left: list[int]  # per bucket: of those, modules yet to finish this forward
    wait_timer: WaitTimer  # time held up by waits on collectives since construction
    sync_grads: bool  # False inside no_sync

    def __init__(
        self,
        buckets: Sequence[BucketStorage],
        forward_order: Sequence[int],
        *,
        reduces: bool,
        gathers: bool,
        overlap_grad_reduce: bool,
        overlap_param_gather: bool,
        reshard: bool,
        agree_group: ProcessGroup | None = None,
    ) -> None:
        self.buckets = list(buckets)
        if [b.index for b in self.buckets] != list(range(len(self.buckets))):
            raise AssertionError("buckets must come in reduce order, numbered 0, 1, ...")
        self.forward_order = [self.buckets[i] for i in forward_order]
        self.reduces, self.gathers = reduces, gathers
        self.overlap_grad_reduce = overlap_grad_reduce
        self.overlap_param_gather = overlap_param_gather
        self.reshard = reshard
        self.users = [0] * len(self.buckets)
        self.forward_left = [0] * len(self.buckets)
        self.wait_timer = WaitTimer(self.buckets[0].param.device)
        self.sync_grads = True
        self._next_reduce = 0  # buckets whose reduction was dispatched this step
        self._grads_reduced = False
        self._queue: deque[BucketStorage] = deque()
        self._queued: set[int] = set()
        self._gathering = 0  # gathers in flight
        self._backward_task: int | None = None
        self._kept: set[int] = set()  # buckets kept gathered across forward/backward
        self.ran = RanEverywhere(len(self.buckets), self.buckets[0].param.device, agree_group)

    # -- gradients --------------------------------------------------------------------------

    def grad_arrived(self, bucket: BucketStorage, i: int, param: torch.Tensor, name: str) -> None:
        """A param's gradient is complete for this backward: fold it into the grad buffer."""
        if self._grads_reduced or bucket.index < self._next_reduce:
            raise RuntimeError(
                f"a gradient for {name!r} arrived after its bucket was reduced: call "
                f"optimizer.zero_grad() before the next backward, and wrap all but the last "
                f"micro-batch's backward in ddp.no_sync()"
            )
        if self.sync_grads and bucket.landed[i]:
            raise RuntimeError(
                f"a second gradient for {name!r} arrived before the optimizer step (backward "
                f"called twice): call step() and zero_grad() of the wholeshard "
                f"LayerwiseOptimizer between backwards (it owns the step: a torch optimizer "
                f"over ddp.parameters() sees no .grad and steps nothing), and wrap all but the "
                f"last micro-batch's backward in ddp.no_sync()"
            )
        self._enter_backward()
        bucket.accumulate(i, param.grad)
        param.grad = None
        if not self.sync_grads:
            return
        bucket.land(i)
        if not bucket.complete:
            return
        if self.reshard:  # no backward node needs these params any more
            self._release(bucket)
        if self.overlap_grad_reduce and self.reduces:
            n = len(self.buckets)
            while self._next_reduce < n and self._reducible(self.buckets[self._next_reduce]):
                self._start_reduce()

    def _reducible(self, bucket: BucketStorage) -> bool:
        """Whether backward may reduce `bucket` now: complete, and (resharding) no rank skipped
        a module holding its params in this forward ([Note: collective order])."""
        if not bucket.complete:
            return False
        if self.ran.pending:  # time only the one wait, not every lookup
            with self._blocked():
                self.ran.settle()
        return self.ran[bucket.index]

    def _start_reduce(self) -> None:
        n = self._next_reduce
        if self.reshard and n >= REDUCES_IN_FLIGHT:
            # Bound the full grads alive at once: finish the oldest reduction still in flight.
            with self._blocked():
                self.buckets[n - REDUCES_IN_FLIGHT].finish_reduce()
        with record_function("wholeshard.grad_sync.start"):
            self.buckets[n].start_reduce()
        self._next_reduce += 1

    def start_grad_sync(self) -> None:
        """Dispatch the reduction of every bucket not yet dispatched, in bucket order."""
        if self.reduces:
            while self._next_reduce < len(self.buckets):
                self._start_reduce()

    def reduced_in_order(self) -> Iterator[int]:
        """The pipelined step ([Note: pipelined step]): yield each bucket's index in reduce order
        once this rank's grad shards hold its averages; when the caller comes back, having
        written the bucket's owned params, dispatch the bucket's gather (fully sharded: mark it
        stale for the next forward). Every rank must walk it to the end."""
        self.finish_param_sync()  # a gather still in flight must land before params are written
        self.start_grad_sync()
        for b in self.buckets:
            with record_function(f"wholeshard.step.bucket{b.index}"):
                with record_function("wholeshard.grad_sync.finish"), self._blocked():
                    b.finish_reduce()
                yield b.index
                if self.gathers:
                    b.mark_stale()
                    if not self.reshard:
                        self._start_gather(b)
        self._grads_reduced = True
        if self.gathers and self.reshard:
            self.release_all()

    def finish_grad_sync(self) -> None:
        """Wait until every owned grad shard holds its average; params that got no gradient
        count as zero (readiness is settled here)."""
        if self._grads_reduced:
            return
        self.start_grad_sync()
        with record_function("wholeshard.grad_sync.finish"), self._blocked():
            for b in self.buckets:
                b.finish_reduce()
        self._grads_reduced = True

    def zero_grads(self) -> None:
        """Zero every gradient and open the next accumulation window."""
        with self._blocked():  # never zero under an in-flight reduction
            for b in self.buckets:
                b.finish_reduce()
        for b in self.buckets:
            b.zero_grads()
        self._next_reduce = 0
        self._grads_reduced = False

    # -- params -----------------------------------------------------------------------------

    def params_updated(self) -> None:
        """The optimizer wrote the owned params: gather them back (all now; with
        `overlap_param_gather` the first in forward order now, the rest as forward reaches them;
        fully sharded: at the next forward)."""
        self.finish_param_sync()
        if not self.gathers:
            return
        for b in self.buckets:
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
        for b in self.buckets:
            if b.state is BucketState.GATHERING:
                self._finish_gather(b)

    def gather_all(self) -> list[BucketStorage]:
        """Gather every bucket whose params are not all materialised and up to date, in forward
        order, in full precision; return them."""
        self.finish_param_sync()
        todo = [b for b in self.forward_order if not b.readable]
        for b in todo:
            self._start_gather(b, full=True)
        for b in todo:
            self._finish_gather(b)
        return todo

    def settle(self, buckets: Iterable[BucketStorage]) -> None:
        """Wait for the gathers of `buckets` already in flight (dispatches nothing)."""
        for b in buckets:
            if b.state is BucketState.GATHERING:
                self._finish_gather(b)

    def release(self, buckets: Iterable[BucketStorage]) -> None:
        for b in buckets:
            self._release(b)

    def release_all(self) -> None:
        """Fully sharded: free every full param bucket still materialised."""
        self.finish_param_sync()
        self._kept.clear()
        for b in self.buckets:
            if b.params_materialised:
                self._release(b)

    # -- hooks --------------------------------------------------------------------------------

    def root_pre_forward(self) -> None:
        """Fully sharded: a forward begins; queue every released bucket in forward order."""
        if _in_backward():
            return
        self.finish_param_sync()
        self.forward_left = list(self.users)
        self._set_queue(b for b in self.forward_order if b.state is not BucketState.FRESH)
        if self.overlap_param_gather:
            self._dispatch_next()

    def root_post_forward(self) -> None:
        """Fully sharded: the forward ended; release all but what backward needs at once."""
        if _in_backward():
            return
        self.finish_param_sync()
        grad = torch.is_grad_enabled()
        for b in self.buckets:
            keep = grad and (b.index == 0 or b.index in self._kept)
            if b.params_materialised and not keep:
                self._release(b)
        self.ran.clear()
        if grad and self.gathers and self.overlap_grad_reduce and self.reduces and self.sync_grads:
            self.ran.exchange(self.forward_left)

    def pre_forward(self, buckets: Sequence[BucketStorage]) -> None:
        """A module is about to run: its buckets must be gathered."""
        if self._queue or any(b.state is not BucketState.FRESH for b in buckets):
            self._ensure(buckets)

    def post_forward(self, buckets: Sequence[BucketStorage], hookable: bool) -> None:
        """Fully sharded: a module finished forward; `hookable`: its backward is announced."""
        if _in_backward():  # recomputation: backward releases by gradients
            return
        grad = torch.is_grad_enabled()
        for b in buckets:
            self.forward_left[b.index] -= 1
            if grad and not hookable:
                self._kept.add(b.index)
            keep = grad and (b.index == 0 or b.index in self._kept)
            if self.forward_left[b.index] <= 0 and not keep and b.params_materialised:
                self._release(b)

    def pre_backward(self, buckets: Sequence[BucketStorage]) -> None:
        """Fully sharded: the gradient of a module's output arrived; gather its buckets."""
        self._enter_backward()
        self._ensure(buckets)

    def _enter_backward(self) -> None:
        if not self.reshard:
            return
        task = torch._C._current_graph_task_id()
        if task == self._backward_task:
            return
        self._backward_task = task
        Variable._execution_engine.queue_callback(self._backward_done)
        self.finish_param_sync()
        self._set_queue(b for b in self.buckets if b.state is not BucketState.FRESH)

    def _backward_done(self) -> None:
        self._backward_task = None
        self.release_all()

    # -- mechanics ------------------------------------------------------------------------------

    def _set_queue(self, buckets: Iterable[BucketStorage]) -> None:
        self._queue = deque(b for b in buckets if b.state is not BucketState.GATHERING)
        self._queued = {b.index for b in self._queue}

    def _dispatch_next(self) -> None:
        if self._queue:
            b = self._queue.popleft()
            self._queued.discard(b.index)
            self._start_gather(b)

    def _ensure(self, buckets: Sequence[BucketStorage]) -> None:
        for b in buckets:
            if b.state is BucketState.FRESH:
                continue
            if b.state is not BucketState.GATHERING:
                if b.index in self._queued:  # keep the dispatch order identical on every rank
                    while b.state is not BucketState.GATHERING:
                        self._dispatch_next()
                else:
                    self._start_gather(b)
            self._finish_gather(b)
        if self.overlap_param_gather and not self._gathering:  # prefetch one, in queue order
            self._dispatch_next()

    def _start_gather(self, b: BucketStorage, full: bool = False) -> None:
        with record_function("wholeshard.param_sync.start"):
            b.start_gather(full)
        self._gathering += 1

    def _finish_gather(self, b: BucketStorage) -> None:
        with record_function("wholeshard.param_sync.finish"), self._blocked():
            b.finish_gather()
        self._gathering -= 1
        self.forward_left[b.index] = self.users[b.index]

    def _release(self, b: BucketStorage) -> None:
        if b.state is BucketState.GATHERING:
            self._finish_gather(b)
        b.release_params()

    def _blocked(self) -> contextlib.AbstractContextManager[None]:
        """Count the time spent inside as held up by collectives."""
        return self.wait_timer.blocked()


def _in_backward() -> bool:
    """Whether the autograd engine is running a backward on this thread (e.g. recomputation)."""
    return torch._C._current_graph_task_id() != -1
