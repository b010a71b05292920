"""A checkpoint's model weights as one safetensors file (`wholeshard export CKPT OUT`).

Runs in one process without a process group. The file holds every key of the model's
`state_dict()` (tied aliases as separate copies, so `load_state_dict(strict=True)` works) and
loads with `safetensors.torch.load_file`. The safetensors format is written here directly (an
8-byte little-endian header length, a JSON header of dtype/shape/byte range per tensor, then the
raw bytes), so export needs torch alone.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from collections.abc import Mapping
from pathlib import Path

import torch

from ._load import load_consolidated

_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


def write_safetensors(
    tensors: Mapping[str, torch.Tensor], path: str | os.PathLike, metadata: dict[str, str] | None
) -> None:
    """Write `tensors` as a safetensors file, atomically (temp file, fsync, rename)."""
    if sys.byteorder != "little":
        raise RuntimeError("safetensors stores little-endian bytes; this host is big-endian")
    header: dict[str, object] = {"__metadata__": dict(metadata or {})}
    blobs, offset = [], 0
    for name, t in tensors.items():
        if t.dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{name}: dtype {t.dtype} has no safetensors equivalent")
        data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + data.nbytes],
        }
        blobs.append(data)
        offset += data.nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(head)))
            f.write(head)
            for data in blobs:
                f.write(memoryview(data))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def refuse_existing(out: str | os.PathLike, overwrite: bool, api: str) -> None:
    """Raise FileExistsError if `out` exists (a file, a directory or a link) and not `overwrite`;
    `api` names the Python function whose `overwrite=True` replaces it."""
    if not overwrite and os.path.lexists(out):
        raise FileExistsError(
            f"{out} already exists; pass --overwrite ({api}(..., overwrite=True)) to replace it"
        )


def export_checkpoint(
    checkpoint: str | os.PathLike,
    out: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
) -> dict[str, torch.Tensor]:
    """Write the checkpoint's model weights to `out`; returns what was written.

    `checkpoint` is resolved like `load_checkpoint`'s path (a `step-N` directory, or a
    checkpoints directory whose `latest` is followed). With `dtype`, floating tensors are cast
    (params from their fp32 masters when the checkpoint has them). An existing `out` raises
    FileExistsError unless `overwrite`. A checkpoint that does not verify against its manifest
    (`directory.verify`) raises CheckpointError before anything in it is unpickled or anything
    is written.
    """
    refuse_existing(out, overwrite, "export_checkpoint")
    tensors, manifest = load_consolidated(checkpoint, dtype=dtype)
    metadata = {"format": "pt", "wholeshard_step": str(manifest["step"])}
    write_safetensors(tensors, out, metadata)
    return tensors
