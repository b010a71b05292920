"""What the Lightning Trainer strategy and the Fabric strategy share: the `LayerwiseOptimizer`
over the wrapped module (`layerwise_optimizer`), finding it behind Lightning's optimizer
wrappers, and a checkpoint as a directory.

A checkpoint is a directory: `wholeshard/` holds the params and optimizer state as a wholeshard
checkpoint (every rank writes what it owns; it loads at any world size and plan), `meta.pt`
(rank 0's) the rest of what Lightning saves (loop and scheduler states, counters, hparams).
Outside fit (validation, test, prediction of a module no `DataParallel` wraps) only its params
are read (`load_params`).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import nn

from ...checkpoint import load_checkpoint, load_consolidated, save_checkpoint
from ...engine.config import DataParallelConfig
from ...engine.data_parallel import DataParallel
from ...optim.layerwise import LayerwiseOptimizer
from ...planning.routing import MatrixParams
from ..start import check_optimizer, check_routing, data_parallel_config

CHECKPOINT_DIR = "wholeshard"
"""Where in a Lightning checkpoint directory the wholeshard checkpoint lives."""
META_FILE = "meta.pt"
"""Rank 0's file in a Lightning checkpoint directory: everything but params and optimizers."""


class WrappingOptions:
    """The options both strategies take (before their `DDPStrategy`'s keyword arguments), and
    how they wrap a module.

    Args:
        data_parallel: a `DataParallelConfig`, or a dict of its fields; without `mp_policy`, a
            module whose params are not float32 ("bf16-true") reduces gradients in float32.
        matrix_params: the routing predicate (`wholeshard.route_params`).
        adamw_only: when no matrix goes to the matrix rule, train with torch DDP (the plain
            "ddp" strategy) instead of refusing.
    """

    def __init__(
        self,
        data_parallel: DataParallelConfig | dict[str, Any] | None = None,
        *,
        matrix_params: MatrixParams | None = None,
        adamw_only: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.dp_config = data_parallel_config(data_parallel, matrix_params)
        self.adamw_only = adamw_only

    def wrap(self, module: nn.Module) -> DataParallel | None:
        """`module` in a `DataParallel` (the routing logged on rank 0), or None when no matrix
        goes to the matrix rule and `adamw_only` says that is intended (raises otherwise)."""
        routing = check_routing(module, self.dp_config.matrix_params, adamw_only=self.adamw_only)
        if routing is None:
            rank_zero_info("wholeshard: no matrix goes to the matrix rule: training with DDP")
            return None
        dtype = next(module.parameters()).dtype
        ddp = DataParallel(module, data_parallel_config(self.dp_config, param_dtype=dtype))
        rank_zero_info(routing.summary())
        return ddp


def layerwise_optimizer(model: nn.Module, **kwargs: Any) -> LayerwiseOptimizer:
    """A `LayerwiseOptimizer(ddp, **kwargs)` over the `DataParallel` that wraps `model`: a
    `LightningModule` trained under `WholeshardStrategy` (call it in `configure_optimizers`),
    the module `fabric.setup_module` returned under `WholeshardFabricStrategy`, or the
    `DataParallel` itself."""
    return LayerwiseOptimizer(data_parallel_around(model), **kwargs)


def data_parallel_around(model: nn.Module) -> DataParallel:
    """The `DataParallel` training `model` (see `layerwise_optimizer`)."""
    forward = getattr(model, "_forward_module", None)  # Fabric's module wrapper
    if isinstance(model, DataParallel):
        return model
    if isinstance(forward, DataParallel):
        return forward
    trainer = getattr(model, "_trainer", None)
    wrapped = getattr(getattr(trainer, "strategy", None), "model", None)
    if isinstance(wrapped, DataParallel) and wrapped.module is model:
        return wrapped
    raise TypeError(
        f"{type(model).__name__} is not trained by a wholeshard.DataParallel: call "
        f"layerwise_optimizer(self, ...) in configure_optimizers of a LightningModule trained "
        f"with strategy=WholeshardStrategy(), or pass it the module fabric.setup_module(...) "
        f"returned under WholeshardFabricStrategy"
    )


def layerwise_of(optimizer: Any, ddp: DataParallel | None = None) -> LayerwiseOptimizer:
    """The `LayerwiseOptimizer` behind Lightning's wrappers of `optimizer` (over `ddp` when
    given); raises naming the fix when it is another optimizer."""
    while hasattr(optimizer, "_optimizer"):  # LightningOptimizer, Fabric's _FabricOptimizer
        optimizer = optimizer._optimizer
    if ddp is None and isinstance(optimizer, LayerwiseOptimizer):
        return optimizer
    try:
        return check_optimizer(ddp if ddp is not None else _no_model(), optimizer)
    except TypeError as e:
        raise TypeError(f"{e} (in Lightning: layerwise_optimizer(module, ...))") from e


def _no_model() -> DataParallel:
    raise TypeError(
        "a wholeshard strategy steps a wholeshard.LayerwiseOptimizer: build it with "
        "layerwise_optimizer(module, ...)"
    )


def save_directory(
    path: Path, ddp: DataParallel, optimizer: LayerwiseOptimizer, meta: dict[str, Any], main: bool
) -> None:
    """Write checkpoint directory `path` (a file of that name is replaced); every rank calls it,
    `main` (rank 0) writes `meta`."""
    if main:
        if path.is_file():
            path.unlink()
        elif (path / CHECKPOINT_DIR).is_dir():
            shutil.rmtree(path / CHECKPOINT_DIR)  # the new one replaces it, as a file would be
        path.mkdir(parents=True, exist_ok=True)
    if dist.is_initialized():
        dist.barrier()  # the directory is ready before any rank writes
    save_checkpoint(path / CHECKPOINT_DIR, ddp, optimizer)
    if main:
        torch.save(meta, path / META_FILE)


def is_directory(path: Path) -> bool:
    """Whether `path` is a checkpoint directory a wholeshard strategy saved."""
    return (path / CHECKPOINT_DIR).is_dir()


def load_directory(
    path: Path, ddp: DataParallel, optimizer: LayerwiseOptimizer, weights_only: bool | None
) -> dict[str, Any]:
    """Load checkpoint directory `path` into `ddp` and `optimizer` (saved at any world size);
    return its `meta` (unpickled in full unless `weights_only`)."""
    if not is_directory(path):
        raise FileNotFoundError(
            f"{path} is not a checkpoint a wholeshard strategy saved (no {CHECKPOINT_DIR}/ in "
            f"it): Lightning's own checkpoint files hold no sharded optimizer state"
        )
    load_checkpoint(path / CHECKPOINT_DIR, ddp, optimizer)
    return _meta(path, weights_only)


def load_params(path: Path, weights_only: bool | None) -> dict[str, Any]:
    """Checkpoint directory `path` as Lightning's checkpoint dict for a module no
    `DataParallel` wraps (validation, test, prediction): `meta` with the full params as its
    `state_dict` (read whole on every rank), which Lightning loads into the module."""
    params, _ = load_consolidated(path / CHECKPOINT_DIR)
    return {**_meta(path, weights_only), "state_dict": params}


def _meta(path: Path, weights_only: bool | None) -> dict[str, Any]:
    # Lightning's own `meta` (hparams, loop states) needs full unpickling; True restricts it.
    return torch.load(path / META_FILE, weights_only=bool(weights_only))
