"""The training job's configuration: `TrainConfig`, in sections, one docstring per field.

The sections (`sections`) live with what they configure (torchtitan's rule): the model, the
data, the optimizer, `parallel` (a `DataParallelConfig`: the library's own options, not a copy
of them), checkpoints, reliability and output. Every field is a `wholeshard train` flag
(`wholeshard.cli.flags`): `--batch-size` for `data.batch_size`, or the name a field declares in
`metadata["flag"]` (`--model` for `model.name`), and a key of a TOML job file
(`wholeshard.train.jobfile`: `batch_size` under `[data]`). Bounds are declared beside each field
(`metadata["min"]`, `["max"]`), choices by `Literal` types, and checked at construction: an
invalid value raises `ConfigError` naming the field (call `validate()` after changing one).
Importing this module does not import torch.
"""

from __future__ import annotations

import dataclasses
import math
import os
import typing
from dataclasses import dataclass, field
from typing import Any

from ..engine.config import ConfigError, DataParallelConfig, literal_choices
from .batch import BatchSplit, split_batch
from .sections import (
    DEFAULT_LR,
    GPT_SIZES,
    HF_CONFIG,
    HF_DIR,
    CheckpointConfig,
    DataConfig,
    ModelConfig,
    OptimConfig,
    OutputConfig,
    ReliabilityConfig,
    at_least,
)

PARALLEL_SET_BY_THE_JOB = frozenset({"matrix_params", "mp_policy", "fp8_param_gather"})
"""`DataParallelConfig` fields the job sets itself (the routing, from `model.param_dtype` and
`model.fp8`), so they are not flags."""


