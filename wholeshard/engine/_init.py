"""The steps that build a `DataParallel` before its `ShardedGroup`s, in the order it takes them.

1. `check_model`: every rank can wrap its module and built the same model (raised everywhere;
   a device NCCL cannot use, on the ranks where it is wrong, before any collective);
2. `common_dtype`: the param dtype when the config gives none, and `cast_frozen`: frozen
   params in it (they stay outside the buffers).
The groups then build their plans, storage units and schedules (`_sharded_group`).
"""

from __future__ import annotations

import os
from collections.abc import Collection
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from ..planning.routing import Route
from ._guard import device_problem, placement_problem


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
    checked already (the experts' group, built after the dense params are in buffers)."""
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
