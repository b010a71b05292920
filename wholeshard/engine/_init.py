"""The steps that build a `DataParallel`, in the order its constructor takes them.

1. `check_model`: every rank can wrap its module and built the same model (raised everywhere;
   a device NCCL cannot use, on the ranks where it is wrong, before any collective);
2. `cast_frozen`: frozen params in the param dtype (`common_dtype` when the config gives none;
   they stay outside the buffers), and `plan_routes`: the plan of the trainable params;
3. `build_storage`: one `StorageUnit` per storage unit of the plan, in reduce order, each
   given rank 0's values (and, fully sharded, reduced to this rank's shards) before the next
   is built, so at most one full unit exists beside the model;
   (from the meta device, `param_init`: each unit filled with this rank's owned params,
   [Note: meta-device construction] in `_meta`);
4. `broadcast_the_rest`: frozen params and buffers from rank 0;
5. `forward_order`: the order the next forward needs the units in.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from ..distributed import collectives
from ..distributed.dtensor import local
from ..planning import ParamSpec, Placement, Plan
from ..planning.auto import plan_for
from ..planning.routing import Route
from ._fp8_storage import fp8_storage_factory
from ._guard import device_problem, placement_problem
from ._storage import StorageUnit
from ._unaligned_storage import UnalignedStorage
from .config import DataParallelConfig, Variant

StorageFactory = Callable[..., StorageUnit]
"""`factory(index, kind, buckets, params, groups, *, reshard, param_dtype, grad_dtype)`."""


def check_model(
    module: nn.Module,
    routes: list[Route],
    group: ProcessGroup | None,
    dp: int,
    placeholders: Collection[nn.Parameter] = frozenset(),
    placed: bool = False,
) -> None:
    """Raise on every rank if any rank's module cannot be wrapped or ranks built different
    models, naming the rank and the first difference. `placed`: the module's placement was
    checked already (the experts' wrapper, built after the dense params are in buffers)."""
    problem = None if placed else placement_problem(module, placeholders)
    if dp == 1:
        if problem is not None:
            raise ValueError(f"cannot wrap the model: {problem}")
        return
    if problem is None:  # before the first collective, which would fail on a wrong device
        check_device(routes[0].param.device, group)
    mine = [(r.name, r.shape, str(r.param.dtype), r.matrix) for r in routes]
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (problem, mine), group=group)
    for rank, (theirs, _) in enumerate(everyone):
        if theirs is not None:
            raise ValueError(f"cannot wrap the model of rank {rank}: {theirs}")
    reference = everyone[0][1]
    for rank, (_, theirs) in enumerate(everyone[1:], start=1):
        if theirs == reference:
            continue
        for i in range(max(len(reference), len(theirs))):
            a = reference[i] if i < len(reference) else "<missing>"
            b = theirs[i] if i < len(theirs) else "<missing>"
            if a != b:
                raise RuntimeError(
                    f"ranks built different models: param #{i} is {a} on rank 0 but {b} on "
                    f"rank {rank} (fields: name, shape, dtype, routed to Muon). Build the same "
                    f"model with the same routing on every rank."
                )


def cast_frozen(module: nn.Module, dtype: torch.dtype) -> list[nn.Parameter]:
    """Cast every floating-point param with `requires_grad=False` to `dtype` in place (same
    Parameter objects) and return them. Buffers keep their dtype, as with FSDP2's
    `MixedPrecisionPolicy`."""
    frozen = []
    for p in module.parameters():
        if not p.requires_grad:
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)
            frozen.append(p)
    return frozen


