"""transformers' `Trainer` with wholeshard: `WholeshardTrainer`, and `WholeshardTrainerMixin` for
trainers built on `Trainer` (`class MyTrainer(WholeshardTrainerMixin, trl.SFTTrainer)`).

What the mixin changes, through `Trainer`'s own extension points (its overridable methods):
- the model is wrapped in `DataParallel` once, at construction, after `Trainer` placed it and
  before Accelerate sees it; `_wrap_model` hands out that wrapper, so Accelerate never wraps
  the model (no torch DDP, no autocast patch) and evaluation and prediction run through it
  (current params in every mode);
- the optimizer is a `LayerwiseOptimizer` whose defaults come from `TrainingArguments`
  (`optimizer_kwargs`); `Trainer`'s LR scheduler drives both of its param groups; its routing
  line is printed on the world process zero, as `Trainer` prints its logs;
- clipping (`max_grad_norm`) and the logged `grad_norm` are the global norm
  (`LayerwiseOptimizer.clip_grad_norm_`, through `_clip_grad_norm` and `_get_grad_norm`); with
  `max_grad_norm > 0` a step whose gradients it did not clip raises (a `Trainer` that stopped
  calling `_clip_grad_norm` would clip nothing: [Note: clipping the framework asked for]); all
  but the last micro-batch of an accumulation run under `ddp.no_sync()`, so gradients are
  reduced once per optimizer step;
- checkpoints (`save_steps`, `resume_from_checkpoint`) hold the model and optimizer as a
  wholeshard checkpoint (`checkpoint-N/wholeshard/step-N`: any world size) beside the
  `from_pretrained` directory `save_model()` writes and `Trainer`'s scheduler, RNG and state
  files; `load_best_model_at_end` loads the best one's wholeshard checkpoint.
`bf16=True` trains bf16 params with fp32 masters and fp32 gradient reduction; `fp16=True`,
`model_init`, a non-default `optim` or any `optim_args`, and `save_only_model` with
`load_best_model_at_end` are refused. When no matrix goes to the matrix rule and
`adamw_only=True`, the trainer is `Trainer` itself, unchanged (its `optim` honoured). Either
way `TrainingArguments` set up for another number of processes than torch.distributed has (on
CPU under torchrun without `use_cpu=True`) are refused: every rank would train on the same
batches.
Needs `pip install 'wholeshard[hf]'`.
"""

from __future__ import annotations

import dataclasses
import logging as pylogging
import os
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn
from transformers.utils import logging

from ..checkpoint import hf_extra, load_checkpoint, save_checkpoint
from ..engine.config import DataParallelConfig
from ..engine.data_parallel import DataParallel
from ..optim.layerwise import LayerwiseOptimizer
from ..planning.routing import MatrixParams
from .start import check_optimizer, check_process_count, check_routing, data_parallel_config

logger = logging.get_logger(__name__)

CHECKPOINT_DIR = "wholeshard"
"""Where in a `Trainer` checkpoint (`checkpoint-N/`) the wholeshard checkpoint lives."""
SCHEDULER_NAME = "scheduler.pt"  # Trainer's name for its LR scheduler's state
TORCH_ADAMW = ("adamw_torch", "adamw_torch_fused")
"""`optim` names of torch's AdamW (fused or not), which `LayerwiseOptimizer` runs on the params
that do not go to the matrix rule."""
_PROCESS_FIX = (
    "On CPU pass TrainingArguments(use_cpu=True) (Accelerate's multi-process CPU mode); on "
    "GPUs start the processes with torchrun, which sets LOCAL_RANK"
)


def optimizer_kwargs(args: transformers.TrainingArguments) -> dict[str, dict[str, Any]]:
    """`LayerwiseOptimizer`'s `matrix` and `adamw` keyword arguments from `args`: AdamW from
    `learning_rate`, `weight_decay`, `adam_beta1/2`, `adam_epsilon`; `torch.optim.Muon` with its
    own defaults at the same `learning_rate` and `weight_decay`, its update scaled to AdamW's
    RMS (`adjust_lr_fn="match_rms_adamw"`), so one learning rate serves both."""
    lr, decay = args.learning_rate, args.weight_decay
    return {
        "matrix": dict(lr=lr, weight_decay=decay, adjust_lr_fn="match_rms_adamw"),
        "adamw": dict(
            lr=lr,
            weight_decay=decay,
            betas=(args.adam_beta1, args.adam_beta2),
            eps=args.adam_epsilon,
        ),
    }


