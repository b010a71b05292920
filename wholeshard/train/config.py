"""The training job's configuration: one dataclass, one docstring per field."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

MODELS = ("tiny", "small")
OPTIMIZERS = ("muon", "adamw")
SCHEDULES = ("cosine", "wsd")
PARAM_DTYPES = ("auto", "float32", "bfloat16")
POSITIONS = ("rope", "learned")
LAYOUTS = ("aligned", "ping_pong")
PARAM_SYNCS = ("allgather", "broadcast")
FP8_RECIPES = ("mxfp8", "tensorwise")

# Peak learning rate per optimizer when `--lr` is not given (tuned on the tiny model; see README).
DEFAULT_LR = {"muon": 1e-2, "adamw": 2e-3}


@dataclass
class TrainConfig:
    """Everything `train()` needs. Field names map to CLI flags (`batch_size` -> `--batch-size`)."""

    steps: int = 300
    """Optimizer steps to run."""
    batch_size: int = 32
    """Global batch in sequences per step; each rank takes a contiguous 1/world slice of it."""
    seq_len: int = 128
    """Bytes per training sequence (the model's context length)."""
    model: str = "tiny"
    """Model preset: `tiny` (~2M params) or `small` (~20M params)."""
    pos: str | None = None
    """Position encoding, `rope` or `learned`; None takes the preset's."""
    tie: bool | None = None
    """Tie the output head to the byte embedding; None takes the preset's."""
    optimizer: str = "muon"
    """`muon`: wholeshard DataParallel + LayerwiseOptimizer; `adamw`: torch DDP + AdamW."""
    lr: float | None = None
    """Peak learning rate for every param group; None takes `DEFAULT_LR[optimizer]`."""
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
    layout: str = "aligned"
    """Muon path: `aligned` (whole-tensor shards) or the legacy `ping_pong` baseline."""
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

    def validate(self) -> None:
        """Raise ValueError naming the field of the first invalid value."""
        for name in ("steps", "batch_size", "seq_len", "eval_every", "eval_batches", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name, choices in (
            ("model", MODELS),
            ("optimizer", OPTIMIZERS),
            ("schedule", SCHEDULES),
            ("param_dtype", PARAM_DTYPES),
            ("layout", LAYOUTS),
            ("param_sync", PARAM_SYNCS),
        ):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {getattr(self, name)!r}")
        if self.fp8 is not None and self.fp8 not in FP8_RECIPES:
            raise ValueError(f"fp8 must be one of {FP8_RECIPES} or None, got {self.fp8!r}")
        if self.pos is not None and self.pos not in POSITIONS:
            raise ValueError(f"pos must be one of {POSITIONS}, got {self.pos!r}")
        if self.lr is not None and not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not self.weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if self.warmup is not None and not 0 <= self.warmup <= self.steps:
            raise ValueError(f"warmup must be in [0, steps={self.steps}], got {self.warmup}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not self.clip_grad >= 0:
            raise ValueError(f"clip_grad must be >= 0, got {self.clip_grad}")
        if self.bucket_size is not None and self.bucket_size < 1:
            raise ValueError(f"bucket_size must be >= 1, got {self.bucket_size}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0, got {self.checkpoint_every}")
        if not 0 < self.collective_timeout < float("inf"):
            raise ValueError(
                f"collective_timeout must be > 0 seconds, got {self.collective_timeout}"
            )
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if self.max_restarts and not self.checkpoint_every:
            raise ValueError(
                "max_restarts needs checkpoint_every > 0: a restart resumes from the latest "
                "checkpoint (e.g. --checkpoint-every 100)"
            )
        if self.keep_last is not None and self.keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {self.keep_last}")
        if self.optimizer != "muon" and (
            self.reshard_after_forward or self.separate_all_gather_group is not None
        ):
            raise ValueError(
                "reshard_after_forward and separate_all_gather_group need --optimizer muon "
                "(they are wholeshard DataParallel modes)"
            )
        if self.reshard_after_forward and self.layout == "ping_pong":
            raise ValueError(
                "reshard_after_forward needs layout 'aligned': the ping_pong baseline cannot be "
                "fully sharded"
            )
        if self.optimizer != "muon" and (self.checkpoint_every or self.resume):
            raise ValueError(
                "checkpoint_every and resume need --optimizer muon (wholeshard checkpoints "
                "hold DataParallel + LayerwiseOptimizer state)"
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
