"""The training job's configuration: one dataclass, one docstring per field."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import math
import os
from dataclasses import dataclass

MODELS = ("tiny", "small")
OPTIMIZERS = ("muon", "adamw")
SCHEDULES = ("cosine", "wsd")
PARAM_DTYPES = ("auto", "float32", "bfloat16")
POSITIONS = ("rope", "learned")
SCHEMES = ("aligned", "ping_pong")
PARAM_SYNCS = ("allgather", "broadcast")
FP8_RECIPES = ("mxfp8", "tensorwise")
NONFINITE = ("error", "skip")

# Peak learning rate per optimizer when `lr` is not given (tuned on the tiny model; see README).
DEFAULT_LR = {"muon": 1e-2, "adamw": 2e-3}

CHOICES = {
    "model": MODELS,
    "pos": POSITIONS,
    "optimizer": OPTIMIZERS,
    "schedule": SCHEDULES,
    "param_dtype": PARAM_DTYPES,
    "scheme": SCHEMES,
    "param_sync": PARAM_SYNCS,
    "fp8": FP8_RECIPES,
    "on_nonfinite": NONFINITE,
}
"""The values a field may take (besides None where None is its default)."""

_AT_LEAST = {
    **dict.fromkeys(("steps", "batch_size", "seq_len", "eval_every", "eval_batches"), 1),
    **dict.fromkeys(("log_every", "bucket_size", "threads", "keep_last"), 1),
    **dict.fromkeys(("seed", "weight_decay", "clip_grad", "checkpoint_every", "max_restarts"), 0),
}
"""Lower bounds of numeric fields (None, where allowed, is not checked)."""

_AT_MOST = {"seed": 2**31 - 1, "threads": 1024, "seq_len": 65536}
"""Upper bounds: batch seeds are `(seed << 32) + step` in an int64 generator seed; threads and
context length beyond these are typos, not jobs."""


class ConfigError(ValueError):
    """An invalid TrainConfig value; `field` names the field to fix."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass
