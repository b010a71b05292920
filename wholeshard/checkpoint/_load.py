"""`load_checkpoint` (into a `DataParallel` and its optimizer, at any world size and plan)
and `load_consolidated` (full tensors in one process, for export)."""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ..engine.data_parallel import DataParallel
from ..optim.pieces import Checkpointable, LoadedPiece, elementwise, install_state
from . import _chunks as chunks
from . import _pending as pending
from ._arrival import all_arrive
from ._chunks import Chunks, add, matrix_row, own_state_keys, piece_parts, shifted, whole
from ._consensus import RankConsensus
from ._model_table import (
    Table,
    check_model,
    model_table,
    names,
    other_tensors,
    state_keys,
    tensor_places,
    trainable_changes,
)
from .directory import (
    TRAINER,
    CheckpointError,
    check_files,
    read_manifest,
    resolve_checkpoint,
    verify,
)


def load_checkpoint(path: str | os.PathLike, ddp: DataParallel, optimizer: Checkpointable) -> Any:
    """Load a checkpoint into `ddp` and `optimizer` at any world size and plan; return `extra`.

    `path` is a checkpoint (`.../step-N`), a checkpoints directory (its `latest` is followed),
    or a `latest` file. Every rank of `ddp`'s group must call it (one that calls it alone
    raises `CheckpointError` after the arrival timeout, `_arrival`). Param-group hyperparameters
    (lr, betas, ...) and the optimizer's step count are restored, as
    `torch.optim.Optimizer.load_state_dict` does. Afterwards every rank holds every param
    (gathered from the owners) and the gradient buffer is zero. Raises CheckpointError on every
    rank, changing nothing, if the checkpoint is damaged or was saved from a different model
    (names, shapes or Muon/AdamW routing).

    Which params are frozen may have changed since the save: every param gets its saved value;
    one trainable now but frozen then starts with fresh optimizer state (its master from the
    loaded value), one frozen now drops its saved state; a warning names them.
    """
    ranks = ddp.model_ranks  # the data-parallel ranks (and tensor-parallel: dp x tp)
    group = RankConsensus(ranks.group, ranks.size, ranks.rank)
    if group.distributed:  # before anything is read or a collective is entered
        all_arrive(ranks.group, "load_checkpoint")
    pending.settle()  # a save in flight is committed (or its error raised) first
    ddp.free_overlap_buffers()  # nothing in flight, and no gather buffers held while reading
    table = model_table(ddp, group)
    ckpt = group.on_first(lambda: resolve_checkpoint(path), "cannot find the checkpoint")

    manifest = group.all_succeed(lambda: read_manifest(ckpt), f"checkpoint {ckpt} is damaged")
    group.all_succeed(
        lambda: check_files(ckpt, manifest, sorted(manifest["files"])[group.rank :: group.size]),
        f"checkpoint {ckpt} is damaged",
    )

    def prepare() -> tuple[dict[str, Any], _LoadPlan]:
        metadata = dcp.FileSystemReader(ckpt).read_metadata()
        trainer = torch.load(ckpt / TRAINER, weights_only=True)
        check_model(ckpt, manifest, metadata, table, optimizer, trainer)
        return trainer, _plan_load(metadata, ddp, optimizer)

    trainer, plan = group.all_succeed(prepare, f"cannot load checkpoint {ckpt}")
    try:
        chunks.read(plan.entries, ckpt, ranks.group, group.distributed)
    except (Exception, dcp.CheckpointException) as e:  # DCP raises on every rank if any fails
        raise CheckpointError(f"reading checkpoint {ckpt} failed (nothing was changed): {e}") from e
    with torch.no_grad():
        for live, value in plan.others:
            live.copy_(value)
    ddp.step_protocol.zero_grad_buffer()
    pieces = [_private(p) for p in plan.pieces]
    install_state(ddp, optimizer, pieces, trainer["param_groups"], _saved_steps(trainer))
    _warn_trainable_changes(ckpt, manifest, table)
    return trainer["extra"]


def _saved_steps(trainer: dict[str, Any]) -> int | None:
    """The optimizer's step count at the save; for checkpoints that did not record it (or whose
    optimizer kept none), `extra["step"]` if that is an int."""
    steps = trainer.get("steps")
    if steps is None and isinstance(trainer["extra"], dict):
        steps = trainer["extra"].get("step")
    return steps if isinstance(steps, int) and not isinstance(steps, bool) else None


def _warn_trainable_changes(ckpt: os.PathLike, manifest: dict[str, Any], table: Table) -> None:
    unfrozen, frozen = trainable_changes(manifest, table)
    said = []
    if unfrozen:
        said.append(
            f"trainable now but frozen in the checkpoint, fresh optimizer state: {names(unfrozen)}"
        )
    if frozen:
        said.append(f"frozen now, their saved optimizer state dropped: {names(frozen)}")
    if said:
        warnings.warn(
            f"loaded {ckpt} with a changed set of frozen params; " + "; ".join(said), stacklevel=3
        )


