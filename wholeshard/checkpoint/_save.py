"""`save_checkpoint`: every rank writes the elements it owns into one new `step-N` directory,
then or in the background (`_pending`)."""

from __future__ import annotations

import io
import math
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from ..distributed.dtensor import local
from ..engine.data_parallel import DataParallel
from ..optim.pieces import Checkpointable, elementwise, step_count
from ..optim.tensor_parallel import tp_slices
from . import _chunks as chunks
from . import _pending as pending
from ._arrival import all_arrive
from ._chunks import Chunks, add, block_key, matrix_row, piece_parts, shifted, whole
from ._consensus import RankConsensus
from ._model_table import aliases, model_table, other_tensors, tensor_places
from ._pending import AsyncSave
from ._staging import stage
from .directory import (
    TRAINER,
    CheckpointError,
    begin,
    choose_step,
    commit,
    digest,
    write_durably,
)


def save_checkpoint(
    path: str | os.PathLike,
    ddp: DataParallel,
    optimizer: Checkpointable,
    *,
    extra: dict[str, Any] | None = None,
    keep_last: int | None = None,
    blocking: bool = True,
) -> Path | AsyncSave:
    """Save params, optimizer state and hyperparameters, and `extra`, as `path/step-N`.

    Every rank of `ddp`'s group must call it, between optimizer steps; a rank that calls it alone
    raises `CheckpointError` after the arrival timeout (`_arrival`), having written nothing. N is
    `extra["step"]` when given (an int >= 0), else the optimizer's `steps` (its step() calls),
    else one more than the largest existing `step-M` (0 if none). `extra` is rank 0's small dict
    (step, RNG states, data position, scheduler state); it must survive
    `torch.load(weights_only=True)` (tensors, numbers, strings, None, and containers of them),
    which is checked here rather than at resume time. Gradients are not saved; the optimizer's
    step count is.

    Replacing an existing `step-N` is allowed unless `latest` names it. With `keep_last=K`,
    older checkpoints (`step-M`, M < N) beyond the K - 1 most recent are deleted after the new
    one is complete. Returns the new checkpoint's directory.

    With `blocking=False` it returns an `AsyncSave` as soon as every rank has copied what it
    writes to host memory, and writes and commits it in the background ([Note: background
    saves]): training may step on at once. A save or load waits first for the save in flight
    and raises its error, if it failed, on every rank.
    """
    if keep_last is not None and (isinstance(keep_last, bool) or keep_last < 1):
        raise ValueError(f"keep_last must be an integer >= 1 or None, got {keep_last!r}")
    root = Path(path)
    ranks = ddp.model_ranks  # the data-parallel ranks (and tensor-parallel: dp x tp)
    group = RankConsensus(ranks.group, ranks.size, ranks.rank)
    if group.distributed:  # before anything touches the disk or a collective
        all_arrive(ranks.group, "save_checkpoint")
    pending.settle()  # the save in flight is committed (or its error raised) first
    ddp.free_overlap_buffers()  # nothing in flight, and no gather buffers held while writing
    params, others = model_table(ddp, group)
    trainer: list[bytes] = []  # rank 0's `trainer.pt`

    def prepare() -> tuple[int, Path]:
        step = choose_step(root, extra, step_count(optimizer))
        trainer.append(_trainer_blob(optimizer, extra))
        return step, begin(root, step)

    step, tmp = group.on_first(prepare, f"cannot start a checkpoint in {root}")
    entries = group.all_succeed(lambda: _save_entries(ddp, optimizer, group.rank), "cannot save")
    manifest = {
        "params": params,
        "others": others,
        "aliases": aliases(ddp),
        "saved_with": {
            "world_size": ddp.dp_size,
            "tensor_parallel": ranks.size // ddp.dp_size,
            "expert_parallel": ddp.expert_layout.size if ddp.expert_layout else 1,
            "torch": torch.__version__,
        },
    }

    def write(entries: dict[str, Chunks], group: RankConsensus) -> Path:
        """Write the files, then commit them as `step-N` (every rank, on `group`)."""
        group.on_first(lambda: write_durably(tmp / TRAINER, trainer[0]), f"cannot write {tmp}")
        try:
            chunks.write(entries, tmp, group.pg, group.distributed)
        except (Exception, dcp.CheckpointException) as e:  # DCP raises on every rank if any fails
            if group.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(f"writing checkpoint step-{step} to {tmp} failed: {e}") from e
        body = dict(manifest, files=_digest_files(group, tmp))
        return group.on_first(
            lambda: commit(root, tmp, step, body, keep_last),
            f"cannot complete checkpoint step-{step} in {root}",
        )

    if blocking:
        return write(entries, group)
    staged, nbytes = group.all_succeed(lambda: stage(entries), "cannot stage the checkpoint")
    save = AsyncSave(step, root / f"step-{step}", nbytes)
    return pending.start(save, lambda background: write(staged, background), ranks)


