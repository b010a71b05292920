"""`WholeshardStrategy`: `lightning.pytorch.Trainer` training a `LightningModule` wrapped in
`DataParallel` and stepped by `LayerwiseOptimizer`.

Built as Lightning builds its own strategies on DDP's process setup (DeepSpeed's does the same):
it keeps `DDPStrategy`'s launchers, process group and collectives, and changes what DDP does to
the model and its gradients:
- the `LightningModule` is wrapped in `DataParallel` when fitting (`configure_ddp`), so every
  training, validation and test step runs through the wrapper (current params in every loop);
  the routing is logged on rank 0 and a model with no matrix to the matrix rule is refused
  unless `adamw_only=True` (then it trains with torch DDP, as the plain "ddp" strategy);
- `configure_optimizers` returns `layerwise_optimizer(self, ...)` (any other optimizer is
  refused), with an LR scheduler config as usual;
- `accumulate_grad_batches` runs all but the last micro-batch under `ddp.no_sync()`
  (`block_backward_sync`): one reduction per optimizer step;
- `gradient_clip_val` with the "norm" algorithm clips by the global norm
  (`LayerwiseOptimizer.clip_grad_norm_`, through the precision plugin's `clip_grad_by_norm`);
  `grad_norm` is that norm at the last clipped step; the "value" algorithm is refused; a step
  it did not clip raises (a Lightning that stopped calling `clip_grad_by_norm` would clip by
  each rank's own norm: [Note: clipping the framework asked for]), unless the module
  overrides `configure_gradient_clipping`;
- `trainer.save_checkpoint(path)` (and so `ModelCheckpoint`) and `fit(ckpt_path=path)` write
  and read a directory (`common`: a wholeshard checkpoint, any world size, beside rank 0's
  `meta.pt`); `validate/test/predict(ckpt_path=path)` load its params into the module (into
  the wrapper, with the optimizer's state, when the module was fitted by this strategy).
Precision "32-true", "bf16-mixed" (autocast), "bf16-true" (bf16 params, fp32 masters and fp32
reduction); "16-mixed" on a GPU is refused (its GradScaler reads `.grad`, which stays None).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.strategies import DDPStrategy

from ...engine.data_parallel import DataParallel
from .common import (
    WrappingOptions,
    is_directory,
    layerwise_of,
    load_directory,
    load_params,
    save_directory,
)


class WholeshardStrategy(WrappingOptions, DDPStrategy):
    """`Trainer(strategy=WholeshardStrategy(...))` (the module docstring says what changes).
    Arguments: `WrappingOptions`', then `DDPStrategy`'s (`start_method`, `timeout`, ...)."""

    strategy_name = "wholeshard"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._wrapper: DataParallel | None = None  # kept after fit, for a later fit or save

    @property
    def data_parallel(self) -> DataParallel | None:
        """The wrapper of the module: while fitting, and after (validation, test, prediction
        and checkpoints of the fitted module see it); None before, or with torch DDP."""
        if isinstance(self.model, DataParallel):
            return self.model
        wrapper = self._wrapper  # outside fit Lightning hands the strategy the bare module
        return wrapper if wrapper is not None and wrapper.module is self.model else None

    # -- the model and the optimizers ----------------------------------------------------

    def configure_ddp(self) -> None:
        module = self.model
        if self._wrapper is not None and self._wrapper.module is module:
            self.model = self._wrapper  # fit again: the module is still wrapped
            return
        wrapper = self.wrap(module)
        if wrapper is None:
            return super().configure_ddp()
        self.model = self._wrapper = wrapper

    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        ddp = self.data_parallel
        if ddp is not None:
            for optimizer in self.optimizers:
                layerwise = layerwise_of(optimizer, ddp)  # raises naming the fix
                layerwise.expect_clipping(*_expected_clipping(trainer))

    @property
    def precision_plugin(self) -> Precision:
        plugin = self._precision_plugin
        return plugin if plugin is not None else _GlobalNormPrecision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        self._precision_plugin = None if plugin is None else _clipping_globally(plugin)

    @property
    def grad_norm(self) -> torch.Tensor | None:
        """The global gradient norm before clipping at the last clipped step (None before)."""
        return getattr(self._precision_plugin, "grad_norm", None)

    # -- the step -------------------------------------------------------------------------

    def block_backward_sync(self) -> Any:
        ddp = self.data_parallel
        return ddp.no_sync() if ddp is not None else super().block_backward_sync()

    def teardown(self) -> None:
        ddp = self.data_parallel
        if ddp is None:
            return super().teardown()
        ddp.finish_param_sync()  # the module's params current after fit
        # DDPStrategy's teardown, but the module stays wrapped and where it is (its params are
        # views of the wrapper's buffers: moving it to the CPU would cut them off), so that
        # trainer.save_checkpoint after fit and a later fit work.
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    # -- checkpoints ----------------------------------------------------------------------

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the optimizer exists when the checkpoint is loaded

    @property
    def lightning_restore_optimizer(self) -> bool:
        return self.data_parallel is None

    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self.data_parallel is None:
            return super().lightning_module_state_dict()
        return {}  # the params are saved in the wholeshard checkpoint

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        if self.data_parallel is None:
            return super().optimizer_state(optimizer)
        return {}

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        if self.data_parallel is None:
            super().load_model_state_dict(checkpoint, strict)

    def save_checkpoint(
        self,
        checkpoint: dict[str, Any],
        filepath: str | os.PathLike,
        storage_options: Any | None = None,
    ) -> None:
        ddp = self.data_parallel
        if ddp is None:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if storage_options is not None:
            raise TypeError("WholeshardStrategy.save_checkpoint takes no storage_options")
        (optimizer,) = self.optimizers
        meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        path = Path(self.broadcast(filepath))
        save_directory(path, ddp, layerwise_of(optimizer, ddp), meta, self.is_global_zero)

    def load_checkpoint(
        self, checkpoint_path: str | os.PathLike, weights_only: bool | None = None
    ) -> Any:
        ddp = self.data_parallel
        if ddp is None and is_directory(Path(checkpoint_path)):
            return load_params(Path(checkpoint_path), weights_only)  # validate/test/predict
        if ddp is None:
            return super().load_checkpoint(checkpoint_path, weights_only)
        (optimizer,) = self.optimizers
        path = Path(self.broadcast(checkpoint_path))
        meta = load_directory(path, ddp, layerwise_of(optimizer, ddp), weights_only)
        return {**meta, "state_dict": {}}


def _expected_clipping(trainer: Any) -> tuple[float | None, str]:
    """The norm each step must be clipped to, and the setting that asks ([Note: clipping the
    framework asked for]): `gradient_clip_val` with the "norm" algorithm, under automatic
    optimization, unless the module overrides `configure_gradient_clipping` (then it decides)."""
    import lightning.pytorch as pl
    from lightning.pytorch.utilities.model_helpers import is_overridden

    clip, module = trainer.gradient_clip_val, trainer.lightning_module
    algorithm = trainer.gradient_clip_algorithm or "norm"
    own = is_overridden("configure_gradient_clipping", module, pl.LightningModule)
    if not clip or algorithm != "norm" or own or not module.automatic_optimization:
        return None, ""
    return float(clip), f"Trainer(gradient_clip_val={clip})"


class _GlobalNormClipping:
    """Clipping by the global norm, for a precision plugin over a `DataParallel`."""

    grad_norm: torch.Tensor | None = None

    def clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        self.grad_norm = layerwise_of(optimizer).clip_grad_norm_(clip_val)

    def clip_grad_by_value(self, optimizer: Any, clip_val: float) -> None:
        raise ValueError(
            "WholeshardStrategy does not clip by value (the wrapped params' .grad stays "
            "None: the gradients live in wholeshard.DataParallel's units): use "
            "gradient_clip_algorithm='norm', which clips by the global norm"
        )


class _GlobalNormPrecision(_GlobalNormClipping, Precision):
    pass


class _GlobalNormMixedPrecision(_GlobalNormClipping, MixedPrecision):
    pass


class _GlobalNormHalfPrecision(_GlobalNormClipping, HalfPrecision):
    pass


_CLIPPING = {
    Precision: _GlobalNormPrecision,
    MixedPrecision: _GlobalNormMixedPrecision,
    HalfPrecision: _GlobalNormHalfPrecision,
}


def _clipping_globally(plugin: Precision) -> Precision:
    """`plugin`, its class swapped for the subclass that clips by the global norm (the
    subclasses add methods, no state)."""
    if isinstance(plugin, _GlobalNormClipping):
        return plugin
    if getattr(plugin, "scaler", None) is not None:
        raise ValueError(
            f"WholeshardStrategy does not support precision={plugin.precision!r} (a GradScaler "
            f"reads .grad, which stays None under wholeshard.DataParallel): use 'bf16-mixed', "
            f"'bf16-true' or '32-true'"
        )
    if type(plugin) not in _CLIPPING:
        raise TypeError(
            f"WholeshardStrategy supports Lightning's Precision, MixedPrecision and "
            f"HalfPrecision plugins, not {type(plugin).__name__} (its gradient clipping reads "
            f".grad, which stays None under wholeshard.DataParallel)"
        )
    plugin.__class__ = _CLIPPING[type(plugin)]
    return plugin