@dataclass
class TrainConfig:
    """Everything `train()` needs. Construction validates: an invalid value raises ConfigError
    (call `validate()` again after changing a field)."""

    seed: int = field(default=0, metadata=at_least(0, high=2**31 - 1))
    """Seeds the model init and the batch order; the same seed, world size and machine give the
    same losses."""
    threads: int | None = field(default=None, metadata=at_least(1, high=1024))
    """CPU threads per process; None divides the available cores among the local processes."""
    tp: int = field(default=1, metadata=at_least(1, high=1024, flag="tp"))
    """Tensor-parallel ranks (world = dp x tp): the byte GPT's blocks in torch's TP styles
    (`models.gpt.BLOCK_TP_STYLES`), Muon on logical matrices (docs/parallelism.md)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: DataParallelConfig = field(default_factory=DataParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    reliability: ReliabilityConfig = field(default_factory=ReliabilityConfig)
    output: OutputConfig = field(default_factory=OutputConfig)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ConfigError naming the field of the first invalid value (`section.field`)."""
        _check_fields(self, "")
        for name in SECTIONS:
            if name != "parallel":  # DataParallelConfig checks itself (frozen: it cannot change)
                _check_fields(getattr(self, name), name + ".")
        self._check_model()
        self._check_tp()
        optim = self.optim
        if optim.qk_clip is not None and not optim.qk_clip > 0:
            raise ConfigError("optim.qk_clip", f"qk_clip must be > 0, got {optim.qk_clip}")
        if optim.lr is not None and not optim.lr > 0:
            raise ConfigError("optim.lr", f"lr must be > 0, got {optim.lr}")
        if not self.reliability.collective_timeout > 0:
            raise ConfigError(
                "reliability.collective_timeout",
                f"collective_timeout must be > 0 seconds, got "
                f"{self.reliability.collective_timeout}",
            )
        if self.reliability.max_restarts and not self.checkpoint.every:
            raise ConfigError(
                "reliability.max_restarts",
                "max_restarts needs checkpoint_every > 0: a restart resumes from the latest "
                "checkpoint (e.g. --checkpoint-every 100)",
            )
        if optim.warmup is not None and not optim.warmup <= optim.steps:
            raise ConfigError(
                "optim.warmup", f"warmup must be in [0, steps={optim.steps}], got {optim.warmup}"
            )
        if optim.name != "muon":
            self._check_adamw()
        for name, default in (("ns_coefficients", "quintic"), ("ns_algorithm", "standard")):
            if getattr(optim, name) != default and optim.matrix_optimizer == "soap":
                raise ConfigError(
                    f"optim.{name}",
                    f"{name} needs a Newton-Schulz rule (--matrix-optimizer muon or normuon); "
                    f"soap does not orthogonalize",
                )
        if optim.newton_schulz != "auto" and optim.matrix_optimizer != "muon":
            raise ConfigError(
                "optim.newton_schulz",
                f"newton_schulz picks how muon runs Newton-Schulz; {optim.matrix_optimizer} "
                f"has its own: leave it auto, or use --matrix-optimizer muon",
            )
        if optim.newton_schulz.startswith("batched") and optim.ns_coefficients != "quintic":
            raise ConfigError(
                "optim.newton_schulz",
                f"newton_schulz {optim.newton_schulz} runs torch's quintic only, not "
                f"{optim.ns_coefficients}: use torch_bf16 (or auto) with it",
            )
        if self.checkpoint.resume in ("latest", "auto") and self.output.out is None:
            raise ConfigError(
                "checkpoint.resume",
                f"resume {self.checkpoint.resume} needs out, the directory of the run to "
                f"continue (e.g. --out runs/a)",
            )

    def _check_tp(self) -> None:
        """`tp` > 1: the byte GPT with its heads split evenly, muon, no FP8, QK-clip or state
        offload."""
        if self.tp == 1:
            return
        from ..models.gpt import SIZES  # (torch: only when asked)

        size = SIZES.get(self.model.name)
        if size is None or self.optim.name != "muon" or self.model.fp8:
            raise ConfigError("tp", "tp > 1 needs the byte GPT, --optimizer muon and no --fp8")
        if size.n_head % self.tp or self.optim.qk_clip is not None:
            raise ConfigError("tp", f"tp={self.tp} must divide {size.n_head} heads; no --qk-clip")
        if self.optim.offload_state:
            raise ConfigError(
                "optim.offload_state",
                "offload_state does not support tensor parallelism yet: drop it or use --tp 1",
            )

    def _check_model(self) -> None:
        """`model.name` is a GPT size, `hf:DIR` or `hf-config:FILE`; GPT options need the GPT."""
        name = self.model.name
        if name in GPT_SIZES:
            if self.data.tokenizer is not None:
                raise ConfigError(
                    "data.tokenizer",
                    f"tokenizer needs a transformers model (--model hf:DIR or "
                    f"hf-config:FILE): the byte GPT ({name}) reads bytes",
                )
            return
        if not name.startswith((HF_DIR, HF_CONFIG)) or name in (HF_DIR, HF_CONFIG):
            raise ConfigError(
                "model.name",
                f"model must be one of {GPT_SIZES}, hf:DIR (a local transformers model "
                f"directory) or hf-config:FILE.json (a transformers config), got {name!r}",
            )
        if self.optim.qk_clip is not None:
            raise ConfigError(
                "optim.qk_clip",
                "qk_clip needs a model that reports its attention logits (the byte GPT: "
                "wholeshard.optim.qk_clip's interface); transformers models do not",
            )
        for option in ("pos", "tie"):
            if getattr(self.model, option) is not None:
                raise ConfigError(
                    f"model.{option}",
                    f"{option} is an option of the byte GPT ({'/'.join(GPT_SIZES)}); a "
                    f"transformers model takes it from its config",
                )

    def data_parallel_size(self, world: int) -> int:
        """The data-parallel ranks of a world of `world` ranks (world = dp x tp); ConfigError,
        naming the field, where the job does not fit that world: `tp` must divide it, and
        `parallel.shard_group_size` and `data.batch_size` must split over its dp ranks
        (`batch_split`), and `parallel.node_size` must divide a shard group that spans nodes.
        The command line checks this before any worker starts, every rank again at its start."""
        if world % self.tp:
            raise ConfigError(
                "tp",
                f"tp={self.tp} does not divide the world of {world} ranks (world = dp x tp); "
                f"use a world that is a multiple of {self.tp} (--nproc) or a tp dividing {world}",
            )
        dp = world // self.tp
        ranks = f"{dp} data-parallel ranks"
        if self.tp > 1:
            ranks += f" ({world} ranks / tp {self.tp})"
        k = self.parallel.shard_group_size
        if k not in (None, "auto") and dp % k:
            divisors = [d for d in range(1, dp + 1) if dp % d == 0]
            raise ConfigError(
                "parallel.shard_group_size",
                f"shard_group_size={k} does not divide the {ranks}: params are sharded within "
                f"groups of that many ranks; choose one of {divisors}, or leave it unset",
            )
        n, k = self.parallel.node_size, dp if k is None else k
        if n is not None and k != "auto" and k > n and k % n:
            raise ConfigError(
                "parallel.node_size",
                f"node_size={n} does not divide the shard group of {k} of the {ranks}: a "
                f"two-level group is whole nodes; pass the data-parallel ranks of a node (a "
                f"divisor of {k}), or leave it unset",
            )
        self.batch_split(dp)
        return dp

    def batch_split(self, dp: int) -> BatchSplit:
        """How `data.batch_size` splits over `dp` data-parallel ranks (per rank, micro-batches);
        ConfigError naming the world sizes that can split it where `dp` cannot."""
        d = self.data
        try:
            return split_batch(d.batch_size, d.micro_batch_size, dp, self.tp)
        except ValueError as e:
            raise ConfigError("data.batch_size", str(e)) from None

    @property
    def is_hf(self) -> bool:
        """Whether `model.name` names a transformers model."""
        return self.model.name not in GPT_SIZES

    def _check_adamw(self) -> None:
        """The AdamW path is torch DDP: wholeshard's modes and checkpoints need muon."""
        default = DataParallelConfig()
        for f in dataclasses.fields(DataParallelConfig):
            if f.name not in ("bucket_size", *PARALLEL_SET_BY_THE_JOB):
                if getattr(self.parallel, f.name) != getattr(default, f.name):
                    raise ConfigError(
                        f"parallel.{f.name}",
                        f"{f.name} needs --optimizer muon (it is a wholeshard DataParallel mode)",
                    )
        optim, default_optim = self.optim, OptimConfig()
        for name in ("matrix_optimizer", "ns_coefficients", "ns_algorithm", "qk_clip",
                     "offload_state"):  # fmt: skip
            if getattr(optim, name) != getattr(default_optim, name):
                raise ConfigError(
                    f"optim.{name}", f"{name} needs --optimizer muon (a wholeshard matrix rule)"
                )
        for name, used in (("every", self.checkpoint.every), ("resume", self.checkpoint.resume)):
            if used:
                raise ConfigError(
                    f"checkpoint.{name}",
                    "checkpoint_every and resume need --optimizer muon (wholeshard checkpoints "
                    "hold DataParallel + LayerwiseOptimizer state)",
                )

    @property
    def peak_lr(self) -> float:
        """The learning rate after warm-up."""
        optim = self.optim
        rule = optim.matrix_optimizer if optim.name == "muon" else optim.name
        return optim.lr if optim.lr is not None else DEFAULT_LR[rule]

    @property
    def checkpoint_dir(self) -> str:
        """Where checkpoints of this run go."""
        return os.path.join(self.output.out or ".", "checkpoints")

    @property
    def resume_path(self) -> str | None:
        """The checkpoint path `checkpoint.resume` names (`latest`, `auto`: this run's
        checkpoint directory)."""
        resume = self.checkpoint.resume
        return self.checkpoint_dir if resume in ("latest", "auto") else resume

    @property
    def warmup_steps(self) -> int:
        """`optim.warmup`, or 5% of `optim.steps` when not set."""
        warmup = self.optim.warmup
        return warmup if warmup is not None else max(1, self.optim.steps // 20)

    @property
    def lr_schedule(self) -> dict[str, Any]:
        """The learning-rate schedule's settings (`lr_schedule.lr_factor`'s keyword arguments)."""
        o = self.optim
        return dict(
            steps=o.steps, warmup=self.warmup_steps, schedule=o.schedule, min_ratio=o.min_lr_ratio
        )


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "optim": OptimConfig,
    "parallel": DataParallelConfig,
    "checkpoint": CheckpointConfig,
    "reliability": ReliabilityConfig,
    "output": OutputConfig,
}
"""`TrainConfig`'s sections and their classes, in the order `--help` lists them."""


def _check_fields(obj: Any, prefix: str) -> None:
    """`Literal` choices, finiteness and bounds (`metadata["min"]`, `["max"]`) of the plain
    fields of dataclass `obj`; raise ConfigError naming `prefix + field`."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        if f.name in SECTIONS:
            continue
        value, where = getattr(obj, f.name), prefix + f.name
        name = f.metadata.get("flag", f.name).replace("-", "_")  # as the user spells it
        if value is None and type(None) in typing.get_args(hints[f.name]):
            continue  # (None where the annotation admits it: `keep_last=None` keeps all)
        choices = literal_choices(hints[f.name])
        if choices is not None and value not in choices:
            raise ConfigError(where, f"{name} must be one of {choices}, got {value!r}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(where, f"{name} must be a finite number, got {value}")
        low, high = f.metadata.get("min"), f.metadata.get("max")
        if low is not None and not value >= low:
            raise ConfigError(where, f"{name} must be >= {low}, got {value}")
        if high is not None and value > high:
            raise ConfigError(where, f"{name} must be <= {high:,}, got {value}")
