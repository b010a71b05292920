"""Text data as a 1-D stream: the stdlib corpus, a deterministic split, and batch sampling.

Bytes are read here; tokenized and record (`.jsonl`, `.json`, `.parquet`) data are built and
cached by `wholeshard.train.tokens`, which returns the same `Corpus`.

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
from fractions import Fraction
from pathlib import Path

import torch

# Directories of the stdlib tree that are not the library's own sources.
_STDLIB_SKIP = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
_SPLIT_BLOCKS = 100  # the text is cut into at least this many equal blocks ...
VAL_FRACTION = 0.05  # ... and this fraction of them, spread evenly, is validation text
_MAX_DENOMINATOR = 1000  # val_fraction is rounded to a fraction p/q with q <= this


@dataclass(frozen=True)
class Corpus:
    """Train and validation text as 1-D integer tensors, plus where they came from.

    `unit` is "bytes" (uint8 tensors) or "tokens" (uint16 or uint32 tensors, views of the
    memory-mapped `cache` file). Index first, then convert (`_windows` does): unsigned 16- and
    32-bit tensors support few torch ops.
    """

    train: torch.Tensor
    val: torch.Tensor
    source: str
    files: int
    unit: str = "bytes"
    cache: Path | None = None


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


def split_fraction(val_fraction: float = VAL_FRACTION) -> tuple[int, int]:
    """`val_fraction` as `(p, q)`, the nearest fraction with `q <= 1000` (0.05 -> (1, 20))."""
    f = Fraction(val_fraction).limit_denominator(_MAX_DENOMINATOR)
    if not 0 < f < 1:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    return f.numerator, f.denominator


def split_blocks(n: int, val_fraction: float = VAL_FRACTION) -> list[tuple[int, int, bool]]:
    """`(start, stop, is_val)` of the equal blocks a stream of `n` items is cut into.

    With `val_fraction = p/q` there are `q * ceil(100 / q)` blocks (a multiple of q, at least
    100), each `ceil(n / blocks)` long (the last ones shorter or empty), and block `i` is
    validation when `floor((i + 1) p / q) > floor(i p / q)`: exactly `p` of every `q`, spread
    evenly. The default 1/20 gives 100 blocks with every 20th validation. Integers only.
    """
    p, q = split_fraction(val_fraction)
    blocks = q * -(-_SPLIT_BLOCKS // q)
    size = -(-n // blocks)
    return [
        (min(i * size, n), min((i + 1) * size, n), (i + 1) * p // q > i * p // q)
        for i in range(blocks)
    ]


def split(data: bytes, val_fraction: float = VAL_FRACTION) -> tuple[bytes, bytes]:
    """`data` cut by `split_blocks`: (the train blocks joined, the validation blocks joined)."""
    train, val = [], []
    for start, stop, is_val in split_blocks(len(data), val_fraction):
        (val if is_val else train).append(data[start:stop])
    return b"".join(train), b"".join(val)


def load_corpus(
    path: str | os.PathLike | None = None, *, val_fraction: float = VAL_FRACTION
) -> Corpus:
    """Read `path` (a file or directory), or the stdlib sources when None, as bytes, and split
    it (`split`). Every file is read as text, whatever its suffix."""
    if path is None:
        files, source = stdlib_files(), f"python stdlib ({stdlib_root()})"
    else:
        files, source = text_files(path), str(path)
    data, used = read_text_bytes(files)
    if not data:
        raise ValueError(f"no text found in {source}")
    train, val = split(data, val_fraction)

    def as_tensor(b: bytes) -> torch.Tensor:
        if not b:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(bytearray(b), dtype=torch.uint8)

    return Corpus(as_tensor(train), as_tensor(val), source, used)


def _windows(text: torch.Tensor, starts: torch.Tensor, seq_len: int):
    idx = starts[:, None] + torch.arange(seq_len + 1)
    seqs = text[idx].long()  # gather first: uint16/uint32 support indexing, not arithmetic
    return seqs[:, :-1], seqs[:, 1:]


def _long_enough(text: torch.Tensor, seq_len: int, part: str) -> None:
    if len(text) <= seq_len:
        unit = "bytes" if text.dtype == torch.uint8 else "tokens"
        raise ValueError(f"{part} text has {len(text)} {unit}, need more than seq_len={seq_len}")


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
    _long_enough(text, seq_len, "train")
    g = torch.Generator().manual_seed((seed << 32) + step)
    starts = torch.randint(0, len(text) - seq_len, (batch_size,), generator=g)
    return _windows(text, starts[rank_slice(batch_size, rank, world)], seq_len)


def val_batches(
    text: torch.Tensor, n_batches: int, batch_size: int, seq_len: int, rank: int, world: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's slices of `n_batches` fixed validation batches of evenly spaced windows."""
    _long_enough(text, seq_len, "val")
    n = n_batches * batch_size
    starts = torch.linspace(0, len(text) - seq_len - 1, n).long().view(n_batches, batch_size)
    mine = rank_slice(batch_size, rank, world)
    return [_windows(text, row[mine], seq_len) for row in starts]


def on_device(device: torch.device, *batch: torch.Tensor) -> list[torch.Tensor]:
    """`batch` on `device`; to a GPU from pinned memory without blocking the host."""
    if device.type != "cuda":
        return [t.to(device) for t in batch]
    return [t.pin_memory().to(device, non_blocking=True) for t in batch]
