"""The training job's configuration: `TrainConfig`, in sections, one docstring per field.

Sections live with what they configure (torchtitan's rule): the model, the data, the optimizer,
`parallel` (a `DataParallelConfig`: the library's own options, not a copy of them),
checkpoints, reliability and output. Every field is a `wholeshard train` flag
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
import sys
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from ..engine.config import ConfigError, DataParallelConfig, literal_choices

DEFAULT_LR = {"muon": 1e-2, "normuon": 3e-2, "soap": 3e-3, "adamw": 2e-3}
"""Peak learning rate per matrix rule (the muon path) or for the adamw path, when `optim.lr` is
not given (tuned on the tiny model)."""


def _at_least(low: float, *, flag: str | None = None, high: float | None = None) -> dict:
    meta = {"min": low, "max": high, "flag": flag}
    return {k: v for k, v in meta.items() if v is not None}


GPT_SIZES = ("micro", "tiny", "small")
"""The byte-level GPT's sizes (`wholeshard.models.gpt.SIZES`), by `model.name`."""

HF_DIR, HF_CONFIG = "hf:", "hf-config:"
"""`model.name` prefixes of a transformers model directory and of a transformers config file."""


@dataclass
class ModelConfig:
    """The model: the byte-level GPT (`wholeshard.models.gpt`) or a transformers causal LM."""

    name: str = field(default="tiny", metadata={"flag": "model"})
    """`tiny` (~2M params), `small` (~20M) or `micro` (~0.1M, for smoke tests): the byte-level
    GPT; `hf:DIR`: a local transformers model directory (its config, its weights if present,
    its tokenizer if present; nothing is downloaded); `hf-config:FILE.json`: any transformers
    causal-LM config, random init."""
    pos: Literal["rope", "learned"] | None = None
    """The byte GPT's position encoding, `rope` or `learned`; None takes the model size's."""
    tie: bool | None = None
    """Tie the byte GPT's output head to its embedding; None takes the model size's."""
    gradient_checkpointing: bool = False
    """Recompute each transformer block's activations in backward instead of keeping them
    (less memory, about one more forward of compute)."""
    param_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Compute dtype of forward/backward (the optimizers keep fp32 masters); `auto` takes
    bfloat16 where the hardware has fast bf16 matmuls, else float32."""
    fp8: Literal["mxfp8", "tensorwise"] | None = None
    """FP8 compute for the matrix-routed linear layers (`wholeshard.fp8.convert`), their weights
    gathered as FP8 (muon): `mxfp8` or `tensorwise`; None: off."""


@dataclass
class DataConfig:
    """The text and how it is cut into batches."""

    path: str | None = field(default=None, metadata={"flag": "data"})
    """What to train on: a text file or a directory of them, or `.jsonl`, `.json` or `.parquet`
    files (or a directory of them) read with Hugging Face `datasets`; None uses the Python
    standard library's sources."""
    text_field: str = field(default="text", metadata={"flag": "data-field"})
    """The text field of each record of `.jsonl`, `.json` and `.parquet` data."""
    tokenizer: str | None = None
    """A local tokenizer directory (transformers `AutoTokenizer`); None takes the model's own
    (`hf:DIR` with tokenizer files), else the text is read as bytes (needs a vocab >= 256)."""
    val_fraction: float = field(default=0.05, metadata=_at_least(0.001, high=0.5))
    """Fraction of the text (in equal blocks spread over it) held out for validation."""
    cache_dir: str | None = None
    """Where tokenized data is cached (memory-mapped token ids keyed by the data files, their
    sizes and mtimes, and the tokenizer); None: `token-cache` beside the output directory."""
    batch_size: int = field(default=32, metadata=_at_least(1))
    """Global batch in sequences per step; each rank takes a contiguous 1/world slice of it."""
    seq_len: int = field(default=128, metadata=_at_least(1, high=65536))
    """Tokens (bytes, for byte-level data) per training sequence: the context length."""


@dataclass
class OptimConfig:
    """The optimizer and its schedule."""

    name: Literal["muon", "adamw"] = field(default="muon", metadata={"flag": "optimizer"})
    """`muon`: wholeshard DataParallel + LayerwiseOptimizer; `adamw`: torch DDP + AdamW."""
    matrix_optimizer: Literal["muon", "normuon", "soap"] = "muon"
    """The rule stepping the hidden matrices (muon path): `muon` (torch's Muon), `normuon`
    (Muon with per-row second moments), `soap` (Shampoo-preconditioned Adam); AdamW steps the
    rest."""
    ns_coefficients: Literal["quintic", "polar_express"] = "quintic"
    """Newton-Schulz coefficients of `muon` and `normuon`: the fixed quintic or the Polar
    Express schedule."""
    ns_algorithm: Literal["standard", "gram"] = "standard"
    """How `muon` and `normuon` run Newton-Schulz: `standard`, or `gram` (the same iterations in
    fewer flops, on symmetric Gram products: `wholeshard.optim.gram_ns`; not bitwise the
    standard's)."""
    qk_clip: float | None = field(default=None, metadata=_at_least(0, flag="qk-clip"))
    """MuonClip: after each step, scale the query and key rows of every attention head whose
    largest pre-softmax logit exceeded this (needs a model that reports them: the byte GPT);
    None: off."""
    steps: int = field(default=300, metadata=_at_least(1))
    """Optimizer steps to run."""
    lr: float | None = None
    """Peak learning rate for every param group; None takes `DEFAULT_LR` of the matrix rule
    (muon path) or of adamw, tuned on the tiny model."""
    weight_decay: float = field(default=0.0, metadata=_at_least(0))
    """Decoupled weight decay for every param group."""
    warmup: int | None = field(default=None, metadata=_at_least(0))
    """Linear warm-up steps; None takes 5% of `steps`."""
    schedule: Literal["cosine", "wsd"] = "cosine"
    """After warm-up: `cosine` decay, or `wsd` (constant, then linear decay over the last 20%)."""
    min_lr_ratio: float = field(default=0.0, metadata=_at_least(0, high=1))
    """Final learning rate as a fraction of the peak."""
    clip_grad: float = field(default=1.0, metadata=_at_least(0))
    """Clip the global gradient norm to this; 0 disables clipping (the norm is still logged)."""
    on_nonfinite: Literal["error", "skip"] = "error"
    """What an inf or nan in the averaged gradients does: `error` stops the job (exit 1) naming
    the param and the step, `skip` skips that update (`skipped: true` in metrics.jsonl). A
    non-finite loss always stops the job, before the update."""


