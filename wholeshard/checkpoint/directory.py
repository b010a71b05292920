"""The checkpoint directory protocol: atomic `step-N` directories, the `latest` marker,
checksums and pruning. Plain files only; what goes inside a checkpoint is `checkpoint`'s business.

    root/step-N/      a complete checkpoint, only ever created by renaming a finished temp dir
        wholeshard.json   its manifest, written last: format, step, size + crc32 of every file
    root/latest       names the newest complete checkpoint ("step-N"), replaced atomically
    root/.tmp-step-N  a save in progress; root/.trash-step-N a checkpoint being pruned

A save is `choose_step`, `begin` (the temp dir), the caller's files, `digest`, then `commit`
(manifest, fsync, rename, `latest`, prune). Invariants:
- a `step-N` directory is complete: it only ever appears by an atomic rename of a fully written,
  fsynced temp directory, and `latest` is replaced (atomically) only after that rename. A save
  killed at any point leaves the previous checkpoint loadable and `latest` naming it;
- pruning happens only after the new checkpoint is complete and `latest` names it; a pruned
  checkpoint is renamed away before it is deleted, so no half-deleted `step-M` is ever visible.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

FORMAT, VERSION = "wholeshard-checkpoint", 1
MANIFEST, TRAINER, LATEST = "wholeshard.json", "trainer.pt", "latest"
STEP_DIR = re.compile(r"^step-(\d+)$")
TMP_PREFIX, TRASH_PREFIX = ".tmp-", ".trash-"
_READ_BLOCK = 16 << 20


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded. In a process group every rank raises it with
    the same message; a failed load has changed nothing."""


def crc32(path: Path) -> str:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(_READ_BLOCK):
            crc = zlib.crc32(block, crc)
    return f"{crc:08x}"


def check_files(ckpt: Path, manifest: dict[str, Any], names: list[str]) -> None:
    problems = []
    for name in names:
        want, path = manifest["files"][name], ckpt / name
        if not path.is_file():
            problems.append(f"file {name} is missing")
        elif path.stat().st_size != want["bytes"]:
            problems.append(
                f"file {name} has {path.stat().st_size} bytes, {want['bytes']} were written "
                f"(truncated or overwritten)"
            )
        elif crc32(path) != want["crc32"]:
            problems.append(f"file {name} fails its checksum (corrupted)")
    if problems:
        raise CheckpointError(f"checkpoint {ckpt} is damaged: " + "; ".join(problems))


def manifest_checksum(body: dict[str, Any]) -> str:
    return f"{zlib.crc32(json.dumps(body, sort_keys=True).encode()):08x}"


def read_manifest(ckpt: Path) -> dict[str, Any]:
    try:
        doc = json.loads((ckpt / MANIFEST).read_text())
        body = doc["body"]
        ok = doc["checksum"] == manifest_checksum(body)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {ckpt} has no {MANIFEST}: it is incomplete") from None
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint {ckpt}: {MANIFEST} is unreadable ({e})") from None
    if not ok:
        raise CheckpointError(f"checkpoint {ckpt}: {MANIFEST} fails its checksum (corrupted)")
    if body.get("format") != FORMAT or body.get("version") != VERSION:
        raise CheckpointError(
            f"checkpoint {ckpt} has format {body.get('format')!r} version {body.get('version')!r};"
            f" this wholeshard reads {FORMAT!r} version {VERSION}"
        )
    return body


def verify(ckpt: Path) -> dict[str, Any]:
    """The manifest of `ckpt`, once the whole directory verifies against it: the manifest's own
    checksum and format, its tables well formed, and every other file listed, with the size and
    crc32 it was saved with. Nothing unlisted may sit beside them, so nothing is read (DCP's
    `.metadata` is a pickle) that the manifest does not vouch for. Raises CheckpointError.

    [Note: the checksums catch corruption, truncation and stray or swapped files, not forgery:
    whoever can edit the files can rewrite the manifest. A checkpoint must come from a trusted
    source.]"""
    body = read_manifest(ckpt)
    files = body.get("files")
    tables_ok = (
        isinstance(files, dict)
        and all(_plain_name(n) and _file_entry(e) for n, e in files.items())
        and isinstance(body.get("step"), int)
        and all(isinstance(body.get(k), dict) for k in ("params", "others", "aliases"))
        and all(isinstance(v, str) for v in body["aliases"].values())
    )
    if not tables_ok:
        raise CheckpointError(f"checkpoint {ckpt} does not verify: {MANIFEST} is malformed")
    unlisted = sorted(p.name for p in ckpt.iterdir() if p.name != MANIFEST and p.name not in files)
    if unlisted:
        raise CheckpointError(
            f"checkpoint {ckpt} does not verify: {', '.join(unlisted)} not in its {MANIFEST}"
        )
    check_files(ckpt, body, sorted(files))
    return body


