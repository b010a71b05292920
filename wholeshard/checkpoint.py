"""Checkpoints on torch.distributed.checkpoint (DCP): save anywhere, resume at any world size.

Directory protocol (`root` is a directory of checkpoints; file handling in `checkpoint_dir`):

    root/step-N/           one complete checkpoint (N = extra["step"], else the next free number)
        .metadata, __R_I.distcp    DCP's files: logical tensors, see "Format"
        trainer.pt                 param-group hyperparameters and the caller's `extra` (rank 0)
        wholeshard.json            manifest, written last: model table, size + crc32 of every file
    root/latest            text file naming the most recently completed save ("step-N")
    root/.tmp-step-N/      a save in progress; renamed to step-N only once complete

Invariants:
- a `step-N` directory is complete: it only ever appears by an atomic rename of a fully written,
  fsynced temp directory, and `latest` is replaced (atomically) only after that rename. A save
  killed at any point leaves the previous checkpoint loadable and `latest` naming it;
- `keep_last` prunes only after the new checkpoint is complete and `latest` names it; a pruned
  checkpoint is renamed away before it is deleted, so no half-deleted `step-M` is ever visible;
- a load validates everything (manifest, every file's size and crc32, model names, shapes and
  routing, chunk coverage) and agrees on the outcome across ranks BEFORE any param or optimizer
  state is touched; a damaged or mismatched checkpoint raises `CheckpointError` on every rank.

Format: one DCP entry per logical tensor, keyed by parameter FQN, with the tensor's full shape:
    model/<fqn>              the param as the model holds it (param dtype); also persistent
                             buffers and frozen params (written by rank 0)
    optim/<fqn>/master       the fp32 master, when it is separate from the param
    optim/<fqn>/<key>        torch optimizer state (Muon `momentum_buffer`; AdamW `exp_avg`,
                             `exp_avg_sq`, `step`)
Each rank writes exactly the elements it owns, as rectangular chunks with offsets into the full
tensor: an owned whole tensor is the special case of one chunk at offset 0; a flat slice
`[offset, offset + n)` of a param is cut into at most `2 * ndim - 1` row-major boxes. Optimizer
state that is not elementwise (AdamW's scalar `step`) is identical across the pieces of one param
and is written by the piece holding element 0. Nothing in the format depends on the layout, the
world size or the sharding strategy, so DCP reshards on load.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import shutil
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from .checkpoint_dir import (
    FORMAT,
    LATEST,
    MANIFEST,
    STEP_DIR,
    TMP_PREFIX,
    TRAINER,
    VERSION,
    CheckpointError,
    check_files,
    choose_step,
    clean_leftovers,
    crc32,
    fsync_dir,
    read_dcp_metadata,
    read_manifest,
    remove,
    steps,
    verify,
    write_durably,
    write_latest,
    write_manifest,
)
from .data_parallel import DataParallel
from .optim.layerwise import LayerwiseOptimizer, OwnedPiece
from .routing import clean_name

__all__ = [
    "CheckpointError",
    "load_checkpoint",
    "load_consolidated",
    "resolve_checkpoint",
    "save_checkpoint",
]


# -- public API --------------------------------------------------------------------------------


def save_checkpoint(
    path: str | os.PathLike,
    ddp: DataParallel,
    optimizer: LayerwiseOptimizer,
    *,
    extra: dict[str, Any] | None = None,
    keep_last: int | None = None,
) -> Path:
    """Save params, optimizer state and hyperparameters, and `extra`, as `path/step-N`.

    Every rank of `ddp`'s group must call it, between optimizer steps. N is `extra["step"]` when
    given (an int >= 0), else one more than the largest existing `step-M` (0 if none). `extra`
    is rank 0's small dict (step, RNG states, data position, scheduler state); it must survive
    `torch.load(weights_only=True)` (tensors, numbers, strings, None, and containers of them),
    which is checked here rather than at resume time. Gradients are not saved.

    Replacing an existing `step-N` is allowed unless `latest` names it. With `keep_last=K`,
    older checkpoints (`step-M`, M < N) beyond the K - 1 most recent are deleted after the new
    one is complete. Returns the new checkpoint's directory.
    """
    if keep_last is not None and (isinstance(keep_last, bool) or keep_last < 1):
        raise ValueError(f"keep_last must be an integer >= 1 or None, got {keep_last!r}")
    root = Path(path)
    group = _Group(ddp)
    _quiesce(ddp)

    def prepare() -> tuple[int, Path]:
        step = choose_step(root, extra)
        trainer = _trainer_blob(optimizer, extra)
        tmp = root / f"{TMP_PREFIX}step-{step}"
        clean_leftovers(root)
        tmp.mkdir(parents=True)
        write_durably(tmp / TRAINER, trainer)
        return step, tmp

    step, tmp = group.on_first(prepare, f"cannot start a checkpoint in {root}")
    state = group.agree(lambda: _save_entries(ddp, optimizer, group.rank), "cannot save")
    try:
        with _quiet_single_process():
            dcp.save(
                state,
                storage_writer=dcp.FileSystemWriter(tmp, sync_files=True),
                planner=_ChunkSavePlanner(),
                process_group=ddp.process_group,
                no_dist=not group.distributed,
            )
    except (Exception, dcp.CheckpointException) as e:  # DCP raises on every rank if any fails
        if group.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"writing checkpoint step-{step} to {tmp} failed: {e}") from e
    files = _digest_files(group, tmp)

    def commit() -> Path:
        return _commit(root, tmp, step, ddp, files, keep_last)

    return group.on_first(commit, f"cannot complete checkpoint step-{step} in {root}")


def load_checkpoint(
    path: str | os.PathLike, ddp: DataParallel, optimizer: LayerwiseOptimizer
) -> Any:
    """Load a checkpoint into `ddp` and `optimizer` at any world size and layout; return `extra`.

    `path` is a checkpoint (`.../step-N`), a checkpoints directory (its `latest` is followed),
    or a `latest` file. Every rank of `ddp`'s group must call it. Param-group hyperparameters
    (lr, betas, ...) are restored, as `torch.optim.Optimizer.load_state_dict` does. Afterwards
    every rank holds every param (gathered from the owners) and the gradient buffer is zero.
    Raises CheckpointError on every rank, changing nothing, if the checkpoint is damaged or was
    saved from a different model (names, shapes or Muon/AdamW routing).
    """
    group = _Group(ddp)
    _quiesce(ddp)
    ckpt = group.on_first(lambda: resolve_checkpoint(path), "cannot find the checkpoint")

    manifest = group.agree(lambda: read_manifest(ckpt), f"checkpoint {ckpt} is damaged")
    group.agree(
        lambda: check_files(ckpt, manifest, sorted(manifest["files"])[group.rank :: group.size]),
        f"checkpoint {ckpt} is damaged",
    )

    def plan() -> tuple[dict[str, Any], _LoadPlanData]:
        metadata = read_dcp_metadata(ckpt)
        trainer = torch.load(ckpt / TRAINER, weights_only=True)
        _check_model(ckpt, manifest, metadata, ddp, optimizer, trainer)
        return trainer, _plan_load(metadata, ddp, optimizer)

    trainer, data = group.agree(plan, f"cannot load checkpoint {ckpt}")
    try:
        with _quiet_single_process():
            dcp.load(
                data.entries,
                storage_reader=dcp.FileSystemReader(ckpt),
                planner=_ChunkLoadPlanner(),
                process_group=ddp.process_group,
                no_dist=not group.distributed,
            )
    except (Exception, dcp.CheckpointException) as e:  # DCP raises on every rank if any fails
        raise CheckpointError(f"reading checkpoint {ckpt} failed (nothing was changed): {e}") from e
    _install(data, ddp, optimizer, trainer["param_groups"])
    return trainer["extra"]


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """The checkpoint directory `path` means: itself if it holds a manifest, else the one its
    `latest` marker names (for a checkpoints directory or the `latest` file itself)."""
    p = Path(path)
    if p.is_file() and p.name == LATEST:
        p = p.parent
    if (p / MANIFEST).is_file():
        return p
    if (p / LATEST).is_file():
        name = (p / LATEST).read_text().strip()
        target = p / name
        if not STEP_DIR.match(name) or not (target / MANIFEST).is_file():
            raise CheckpointError(
                f"{p / LATEST} names {name!r}, which is not a complete checkpoint in {p}"
            )
        return target
    looks_like_one = STEP_DIR.match(p.name) or (p / ".metadata").exists() or (p / TRAINER).exists()
    if p.is_dir() and looks_like_one:
        raise CheckpointError(f"checkpoint {p} is incomplete or damaged: {MANIFEST} is missing")
    raise CheckpointError(
        f"{p} is neither a checkpoint (no {MANIFEST}) nor a checkpoints directory (no {LATEST})"
    )


def load_consolidated(
    path: str | os.PathLike, *, dtype: torch.dtype | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Full model tensors of a checkpoint, in one process without a process group.

    Returns `(tensors, manifest)`: `tensors` maps every `model.state_dict()` key, tied aliases
    included, to a full CPU tensor. With `dtype`, floating tensors are cast to it, taking params
    from their fp32 masters when the checkpoint has them; without it, params keep the dtype they
    were trained in. Reads nothing before the directory verifies (`checkpoint_dir.verify`).
    """
    ckpt = resolve_checkpoint(path)
    manifest = verify(ckpt)
    metadata = read_dcp_metadata(ckpt)
    keys: dict[str, str] = {}
    for name in manifest["params"]:
        master = f"optim/{name}/master"
        use_master = dtype is not None and master in metadata.state_dict_metadata
        keys[name] = master if use_master else f"model/{name}"
    keys.update({name: f"model/{name}" for name in manifest["others"]})
    entries: dict[str, _Chunks] = {}
    for key in keys.values():
        md = metadata.state_dict_metadata.get(key)
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointError(f"checkpoint {ckpt} is damaged: it has no tensor {key!r}")
        full = torch.empty(md.size, dtype=md.properties.dtype)
        entries[key] = _Chunks(md.size, [((0,) * len(md.size), full)])
    with _quiet_single_process():
        dcp.load(
            entries,
            storage_reader=dcp.FileSystemReader(ckpt),
            planner=_ChunkLoadPlanner(),
            no_dist=True,
        )
    tensors = {}
    for name, key in keys.items():
        t = entries[key].parts[0][1]
        tensors[name] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    for alias, name in manifest["aliases"].items():
        tensors[alias] = tensors[name]
    return tensors, manifest