@dataclass
class CheckpointConfig:
    """Checkpoints of the muon path (`wholeshard.checkpoint`)."""

    every: int = field(default=0, metadata=_at_least(0, flag="checkpoint-every"))
    """Save a checkpoint to `<out>/checkpoints` every this many steps (0: never)."""
    keep_last: int | None = field(default=3, metadata=_at_least(1))
    """Keep this many newest checkpoints (None: all)."""
    resume: str | None = None
    """Resume from a checkpoint: a `step-N` directory, a checkpoints directory, `latest` (the
    latest in `<out>/checkpoints`, which must exist) or `auto` (that one if there is one, else
    start at step 0: the choice for torchrun's `--max-restarts`); the run continues in `out`."""


@dataclass
class ReliabilityConfig:
    """What happens when a rank dies or stalls."""

    collective_timeout: float = 300.0
    """Seconds any collective may wait for the other ranks before this rank fails, saying a peer
    likely died or stalled; every process group the job creates carries it."""
    max_restarts: int = field(default=0, metadata=_at_least(0))
    """Local launcher: after a worker fails, stop all workers and relaunch the job from the
    latest checkpoint in `<out>/checkpoints`, at most this many times (needs checkpoint_every).
    Under torchrun, use torchrun's own `--max-restarts` with `--resume auto`."""


@dataclass
class OutputConfig:
    """What the job writes and shows."""

    out: str | None = None
    """Output directory (metrics.jsonl, loss.png, summary.json); None means `runs/<timestamp>`."""
    eval_every: int = field(default=50, metadata=_at_least(1))
    """Evaluate the validation loss every this many steps (and before the first and after the
    last step)."""
    eval_batches: int = field(default=8, metadata=_at_least(1))
    """Global batches of validation text per evaluation (the same windows every time)."""
    log_every: int = field(default=1, metadata=_at_least(1))
    """Write a `metrics.jsonl` record every this many steps."""
    progress: bool = True
    """Show a tqdm progress bar on rank 0."""
    trace: str | None = None
    """Write a Chrome trace (torch.profiler) of a few steps to this file (rank 0)."""


PARALLEL_SET_BY_THE_JOB = frozenset({"matrix_params", "mp_policy", "fp8_param_gather"})
"""`DataParallelConfig` fields the job sets itself (the routing, from `model.param_dtype` and
`model.fp8`), so they are not flags."""


@dataclass
class TrainConfig:
    """Everything `train()` needs. Construction validates: an invalid value raises ConfigError
    (call `validate()` again after changing a field)."""

    seed: int = field(default=0, metadata=_at_least(0, high=2**31 - 1))
    """Seeds the model init and the batch order; same seed and world size give the same losses."""
    threads: int | None = field(default=None, metadata=_at_least(1, high=1024))
    """CPU threads per process; None divides the available cores among the local processes."""
    tp: int = field(default=1, metadata=_at_least(1, high=1024, flag="tp"))
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
        if self.checkpoint.resume in ("latest", "auto") and self.output.out is None:
            raise ConfigError(
                "checkpoint.resume",
                f"resume {self.checkpoint.resume} needs out, the directory of the run to "
                f"continue (e.g. --out runs/a)",
            )

    def _check_tp(self) -> None:
        """`tp` > 1: the byte GPT with its heads split evenly, muon, no FP8 or QK-clip."""
        if self.tp == 1:
            return
        from ..models.gpt import SIZES  # (torch: only when asked)

        size = SIZES.get(self.model.name)
        if size is None or self.optim.name != "muon" or self.model.fp8:
            raise ConfigError("tp", "tp > 1 needs the byte GPT, --optimizer muon and no --fp8")
        if size.n_head % self.tp or self.optim.qk_clip is not None:
            raise ConfigError("tp", f"tp={self.tp} must divide {size.n_head} heads; no --qk-clip")

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
        for name in ("matrix_optimizer", "ns_coefficients", "ns_algorithm", "qk_clip"):
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
    hints = typing.get_type_hints(type(obj), vars(sys.modules[__name__]))
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
