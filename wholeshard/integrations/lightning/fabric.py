"""`WholeshardFabricStrategy`: `lightning.fabric.Fabric` training a module wrapped in
`DataParallel` and stepped by `LayerwiseOptimizer`.

Built on Fabric's `DDPStrategy` (its launchers, process group and collectives), as Fabric's
DeepSpeed strategy is; what changes:
- `fabric.setup_module(model)` wraps the model in `DataParallel` (the routing logged on rank 0;
  no matrix to the matrix rule is refused unless `adamw_only=True`, which trains with torch
  DDP instead); then `fabric.setup_optimizers(layerwise_optimizer(model, ...))`. A joint
  `fabric.setup(model, optimizer)` is refused: the optimizer must be built over the wrapper;
- `fabric.no_backward_sync(model)` is `ddp.no_sync()`: one reduction per optimizer step;
- `fabric.clip_gradients(model, optimizer, max_norm=...)` clips by the global norm and returns
  it; `clip_val=` (by value) is refused;
- `fabric.save(path, state)` / `fabric.load(path, state)` write and read a directory: the
  module and its optimizer as a wholeshard checkpoint (any world size), the other entries
  (scheduler states, counters) in rank 0's `meta.pt`, loaded back into `state` as Fabric does.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from torch import nn

from ...engine.data_parallel import DataParallel
from ..start import check_routing
from .common import WrappingOptions, layerwise_of, load_directory, save_directory


class WholeshardFabricStrategy(WrappingOptions, DDPStrategy):
    """`Fabric(strategy=WholeshardFabricStrategy(...))` (the module docstring says what
    changes). Arguments: `WrappingOptions`', then Fabric `DDPStrategy`'s."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._backward_sync_control = _NoSync()
        self.wrapped: list[DataParallel] = []

    def setup_module(self, module: nn.Module) -> nn.Module:
        if getattr(self.precision, "scaler", None) is not None:
            raise ValueError(
                "WholeshardFabricStrategy does not support fp16 mixed precision (its GradScaler "
                "reads .grad, which stays None under wholeshard.DataParallel): use 'bf16-mixed', "
                "'bf16-true' or '32-true'"
            )
        ddp = self.wrap(module)
        if ddp is None:
            return super().setup_module(module)
        self.wrapped.append(ddp)
        return ddp

    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list, scheduler: Any = None
    ) -> Any:
        if check_routing(module, self.dp_config.matrix_params, adamw_only=True) is None:
            return super().setup_module_and_optimizers(module, optimizers, scheduler)
        raise RuntimeError(
            "WholeshardFabricStrategy sets up the module before its optimizer (the optimizer "
            "steps the wrapper's buffers): model = fabric.setup_module(model); optimizer = "
            "fabric.setup_optimizers(layerwise_optimizer(model, matrix=..., adamw=...))"
        )

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        if self.wrapped:
            layerwise = layerwise_of(optimizer)  # raises naming the fix
            if not any(ddp is layerwise.ddp for ddp in self.wrapped):
                raise ValueError(
                    "the LayerwiseOptimizer is over a DataParallel this strategy did not set up: "
                    "build it with layerwise_optimizer(fabric.setup_module(model), ...)"
                )
        return super().setup_optimizer(optimizer)

    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        if not isinstance(module, DataParallel):
            return super().clip_gradients_norm(
                module, optimizer, max_norm, norm_type, error_if_nonfinite
            )
        return layerwise_of(optimizer, module).clip_grad_norm_(max_norm, norm_type)

    def clip_gradients_value(self, module: nn.Module, optimizer: Any, clip_val: float) -> None:
        if not isinstance(module, DataParallel):
            return super().clip_gradients_value(module, optimizer, clip_val)
        raise ValueError(
            "WholeshardFabricStrategy does not clip by value (the wrapped params' .grad "
            "stays None: the gradients live in wholeshard.DataParallel's units): "
            "fabric.clip_gradients(model, optimizer, max_norm=...) clips by the global norm"
        )

    # -- checkpoints ----------------------------------------------------------------------

    def save_checkpoint(
        self,
        path: str | os.PathLike,
        state: dict[str, Any],
        storage_options: Any | None = None,
        filter: dict[str, Any] | None = None,
    ) -> None:
        found = _ours(state)
        if found is None:
            return super().save_checkpoint(path, state, storage_options, filter)
        if storage_options is not None or filter:
            raise TypeError(
                "WholeshardFabricStrategy.save_checkpoint takes no storage_options, filter"
            )
        ddp, optimizer, rest = found
        meta = {k: v.state_dict() if _stateful(v) else v for k, v in rest.items()}
        save_directory(Path(self.broadcast(path)), ddp, optimizer, meta, self.is_global_zero)

    def load_checkpoint(
        self,
        path: str | os.PathLike,
        state: Any = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        found = _ours(state) if isinstance(state, dict) else None
        if found is None:
            return super().load_checkpoint(path, state, strict, weights_only)
        ddp, optimizer, rest = found
        meta = load_directory(Path(self.broadcast(path)), ddp, optimizer, weights_only)
        missing = sorted(set(rest) - set(meta))
        if strict and missing:
            raise KeyError(f"the checkpoint at {path} holds no {missing} (pass strict=False)")
        for name, obj in rest.items():
            if name in meta:
                if _stateful(obj):
                    obj.load_state_dict(meta.pop(name))
                else:
                    state[name] = meta.pop(name)
        return meta


def _stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def _ours(state: dict[str, Any]) -> tuple[DataParallel, Any, dict[str, Any]] | None:
    """The `DataParallel` in `state`, its `LayerwiseOptimizer` and the other entries; None
    when `state` holds no `DataParallel`."""
    models = {k: v for k, v in state.items() if isinstance(v, DataParallel)}
    if not models:
        return None
    optimizers = {k: v for k, v in state.items() if isinstance(v, torch.optim.Optimizer)}
    others = [k for k, v in state.items() if isinstance(v, nn.Module) and k not in models]
    if len(models) != 1 or len(optimizers) != 1 or others:
        raise TypeError(
            f"a wholeshard checkpoint holds one model and its optimizer: the state has modules "
            f"{sorted(models) + others} and optimizers {sorted(optimizers)}"
        )
    (ddp,) = models.values()
    (optimizer,) = optimizers.values()
    rest = {k: v for k, v in state.items() if k not in models and k not in optimizers}
    return ddp, layerwise_of(optimizer, ddp), rest


class _NoSync(_BackwardSyncControl):
    """`fabric.no_backward_sync(model)`: `no_sync()` of the `DataParallel` (or, with
    `adamw_only`, of torch's DDP)."""

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> Any:
        if not enabled:
            return contextlib.nullcontext()
        if not callable(getattr(module, "no_sync", None)):
            raise TypeError(f"{type(module).__name__} has no no_sync(): set it up with fabric")
        return module.no_sync()
