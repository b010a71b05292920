"""`ShardedGroup`: the params one process group syncs, and everything that serves them.

A `DataParallel` holds one per process group (FSDP2's `FSDPParamGroup`s): the dense params'
over its data-parallel group and, with an "ep" mesh dim, the experts' over the
expert-data-parallel group ([Note: expert parallelism] in `wholeshard.distributed.mesh`;
`_experts.expert_group` builds it). Each builds, in order: its plan (`plan_for`: the decision
alone), its comm groups, one `StorageUnit` per storage unit of the plan in reduce order, each
given its initial values (fully sharded: then reduced to this rank's shards) before the next
is built, so one full unit at most exists beside the model ([Note: meta-device construction]
in `_meta`), its frozen params and buffers from its first rank, its scheduler and its hooks.

Invariants: every trainable param is in exactly one group; a group's collectives run on its
process group and the groups derived from it only; its unit indices count from 0 (the wrapper
lists the groups' units one after another, in the order it holds them); a group is ready when
built (initial values in place, gathered where the first forward would not gather them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.utils.hooks import RemovableHandle

from ..distributed import collectives
from ..distributed.dtensor import local
from ..distributed.groups import TwoLevel, make_groups, make_levels, resolve_group
from ..planning import ParamSpec, Plan
from ..planning.auto import plan_for
from ..planning.layouts import layout_named
from ..planning.routing import Route
from ..planning.specs import MatrixCost
from ..planning.units import storage_units
from . import _hooks as hooks
from ._comm_groups import CommGroups
from ._exchange import Exchange
from ._fp8_storage import fp8_storage_factory
from ._meta import fill_owned
from ._owned import OwnedRange, owned_ranges
from ._schedule import Scheduler
from ._storage import StorageUnit
from .config import DataParallelConfig, Variant
from .layouts import load


class CommGroupsMade(NamedTuple):
    """What `make_groups` (and `make_levels`) made for `key` (shard group size, a separate
    gather group, ranks per node of two-level groups)."""

    key: tuple[int, bool, int]
    shard_group: ProcessGroup | None
    replica_group: ProcessGroup | None
    gather_group: ProcessGroup | None
    levels: TwoLevel | None = None
    gather_levels: TwoLevel | None = None


class ShardedGroup:
    """The params `routes` of `module`, synced over `process_group` as `cfg` and `variant` say.

    Args:
        param_dtype, grad_dtype: what the units hold.
        rest: frozen params and buffers this group gives every rank from its first.
        divide_by: what the summed gradients divide by; 0: the ranks they are summed over
            (the experts': dp x ep).
        matrix_cost: the matrix rule's work per matrix, which the plan evens out across ranks
            (None: Newton-Schulz's; `DataParallel.balance_for` sets the rule's).
        previous: the comm groups of the group this one replaces (a new layout of the same
            params), made again only if this plan needs others.
    """

    routes: list[Route]  # this group's trainable params, in registration order
    process_group: ProcessGroup | None
    dp_size: int
    rank: int  # in `process_group`
    plan: Plan  # the decision alone, no report (that is `wholeshard.capacity.choice`'s)
    shard_group_size: int
    shard_rank: int  # in this rank's shard group
    shard_group: ProcessGroup | None  # `make_groups`' three, from `process_group`
    replica_group: ProcessGroup | None
    gather_group: ProcessGroup | None
    made: CommGroupsMade  # the three, for a new layout of the group to reuse
    reshard_after_forward: bool  # what the config asks, where there is anything to gather
    fp8_param_gather: bool  # likewise
    scheduler: Scheduler  # its units, in reduce order, and their collectives
    hooks: list[RemovableHandle]  # gradient hooks on its params, module hooks for its units

    def __init__(
        self,
        module: nn.Module,
        routes: list[Route],
        cfg: DataParallelConfig,
        variant: Variant,
        process_group: ProcessGroup | None,
        *,
        param_dtype: torch.dtype,
        grad_dtype: torch.dtype,
        rest: Sequence[torch.Tensor],
        divide_by: int = 0,
        matrix_cost: MatrixCost | None = None,
        previous: CommGroupsMade | None = None,
    ) -> None:
        self.routes = routes
        self.process_group, self.dp_size, self.rank = resolve_group(process_group)
        specs = [ParamSpec(r.name, r.shape, r.matrix, r.tied) for r in routes]
        self.plan = plan_for(
            specs,
            self.dp_size,
            bucket_size=cfg.bucket_size,
            strategy=variant.strategy,
            shard_group_size=cfg.shard_group_size,
            layout=variant.layout,
            matrix_cost=matrix_cost,
            node_size=cfg.node_size,
        )
        self.shard_group_size = self.plan.shard_group_size
        self.shard_rank = self.plan.shard_rank(self.rank)
        self._fill = cfg.param_init and fill_owned(self.plan, self.shard_rank, cfg.param_init)
        gathers = self.dp_size > 1 and self.shard_group_size > 1
        self.reshard_after_forward = reshard = cfg.reshard_after_forward and gathers
        self.fp8_param_gather = cfg.fp8_param_gather and gathers
        separate = variant.separate_all_gather_group
        if separate is None:
            separate = cfg.reshard_after_forward or cfg.pipelined_step
        key = (self.shard_group_size, separate and gathers, self.plan.node_size)
        if previous is None or previous.key != key:
            previous = self._make_groups(key)
        self.made = previous
        _, self.shard_group, self.replica_group, self.gather_group, *levels = previous
        groups = CommGroups(
            self.shard_group,
            self.shard_rank,
            self.shard_group_size,
            self.gather_group,
            self.replica_group,
            divide_by,
            *levels,
        )
        fp8 = fp8_storage_factory(module) if self.fp8_param_gather else StorageUnit
        storage_of: dict[str | None, Any] = {}  # a layout's kind: its storage class
        if variant.layout is not None:  # its schemes' halves loaded ([Note: layouts])
            layout = layout_named(variant.layout)
            storage_of[layout.kind] = load(layout).storage
        storages = build_storage(
            self.plan,
            routes,
            specs,
            lambda kind: storage_of.get(kind) or fp8,
            self._fill_initial,
            groups=groups,
            reshard=reshard,
            param_dtype=param_dtype,
            grad_dtype=grad_dtype,
        )
        if self.dp_size > 1:
            broadcast_the_rest(rest, self.process_group, storages[0].param.device)
        registered = {r.name: i for i, r in enumerate(routes)}
        first = [min(registered[p.name] for _, p in s.params) for s in storages]
        exchanged = [b for b in self.plan.buffers if b.kind == "exchange"]
        exchange = None
        if exchanged and gathers:
            exchange = Exchange(
                exchanged[0],
                storages,
                self.shard_rank,
                self.shard_group_size,
                self.shard_group,
                variant.exchange_every,
                groups.group_rank,
            )
        self.scheduler = Scheduler(
            storages,
            sorted(range(len(storages)), key=first.__getitem__),  # forward order
            reduces=self.dp_size > 1 or divide_by > 1,  # experts at dp 1: the average
            gathers=gathers,
            overlap_grad_reduce=cfg.overlap_grad_reduce,
            overlap_param_gather=cfg.overlap_param_gather,
            reshard=reshard,
            agree_group=self.process_group,
            exchange=exchange,
        )
        self.slot_of = {p.name: (b, i) for b in storages for i, (_, p) in enumerate(b.params)}
        self.hooks = hooks.grad_hooks(self.scheduler, storages)
        unit_of = {id(param): b for b in storages for param, _ in b.params}
        on_demand = gathers and (cfg.overlap_param_gather or reshard)
        if on_demand:  # module hooks gather the units as the forward reaches them
            self.hooks += hooks.register(self.scheduler, module, unit_of, reshard=reshard)
        if on_demand or self.fp8_param_gather:  # params can be stale between steps
            self.hooks += hooks.refuse_stale_reads(self.scheduler, module, unit_of)
        if self.fp8_param_gather or (self._fill and (not reshard or exchange is not None)):
            # The owners' values (the first FP8 weights; the holders' pieces of owned matrices).
            self.scheduler.params_updated()
            self.scheduler.finish_param_sync()

    def _make_groups(self, key: tuple[int, bool, int]) -> CommGroupsMade:
        """The comm groups for `key` ([Note: making groups] in `distributed.groups`): with
        two-level groups, also the node and cross groups (a second pair for the gathers when
        they have a group of their own)."""
        k, separate, node_size = key
        made = make_groups(self.process_group, self.dp_size, k, separate)
        if node_size == 1:
            return CommGroupsMade(key, *made)
        levels = make_levels(self.process_group, self.dp_size, k, node_size, None)
        if separate:
            gather = make_levels(self.process_group, self.dp_size, k, node_size, None)
        return CommGroupsMade(key, *made, levels, gather if separate else levels)

    def _fill_initial(self, storage: StorageUnit) -> None:
        """Give a new storage unit its group's first rank's values (or, from `param_init`, its
        owned ones) and, fully sharded, keep only this rank's shards."""
        if self._fill:
            self._fill(storage)
        elif self.dp_size > 1:
            collectives.broadcast_from_first(storage.param, self.process_group)
        if storage.reshard:
            storage.keep_shards()

    def owned(self) -> Iterator[OwnedRange]:
        """What this rank updates of the group's params, in registration order (unit indices
        within the group)."""
        units = {name: b for name, (b, _) in self.slot_of.items()}
        return owned_ranges(self.plan, self.routes, self.shard_rank, units)


def build_storage(
    plan: Plan,
    routes: list[Route],
    specs: Sequence[ParamSpec],
    make: Callable[[str], Callable[..., StorageUnit]],
    fill_initial: Callable[[StorageUnit], None],
    **kwargs: Any,
) -> list[StorageUnit]:
    """One storage per storage unit of `plan` (`planning.units.storage_units`, in reduce
    order), built by `make(buffer kind)`. Each gets its initial values (`fill_initial`) before
    the next is built. `kwargs` go to it after the unit's own arguments."""
    param_of = {r.name: r.param for r in routes}
    placement = {p.name: p for buffer in plan.buffers for p in buffer.placements}
    storages = []
    for unit in storage_units(plan, specs):
        params = [(param_of[name], placement[name]) for name in unit.names]
        storage = make(unit.kind)(unit.index, unit.kind, unit.buckets, params, **kwargs)
        fill_initial(storage)
        storages.append(storage)
    return storages


def broadcast_the_rest(
    tensors: Sequence[torch.Tensor], group: ProcessGroup | None, device: torch.device
) -> None:
    """Give every rank the first's `tensors` (frozen params and buffers). A tensor kept off the
    model's `device` (a CPU table in a CUDA model) travels through a copy on it: NCCL moves
    device tensors only."""
    for t in tensors:
        data = local(t.data)  # a DTensor's: its shard, the same on its data-parallel peers
        if data.device == device:
            collectives.broadcast_from_first(data, group)
            continue
        staged = data.to(device)
        collectives.broadcast_from_first(staged, group)
        data.copy_(staged)