def _plain_name(name: str) -> bool:
    return name not in ("", ".", "..") and "/" not in name and os.sep not in name


def _file_entry(entry: Any) -> bool:
    return (
        isinstance(entry, dict)
        and type(entry.get("bytes")) is int
        and isinstance(entry.get("crc32"), str)
    )


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_manifest(path: Path, body: dict[str, Any]) -> None:
    doc = {"body": body, "checksum": manifest_checksum(body)}
    write_durably(path, json.dumps(doc, indent=1, sort_keys=True).encode())


def write_latest(root: Path, name: str) -> None:
    tmp = root / f"{LATEST}.tmp"
    write_durably(tmp, f"{name}\n".encode())
    os.replace(tmp, root / LATEST)
    fsync_dir(root)


def read_latest(root: Path) -> str | None:
    try:
        return (root / LATEST).read_text().strip()
    except FileNotFoundError:
        return None


def steps(root: Path) -> dict[int, Path]:
    if not root.is_dir():
        return {}
    return {int(m[1]): p for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()}


def choose_step(root: Path, extra: Mapping[str, Any] | None, counted: int | None) -> int:
    """The N of the new `step-N`: `extra["step"]`, else `counted` (the optimizer's step count),
    else one more than the largest existing one; never the one `latest` names."""
    if extra is not None and not isinstance(extra, Mapping):
        raise TypeError(f"extra must be a dict or None, got {type(extra).__name__}")
    if extra is not None and "step" in extra:
        step = extra["step"]
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f'extra["step"] must be an int >= 0, got {step!r}')
    elif counted is not None:
        step = counted
    else:
        step = max(steps(root), default=-1) + 1
    if read_latest(root) == f"step-{step}":
        raise FileExistsError(
            f"{root / f'step-{step}'} is the latest checkpoint; refusing to replace it "
            f"(save under another step, or delete it first)"
        )
    return step


def clean_leftovers(root: Path) -> None:
    """Remove what killed saves and prunes left behind (never a `step-N` directory)."""
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith((TMP_PREFIX, TRASH_PREFIX)) and p.is_dir():
                shutil.rmtree(p)


def remove(root: Path, directory: Path) -> None:
    """Delete a checkpoint so that no half-deleted `step-N` is ever visible."""
    trash = root / f"{TRASH_PREFIX}{directory.name}"
    if trash.exists():
        shutil.rmtree(trash)
    os.rename(directory, trash)
    fsync_dir(root)
    shutil.rmtree(trash)


def step_of(ckpt: Path) -> int | None:
    """The step of a `step-N` checkpoint directory, else None."""
    m = STEP_DIR.match(ckpt.name)
    return int(m[1]) if m else None


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """The checkpoint directory `path` means: itself if it holds a manifest, else the one its
    `latest` marker names (for a checkpoints directory or the `latest` file itself)."""
    p = Path(path)
    if p.is_file() and p.name == LATEST:
        p = p.parent
    if p.name.startswith(TMP_PREFIX) and p.is_dir():
        raise CheckpointError(
            f"{p} is a save that never completed (killed, or still being written): load "
            f"{p.parent} to take its latest complete checkpoint; the next save removes {p.name}"
        )
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


def begin(root: Path, step: int) -> Path:
    """A fresh temp directory for the save of `step`, after clearing what killed saves left."""
    clean_leftovers(root)
    tmp = root / f"{TMP_PREFIX}step-{step}"
    tmp.mkdir(parents=True)
    return tmp


def digest(directory: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """Size and crc32 of the files `names` in `directory`, as the manifest records them."""
    return {
        n: {"bytes": (directory / n).stat().st_size, "crc32": crc32(directory / n)} for n in names
    }


def commit(root: Path, tmp: Path, step: int, body: dict[str, Any], keep_last: int | None) -> Path:
    """Finish the save `begin` started: write the manifest (`body` with the format, version and
    step added; `body["files"]` from `digest`), fsync, rename `tmp` to `root/step-N`, point
    `latest` at it, then keep the `keep_last` newest (None: all). Returns the checkpoint."""
    write_manifest(tmp / MANIFEST, {**body, "format": FORMAT, "version": VERSION, "step": step})
    fsync_dir(tmp)
    final = root / f"step-{step}"
    if final.exists():  # not the latest (`choose_step` refuses that): a stale save of this step
        remove(root, final)
    os.rename(tmp, final)
    fsync_dir(root)
    write_latest(root, final.name)
    if keep_last is not None:
        older = sorted((s, p) for s, p in steps(root).items() if s < step)
        for _, p in older[: max(0, len(older) - (keep_last - 1))]:
            remove(root, p)
    return final