# -- what is saved -----------------------------------------------------------------------------


@dataclass
class _Chunks:
    """One logical tensor of `size`: the parts this rank writes or reads, as (offsets, view)."""

    size: torch.Size
    parts: list[tuple[tuple[int, ...], torch.Tensor]] = field(default_factory=list)


def flat_range_boxes(
    shape: tuple[int, ...], start: int, stop: int
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Row-major elements `[start, stop)` of a tensor of `shape` as boxes `(offsets, sizes)`.

    The boxes are disjoint, cover exactly the range, come in row-major order, and each is
    contiguous in row-major order (fixed leading indices, a range in one dim, full trailing
    dims), so each is a view of the flat range. At most `2 * len(shape) - 1` boxes.
    """
    shape = tuple(shape)
    if not 0 <= start <= stop <= math.prod(shape):
        raise ValueError(f"range [{start}, {stop}) is outside a tensor of shape {shape}")
    if start == stop:
        return [((0,) * len(shape), shape)] if math.prod(shape) == 0 else []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    rest = shape[1:]
    first, last = start // inner, (stop - 1) // inner
    lo, hi = start - first * inner, stop - last * inner

    def in_row(row: int, a: int, b: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        return [((row, *o), (1, *s)) for o, s in flat_range_boxes(rest, a, b)]

    if first == last:
        return in_row(first, lo, hi)
    boxes = in_row(first, lo, inner) if lo else []
    full_lo = first + 1 if lo else first
    full_hi = last + 1 if hi == inner else last
    if full_hi > full_lo:
        boxes.append(((full_lo, *(0,) * len(rest)), (full_hi - full_lo, *rest)))
    if hi != inner:
        boxes += in_row(last, 0, hi)
    return boxes


def _piece_parts(
    piece: OwnedPiece, flat: torch.Tensor
) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """`flat` (the piece's elements, any shape) cut into chunks of the full param."""
    flat = flat.reshape(-1)
    stop = piece.offset + flat.numel()
    parts, at = [], 0
    for offsets, sizes in flat_range_boxes(piece.full_shape, piece.offset, stop):
        n = math.prod(sizes)
        parts.append((offsets, flat[at : at + n].view(sizes)))
        at += n
    return parts


def _add(entries: dict[str, _Chunks], key: str, size: tuple[int, ...], parts: list) -> None:
    entries.setdefault(key, _Chunks(torch.Size(size))).parts.extend(parts)


def _elementwise(value: torch.Tensor, piece: OwnedPiece) -> bool:
    return tuple(value.shape) == tuple(piece.master.shape)


def _save_entries(ddp: DataParallel, optimizer: LayerwiseOptimizer, rank: int) -> dict[str, Any]:
    """This rank's share: each owned element once, plus (rank 0) buffers and frozen params."""
    entries: dict[str, _Chunks] = {}
    for piece in optimizer.owned_pieces():
        name, shape = piece.name, piece.full_shape
        _add(entries, f"model/{name}", shape, _piece_parts(piece, piece.param.detach()))
        if piece.separate_master:
            master = piece.oriented(piece.master.detach())
            _add(entries, f"optim/{name}/master", shape, _piece_parts(piece, master))
        for key, value in optimizer.piece_state(piece).items():
            if not torch.is_tensor(value):
                raise TypeError(
                    f"optimizer state {name!r}[{key!r}] is a {type(value).__name__}; "
                    f"checkpoints hold tensor state only"
                )
            value = value.detach()
            if _elementwise(value, piece):
                _add(
                    entries,
                    f"optim/{name}/{key}",
                    shape,
                    _piece_parts(piece, piece.oriented(value)),
                )
            elif piece.offset == 0:  # same on every piece of the param: element 0's owner writes
                _add(entries, f"optim/{name}/{key}", value.shape, [((0,) * value.ndim, value)])
    if rank == 0:
        for name, t in _other_tensors(ddp).items():
            _add(entries, f"model/{name}", t.shape, [((0,) * t.ndim, t.detach())])
    return entries


def _other_tensors(ddp: DataParallel) -> dict[str, torch.Tensor]:
    """State-dict tensors DataParallel does not shard: persistent buffers and frozen params."""
    routed = {id(r.param) for r in ddp.routes}
    out = {}
    for fqn, value in ddp.module.state_dict(keep_vars=True).items():
        name = clean_name(fqn)
        if not torch.is_tensor(value):
            raise TypeError(f"module state {name!r} is not a tensor; checkpoints hold tensors only")
        if id(value) not in routed:
            out[name] = value
    return out


def _aliases(ddp: DataParallel) -> dict[str, str]:
    """Every other name of a routed (tied) param, mapped to its route name."""
    first = {id(r.param): r.name for r in ddp.routes}
    aliases = {}
    for fqn, p in ddp.module.named_parameters(remove_duplicate=False):
        name = clean_name(fqn)
        if id(p) in first and first[id(p)] != name:
            aliases[name] = first[id(p)]
    return aliases


def _trainer_blob(optimizer: LayerwiseOptimizer, extra: dict[str, Any] | None) -> bytes:
    """`trainer.pt`'s bytes: param-group hyperparameters and `extra`, checked to load back."""
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    buf = io.BytesIO()
    torch.save({"param_groups": groups, "extra": extra}, buf)
    try:
        torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    except Exception as e:
        raise ValueError(
            f"extra must hold only tensors, numbers, strings, None and lists/tuples/dicts of "
            f"them (a resume loads it with torch.load(weights_only=True)): {e}"
        ) from e
    return buf.getvalue()


# -- DCP planners ------------------------------------------------------------------------------


class _ChunkSavePlanner(DefaultSavePlanner):
    """Writes each `_Chunks` part as one DCP chunk. Fails if two ranks offer the same chunk: DCP
    would keep only one of them, silently (measured: per-rank tensors saved under one shared key
    keep rank 0's values alone)."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False) -> None:
        self.state_dict = state_dict
        self.is_coordinator = is_coordinator
        self._parts = {
            MetadataIndex(key, offsets): t
            for key, chunks in state_dict.items()
            for offsets, t in chunks.parts
        }

    def create_local_plan(self) -> SavePlan:
        items = [
            WriteItem(
                index=MetadataIndex(key, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(torch.Size(offsets), t.shape),
                    properties=TensorProperties.create_from_tensor(t),
                    size=chunks.size,
                ),
            )
            for key, chunks in self.state_dict.items()
            for offsets, t in chunks.parts
        ]
        self.plan = SavePlan(items)
        return self.plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        seen: dict[MetadataIndex, int] = {}
        for rank, plan in enumerate(all_plans):
            for item in plan.items:
                if item.index in seen:
                    raise AssertionError(
                        f"ranks {seen[item.index]} and {rank} both write {item.index.fqn} at "
                        f"{tuple(item.index.offset)}: ownership is not disjoint"
                    )
                seen[item.index] = rank
        return super().create_global_plan(all_plans)

    def lookup_object(self, index: MetadataIndex) -> Any:
        return self._parts[MetadataIndex(index.fqn, index.offset)]


class _ChunkLoadPlanner(DefaultLoadPlanner):
    """Reads into each `_Chunks` part; DCP finds the saved chunks that overlap it."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        self.state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator
        self._parts = {
            MetadataIndex(key, offsets): t
            for key, chunks in state_dict.items()
            for offsets, t in chunks.parts
        }

    def create_local_plan(self) -> LoadPlan:
        items: list[ReadItem] = []
        for key, chunks in self.state_dict.items():
            local = [ChunkStorageMetadata(torch.Size(o), t.shape) for o, t in chunks.parts]
            items += create_read_items_for_chunk_list(
                key, self.metadata.state_dict_metadata[key], local
            )
        return LoadPlan(items)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise AssertionError(f"unexpected non-tensor entry {read_item.dest_index.fqn!r}")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        index = read_item.dest_index
        target = self._parts[MetadataIndex(index.fqn, index.offset)]
        for dim, (offset, length) in enumerate(
            zip(read_item.dest_offsets, read_item.lengths, strict=True)
        ):
            target = target.narrow(dim, offset, length)
        return target


# -- load planning and installation ------------------------------------------------------------


@dataclass
class _LoadPlanData:
    """Fresh tensors DCP reads into, and where each goes once every rank has read."""

    entries: dict[str, _Chunks]
    truth: list[tuple[OwnedPiece, torch.Tensor]]  # piece, its master's new value
    state: list[tuple[OwnedPiece, dict[str, torch.Tensor]]]
    others: list[tuple[torch.Tensor, torch.Tensor]]  # live tensor, new value


def _state_keys(metadata: Metadata, name: str) -> list[str]:
    prefix = f"optim/{name}/"
    return sorted(
        k[len(prefix) :]
        for k in metadata.state_dict_metadata
        if k.startswith(prefix) and k != f"{prefix}master"
    )


def _plan_load(
    metadata: Metadata, ddp: DataParallel, optimizer: LayerwiseOptimizer
) -> _LoadPlanData:
    md = metadata.state_dict_metadata
    entries: dict[str, _Chunks] = {}
    data = _LoadPlanData(entries, [], [], [])
    for piece in optimizer.owned_pieces():
        name, shape = piece.name, piece.full_shape
        key = f"optim/{name}/master" if f"optim/{name}/master" in md else f"model/{name}"
        # Read in the storage layout; install through the optimizer-layout view.
        value = piece.param.new_empty(piece.param.shape, dtype=piece.master.dtype)
        _add(entries, key, shape, _piece_parts(piece, value))
        data.truth.append((piece, piece.oriented(value)))
        state = {}
        for k in _state_keys(metadata, name):
            saved = md[f"optim/{name}/{k}"]
            if tuple(saved.size) == shape:
                value = piece.param.new_empty(piece.param.shape, dtype=saved.properties.dtype)
                _add(entries, f"optim/{name}/{k}", shape, _piece_parts(piece, value))
                value = piece.oriented(value)
            else:  # one value per param (AdamW's step): every piece reads the whole of it
                whole = f"optim/{name}/{k}"
                if whole not in entries:
                    full = torch.empty(saved.size, dtype=saved.properties.dtype)
                    _add(entries, whole, saved.size, [((0,) * len(saved.size), full)])
                value = entries[whole].parts[0][1]
            state[k] = value
        data.state.append((piece, state))
    for name, live in _other_tensors(ddp).items():
        value = torch.empty_like(live, memory_format=torch.contiguous_format)
        _add(entries, f"model/{name}", live.shape, [((0,) * live.ndim, value)])
        data.others.append((live, value))
    return data


@torch.no_grad()
def _install(
    data: _LoadPlanData,
    ddp: DataParallel,
    optimizer: LayerwiseOptimizer,
    param_groups: list[dict[str, Any]],
) -> None:
    """Make the read values live, then gather every param from its owner."""
    for piece, value in data.truth:
        piece.master.copy_(value)
        if piece.separate_master:
            piece.param.copy_(piece.oriented(piece.master))
    for piece, state in data.state:
        live = optimizer.piece_state(piece)
        live.clear()
        live.update(
            {k: v.contiguous() if _elementwise(v, piece) else v.clone() for k, v in state.items()}
        )
    for live, value in data.others:
        live.copy_(value)
    for group, saved in zip(optimizer.param_groups, param_groups, strict=True):
        group.update({k: v for k, v in saved.items() if k != "params"})
    ddp.zero_grad_buffer()
    ddp.start_param_sync()
    ddp.finish_param_sync()


# -- validation --------------------------------------------------------------------------------


def _model_table(ddp: DataParallel) -> tuple[dict[str, Any], dict[str, Any]]:
    params = {
        r.name: {
            "shape": list(r.shape),
            "dtype": str(r.param.dtype).removeprefix("torch."),
            "optimizer": "muon" if r.muon else "adamw",
        }
        for r in ddp.routes
    }
    others = {
        name: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
        for name, t in _other_tensors(ddp).items()
    }
    return params, others


def _check_model(
    ckpt: Path,
    manifest: dict[str, Any],
    metadata: Metadata,
    ddp: DataParallel,
    optimizer: LayerwiseOptimizer,
    trainer: dict[str, Any],
) -> None:
    """Raise naming every difference between the checkpoint and this model."""
    params, others = _model_table(ddp)
    problems = _compare_tables("param", manifest["params"], params, ("shape", "optimizer"))
    problems += _compare_tables("buffer or frozen param", manifest["others"], others, ("shape",))
    if problems:
        raise CheckpointError(
            f"checkpoint {ckpt} was saved from a different model: " + "; ".join(problems)
        )
    md = metadata.state_dict_metadata
    expected: dict[str, tuple[int, ...] | None] = {
        f"model/{n}": tuple(e["shape"]) for n, e in {**params, **others}.items()
    }
    for name, entry in params.items():
        if f"optim/{name}/master" in md:
            expected[f"optim/{name}/master"] = tuple(entry["shape"])
        expected.update({f"optim/{name}/{k}": None for k in _state_keys(metadata, name)})
    damaged = []
    for key, shape in sorted(expected.items()):
        saved = md.get(key)
        if not isinstance(saved, TensorStorageMetadata):
            damaged.append(f"{key} is missing")
        elif shape is not None and tuple(saved.size) != shape:
            damaged.append(f"{key} has shape {tuple(saved.size)}, the manifest says {shape}")
        elif sum(math.prod(c.sizes) for c in saved.chunks) != math.prod(saved.size):
            damaged.append(f"{key}'s chunks do not cover it exactly once (a shard is missing)")
    if len(trainer.get("param_groups", ())) != len(optimizer.param_groups):
        damaged.append(
            f"{TRAINER} has {len(trainer.get('param_groups', ()))} param groups, the optimizer "
            f"{len(optimizer.param_groups)}"
        )
    if damaged:
        raise CheckpointError(f"checkpoint {ckpt} is damaged: " + "; ".join(damaged[:10]))


def _compare_tables(
    what: str, saved: dict[str, Any], model: dict[str, Any], fields: tuple[str, ...]
) -> list[str]:
    def names(xs: list[str]) -> str:
        return ", ".join(xs[:8]) + (f" and {len(xs) - 8} more" if len(xs) > 8 else "")

    problems = []
    missing = sorted(set(model) - set(saved))
    unexpected = sorted(set(saved) - set(model))
    if missing:
        problems.append(f"{what}s missing from the checkpoint: {names(missing)}")
    if unexpected:
        problems.append(f"{what}s in the checkpoint but not in the model: {names(unexpected)}")
    for name in sorted(set(saved) & set(model)):
        for f in fields:
            if saved[name][f] != model[name][f]:
                want, got = saved[name][f], model[name][f]
                if f == "shape":
                    want, got = tuple(want), tuple(got)
                problems.append(f"{name}: {f} {want} in the checkpoint, {got} in the model")
    return problems


# -- the directory protocol steps that need the process group ------------------------------


def _digest_files(group: _Group, directory: Path) -> dict[str, Any]:
    """Size and crc32 of every file in `directory`, hashed in parallel across ranks."""
    names = group.on_first(lambda: sorted(os.listdir(directory)), f"cannot list {directory}")
    mine = group.agree(
        lambda: {
            n: {"bytes": (directory / n).stat().st_size, "crc32": crc32(directory / n)}
            for n in names[group.rank :: group.size]
        },
        f"cannot checksum {directory}",
    )
    merged: dict[str, Any] = {}
    for part in group.all_gather(mine):
        merged.update(part)
    return merged


def _commit(
    root: Path,
    tmp: Path,
    step: int,
    ddp: DataParallel,
    files: dict[str, Any],
    keep_last: int | None,
) -> Path:
    """Manifest, fsync, rename into place, point `latest` at it, prune (rank 0)."""
    params, others = _model_table(ddp)
    body = {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "params": params,
        "others": others,
        "aliases": _aliases(ddp),
        "files": files,
        "saved_with": {"world_size": ddp.dp_size, "torch": torch.__version__},
    }
    write_manifest(tmp / MANIFEST, body)
    fsync_dir(tmp)
    final = root / f"step-{step}"
    if final.exists():  # not the latest (checked before the save): a stale save of this step
        remove(root, final)
    os.rename(tmp, final)
    fsync_dir(root)
    write_latest(root, final.name)
    if keep_last is not None:
        older = sorted((s, p) for s, p in steps(root).items() if s < step)
        for _, p in older[: max(0, len(older) - (keep_last - 1))]:
            remove(root, p)
    return final


# -- process-group plumbing --------------------------------------------------------------------


class _Group:
    """The collectives a save or load needs, on `ddp`'s group; local without one."""

    def __init__(self, ddp: DataParallel) -> None:
        self.pg = ddp.process_group
        self.size, self.rank = ddp.dp_size, ddp.rank
        self.distributed = self.size > 1

    def broadcast(self, obj: Any) -> Any:
        if not self.distributed:
            return obj
        src = 0 if self.pg is None else dist.get_global_rank(self.pg, 0)
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.pg)
        return box[0]

    def all_gather(self, obj: Any) -> list[Any]:
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    def on_first(self, fn, what: str) -> Any:
        """Run `fn` on rank 0 only; every rank returns its result or raises its error."""
        result, error = None, None
        if self.rank == 0:
            try:
                result = fn()
            except Exception as e:
                error = _describe(e, what)
        result, error = self.broadcast((result, error))
        if error is not None:
            raise CheckpointError(error)
        return result

    def agree(self, fn, what: str) -> Any:
        """Run `fn` on every rank; if any rank fails, every rank raises all their errors."""
        result, error = None, None
        try:
            result = fn()
        except Exception as e:
            error = _describe(e, what)
        errors = self.all_gather(error)
        distinct = list(dict.fromkeys(e for e in errors if e is not None))
        if distinct:
            raise CheckpointError(" | ".join(distinct))
        return result


def _describe(e: Exception, what: str) -> str:
    return str(e) if isinstance(e, CheckpointError) else f"{what}: {type(e).__name__}: {e}"


def _quiesce(ddp: DataParallel) -> None:
    """Nothing in flight: pending all-gathers done, and temporary gather buffers freed, since
    holding them across a save costs memory exactly when the save needs it."""
    ddp.free_overlap_buffers()


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """Silence DCP's warning that it runs without a process group: that is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
