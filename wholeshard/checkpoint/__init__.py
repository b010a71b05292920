"""Checkpoints on torch.distributed.checkpoint (DCP): save anywhere, resume at any world size.

A checkpoint is a `step-N` directory of a checkpoints directory (the directory protocol, with
its atomic rename, `latest` marker and pruning, is `directory`):

    root/step-N/           one complete checkpoint (N = extra["step"], else the optimizer's
                           step count, else the next free number)
        .metadata, __R_I.distcp    DCP's files: logical tensors, see "Format"
        trainer.pt                 param-group hyperparameters, the optimizer's step count and
                                   the caller's `extra` (rank 0)
        wholeshard.json            manifest, written last: model table, size + crc32 of every file
    root/latest            text file naming the most recently completed save ("step-N")

Every rank of the group calls a save or load; each first checks that all did (`_arrival`),
so a rank calling alone raises `CheckpointError` within the arrival timeout, having written
nothing. A load validates everything (manifest, every file's size and crc32, model names, shapes
and routing, chunk coverage) and agrees on the outcome across ranks BEFORE any param or
optimizer state is touched; a damaged or mismatched checkpoint raises `CheckpointError` on every
rank. Which params are frozen may differ between save and load (`_model_table`).

Format: one DCP entry per logical tensor, keyed by parameter FQN, with the tensor's full shape:
    model/<fqn>              the param as the model holds it (param dtype); also persistent
                             buffers and frozen params (written by rank 0)
    optim/<fqn>/master       the fp32 master, when it is separate from the param
    optim/<fqn>/<key>        torch optimizer state (Muon `momentum_buffer`; AdamW `exp_avg`,
                             `exp_avg_sq`, `step`)
Each rank writes exactly the elements it owns, as rectangular chunks with offsets into the full
tensor (`chunks`). Optimizer state that is not elementwise (AdamW's scalar `step`) is identical
across the pieces of one param and is written by the piece holding element 0. Nothing in the
format depends on the plan, the world size or the sharding strategy, so DCP reshards on load.

What a checkpoint needs of the optimizer is `Checkpointable`: its owned pieces, their state and
its param groups (`wholeshard.optim.pieces`). Modules: `directory` (the directory protocol),
`export_safetensors` (a checkpoint's weights as safetensors), `export_hf` (a checkpoint of a
transformers model as a transformers model directory; `hf_extra` is what it needs in `extra`),
and the private `_save`, `_load`, `_chunks` (geometry and DCP planners), `_arrival` (every rank
made the call), `_consensus` (same outcome on every rank), `_model_table` (the model's
description and checks), `_staging` (a host copy of what a rank writes) and `_pending` (the
save in flight: `save_checkpoint(..., blocking=False)` returns an `AsyncSave`).
"""

from ._load import load_checkpoint, load_consolidated
from ._pending import AsyncSave
from ._save import save_checkpoint
from .directory import CheckpointError, resolve_checkpoint
from .export_hf import export_hf, hf_extra
from .export_safetensors import export_checkpoint, write_safetensors

__all__ = [
    "AsyncSave",
    "CheckpointError",
    "export_checkpoint",
    "export_hf",
    "hf_extra",
    "load_checkpoint",
    "load_consolidated",
    "resolve_checkpoint",
    "save_checkpoint",
    "write_safetensors",
]