def build_storage(
    plan: Plan,
    routes: list[Route],
    make: StorageFactory,
    fill_initial: Callable[[StorageUnit], None],
    **kwargs: Any,
) -> list[StorageUnit]:
    """One storage per storage unit of every buffer of `plan`, in reduce (backprop) order: the
    unit holding the latest-registered param first. Each gets its initial values (`fill_initial`)
    before the next is built. `kwargs` go to `make` after the unit's own arguments."""
    registered = {r.name: i for i, r in enumerate(routes)}
    param_of = {r.name: r.param for r in routes}
    units = []  # (kind, buckets, [(param, placement)])
    for buffer in plan.buffers:
        bucket_runs = buffer.storage_units()
        run_of = {b: n for n, run in enumerate(bucket_runs) for b in run}
        members: list[list[tuple[nn.Parameter, Placement]]] = [[] for _ in bucket_runs]
        for p in buffer.placements:
            members[run_of[p.bucket]].append((param_of[p.name], p))
        for run, params in zip(bucket_runs, members, strict=True):
            units.append((buffer.kind, buffer.buckets[run.start : run.stop], params))
    units.sort(key=lambda unit: -max(registered[p.name] for _, p in unit[2]))
    storages = []
    for index, (kind, buckets, params) in enumerate(units):
        storage = make(index, kind, buckets, params, **kwargs)
        fill_initial(storage)
        storages.append(storage)
    return storages


def storage_factory(module: nn.Module, fp8_param_gather: bool) -> StorageFactory:
    """What builds each storage unit: by buffer kind, and FP8 storage where it gathers FP8."""
    fp8 = fp8_storage_factory(module) if fp8_param_gather else StorageUnit

    def make(index: int, kind: str, *args: Any, **kwargs: Any) -> StorageUnit:
        cls = UnalignedStorage if kind == "unaligned" else fp8
        return cls(index, kind, *args, **kwargs)

    return make


def check_device(device: torch.device, group: ProcessGroup | None) -> None:
    """Raise (on this rank, before any collective) if NCCL cannot run on `device`
    (`_guard.device_problem`)."""
    if device.type != "cuda" or dist.get_backend(group) != "nccl":
        return
    pg = group or dist.distributed_c10d._get_default_group()
    problem = device_problem(
        device,
        backend="nccl",
        current=torch.cuda.current_device(),
        bound=pg.bound_device_id,
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        local_world=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        visible=torch.cuda.device_count(),
    )
    if problem is not None:
        raise ValueError(f"cannot wrap the model: {problem}")


def broadcast_the_rest(
    tensors: Sequence[torch.Tensor], group: ProcessGroup | None, device: torch.device
) -> None:
    """Give every rank rank 0's `tensors` (frozen params and buffers). A tensor kept off the
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


def forward_order(storages: Sequence[StorageUnit], routes: list[Route]) -> list[int]:
    """Indices of `storages` in forward order: the unit holding the earliest-registered param
    first."""
    registered = {r.name: i for i, r in enumerate(routes)}
    first = [min(registered[p.name] for _, p in s.params) for s in storages]
    return sorted(range(len(storages)), key=first.__getitem__)


def plan_routes(
    routes: list[Route], cfg: DataParallelConfig, variant: Variant, dp_size: int
) -> Plan:
    """The plan of the routed params (`planning.auto.plan_for`: the config's bucket size or
    the default for the shard group, its shard group size or the automatic choice): the
    decision alone, no report (that is `wholeshard.capacity.choice`'s)."""
    specs = [ParamSpec(r.name, r.shape, r.matrix, r.tied) for r in routes]
    return plan_for(
        specs,
        dp_size,
        bucket_size=cfg.bucket_size,
        strategy=variant.strategy,
        shard_group_size=cfg.shard_group_size,
        scheme=variant.scheme,
        matrix_cost=cfg.matrix_cost,
    )


def common_dtype(routes: list[Route]) -> torch.dtype:
    """The one floating dtype of the trainable params (`param_dtype=None`)."""
    dtypes = {r.param.dtype for r in routes}
    if len(dtypes) > 1 or not next(iter(dtypes)).is_floating_point:
        raise ValueError(
            f"the trainable params have dtypes {sorted(map(str, dtypes))}, but the buffers hold "
            f"one floating dtype: pass mp_policy=MixedPrecisionPolicy(param_dtype=...) (e.g. "
            f"torch.bfloat16 or torch.float32)"
        )
    return dtypes.pop()
