"""A checkpoint of a transformers model as a transformers model directory
(`wholeshard export CKPT OUT --format hf`).

The training job puts `hf_extra(model, tokenizer)` in the checkpoint's `extra["hf"]`: the model's
config as JSON and the files export cannot rebuild from it (the tokenizer's, the generation
config), as uint8 tensors so that `extra` survives `torch.load(weights_only=True)`. `export_hf`
rebuilds the model from that config (on the meta device: no random init), assigns it exactly the
checkpoint's consolidated weights (`load_consolidated`), re-ties the weights the config ties, and
writes it with transformers' `save_pretrained` plus the saved files. So
`AutoModelForCausalLM.from_pretrained(OUT)` holds the checkpoint's weights bit for bit, and in
fp32 gives the logits the trained model gave. Runs in one process without a process group;
transformers and safetensors are imported only here (`pip install 'wholeshard[hf]'`).
"""

from __future__ import annotations

import importlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..engine.data_parallel import DataParallel
from ._load import load_consolidated
from .directory import TRAINER, CheckpointError, _plain_name, fsync_dir, resolve_checkpoint
from .export_safetensors import refuse_existing

HF = "hf"
"""The key of `extra` that holds `hf_extra`'s dict."""
CONFIG = "config.json"
_OURS = (CONFIG, "model.safetensors", "model.safetensors.index.json")
"""Files `save_pretrained` writes that a saved file must not replace."""
DEFAULT_MAX_SHARD_SIZE = "5GB"
_NEEDS = ("safetensors", "transformers")
"""What the export imports (the `hf` extra), each checked: transformers imports without
safetensors and fails later, at the first model class it loads, naming neither."""


def hf_extra(model: nn.Module, tokenizer: Any = None) -> dict[str, Any]:
    """What a checkpoint's `extra["hf"]` holds so that `export_hf` can rebuild the model
    directory: `{"config": model.config.to_json_string(), "files": {name: uint8 tensor}}`, the
    files being the tokenizer's (`tokenizer.save_pretrained`) and `generation_config.json` when
    the model has a generation config. `model` is the transformers model (or its
    `DataParallel`); only its config is read, not its weights. The value survives
    `torch.load(weights_only=True)`; it does not change while training, so compute it once."""
    if isinstance(model, DataParallel):
        model = model.module
    config = getattr(model, "config", None)
    if not hasattr(config, "to_json_string"):
        raise TypeError(f"hf_extra needs a transformers model, got {type(model).__name__}")
    files: dict[str, torch.Tensor] = {}
    with tempfile.TemporaryDirectory() as tmp:
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        generation = getattr(model, "generation_config", None)
        if generation is not None:
            generation.save_pretrained(tmp)
        for path in sorted(Path(tmp).iterdir()):
            if path.is_file():
                data = path.read_bytes()
                files[path.name] = torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()
    return {"config": config.to_json_string(), "files": files}