def load_consolidated(
    path: str | os.PathLike, *, dtype: torch.dtype | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Full model tensors of a checkpoint, in one process without a process group.

    Returns `(tensors, manifest)`: `tensors` maps every `model.state_dict()` key, tied aliases
    included, to a full CPU tensor. With `dtype`, floating tensors are cast to it, taking params
    from their fp32 masters when the checkpoint has them; without it, params keep the dtype they
    were trained in. Reads nothing before the directory verifies (`directory.verify`).
    """
    pending.settle()
    ckpt = resolve_checkpoint(path)
    manifest = verify(ckpt)
    metadata = dcp.FileSystemReader(ckpt).read_metadata()
    keys: dict[str, str] = {}
    for name in manifest["params"]:
        master = f"optim/{name}/master"
        use_master = dtype is not None and master in metadata.state_dict_metadata
        keys[name] = master if use_master else f"model/{name}"
    keys.update({name: f"model/{name}" for name in manifest["others"]})
    entries: dict[str, Chunks] = {}
    for key in keys.values():
        md = metadata.state_dict_metadata.get(key)
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointError(f"checkpoint {ckpt} is damaged: it has no tensor {key!r}")
        add(entries, key, md.size, whole(torch.empty(md.size, dtype=md.properties.dtype)))
    chunks.read(entries, ckpt)
    tensors = {}
    for name, key in keys.items():
        t = entries[key].parts[0][1]
        tensors[name] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    for alias, name in manifest["aliases"].items():
        tensors[alias] = tensors[name]
    return tensors, manifest


@dataclass
class _LoadPlan:
    """Fresh tensors DCP reads into, and where each goes once every rank has read."""

    entries: dict[str, Chunks]
    pieces: list[LoadedPiece]  # state tensors not elementwise are shared by a param's pieces
    others: list[tuple[torch.Tensor, torch.Tensor]]  # live tensor, new value


def _plan_load(metadata: Metadata, ddp: DataParallel, optimizer: Checkpointable) -> _LoadPlan:
    md = metadata.state_dict_metadata
    plan = _LoadPlan({}, [], [])
    entries = plan.entries
    places = tensor_places(ddp)
    for piece in optimizer.owned_pieces():
        name, shape, place = places[piece.name]  # a slice or a stack of experts: its place
        key = f"optim/{name}/master" if f"optim/{name}/master" in md else f"model/{name}"
        # Read in the storage orientation; install through the optimizer-orientation view.
        master = piece.param.new_empty(piece.param.shape, dtype=piece.master.dtype)
        add(entries, key, shape, piece_parts(piece, master, place))
        state, shaped = {}, []
        for k in state_keys(metadata, name):
            key, saved = f"optim/{name}/{k}", md[f"optim/{name}/{k}"]
            if tuple(saved.size) == shape and piece.replica is None:  # a replica's: whole
                value = piece.param.new_empty(piece.param.shape, dtype=saved.properties.dtype)
                add(entries, key, shape, piece_parts(piece, value, place))
                state[k] = piece.oriented(value)
            else:
                shaped.append(k)
        for k, own in own_state_keys(piece, shaped).items():  # a row block's own, if split
            key, saved = f"optim/{name}/{k}", md[f"optim/{name}/{k}"]
            if piece.matrix is not None and saved.size[0] == math.prod(shape[:-2]):
                value = torch.empty(tuple(saved.size[1:]), dtype=saved.properties.dtype)
                add(entries, key, saved.size, matrix_row(piece, value, place))
                state[own] = value  # a stack's matrix: its own row (per-row moments, say)
            else:  # one value per param or block (AdamW's step): each piece reads all of it
                if key not in entries:
                    full = torch.empty(saved.size, dtype=saved.properties.dtype)
                    add(entries, key, saved.size, whole(full))
                state[own] = entries[key].parts[0][1]
        plan.pieces.append(LoadedPiece(piece, piece.oriented(master), state))
    for name, live in other_tensors(ddp).items():  # a param trainable at save: from its master
        name, shape, place = places[name]
        key = f"optim/{name}/master" if f"optim/{name}/master" in md else f"model/{name}"
        value = torch.empty_like(live, memory_format=torch.contiguous_format)
        add(entries, key, shape, shifted(whole(value), place))
        plan.others.append((live, value))
    return plan


def _private(loaded: LoadedPiece) -> LoadedPiece:
    """`loaded` with state the piece alone holds: contiguous in the optimizer's orientation, and
    per-param values copied so no two pieces share one."""
    piece = loaded.piece
    state = {
        k: v.contiguous() if elementwise(v, piece) else v.clone() for k, v in loaded.state.items()
    }
    return loaded._replace(state=state)
