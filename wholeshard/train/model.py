"""The job's model, as `model.name` says: the byte-level GPT, or any transformers causal LM.

`build_model(cfg)` returns a `JobModel`: the module (fp32, on the CPU, the same values on every
rank for the same seed), its vocabulary size, its tokenizer (or None: bytes), a label for the
log, and `forward(module, x)`, which the loop calls on the wrapped module and which returns the
logits and the auxiliary loss to add (an MoE router's load-balancing loss, when the model's
config says `output_router_logits`, scaled by its `router_aux_loss_coef`; else None).

`hf:DIR` loads a local transformers model directory with `local_files_only` (nothing is
downloaded): its config, its weights when it has any (else random init), its tokenizer when it
has tokenizer files. `hf-config:FILE.json` builds any causal-LM config with random init.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .config import TrainConfig
from .extras import require
from .sections import HF_CONFIG, HF_DIR

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""A directory with any of these has a tokenizer."""
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
"""A directory with any of these has weights."""

Forward = Callable[[nn.Module, torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]


@dataclass
class JobModel:
    """What the job trains; see the module docstring."""

    module: nn.Module
    vocab_size: int
    tokenizer: Any | None
    label: str
    forward: Forward
    hf: bool
    export: dict | None = None
    """A transformers model's config and tokenizer files as they were when built
    (`checkpoint.export_hf.hf_extra`): checkpoints carry them for `export --format hf`."""


def build_model(cfg: TrainConfig) -> JobModel:
    """The model `cfg.model` names, seeded by `cfg.seed`, on the CPU in fp32."""
    torch.manual_seed(cfg.seed)  # identical init on every rank
    job = _transformers_model(cfg) if cfg.is_hf else _byte_gpt(cfg)
    if cfg.model.gradient_checkpointing:
        _checkpoint_activations(job)
    return job


def _byte_gpt(cfg: TrainConfig) -> JobModel:
    from ..models.gpt import GPT, VOCAB, model_config

    m = cfg.model
    gpt = GPT(model_config(m.name, cfg.data.seq_len, m.pos, m.tie))

    def forward(module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return module(x), None

    return JobModel(gpt, VOCAB, None, f"{m.name} GPT", forward, hf=False)


def _transformers_model(cfg: TrainConfig) -> JobModel:
    require("transformers", extra="hf")
    import transformers

    name = cfg.model.name
    if name.startswith(HF_DIR):
        path = name.removeprefix(HF_DIR)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"--model {name}: {path} is not a directory")
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
        has_weights = any(os.path.exists(os.path.join(path, f)) for f in WEIGHT_FILES)
    else:
        path = name.removeprefix(HF_CONFIG)
        config, has_weights = _config_from_file(path), False
    _check_context(config, cfg.data.seq_len, name)
    auto = transformers.AutoModelForCausalLM
    if has_weights:
        model = auto.from_pretrained(
            path, config=config, local_files_only=True, dtype=torch.float32
        )
    else:
        model = auto.from_config(config, dtype=torch.float32)
    tok_dir, tokenizer = tokenizer_dir(cfg), None
    if tok_dir is not None:
        tokenizer = transformers.AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
        _check_vocab(tokenizer, config.vocab_size, tok_dir)
    from ..checkpoint.export_hf import hf_extra

    label = f"{type(model).__name__} ({name}{'' if has_weights else ', random init'})"
    forward, export = _hf_forward(config), hf_extra(model, tokenizer)
    return JobModel(model, config.vocab_size, tokenizer, label, forward, True, export)


def _hf_forward(config: Any) -> Forward:
    """Logits, and the router's load-balancing loss times its coefficient when the config asks
    for it (what transformers adds to the loss it computes from labels)."""
    router = bool(getattr(config, "output_router_logits", False))
    coef = float(getattr(config, "router_aux_loss_coef", 0.0))

    def forward(module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not router:
            return module(input_ids=x, use_cache=False).logits, None
        out = module(input_ids=x, use_cache=False, output_router_logits=True)
        aux = getattr(out, "aux_loss", None)
        return out.logits, None if aux is None or coef == 0 else coef * aux

    return forward


def _config_from_file(path: str) -> Any:
    import transformers

    try:
        with open(path) as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"--model hf-config:{path}: no such file") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--model hf-config:{path}: not a JSON config ({e})") from None
    model_type = raw.pop("model_type", None) if isinstance(raw, dict) else None
    if model_type is None:
        raise ValueError(
            f'--model hf-config:{path}: the config has no model_type (e.g. "llama"); save '
            f"one with transformers' config.to_json_file()"
        )
    raw.pop("transformers_version", None)
    return transformers.AutoConfig.for_model(model_type, **raw)


def tokenizer_dir(cfg: TrainConfig) -> str | None:
    """The tokenizer the job reads text with: `data.tokenizer`, else an `hf:DIR` model's own
    (a directory with tokenizer files), else None: the text is read as bytes."""
    if cfg.data.tokenizer is not None or not cfg.model.name.startswith(HF_DIR):
        return cfg.data.tokenizer
    path = cfg.model.name.removeprefix(HF_DIR)
    return path if any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES) else None


def _check_context(config: Any, seq_len: int, name: str) -> None:
    longest = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", 0)
    if longest and seq_len > longest:
        raise ValueError(
            f"seq_len={seq_len} is longer than {name}'s context ({longest} positions); "
            f"pass --seq-len {longest} or less"
        )


def _check_vocab(tokenizer: Any, vocab_size: int, where: str) -> None:
    if len(tokenizer) > vocab_size:
        raise ValueError(
            f"the tokenizer in {where} has {len(tokenizer)} tokens but the model's vocab_size is "
            f"{vocab_size}: token ids would index past the embedding; use the model's own "
            f"tokenizer or a config with vocab_size >= {len(tokenizer)}"
        )
    if tokenizer.eos_token_id is None:
        raise ValueError(
            f"the tokenizer in {where} has no EOS token, which joins documents; set its "
            f"eos_token (tokenizer_config.json)"
        )


def _checkpoint_activations(job: JobModel) -> None:
    """Recompute each block in backward (non-reentrant, as DataParallel's hooks need)."""
    kwargs = {"use_reentrant": False}
    model = job.module
    if not job.hf:
        model.checkpoint_blocks = True
    elif hasattr(model, "activation_checkpointing_enable"):  # the name since transformers 5.x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