class TrainConfig:
    """Everything `train()` needs; each field is a `wholeshard train` flag (`batch_size` ->
    `--batch-size`) whose help is the field's docstring. Construction validates: an invalid
    value raises ConfigError (call `validate()` again after changing a field)."""

    steps: int = 300
    """Optimizer steps to run."""
    batch_size: int = 32
    """Global batch in sequences per step; each rank takes a contiguous 1/world slice of it."""
    seq_len: int = 128
    """Bytes per training sequence (the model's context length)."""
    model: str = "tiny"
    """Model size: `tiny` (~2M params) or `small` (~20M params)."""
    pos: str | None = None
    """Position encoding, `rope` or `learned`; None takes the model size's."""
    tie: bool | None = None
    """Tie the output head to the byte embedding; None takes the model size's."""
    optimizer: str = "muon"
    """`muon`: wholeshard DataParallel + LayerwiseOptimizer; `adamw`: torch DDP + AdamW."""
    lr: float | None = None
    """Peak learning rate for every param group; None takes `DEFAULT_LR[optimizer]`, tuned on the
    tiny model."""
    weight_decay: float = 0.0
    """Decoupled weight decay for every param group."""
    warmup: int | None = None
    """Linear warm-up steps; None takes 5% of `steps`."""
    schedule: str = "cosine"
    """After warm-up: `cosine` decay, or `wsd` (constant, then linear decay over the last 20%)."""
    min_lr_ratio: float = 0.0
    """Final learning rate as a fraction of the peak."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping (the norm is still logged)."""
    on_nonfinite: str = "error"
    """What an inf or nan in the averaged gradients does: `error` stops the job (exit 1) naming
    the param and the step, `skip` skips that update (`skipped: true` in metrics.jsonl). A
    non-finite loss always stops the job, before the update."""
    seed: int = 0
    """Seeds the model init and the batch order; same seed and world size give the same losses."""
    data: str | None = None
    """A text file or directory to train on; None uses the Python standard library's sources."""
    eval_every: int = 50
    """Evaluate the validation loss every this many steps (and before the first and after the
    last step)."""
    eval_batches: int = 8
    """Global batches of validation text per evaluation (the same windows every time)."""
    param_dtype: str = "auto"
    """Compute dtype of forward/backward, `float32` or `bfloat16` (the optimizers keep fp32
    masters); `auto` takes bfloat16 where the hardware has fast bf16 matmuls, else float32."""
    bucket_size: int | None = None
    """Gradient bucket size in elements; None takes the library default."""
    log_every: int = 1
    """Write a `metrics.jsonl` record every this many steps."""
    out: str | None = None
    """Output directory (metrics.jsonl, loss.png, summary.json); None means `runs/<timestamp>`."""
    progress: bool = True
    """Show a tqdm progress bar on rank 0."""
    threads: int | None = None
    """CPU threads per process; None divides the available cores among the local processes."""
    overlap: bool = False
    """Muon path: reduce-scatter during backward and all-gather during the next forward."""
    scheme: str = "aligned"
    """Muon path: `aligned` (whole-tensor shards) or the legacy `ping_pong` baseline
    (`--layout` is the old spelling, deprecated)."""
    param_sync: str = "allgather"
    """Muon path: sync updated params by `allgather` or by one `broadcast` per rank."""
    fp8: str | None = None
    """FP8 compute for the Muon-routed linear layers (`wholeshard.fp8.convert`): `mxfp8` or
    `tensorwise`; None: off."""
    reshard_after_forward: bool = False
    """Muon path: fully sharded; between steps each rank keeps only the params it owns."""
    separate_all_gather_group: bool | None = None
    """Muon path: param all-gathers on a second process group; None: on iff fully sharded."""
    trace: str | None = None
    """Write a Chrome trace (torch.profiler) of a few steps to this file (rank 0)."""
    checkpoint_every: int = 0
    """Save a checkpoint to `<out>/checkpoints` every this many steps (0: never)."""
    keep_last: int | None = 3
    """Keep this many newest checkpoints (None: all)."""
    resume: str | None = None
    """Resume from a checkpoint: a `step-N` directory, a checkpoints directory, or `latest`
    (`<out>/checkpoints`); the run continues in `out`."""

    collective_timeout: float = 300.0
    """Seconds any collective may wait for the other ranks before this rank fails, saying a peer
    likely died or stalled; every process group the job creates carries it."""
    max_restarts: int = 0
    """Local launcher: after a worker fails, stop all workers and relaunch the job from the
    latest checkpoint in `<out>/checkpoints`, at most this many times (needs checkpoint_every)."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ConfigError naming the field of the first invalid value."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f.name, f"{f.name} must be a finite number, got {value}")
        for name, choices in CHOICES.items():
            value = getattr(self, name)
            if value not in choices and (value is not None or _default(name) is not None):
                raise ConfigError(name, f"{name} must be one of {choices}, got {value!r}")
        for name, low in _AT_LEAST.items():
            value = getattr(self, name)
            if value is not None and not value >= low:
                raise ConfigError(name, f"{name} must be >= {low}, got {value}")
        for name, high in _AT_MOST.items():
            value = getattr(self, name)
            if value is not None and value > high:
                raise ConfigError(name, f"{name} must be <= {high:,}, got {value}")
        if self.lr is not None and not self.lr > 0:
            raise ConfigError("lr", f"lr must be > 0, got {self.lr}")
        if not self.collective_timeout > 0:
            raise ConfigError(
                "collective_timeout",
                f"collective_timeout must be > 0 seconds, got {self.collective_timeout}",
            )
        if self.max_restarts and not self.checkpoint_every:
            raise ConfigError(
                "max_restarts",
                "max_restarts needs checkpoint_every > 0: a restart resumes from the latest "
                "checkpoint (e.g. --checkpoint-every 100)",
            )
        if self.warmup is not None and not 0 <= self.warmup <= self.steps:
            raise ConfigError(
                "warmup", f"warmup must be in [0, steps={self.steps}], got {self.warmup}"
            )
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(
                "min_lr_ratio", f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}"
            )
        if self.optimizer != "muon":
            modes = (
                "reshard_after_forward and separate_all_gather_group need --optimizer muon (they "
                "are wholeshard DataParallel modes)"
            )
            state = (
                "checkpoint_every and resume need --optimizer muon (wholeshard checkpoints hold "
                "DataParallel + LayerwiseOptimizer state)"
            )
            for name, used, message in (
                ("reshard_after_forward", self.reshard_after_forward, modes),
                ("separate_all_gather_group", self.separate_all_gather_group is not None, modes),
                ("checkpoint_every", self.checkpoint_every, state),
                ("resume", self.resume, state),
            ):
                if used:
                    raise ConfigError(name, message)
        if self.reshard_after_forward and self.scheme == "ping_pong":
            raise ConfigError(
                "reshard_after_forward",
                "reshard_after_forward needs scheme 'aligned': the ping_pong baseline cannot be "
                "fully sharded",
            )

    @property
    def peak_lr(self) -> float:
        """The learning rate after warm-up."""
        return self.lr if self.lr is not None else DEFAULT_LR[self.optimizer]

    @property
    def checkpoint_dir(self) -> str:
        """Where checkpoints of this run go."""
        return os.path.join(self.out or ".", "checkpoints")

    @property
    def resume_path(self) -> str | None:
        """The checkpoint path `resume` names (`latest` is this run's checkpoint directory)."""
        if self.resume is None:
            return None
        return self.checkpoint_dir if self.resume == "latest" else self.resume

    @property
    def warmup_steps(self) -> int:
        """`warmup`, or 5% of `steps` when not set."""
        return self.warmup if self.warmup is not None else max(1, self.steps // 20)

    def to_dict(self) -> dict:
        """Plain-dict form (JSON-safe)."""
        return dataclasses.asdict(self)


def _default(name: str):
    return TrainConfig.__dataclass_fields__[name].default


@functools.cache
def field_docs() -> dict[str, str]:
    """Each field's docstring (the string under it in the class body), on one line.

    Empty where the source cannot be read (e.g. a frozen application without sources)."""
    try:
        source = inspect.getsource(TrainConfig)
    except (OSError, TypeError):
        return {}
    body = ast.parse(source).body[0].body
    docs = {}
    for node, after in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs
