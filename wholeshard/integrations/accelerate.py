"""Accelerate loops with wholeshard: `WholeshardAccelerator`, an `accelerate.Accelerator` that
prepares a `DataParallel` and its `LayerwiseOptimizer` without wrapping them again.

    ddp = wholeshard.DataParallel(model)
    opt = wholeshard.LayerwiseOptimizer(ddp, matrix=..., adamw=...)
    accelerator = WholeshardAccelerator(gradient_accumulation_steps=2)
    ddp, opt, loader, sched = accelerator.prepare(ddp, opt, loader, sched)

What changes, through `Accelerator`'s own methods (the loop is Accelerate's, unchanged):
- `prepare` registers a `DataParallel` as prepared (Accelerate's autocast applies; no torch
  DDP, no device move) and its `LayerwiseOptimizer` in Accelerate's optimizer wrapper (steps
  and `zero_grad` skipped while accumulating); dataloaders and schedulers are Accelerate's.
  It refuses a trainable model that is not a `DataParallel` (Accelerate would wrap it in torch
  DDP and train it without wholeshard: use `accelerate.Accelerator` when AdamW alone is
  intended), any other optimizer, and fp16 (a GradScaler reads `.grad`, which stays None).
  It prints (main process, `Accelerator.print`: shown without any logging set up) what goes
  to the matrix rule and what to AdamW.
- `accumulate` / `no_sync` run a `DataParallel`'s micro-batches under `ddp.no_sync()` (also in
  one process): gradients are reduced once per optimizer step.
- `clip_grad_norm_(ddp.parameters(), max_norm)` clips by the global norm
  (`LayerwiseOptimizer.clip_grad_norm_`) and returns it; these methods check the params
  themselves (not through Accelerate's or torch's internals): some of a `DataParallel`'s
  params, or `clip_grad_value_` over wrapped params, raise naming the fix.
- `save_state` / `load_state` keep a `DataParallel` and its optimizer as a wholeshard
  checkpoint (`<dir>/wholeshard`, loadable at any world size; the other files are
  Accelerate's: scheduler, RNG, dataloader states, registered objects).
- `unwrap_model` peels the `DataParallel` (as it peels torch DDP) and `get_state_dict` gathers
  the full params, so `unwrap_model(m).save_pretrained(d, state_dict=get_state_dict(m))`
  writes a `from_pretrained` directory.
Needs `pip install 'wholeshard[hf]'` (Accelerate).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import accelerate
import torch
from torch import nn

from ..checkpoint import load_checkpoint, save_checkpoint
from ..engine.data_parallel import DataParallel
from ..optim.layerwise import LayerwiseOptimizer
from .start import RoutingCounts, check_optimizer, check_process_count, data_parallel_of

CHECKPOINT_DIR = "wholeshard"
"""Where in a `save_state` directory the wholeshard checkpoint lives (`wholeshard_1`, ... for
a second model)."""


class WholeshardAccelerator(accelerate.Accelerator):
    """`accelerate.Accelerator` for `DataParallel` models stepped by `LayerwiseOptimizer` (the
    module docstring says what changes). Takes `Accelerator`'s arguments."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.mixed_precision == "fp16":
            raise ValueError(
                "WholeshardAccelerator does not support mixed_precision='fp16' (its GradScaler "
                "reads .grad, which stays None under wholeshard.DataParallel): use 'bf16', or "
                "bf16 params (DataParallel(model, mp_policy=MixedPrecisionPolicy(...)))"
            )
        self.wholeshard_models: list[DataParallel] = []
        self._layerwise: dict[int, LayerwiseOptimizer] = {}  # id(ddp) -> its optimizer
        self.register_save_state_pre_hook(self._save_wholeshard)
        self.register_load_state_pre_hook(self._load_wholeshard)

    # -- preparing ------------------------------------------------------------------------

    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        """`Accelerator.prepare`, with each `DataParallel` and `LayerwiseOptimizer` registered
        as they are (the others prepared by Accelerate, in the same order)."""
        placements = list(device_placement) if device_placement else [None] * len(args)
        if len(placements) != len(args):
            raise ValueError(f"device_placement has {len(placements)} entries for {len(args)}")
        models = [a for a in args if isinstance(a, DataParallel)]
        for a in args:
            if _prepared(a):
                continue
            if isinstance(a, nn.Module) and not isinstance(a, DataParallel):
                if any(p.requires_grad for p in a.parameters()):
                    data_parallel_of(a)  # raises, naming the fix
            elif isinstance(a, torch.optim.Optimizer):
                self._check_optimizer(a, models)
        result: list[Any] = list(args)
        rest = []
        for i, a in enumerate(args):
            if isinstance(a, DataParallel) and not _prepared(a):
                result[i] = self._prepare_data_parallel(a)
            elif isinstance(a, LayerwiseOptimizer) and not _prepared(a):
                self._layerwise[id(a.ddp)] = a
                result[i] = self.prepare_optimizer(a, device_placement=False)
            else:
                rest.append(i)
                continue
            result[i]._is_accelerate_prepared = True  # as Accelerator.prepare marks its own
        if rest:
            done = super().prepare(
                *(args[i] for i in rest), device_placement=[placements[i] for i in rest]
            )
            for i, obj in zip(rest, done if len(rest) > 1 else (done,), strict=True):
                result[i] = obj
        return tuple(result) if len(result) > 1 else result[0]

    def _prepare_data_parallel(self, ddp: DataParallel) -> DataParallel:
        fix = (
            "On CPU pass WholeshardAccelerator(cpu=True) (Accelerate's multi-process CPU mode); "
            "build the accelerator before the DataParallel"
        )
        check_process_count("Accelerate", self.num_processes, fix)
        self.prepare_model(ddp, device_placement=False, evaluation_mode=True)  # autocast, no DDP
        self.wholeshard_models.append(ddp)
        self.print(RoutingCounts.of(ddp.routes).summary("the matrix rule"))  # the main process's
        return ddp

    def _check_optimizer(
        self, optimizer: torch.optim.Optimizer, models: list[DataParallel]
    ) -> None:
        known = models + self.wholeshard_models
        if not isinstance(optimizer, LayerwiseOptimizer):
            check_optimizer(_first(known), optimizer)  # raises, naming the fix
        elif not any(m is optimizer.ddp for m in known):
            raise ValueError(
                "the LayerwiseOptimizer's DataParallel is not prepared: pass it to prepare() "
                "with its optimizer (accelerator.prepare(ddp, optimizer, ...))"
            )

    # -- the step -------------------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """`Accelerator.no_sync`; for a `DataParallel`, `ddp.no_sync()` in any number of
        processes (the accumulated gradients are reduced once, at the last micro-batch)."""
        if isinstance(model, DataParallel):
            with model.no_sync():
                yield
        else:
            with super().no_sync(model):
                yield

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2
    ) -> torch.Tensor:
        """`Accelerator.clip_grad_norm_`; over every param of a prepared `DataParallel`, its
        `LayerwiseOptimizer.clip_grad_norm_` (the global norm, on every rank). Other wrapped
        params are refused; params no `DataParallel` wraps are Accelerate's."""
        params = list(parameters)
        layerwise = self._layerwise_over(params)
        if layerwise is None:
            return super().clip_grad_norm_(params, max_norm, norm_type)
        return layerwise.clip_grad_norm_(max_norm, norm_type)

    def clip_grad_value_(self, parameters: Iterable[torch.Tensor], clip_value: float) -> None:
        """`Accelerator.clip_grad_value_` over params no `DataParallel` wraps; wrapped params
        are refused (their `.grad` stays None): clip those by the global norm."""
        params = list(parameters)
        wrapped = _wrapped_names(params)
        if wrapped:
            raise ValueError(
                f"WholeshardAccelerator.clip_grad_value_ cannot clip {wrapped[0]!r} (and "
                f"{len(wrapped) - 1} more wrapped params): their .grad stays None under "
                f"wholeshard.DataParallel, which keeps the gradients in its units. Clip by the "
                f"global norm instead: accelerator.clip_grad_norm_(model.parameters(), max_norm) "
                f"(LayerwiseOptimizer.clip_grad_norm_)"
            )
        super().clip_grad_value_(params, clip_value)

    def _layerwise_over(self, params: list[torch.Tensor]) -> LayerwiseOptimizer | None:
        """The prepared `LayerwiseOptimizer` whose `DataParallel`'s params are exactly `params`;
        None when no `DataParallel` wraps any of them; raises naming the fix otherwise (torch's
        or Accelerate's clipping would see no gradient for a wrapped param)."""
        wrapped = _wrapped_names(params)
        if not wrapped:
            return None
        ids = {id(p) for p in params}
        for ddp in self.wholeshard_models:
            if ids == {id(p) for p in ddp.parameters()} and id(ddp) in self._layerwise:
                return self._layerwise[id(ddp)]
        raise RuntimeError(
            f"accelerator.clip_grad_norm_ got {len(params)} params, {len(wrapped)} of them "
            f"wrapped by wholeshard.DataParallel ({wrapped[0]!r}, ...), but not exactly the "
            f"params of a DataParallel prepared with its LayerwiseOptimizer: their .grad stays "
            f"None, so they are clipped only all together, by the global norm, through that "
            f"optimizer. "
            f"Prepare both (accelerator.prepare(ddp, optimizer, ...)) and pass every param "
            f"(accelerator.clip_grad_norm_(model.parameters(), max_norm)), which calls "
            f"LayerwiseOptimizer.clip_grad_norm_(max_norm)"
        )

    # -- the model ------------------------------------------------------------------------

    def unwrap_model(
        self, model: nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True
    ) -> nn.Module:
        """`Accelerator.unwrap_model`, peeling a `DataParallel` too (read its params inside
        `ddp.full_params()`, or through `get_state_dict`)."""
        model = super().unwrap_model(model, keep_fp32_wrapper, keep_torch_compile)
        return model.module if isinstance(model, DataParallel) else model

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """`Accelerator.get_state_dict`; for a `DataParallel`, the unwrapped model's full
        params and buffers (copies, gathered on every rank: every rank must call it)."""
        if not isinstance(model, DataParallel):
            return super().get_state_dict(model, unwrap)
        with model.full_params():
            return {k: v.detach().clone() for k, v in model.module.state_dict().items()}

    # -- saving and loading ---------------------------------------------------------------

    def save_state(
        self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs: Any
    ) -> Any:
        """`Accelerator.save_state`, each `DataParallel` and its optimizer written as a wholeshard
        checkpoint in `<dir>/wholeshard` (every rank writes what it owns)."""
        with self._accelerate_sees_no_wholeshard():
            return super().save_state(output_dir, safe_serialization, **kwargs)

    def load_state(
        self, input_dir: str | None = None, load_kwargs: dict | None = None, **kwargs: Any
    ) -> None:
        """`Accelerator.load_state`; a `DataParallel` and its optimizer load from the wholeshard
        checkpoint (saved at any world size)."""
        with self._accelerate_sees_no_wholeshard():
            super().load_state(input_dir, load_kwargs, **kwargs)

    @contextlib.contextmanager
    def _accelerate_sees_no_wholeshard(self) -> Iterator[None]:
        """Accelerate's own saving and loading without the wholeshard models and optimizers
        (its `optimizer.bin` would hold rank 0's owned state alone)."""
        for ddp in self.wholeshard_models:
            if id(ddp) not in self._layerwise:
                raise ValueError(
                    "save_state/load_state keep a wholeshard.DataParallel with its "
                    "LayerwiseOptimizer: prepare the optimizer too (accelerator.prepare(ddp, opt))"
                )
        models, optimizers = self._models, self._optimizers
        self._models = [m for m in models if not isinstance(m, DataParallel)]
        self._optimizers = [
            o for o in optimizers if not isinstance(o.optimizer, LayerwiseOptimizer)
        ]
        try:
            yield
        finally:
            self._models, self._optimizers = models, optimizers

    def _checkpoints(self, directory: str) -> list[tuple[Path, DataParallel, LayerwiseOptimizer]]:
        """Each prepared `DataParallel`'s checkpoint in `directory`, with its optimizer."""
        return [
            (Path(directory) / checkpoint_name(i), ddp, self._layerwise[id(ddp)])
            for i, ddp in enumerate(self.wholeshard_models)
        ]

    def _save_wholeshard(self, models: list, weights: list, output_dir: str) -> None:
        for path, ddp, opt in self._checkpoints(output_dir):
            save_checkpoint(path, ddp, opt)

    def _load_wholeshard(self, models: list, input_dir: str) -> None:
        for path, ddp, opt in self._checkpoints(input_dir):
            if not path.is_dir():
                raise FileNotFoundError(
                    f"{input_dir} holds no wholeshard checkpoint ({path.name}/): it was not "
                    f"saved by a WholeshardAccelerator with this model, so it has no sharded "
                    f"optimizer state to resume from"
                )
            load_checkpoint(path, ddp, opt)


def checkpoint_name(i: int) -> str:
    """Where in a `save_state` directory the `i`-th prepared `DataParallel`'s checkpoint lives."""
    return CHECKPOINT_DIR if i == 0 else f"{CHECKPOINT_DIR}_{i}"


def _wrapped_names(params: list[torch.Tensor]) -> list[str]:
    """The names of those of `params` a `DataParallel` wraps."""
    return [name for name in map(DataParallel.wrapped_name, params) if name is not None]


def _prepared(obj: Any) -> bool:
    return bool(getattr(obj, "_is_accelerate_prepared", False))


def _first(models: list[DataParallel]) -> DataParallel:
    if not models:
        raise TypeError(
            "WholeshardAccelerator steps wholeshard.LayerwiseOptimizer over a prepared "
            "wholeshard.DataParallel: wrap the model, build the optimizer over the wrapper and "
            "prepare both (accelerator.prepare(ddp, LayerwiseOptimizer(ddp, ...), ...))"
        )
    return models[0]