def _save_entries(ddp: DataParallel, optimizer: Checkpointable, rank: int) -> dict[str, Chunks]:
    """This rank's share: each owned element once (a tensor-parallel slice or a stack of experts
    at its place in the logical tensor; what tensor parallelism does not slice, experts too,
    from tp rank 0), plus (rank 0; an expert's: each expert group's rank 0 at tp rank 0)
    buffers and frozen params."""
    entries: dict[str, Chunks] = {}
    places = tensor_places(ddp)
    tp_peer = ddp.model_ranks.tp_rank != 0  # what tp does not slice, tp rank 0 writes
    _, sliced = tp_slices(ddp.routes)
    copies = {r.name: ddp.replica_of(r.name) for r in ddp.routes}
    for piece in optimizer.owned_pieces():
        name, shape, place = places[piece.name]
        if (tp_peer and piece.name not in sliced) or copies[piece.name]:
            continue  # another rank holds the same elements and writes them
        add(entries, f"model/{name}", shape, piece_parts(piece, piece.value().detach(), place))
        if piece.separate_master:
            master = piece.oriented(piece.master.detach())
            add(entries, f"optim/{name}/master", shape, piece_parts(piece, master, place))
        for key, value in optimizer.piece_state(piece).items():
            if not torch.is_tensor(value):
                raise TypeError(
                    f"optimizer state {name!r}[{key!r}] is a {type(value).__name__}; "
                    f"checkpoints hold tensor state only"
                )
            value = local(value.detach())
            if elementwise(value, piece):
                parts = piece_parts(piece, piece.oriented(value), place)
                add(entries, f"optim/{name}/{key}", shape, parts)
                continue
            entry = f"optim/{name}/{block_key(piece, key)}"
            if piece.matrix is not None:  # a stack's matrix: its own row of a stacked entry
                rows = math.prod(shape[:-2])
                add(entries, entry, (rows, *value.shape), matrix_row(piece, value, place))
            elif piece.rows is not None or (piece.offset == 0 and not (place and place[1])):
                add(entries, entry, value.shape, whole(value))  # per block; per param: its
                # first element's owner writes it (of a sliced param: the first slice's)
    layout = ddp.expert_layout
    for name, t in other_tensors(ddp).items():
        expert = layout is not None and layout.is_expert(name, t)
        if (layout.data_rank if expert else rank) == 0 and not (expert and tp_peer):
            key, shape, place = places[name]
            add(entries, f"model/{key}", shape, shifted(whole(t.detach()), place))
    return entries


def _trainer_blob(optimizer: Checkpointable, extra: dict[str, Any] | None) -> bytes:
    """`trainer.pt`'s bytes: param-group hyperparameters, the optimizer's step count (None if
    it keeps none) and `extra`, checked to load back."""
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    buf = io.BytesIO()
    torch.save({"param_groups": groups, "steps": step_count(optimizer), "extra": extra}, buf)
    try:
        torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    except Exception as e:
        raise ValueError(
            f"extra must hold only tensors, numbers, strings, None and lists/tuples/dicts of "
            f"them (a resume loads it with torch.load(weights_only=True)): {e}"
        ) from e
    return buf.getvalue()


def _digest_files(group: RankConsensus, directory: Path) -> dict[str, Any]:
    """Size and crc32 of every file in `directory`, hashed in parallel across ranks."""
    names = group.on_first(lambda: sorted(os.listdir(directory)), f"cannot list {directory}")
    mine = group.all_succeed(
        lambda: digest(directory, names[group.rank :: group.size]), f"cannot checksum {directory}"
    )
    return {name: entry for part in group.all_gather(mine) for name, entry in part.items()}
