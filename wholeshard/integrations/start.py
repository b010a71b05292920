"""What every framework integration checks when training starts (issue 36's "no silent
fallback"): which params go to the matrix rule and which to AdamW (logged on rank 0), a refusal
when no matrix goes to the matrix rule unless AdamW alone is intended (then the framework trains
as it does without wholeshard), the framework set up for as many processes as torch.distributed
has, no other data-parallel wrapper around the `DataParallel`, and the `LayerwiseOptimizer` over
it as the optimizer. Each check raises on every rank alike
(`DataParallel` checks at construction that every rank built the same model and routing).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from ..engine.config import DataParallelConfig
from ..engine.data_parallel import DataParallel
from ..optim.layerwise import LayerwiseOptimizer
from ..planning.routing import MatrixParams, Route, route_params
from ..planning.specs import matrix_count

_WRAPPER_FIX = (
    "wholeshard.DataParallel reduces the gradients itself: wrap the model in it alone and let "
    "the wholeshard integration hand it to the framework (it tells the framework not to wrap it "
    "again)"
)


@dataclass(frozen=True)
class RoutingCounts:
    """How many matrices and params go to the matrix rule and how many tensors and params to
    AdamW (a stack counts as its matrices; a tied param once)."""

    matrices: int
    matrix_params: int
    adamw_tensors: int
    adamw_params: int

    @classmethod
    def of(cls, routes: list[Route]) -> RoutingCounts:
        matrix = [r for r in routes if r.matrix]
        adamw = [r for r in routes if not r.matrix]
        return cls(
            matrices=sum(matrix_count(r.shape) for r in matrix),
            matrix_params=sum(math.prod(r.shape) for r in matrix),
            adamw_tensors=len(adamw),
            adamw_params=sum(math.prod(r.shape) for r in adamw),
        )

    def summary(self, rule: str = "Muon") -> str:
        """One line, what an integration logs when training starts."""
        return (
            f"wholeshard routing: {self.matrices} matrices ({self.matrix_params:,} params) to "
            f"{rule}, {self.adamw_tensors} tensors ({self.adamw_params:,} params) to AdamW"
        )


def check_routing(
    module: nn.Module,
    matrix_params: MatrixParams | None = None,
    *,
    adamw_only: bool = False,
    rule: str = "Muon",
) -> RoutingCounts | None:
    """The routing counts of `module` (not yet wrapped) with `matrix_params`; None when no
    matrix goes to the matrix rule and `adamw_only` says that is intended (the framework then
    trains without wholeshard). Raises ValueError when no matrix does and `adamw_only` is
    False, and where `route_params` raises."""
    counts = RoutingCounts.of(route_params(module, matrix_params, require_matrix=False))
    if counts.matrices > 0:
        return counts
    if adamw_only:
        return None
    raise ValueError(
        f"no param goes to the matrix rule ({rule}): all {counts.adamw_tensors} trainable "
        f"tensors would train with AdamW. Route the matrices with a matrix_params predicate "
        f"(docs/routing.md), or pass adamw_only=True if AdamW alone is intended (the framework "
        f"then trains without wholeshard)"
    )


def check_process_count(framework: str, processes: int, fix: str) -> None:
    """Raises ValueError, naming `fix`, when `framework` is set up for `processes` processes
    but torch.distributed has another number: the framework would not shard the batches, so
    every rank would train on the same ones (each rank computes the same counts: it raises on
    every rank)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if processes != world:
        raise ValueError(
            f"{framework} is set up for {processes} process(es) but torch.distributed has "
            f"{world}: {framework} would not shard the batches (every rank would train on the "
            f"same ones). {fix}"
        )


def data_parallel_of(model: nn.Module) -> DataParallel:
    """`model`, checked to be a `DataParallel` that no other data-parallel wrapper wraps (a
    foreign one inside it is refused at its construction)."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, (DistributedDataParallel, FullyShardedDataParallel, FSDPModule)):
        raise TypeError(
            f"the model the framework trains is a {type(model).__name__} around a "
            f"wholeshard.DataParallel: every gradient would be reduced twice. {_WRAPPER_FIX}"
        )
    if not isinstance(model, DataParallel):
        raise TypeError(
            f"the model the framework trains is a {type(model).__name__}, not a "
            f"wholeshard.DataParallel: wrap it (wholeshard.DataParallel(model)) before training"
        )
    return model


def check_optimizer(model: nn.Module, optimizer: Any) -> LayerwiseOptimizer:
    """`optimizer` (unwrapped from the framework's wrapper), checked to be the
    `LayerwiseOptimizer` over `model`, a `DataParallel` (`data_parallel_of`)."""
    ddp = data_parallel_of(model)
    if not isinstance(optimizer, LayerwiseOptimizer):
        raise TypeError(
            f"the optimizer is a {type(optimizer).__name__}: over a wholeshard.DataParallel the "
            f"params' .grad is always None, so it would step nothing. Use "
            f"wholeshard.LayerwiseOptimizer(ddp, matrix=..., adamw=...)"
        )
    if optimizer.ddp is not ddp:
        raise ValueError(
            "the LayerwiseOptimizer was built over another wholeshard.DataParallel than the "
            "model being trained: build it over the trained one"
        )
    return optimizer


def data_parallel_config(
    given: DataParallelConfig | dict[str, Any] | None,
    matrix_params: MatrixParams | None = None,
    param_dtype: torch.dtype = torch.float32,
) -> DataParallelConfig:
    """The `DataParallelConfig` an integration wraps with: `given` (a config or a dict of its
    fields), with `matrix_params` as its routing predicate when given, and, where it sets no
    `mp_policy` and the framework trains `param_dtype` params other than float32 (bf16), those
    params with gradients reduced in float32."""
    config = given if isinstance(given, DataParallelConfig) else DataParallelConfig(**(given or {}))
    if matrix_params is not None:
        config = dataclasses.replace(config, matrix_params=matrix_params)
    if config.mp_policy is None and param_dtype != torch.float32:
        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        config = dataclasses.replace(config, mp_policy=policy)
    return config
