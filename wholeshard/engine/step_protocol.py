"""`StepProtocol`: the verbs an optimizer drives a `DataParallel`'s step with.

Reached as `ddp.step_protocol`; not user API: `LayerwiseOptimizer` and checkpoint loading call
it, a training script calls `optimizer.step()`. The verbs are Megatron's; `_schedule.Scheduler`
decides when the collectives run. The step:
1. backward: each param's post-accumulate-grad hook adds its grad into its unit's grad buffer;
   with `overlap_grad_reduce` a unit whose params are all in starts its reduction;
2. `finish_grad_sync()`: every unit reduced (averaged), so this rank's grad shards hold the
   full averaged gradient of every param it owns;
3. the optimizer writes its owned params (`owned()`: views of this rank's param shards);
4. `start_param_sync()`: each unit's gather restores every param on every rank: at once, as
   the next forward reaches them (`overlap_param_gather`), or around each module's forward and
   backward, released after (fully sharded: `reshard_after_forward=True`).
`pipelined_step`: 2-4 unit by unit (`reduced_units()`), each updated once reduced.

Invariants: every verb acts on every `ShardedGroup` of the wrapper, in the order it holds them
(the dense params' first, then the experts': [Note: expert parallelism] in
`wholeshard.distributed.mesh`), so every rank issues the same collectives in the same order; a
unit index (`OwnedRange.unit`, `reduced_units()`) counts over those groups' units in that
order, which is `DataParallel.units`.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence

from torch import nn

from ..planning.routing import Route
from ._guard import ParamSignature
from ._memory import StateHolder
from ._owned import OwnedRange
from ._owned_copies import OwnedCopies
from ._schedule import Scheduler
from ._sharded_group import ShardedGroup
from ._storage import StorageUnit

__all__ = ["OwnedRange", "StepProtocol"]


class StepProtocol:
    """The step verbs of one `DataParallel` (built by it; reached as `ddp.step_protocol`).

    Args:
        groups: the wrapper's `ShardedGroup`s, in unit order: what each rank owns and the
            units and schedulers that sync it.
        routes: every trainable param's route, in registration order.
        module: the wrapped module, its params as they are now kept (`model_changes`).
    """

    schedulers: list[Scheduler]  # the groups', in unit order

    def __init__(
        self,
        groups: Sequence[ShardedGroup],
        routes: list[Route],
        module: nn.Module,
    ) -> None:
        self._groups = tuple(groups)
        self._routes = routes
        self._module = module
        self._signature = ParamSignature(module)
        self.schedulers = [g.scheduler for g in self._groups]
        self._optimizer: weakref.ref[StateHolder] | None = None
        # The owned param copies' values back from the masters that hold them (`masters_kept`).
        self._params_back: Callable[[], object] = lambda: None

    # -- ownership ------------------------------------------------------------------------

    def owned(self) -> Iterator[OwnedRange]:
        """What this rank updates, group by group (experts after the others), each in
        registration order: whole params, whole matrices of stacked params, or flat slices of
        element-wise ones. Ownership comes from the plans. Their params hold their values: an
        optimizer whose masters held them (`masters_kept`) writes them back first."""
        self._params_back()
        return self._owned()

    def _owned(self) -> Iterator[OwnedRange]:
        first = 0
        for g in self._groups:
            yield from (dataclasses.replace(o, unit=first + o.unit) for o in g.owned())
            first += len(g.scheduler.units)

    # -- gradients ------------------------------------------------------------------------

    def start_grad_sync(self) -> None:
        """Dispatch the reduction of every unit not yet dispatched, in unit order."""
        for s in self.schedulers:
            s.start_grad_sync()

    def finish_grad_sync(self) -> None:
        """Wait until this rank's grad shards hold the averaged gradients of its owned params.

        Params that got no gradient this step count as zero: readiness is decided here.
        """
        for s in self.schedulers:
            s.finish_grad_sync()

    def received_grads(self) -> list[bool]:
        """Per route (in `routes` order): whether this rank got a gradient for the param since
        `zero_grad_buffer()`. A param no rank got one for is not stepped (torch's rule)."""
        slots = {n: s for g in self._groups for n, s in g.slot_of.items()}
        return [unit.received[i] for unit, i in (slots[r.name] for r in self._routes)]

    def zero_grad_buffer(self) -> None:
        """Zero every gradient and open the next accumulation window."""
        for s in self.schedulers:
            s.zero_grads()
        for r in self._routes:
            r.param.grad = None

    def reduced_units(self) -> Iterator[int]:
        """The pipelined step: yield each unit's index (in `DataParallel.units`) once its
        grads are reduced; when the caller, having written its owned params, comes back, its
        param sync is dispatched. Every rank walks it to the end ([Note: pipelined step] in
        `_pipelined`)."""
        first = 0
        for s in self.schedulers:
            yield from (first + i for i in s.reduced_in_order())
            first += len(s.units)

    # -- parameters -----------------------------------------------------------------------

    def start_param_sync(self) -> None:
        """Begin restoring every param from its owner (after the optimizer wrote its own).

        Synchronous mode dispatches every unit; with `overlap_param_gather` only the first in
        forward order, the rest as the forward reaches them; fully sharded, nothing until the
        next forward (the units are released).
        """
        for s in self.schedulers:
            s.params_updated()

    def finish_param_sync(self) -> None:
        """Complete every pending param sync: afterwards every param outside a released unit
        is up to date (in ZeRO-1/2 mode: every param)."""
        for s in self.schedulers:
            s.finish_param_sync()

    def hold_owned_params(self) -> None:
        """Give the owned param copies that live only through a step their storage (fully
        sharded on the exchange, after `masters_kept`): a load writes every owned param, then
        `start_param_sync` sends them to their holders and frees them ([Note: owned copies] in
        `_owned_copies`)."""
        for unit in self.units:
            if unit.owned_copies is not None:
                unit.owned_copies.hold(grad=False)

    # -- the model and the optimizer ------------------------------------------------------

    def masters_kept(
        self, optimizer: object, units: Iterable[int], write_params: Callable[[], None]
    ) -> None:
        """`optimizer` keeps a master of its own (not the param view) of every piece it owns of
        `units` (indices in `DataParallel.units`) and writes each of those params from its
        master in every update, stepped or not, on loading (`hold_owned_params`), and by
        `write_params()`: fully sharded on the exchange, their owned param copies then have
        storage only through a step ([Note: owned copies] in `_owned_copies`), until the next
        optimizer reads them (`owned()`) or `optimizer` is gone, when `write_params()` gives
        them their values back (so it must not hold `optimizer`, which would then never go)."""
        every = self.units
        dropped = [every[i].owned_copies for i in units if every[i].owned_copies is not None]
        for copies in dropped:
            copies.drop_params()
        dropped = [c for c in dropped if c.transient]
        if dropped:
            self._params_back = weakref.finalize(optimizer, _params_back, dropped, write_params)
            self._params_back.atexit = False

    @property
    def units(self) -> list[StorageUnit]:
        """Every group's storage units, in unit order (`DataParallel.units`)."""
        return [u for s in self.schedulers for u in s.units]

    def model_changes(self) -> str | None:
        """What changed in the wrapped module's params since wrapping (a param frozen,
        unfrozen, replaced, added or removed), or None. `LayerwiseOptimizer.step` raises on
        every rank when any rank's answer is not None."""
        return self._signature.changes(self._module)

    def attach_optimizer(self, optimizer: StateHolder) -> None:
        """Let `DataParallel.memory()` report `optimizer`'s masters and state (held by weak
        reference)."""
        self._optimizer = weakref.ref(optimizer)

    @property
    def optimizer(self) -> StateHolder | None:
        """The attached optimizer, while it lives."""
        return self._optimizer() if self._optimizer is not None else None


def _params_back(dropped: list[OwnedCopies], write_params: Callable[[], None]) -> None:
    """Keep `dropped`'s param copies between steps again, their values written from the masters
    of the optimizer that dropped them (`write_params`) ([Note: owned copies])."""
    for copies in dropped:
        copies.keep_params_again()
    write_params()
