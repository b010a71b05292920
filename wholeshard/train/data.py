"""Byte-level text data: the embedded stdlib corpus, a deterministic split, and batch sampling.

[Note: batches]
Step `s`'s global batch is `batch_size` windows whose start offsets come from a generator seeded
with `(seed, s)` alone, so every rank draws the same global batch without talking, and rank `r`
keeps the contiguous slice `[r * B / world, (r + 1) * B / world)`. The batches therefore depend
on the seed and the step only, never on the world size; ranks read disjoint slices of them.
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

# Directories of the stdlib tree that are not the library's own sources.
_STDLIB_SKIP = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
_SPLIT_BLOCKS = 100  # the text is cut into this many equal blocks ...
_VAL_EVERY = 20  # ... and every 20th block (5%) is validation text


@dataclass(frozen=True)
class Corpus:
    """Train and validation bytes as 1-D uint8 tensors, plus where they came from."""

    train: torch.Tensor
    val: torch.Tensor
    source: str
    files: int


def stdlib_root() -> Path:
    """The directory of this Python's standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[Path]:
    """The stdlib's own `.py` files (no tests, no site-packages), in a fixed sorted order."""
    root = stdlib_root()
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP and not d.startswith(".")]
        found += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def text_files(path: str | os.PathLike) -> list[Path]:
    """`path` itself if it is a file, else every non-hidden file below it, sorted."""
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"no such file or directory: {path}")
    found = []
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "__pycache__"]
        found += [Path(dirpath, f) for f in filenames if not f.startswith(".")]
    return sorted(found, key=lambda p: p.relative_to(path).as_posix())


def read_text_bytes(files: list[Path]) -> tuple[bytes, int]:
    """Concatenate the files that look like text (no NUL byte); returns (bytes, files used)."""
    parts = []
    for f in files:
        data = f.read_bytes()
        if data and b"\0" not in data[:8192]:
            parts.append(data if data.endswith(b"\n") else data + b"\n")
    return b"".join(parts), len(parts)


def split(data: bytes) -> tuple[bytes, bytes]:
    """Cut `data` into `_SPLIT_BLOCKS` equal blocks; every `_VAL_EVERY`-th is validation."""
    block = -(-len(data) // _SPLIT_BLOCKS)
    train, val = [], []
    for i in range(_SPLIT_BLOCKS):
        chunk = data[i * block : (i + 1) * block]
        (val if i % _VAL_EVERY == _VAL_EVERY - 1 else train).append(chunk)
    return b"".join(train), b"".join(val)


def load_corpus(path: str | os.PathLike | None = None) -> Corpus:
    """Read `path` (a file or directory), or the stdlib sources when None, and split it."""
    if path is None:
        files, source = stdlib_files(), f"python stdlib ({stdlib_root()})"
    else:
        files, source = text_files(path), str(path)
    data, used = read_text_bytes(files)
    if not data:
        raise ValueError(f"no text found in {source}")
    train, val = split(data)

    def as_tensor(b: bytes) -> torch.Tensor:
        if not b:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(bytearray(b), dtype=torch.uint8)

    return Corpus(as_tensor(train), as_tensor(val), source, used)


def _windows(text: torch.Tensor, starts: torch.Tensor, seq_len: int):
    idx = starts[:, None] + torch.arange(seq_len + 1)
    seqs = text[idx].long()
    return seqs[:, :-1], seqs[:, 1:]


def rank_slice(n: int, rank: int, world: int) -> slice:
    """Rank's contiguous slice of a global batch of n (n divisible by world)."""
    if n % world:
        raise ValueError(f"batch of {n} is not divisible by world size {world}")
    per = n // world
    return slice(rank * per, (rank + 1) * per)


def train_batch(
    text: torch.Tensor, step: int, batch_size: int, seq_len: int, seed: int, rank: int, world: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (inputs, targets) of step's global batch, each `[batch / world, seq_len]`."""
    if len(text) <= seq_len:
        raise ValueError(f"train text has {len(text)} bytes, need more than seq_len={seq_len}")
    g = torch.Generator().manual_seed((seed << 32) + step)
    starts = torch.randint(0, len(text) - seq_len, (batch_size,), generator=g)
    return _windows(text, starts[rank_slice(batch_size, rank, world)], seq_len)


def val_batches(
    text: torch.Tensor, n_batches: int, batch_size: int, seq_len: int, rank: int, world: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's slices of `n_batches` fixed validation batches of evenly spaced windows."""
    if len(text) <= seq_len:
        raise ValueError(f"val text has {len(text)} bytes, need more than seq_len={seq_len}")
    n = n_batches * batch_size
    starts = torch.linspace(0, len(text) - seq_len - 1, n).long().view(n_batches, batch_size)
    mine = rank_slice(batch_size, rank, world)
    return [_windows(text, row[mine], seq_len) for row in starts]


def on_device(device: torch.device, *batch: torch.Tensor) -> list[torch.Tensor]:
    """`batch` on `device`; to a GPU from pinned memory without blocking the host."""
    if device.type != "cuda":
        return [t.to(device) for t in batch]
    return [t.pin_memory().to(device, non_blocking=True) for t in batch]
