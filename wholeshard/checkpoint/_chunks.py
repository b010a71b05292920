"""Chunk geometry and the DCP planners: how the elements a rank holds become DCP chunks.

A logical tensor is written and read as rectangular chunks with offsets into the full tensor
(`Chunks`). An owned whole tensor is one chunk at offset 0; a flat slice `[offset, offset + n)`
of a param is cut into at most `2 * ndim - 1` row-major boxes (`flat_range_boxes`); a row block
(ns_split) is one box. The planners
hand DCP exactly these chunks: no flattening, no resharding of their own, so DCP finds for each
chunk read the saved chunks that overlap it, whatever the world size or plan at save time.
"""

from __future__ import annotations

import contextlib
import io
import math
import re
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed import ProcessGroup
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
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

from ..optim.pieces import OwnedPiece

Part = tuple[tuple[int, ...], torch.Tensor]  # (offsets into the full tensor, the chunk)


@dataclass
class Chunks:
    """One logical tensor of `size`: the parts this rank writes or reads, as (offsets, view)."""

    size: torch.Size
    parts: list[Part] = field(default_factory=list)


def add(entries: dict[str, Chunks], key: str, size: tuple[int, ...], parts: list[Part]) -> None:
    """Add `parts` to the entry `key` (a tensor of `size`), creating it if needed."""
    entries.setdefault(key, Chunks(torch.Size(size))).parts.extend(parts)


def whole(t: torch.Tensor) -> list[Part]:
    """`t` as the one chunk of a tensor of its own shape."""
    return [((0,) * t.ndim, t)]


def block_key(piece: OwnedPiece, key: str) -> str:
    """Where state `key` of `piece` that is not element-wise is stored: one entry per row block
    (`key[a:b]`), as the matrix optimizer keeps one per block ([Note: row blocks])."""
    return key if piece.rows is None else f"{key}[{piece.rows[0]}:{piece.rows[1]}]"


def own_state_keys(piece: OwnedPiece, saved: list[str]) -> dict[str, str]:
    """Of `saved`, the state keys of `piece`'s param that are not element-wise, those holding
    `piece`'s state, each mapped to its state key (`block_key`'s inverse). Raises ValueError if
    they were saved under another row split."""
    blocks = {key: _BLOCK.fullmatch(key) for key in saved}
    if piece.rows is None:
        own = {key: key for key, block in blocks.items() if block is None}
        wrong = "with" if len(own) < len(saved) else None
    else:
        own = {
            key: block[1]
            for key, block in blocks.items()
            if block is not None and (int(block[2]), int(block[3])) == piece.rows
        }
        names = {block[1] if block else key for key, block in blocks.items()}
        wrong = "without" if None in blocks.values() else None
        wrong = wrong or ("with other" if names != set(own.values()) else None)
    if wrong:
        raise ValueError(
            f"optimizer state {sorted(saved)[:4]} of {piece.name} was saved {wrong} row blocks "
            f"(ns_split): build the LayerwiseOptimizer with the ns_split it was saved with"
        )
    return own


_BLOCK = re.compile(r"(.*)\[(\d+):(\d+)\]")


def matrix_row(piece: OwnedPiece, t: torch.Tensor, place: tuple[int, int] | None) -> list[Part]:
    """`t`, one matrix's state not shaped like it, as its matrix's row of an entry stacking
    every matrix's (shape `(matrices, *t.shape)`): row `piece.matrix`, moved by `place` when
    the stack is one of experts placed in the whole model's (`dtensor.Place`)."""
    first = 0 if place is None else place[1] * piece.matrices // piece.full_shape[0]
    return [((first + piece.matrix, *(0,) * t.ndim), t.unsqueeze(0))]


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