def check_optim(args: transformers.TrainingArguments) -> None:
    """Raises ValueError when `args` chooses an optimizer `LayerwiseOptimizer` would not run:
    an `optim` other than its field's default (in `type(args)` or `TrainingArguments`, so a
    config's own default passes) or torch's AdamW, or any `optim_args`."""
    chosen = getattr(args.optim, "value", args.optim)
    defaults = {
        f.default
        for cls in (type(args), transformers.TrainingArguments)
        for f in dataclasses.fields(cls)
        if f.name == "optim"
    }
    given = []
    if chosen not in {*TORCH_ADAMW, *defaults}:
        given.append(f"optim={chosen!r}")
    if args.optim_args:
        given.append(f"optim_args={args.optim_args!r}")
    if given:
        raise ValueError(
            f"WholeshardTrainer got TrainingArguments({', '.join(given)}), which it would "
            f"ignore: it steps a LayerwiseOptimizer (the matrix rule on the matrices, torch's "
            f"AdamW on the rest). Leave optim at its default and pass matrix=, adamw=, "
            f"matrix_optimizer= to set it up"
        )


class WholeshardTrainerMixin:
    """Train `Trainer`'s model with `DataParallel` and `LayerwiseOptimizer`; put it before
    `transformers.Trainer` (or a subclass) in the bases.

    Keyword arguments, beside the trainer's own:
        data_parallel: a `DataParallelConfig` (or a dict of its fields); without `mp_policy`,
            `bf16=True` gives bf16 params with fp32 gradient reduction.
        matrix, adamw: keyword arguments replacing `optimizer_kwargs(args)`'s defaults.
        matrix_optimizer: the matrix rule (`torch.optim.Muon` by default).
        matrix_params: the routing predicate (`wholeshard.route_params`).
        adamw_only: when no matrix goes to the matrix rule, train with `Trainer` unchanged
            instead of refusing.

    `self.model` stays the transformers model; `self.model_wrapped` (and `self.ddp`) is its
    `DataParallel`; `self.wholeshard_routing` the `RoutingCounts` logged at the start.
    """

    ddp: DataParallel | None

    def __init__(
        self,
        *args: Any,
        data_parallel: DataParallelConfig | dict[str, Any] | None = None,
        matrix: dict[str, Any] | None = None,
        adamw: dict[str, Any] | None = None,
        matrix_optimizer: type[torch.optim.Optimizer] = torch.optim.Muon,
        matrix_params: MatrixParams | None = None,
        adamw_only: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        targs = self.args
        check_process_count("Trainer", targs.world_size, _PROCESS_FIX)
        if self.model_init is not None:
            raise ValueError(
                "WholeshardTrainer does not support model_init (the model is wrapped once, at "
                "construction): pass model=... instead"
            )
        if targs.fp16:
            raise ValueError(
                "WholeshardTrainer does not support fp16=True (a GradScaler reads .grad, which "
                "stays None under wholeshard.DataParallel): use bf16=True"
            )
        if self.optimizer is not None:
            raise TypeError(
                f"Trainer got optimizers=({type(self.optimizer).__name__}, ...): "
                f"WholeshardTrainer builds its LayerwiseOptimizer itself; pass matrix=, adamw=, "
                f"matrix_optimizer= to set it up (a torch optimizer would step nothing)"
            )
        rule = getattr(matrix_optimizer, "__name__", str(matrix_optimizer))
        dtype = torch.bfloat16 if targs.bf16 else torch.float32
        config = data_parallel_config(data_parallel, matrix_params, dtype)
        self.wholeshard_routing = check_routing(
            self.model, config.matrix_params, adamw_only=adamw_only, rule=rule
        )
        self.ddp = None
        if self.wholeshard_routing is None:
            logger.warning("no matrix goes to the matrix rule: training with Trainer unchanged")
            return
        check_optim(targs)
        if targs.save_only_model and targs.load_best_model_at_end:
            raise ValueError(
                "WholeshardTrainer does not support save_only_model=True with "
                "load_best_model_at_end=True (as Trainer refuses it with FSDP): the best model "
                f"loads from the checkpoint's {CHECKPOINT_DIR}/ part, which save_only_model does "
                f"not write. Drop save_only_model, or load_best_model_at_end"
            )
        self.ddp = DataParallel(self.model, config)
        self.model_wrapped = self.ddp
        defaults = optimizer_kwargs(targs)
        self._layerwise = dict(
            matrix={**defaults["matrix"], **(matrix or {})},
            adamw={**defaults["adamw"], **(adamw or {})},
            matrix_optimizer=matrix_optimizer,
        )
        self._rule = rule
        self._owned_optimizer: LayerwiseOptimizer | None = None

    # -- the model and the optimizer ------------------------------------------------------

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> Any:
        if self.ddp is None:
            return super()._wrap_model(model, training, dataloader)
        return self.ddp  # Accelerate sees a wrapped model and leaves it alone

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        if self.ddp is None:
            return super().create_optimizer(model)
        if self.optimizer is None:
            self._owned_optimizer = LayerwiseOptimizer(self.ddp, **self._layerwise)
            self.optimizer = self._owned_optimizer
            check_optimizer(self.ddp, self._owned_optimizer)
            self._print_routing()
        return self.optimizer

    def _print_routing(self) -> None:
        """Print the routing line on the world process zero, as `Trainer` prints its logs,
        unless the process's log level (`log_level`; by default transformers' verbosity,
        WARNING) is above WARNING: seen by default, silenced with transformers' output."""
        if self.is_world_process_zero() and self.args.get_process_log_level() <= pylogging.WARNING:
            print(self.wholeshard_routing.summary(self._rule), flush=True)

    @property
    def layerwise_optimizer(self) -> LayerwiseOptimizer:
        """The `LayerwiseOptimizer` (`self.optimizer` may be Accelerate's wrapper of it)."""
        if self._owned_optimizer is None:
            raise RuntimeError("the optimizer is created when training starts (train())")
        return self._owned_optimizer

    # -- the step -------------------------------------------------------------------------

    def training_step(self, model: nn.Module, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        if self.ddp is not None and self._owned_optimizer is not None:
            clip = self.args.max_grad_norm  # the step raises unless `_clip_grad_norm` clipped
            source = f"TrainingArguments(max_grad_norm={clip})"
            self._owned_optimizer.expect_clipping(clip if clip and clip > 0 else None, source)
        if self.ddp is None or self.accelerator.sync_gradients:
            return super().training_step(model, inputs, *args, **kwargs)
        with self.ddp.no_sync():  # Accelerate's no_sync is a no-op in one process
            return super().training_step(model, inputs, *args, **kwargs)

    def _clip_grad_norm(self, model: nn.Module) -> Any:
        if self.ddp is None:
            return super()._clip_grad_norm(model)
        return self.layerwise_optimizer.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        if self.ddp is None:
            return super()._get_grad_norm(model, grad_norm)
        if grad_norm is None:  # the norm alone: scaling by 1 changes no gradient
            grad_norm = self.layerwise_optimizer.clip_grad_norm_(float("inf"))
        return grad_norm.item()

    # -- saving and loading ---------------------------------------------------------------

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write a `from_pretrained` directory of the current params (every rank must call it,
        as `Trainer` does; the main process writes)."""
        if self.ddp is None:
            return super().save_model(output_dir, _internal_call)
        with self.ddp.full_params():
            super().save_model(output_dir, _internal_call)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self.ddp is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        extra = {"step": self.state.global_step, "hf": hf_extra(self.model, self.processing_class)}
        save_checkpoint(
            Path(output_dir) / CHECKPOINT_DIR, self.ddp, self.layerwise_optimizer, extra=extra
        )
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(
        self, resume_from_checkpoint: str, model: nn.Module | None = None
    ) -> None:
        if self.ddp is None or not (Path(resume_from_checkpoint) / CHECKPOINT_DIR).is_dir():
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        # The params come with the optimizer's state (`_load_optimizer_and_scheduler`).

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if self.ddp is None or checkpoint is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        load_checkpoint(self._saved(checkpoint, "to resume"), self.ddp, self.layerwise_optimizer)
        scheduler = torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True)
        self.lr_scheduler.load_state_dict(scheduler)

    def _load_best_model(self) -> None:
        """`load_best_model_at_end`: the best checkpoint's params (fp32 masters and optimizer
        state with them) into the wrapper, in every mode (`Trainer` would copy the
        `from_pretrained` weights into the module's params, which reaches neither the
        masters nor, fully sharded, the shards)."""
        if self.ddp is None:
            return super()._load_best_model()
        best = self.state.best_model_checkpoint
        logger.info(f"Loading best model from {best} (score: {self.state.best_metric}).")
        saved = self._saved(best, "to load the best model from")
        load_checkpoint(saved, self.ddp, self.layerwise_optimizer)

    @staticmethod
    def _saved(checkpoint: str, purpose: str) -> Path:
        """The wholeshard checkpoint in `Trainer` checkpoint `checkpoint`; raises naming why
        there is none."""
        saved = Path(checkpoint) / CHECKPOINT_DIR
        if not saved.is_dir():
            raise FileNotFoundError(
                f"{checkpoint} holds no wholeshard checkpoint ({CHECKPOINT_DIR}/), so it has no "
                f"params and optimizer state {purpose}: it was saved with save_only_model=True "
                f"(the from_pretrained weights alone) or not by a WholeshardTrainer"
            )
        return saved


class WholeshardTrainer(WholeshardTrainerMixin, transformers.Trainer):
    """`transformers.Trainer` training with `DataParallel` and `LayerwiseOptimizer`
    (`WholeshardTrainerMixin` says what changes and which keyword arguments it adds)."""