def export_hf(
    checkpoint: str | os.PathLike,
    out: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> Path:
    """Write the checkpoint's transformers model as the directory `out`; returns `out`.

    `out` gets `config.json`, the weights as safetensors (`model.safetensors`, or shards of at
    most `max_shard_size` each plus `model.safetensors.index.json` when they exceed it), the
    tokenizer files and `generation_config.json` saved in `extra["hf"]`. The weights are
    exactly the checkpoint's (cast to `dtype` as in `load_consolidated`, params from their fp32
    masters), and weights the config ties are stored tied. `checkpoint` is resolved like
    `export_checkpoint`'s. The directory is written beside `out` and renamed into place, so
    `out` is either complete or untouched; an existing `out` raises FileExistsError unless
    `overwrite`. A checkpoint that does not verify raises CheckpointError before anything in it
    is unpickled or anything is written; so does one without `extra["hf"]` (the byte GPT).
    """
    out = Path(out)
    refuse_existing(out, overwrite, "export_hf")
    transformers = _transformers()
    shard_bytes = _shard_bytes(max_shard_size)  # a bad size fails before any work
    ckpt = resolve_checkpoint(checkpoint)
    tensors, _ = load_consolidated(ckpt, dtype=dtype)  # verifies the whole directory first
    hf = _saved_hf(ckpt)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        (tmp / CONFIG).write_text(hf["config"])
        config = transformers.AutoConfig.from_pretrained(tmp, local_files_only=True)
        model = _model_with(transformers, config, tensors, ckpt)
        model.save_pretrained(tmp, max_shard_size=shard_bytes)
        for name, data in hf["files"].items():
            (tmp / name).write_bytes(data.numpy().tobytes())
        _sync(tmp)
        _put_in_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _transformers() -> Any:
    """transformers, once it and safetensors (which `save_pretrained` writes with) import; else
    ImportError naming what to install and what the export needs of the checkpoint."""
    failed: dict[str, ImportError] = {}
    modules = {}
    for name in _NEEDS:
        try:
            modules[name] = importlib.import_module(name)
        except ImportError as e:
            failed[name] = e
    if failed:
        why = next(iter(failed.values()))
        raise ImportError(
            f"export_hf (--format hf) needs {' and '.join(failed)} ({why}): pip install "
            f"'wholeshard[hf]' (or: pip install {' '.join(failed)}). It exports a checkpoint "
            f"whose extra['hf'] is wholeshard.checkpoint.hf_extra(model, tokenizer), as "
            f"`wholeshard train --model hf:DIR|hf-config:FILE` saves "
            f"(docs/checkpoints.md#export-to-transformers); --format safetensors exports any "
            f"checkpoint's weights without them"
        ) from why
    return modules["transformers"]


def _shard_bytes(size: int | str) -> int:
    """`max_shard_size` in bytes: an int, digits, or a size transformers reads ("5GB")."""
    from transformers.utils.hub import convert_file_size_to_int

    try:
        if isinstance(size, str) and size.strip().isdigit():
            size = int(size)
        n = convert_file_size_to_int(size) if not isinstance(size, bool) else 0
    except (ValueError, TypeError, AttributeError):
        n = 0
    if not isinstance(n, int) or n <= 0:
        raise ValueError(
            f"max_shard_size must be a positive size such as '5GB', '500MB', '2GiB' or a number "
            f"of bytes, got {size!r}"
        )
    return n


def _saved_hf(ckpt: Path) -> dict[str, Any]:
    """`extra["hf"]` of a verified checkpoint, checked to be what `hf_extra` writes."""
    extra = torch.load(ckpt / TRAINER, weights_only=True)["extra"]
    hf = extra.get(HF) if isinstance(extra, dict) else None
    if hf is None:
        raise CheckpointError(
            f"checkpoint {ckpt} holds no transformers model (no extra['hf']): --format hf needs "
            f"a checkpoint of a transformers model trained by `wholeshard train --model "
            f"hf:DIR|hf-config:FILE`; --format safetensors exports its weights"
        )
    files = hf.get("files") if isinstance(hf, dict) else None
    well_formed = (
        isinstance(files, dict)
        and isinstance(hf.get("config"), str)
        and all(isinstance(n, str) and _plain_name(n) and n not in _OURS for n in files)
        and all(
            torch.is_tensor(t) and t.dtype == torch.uint8 and t.ndim == 1 for t in files.values()
        )
    )
    if not well_formed:
        raise CheckpointError(
            f"checkpoint {ckpt}: extra['hf'] is malformed (expected what "
            f"wholeshard.checkpoint.hf_extra returns)"
        )
    return hf


def _model_with(
    transformers: Any, config: Any, tensors: dict[str, torch.Tensor], ckpt: Path
) -> nn.Module:
    """The causal LM `config` describes, holding exactly `tensors`, its tied weights tied."""
    with torch.device("meta"):  # no storage, no random init: every weight is assigned below
        model = transformers.AutoModelForCausalLM.from_config(config)
    try:
        model.load_state_dict(tensors, strict=True, assign=True)
    except RuntimeError as e:
        raise CheckpointError(
            f"checkpoint {ckpt}: its weights do not fit the model its config describes: {e}"
        ) from e
    tied = dict(getattr(model, "all_tied_weights_keys", None) or {})
    for target, source in tied.items():
        if not torch.equal(model.get_parameter(target), model.get_parameter(source)):
            raise CheckpointError(
                f"checkpoint {ckpt}: the config ties {target} to {source}, but the checkpoint "
                f"holds different values for them"
            )
    model.tie_weights(recompute_mapping=False)  # exactly the pairs checked above
    untied = [t for t, s in tied.items() if model.get_parameter(t) is not model.get_parameter(s)]
    if untied:
        raise CheckpointError(f"checkpoint {ckpt}: could not tie {', '.join(untied)}")
    return model


def _sync(directory: Path) -> None:
    """fsync every file of `directory` and the directory itself."""
    for path in directory.iterdir():
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    fsync_dir(directory)


def _put_in_place(tmp: Path, out: Path) -> None:
    """Rename `tmp` to `out`; an existing `out` (the caller allowed it) is moved aside first and
    deleted once `tmp` is in place."""
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    replacing = os.path.lexists(out)
    if replacing:
        os.rename(out, old)
    os.rename(tmp, out)
    fsync_dir(out.parent)
    if replacing:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old)
        else:
            old.unlink()