def piece_parts(
    piece: OwnedPiece, flat: torch.Tensor, place: tuple[int, int] | None = None
) -> list[Part]:
    """`flat` (the piece's elements in storage order, any shape) cut into chunks of the full
    param: views of `flat`, so reading into them fills `flat`. `place`: where the piece's
    tensor-parallel shard sits in the logical tensor (`shifted`)."""
    if piece.rows is not None:
        return shifted([_block_part(piece, flat)], place)
    flat = flat.reshape(-1)
    stop = piece.offset + flat.numel()
    parts, at = [], 0
    for offsets, sizes in flat_range_boxes(piece.full_shape, piece.offset, stop):
        n = math.prod(sizes)
        parts.append((offsets, flat[at : at + n].view(sizes)))
        at += n
    return shifted(parts, place)


def shifted(parts: list[Part], place: tuple[int, int] | None) -> list[Part]:
    """`parts` of a tensor-parallel shard moved to where the shard sits in the logical tensor:
    `place` is (dim, offset) (`distributed.dtensor.shard_place`); None: unmoved."""
    if place is None:
        return parts
    dim, offset = place
    return [
        (tuple(o + offset if d == dim else o for d, o in enumerate(offsets)), t)
        for offsets, t in parts
    ]


def _block_part(piece: OwnedPiece, t: torch.Tensor) -> Part:
    """A row block's elements (storage orientation) as the one box they fill in the param: rows
    `piece.rows` of its matrix, or those columns when the matrix is stored (in, out)."""
    (a, b), shape = piece.rows, piece.full_shape
    lead = []
    index = piece.matrix or 0
    for dim in reversed(shape[:-2]):  # the matrix's index in each stacking dim
        index, at = divmod(index, dim)
        lead.insert(0, at)
    if piece.transposed:
        offsets, sizes = (*lead, 0, a), (*(1,) * len(lead), shape[-2], b - a)
    else:
        offsets, sizes = (*lead, a, 0), (*(1,) * len(lead), b - a, shape[-1])
    return tuple(offsets), t.reshape(sizes)


# -- DCP -----------------------------------------------------------------------------------------


def write(
    entries: dict[str, Chunks], directory: Path, group: ProcessGroup | None, distributed: bool
) -> None:
    """Write every rank's `entries` into `directory` (every rank of `group` calls it)."""
    with _quiet_single_process():
        dcp.save(
            entries,
            storage_writer=dcp.FileSystemWriter(directory, sync_files=True),
            planner=ChunkSavePlanner(),
            process_group=group,
            no_dist=not distributed,
        )


def read(
    entries: dict[str, Chunks],
    directory: Path,
    group: ProcessGroup | None = None,
    distributed: bool = False,
) -> None:
    """Fill every part of `entries` from the checkpoint in `directory`."""
    with _quiet_single_process():
        dcp.load(
            entries,
            storage_reader=dcp.FileSystemReader(directory),
            planner=ChunkLoadPlanner(),
            process_group=group,
            no_dist=not distributed,
        )


def _by_index(state_dict: dict[str, Chunks]) -> dict[MetadataIndex, torch.Tensor]:
    return {
        MetadataIndex(key, offsets): t
        for key, chunks in state_dict.items()
        for offsets, t in chunks.parts
    }


class ChunkSavePlanner(DefaultSavePlanner):
    """Writes each `Chunks` part as one DCP chunk. Fails if two ranks offer the same chunk: DCP
    would keep only one of them, silently (measured: per-rank tensors saved under one shared key
    keep rank 0's values alone)."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False) -> None:
        self.state_dict = state_dict
        self.is_coordinator = is_coordinator
        self._parts = _by_index(state_dict)

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


class ChunkLoadPlanner(DefaultLoadPlanner):
    """Reads into each `Chunks` part; DCP finds the saved chunks that overlap it."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        self.state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator
        self._parts = _by_index(state_dict)

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


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """Silence DCP's warning that it runs without a process group: that is intended here.
    `catch_warnings` changes the filters of every thread, so off the main thread (a background
    save) the one filter, for that message alone, is added for good instead."""
    if threading.current_thread() is not threading.main_thread():
        warnings.filterwarnings("ignore", message=_NO_GROUP)
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NO_GROUP)
        yield


_NO_GROUP = "torch.distributed is disabled"
