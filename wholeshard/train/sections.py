"""The sections of the training job's configuration (`config.TrainConfig`), one per thing
configured (torchtitan's rule): the model, the data, the optimizer, checkpoints, reliability and
output, one docstring per field. Bounds are declared beside each field (`metadata["min"]`,
`["max"]`: `at_least`), choices by `Literal` types; `TrainConfig` checks them. Importing this
module does not import torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

DEFAULT_LR = {"muon": 1e-2, "normuon": 3e-2, "soap": 3e-3, "adamw": 2e-3}
"""Peak learning rate per matrix rule (the muon path) or for the adamw path, when `optim.lr` is
not given (tuned on the tiny model)."""


def at_least(low: float, *, flag: str | None = None, high: float | None = None) -> dict:
    """A field's metadata: its bounds (`min`, `max`) and the flag naming it, where given."""
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
    val_fraction: float = field(default=0.05, metadata=at_least(0.001, high=0.5))
    """Fraction of the text (in equal blocks spread over it) held out for validation."""
    cache_dir: str | None = None
    """Where tokenized data is cached (memory-mapped token ids keyed by the data files, their
    sizes and mtimes, and the tokenizer); None: `token-cache` beside the output directory."""
    batch_size: int = field(default=32, metadata=at_least(1))
    """Global batch in sequences per optimizer step, whatever the world size; each data-parallel
    rank takes a contiguous 1/dp slice of it (dp = world / tp), so it is a multiple of dp."""
    micro_batch_size: int | None = field(default=None, metadata=at_least(1))
    """The most sequences one rank runs through forward and backward at once: a larger share of
    the batch is accumulated over equal micro-batches of this size (`wholeshard.train.batch`);
    None: the whole share at once."""
    seq_len: int = field(default=128, metadata=at_least(1, high=65536))
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
    newton_schulz: Literal["auto", "torch_bf16", "batched_bf16", "batched_fp32"] = "auto"
    """How `muon` runs Newton-Schulz: `torch_bf16` (torch's Muon: a matrix at a time, bf16
    products), `batched_bf16` or `batched_fp32` (`wholeshard.optim.BatchedMuon`: same-shape
    matrices together, products in bf16 or summed in fp32, fast on CPUs without bf16 units);
    `auto`: `batched_fp32` on an x86 CPU without bf16 matmul units (neither AVX512-BF16 nor AMX),
    else torch's Muon, never by a timing, so a command always runs the same arithmetic on one
    machine; resumed, it keeps the checkpoint's choice (`wholeshard.train.newton_schulz`)."""
    qk_clip: float | None = field(default=None, metadata=at_least(0, flag="qk-clip"))
    """MuonClip: after each step, scale the query and key rows of every attention head whose
    largest pre-softmax logit exceeded this (needs a model that reports them: the byte GPT);
    None: off."""
    steps: int = field(default=300, metadata=at_least(1))
    """Optimizer steps to run."""
    lr: float | None = None
    """Peak learning rate for every param group; None takes `DEFAULT_LR` of the matrix rule
    (muon path) or of adamw, tuned on the tiny model."""
    weight_decay: float = field(default=0.0, metadata=at_least(0))
    """Decoupled weight decay for every param group."""
    warmup: int | None = field(default=None, metadata=at_least(0))
    """Linear warm-up steps; None takes 5% of `steps`."""
    schedule: Literal["cosine", "wsd"] = "cosine"
    """After warm-up: `cosine` decay, or `wsd` (constant, then linear decay over the last 20%)."""
    min_lr_ratio: float = field(default=0.0, metadata=at_least(0, high=1))
    """Final learning rate as a fraction of the peak."""
    clip_grad: float = field(default=1.0, metadata=at_least(0))
    """Clip the global gradient norm to this; 0 disables clipping (the norm is still logged)."""
    on_nonfinite: Literal["error", "skip"] = "error"
    """What an inf or nan in the averaged gradients does: `error` stops the job (exit 1) naming
    the param and the step, `skip` skips that update (`skipped: true` in metrics.jsonl). A
    non-finite loss always stops the job, before the update."""
    offload_state: bool = False
    """Keep the fp32 masters and the optimizer state in host memory, each unit's copied to the
    device for its update and back (`LayerwiseOptimizer(offload_state=True)`): the same bits,
    less GPU memory; nothing moves on a CPU. Not with tensor parallelism."""


@dataclass
class CheckpointConfig:
    """Checkpoints of the muon path (`wholeshard.checkpoint`)."""

    every: int = field(default=0, metadata=at_least(0, flag="checkpoint-every"))
    """Save a checkpoint to `<out>/checkpoints` every this many steps (0: never)."""
    keep_last: int | None = field(default=3, metadata=at_least(1))
    """Keep this many newest checkpoints (None: all)."""
    resume: str | None = None
    """Resume from a checkpoint: a `step-N` directory, a checkpoints directory, `latest` (the
    latest in `<out>/checkpoints`, which must exist) or `auto` (that one if there is one, else
    start at step 0: the choice for torchrun's `--max-restarts`); the run continues in `out`."""
    blocking: bool = field(default=False, metadata={"flag": "checkpoint-blocking"})
    """Save in the foreground, every rank waiting until the checkpoint is written. By default a
    save copies what it writes to host memory and writes it in the background while training
    goes on; the next save and the end of the run wait for it."""


@dataclass
class ReliabilityConfig:
    """What happens when a rank dies or stalls."""

    collective_timeout: float = 300.0
    """Seconds any collective may wait for the other ranks before this rank fails, saying a peer
    likely died or stalled; every process group the job creates carries it."""
    max_restarts: int = field(default=0, metadata=at_least(0))
    """Local launcher: after a worker fails, stop all workers and relaunch the job from the
    latest checkpoint in `<out>/checkpoints`, at most this many times (needs checkpoint_every).
    Under torchrun, use torchrun's own `--max-restarts` with `--resume auto`."""


@dataclass
class OutputConfig:
    """What the job writes and shows."""

    out: str | None = None
    """Output directory (metrics.jsonl, loss.png, summary.json); None means `runs/<timestamp>`."""
    eval_every: int = field(default=50, metadata=at_least(1))
    """Evaluate the validation loss every this many steps (and before the first and after the
    last step)."""
    eval_batches: int = field(default=8, metadata=at_least(1))
    """Global batches of validation text per evaluation (the same windows every time)."""
    log_every: int = field(default=1, metadata=at_least(1))
    """Write a `metrics.jsonl` record every this many steps."""
    progress: bool = True
    """Show a tqdm progress bar on rank 0."""
    trace: str | None = None
    """Write a Chrome trace (torch.profiler) of a few steps to this file (rank 0)."""
