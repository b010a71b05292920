"""`wholeshard export` refuses a checkpoint that does not verify against its manifest: one line
on stderr saying what is wrong, exit 1, nothing written, nothing unpickled."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from support import ADAMW_KW, MUON_KW, lm_loss, local_batch, make_model

import wholeshard
from wholeshard import cli
from wholeshard.checkpoint import directory as checkpoint_dir
from wholeshard.checkpoint import export_checkpoint, save_checkpoint


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-process checkpoint after one step: the pristine copy each test tampers with."""
    root = tmp_path_factory.mktemp("ckpt")
    ddp = wholeshard.DataParallel(make_model())
    opt = wholeshard.LayerwiseOptimizer(ddp, matrix=MUON_KW, adamw=ADAMW_KW)
    lm_loss(ddp, *local_batch(0, 0, 1)).backward()
    opt.step()
    return save_checkpoint(root, ddp, opt)


def export(ckpt: Path, out: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = cli.main(["export", str(ckpt), str(out)])
    return code, capsys.readouterr().err


def manifest(ckpt: Path) -> dict:
    return json.loads((ckpt / checkpoint_dir.MANIFEST).read_text())


def rewrite_manifest(ckpt: Path, change: Callable[[dict], None], *, reseal: bool) -> None:
    """Apply `change` to the manifest body; with `reseal`, give it a matching checksum (a
    consistent manifest that describes files which are not there)."""
    doc = manifest(ckpt)
    change(doc["body"])
    if reseal:
        doc["checksum"] = checkpoint_dir.manifest_checksum(doc["body"])
    (ckpt / checkpoint_dir.MANIFEST).write_text(json.dumps(doc))


def flip_byte(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def _shard(ckpt: Path) -> Path:
    return next(ckpt.glob("*.distcp"))


TAMPERING: dict[str, tuple[Callable[[Path], None], str]] = {
    "data byte flipped": (lambda c: flip_byte(_shard(c), 100), "fails its checksum"),
    "metadata pickle flipped": (lambda c: flip_byte(c / ".metadata", 20), ".metadata fails"),
    "trainer truncated": (
        lambda c: (c / "trainer.pt").write_bytes((c / "trainer.pt").read_bytes()[:-5]),
        "were written (truncated",
    ),
    "shard deleted": (lambda c: _shard(c).unlink(), "is missing"),
    "unlisted file added": (
        lambda c: (c / "extra.pt").write_bytes(b"\x80\x04N."),
        "extra.pt not in its wholeshard.json",
    ),
    "manifest edited": (
        lambda c: rewrite_manifest(c, lambda b: b.update(step=7), reseal=False),
        "wholeshard.json fails its checksum",
    ),
    "manifest truncated": (
        lambda c: (c / "wholeshard.json").write_text(manifest(c).__repr__()[:50]),
        "wholeshard.json is unreadable",
    ),
    "manifest drops the pickle": (  # resealed: the checksum alone cannot tell
        lambda c: rewrite_manifest(c, lambda b: b["files"].pop(".metadata"), reseal=True),
        ".metadata not in its wholeshard.json",
    ),
    "manifest lists a path outside": (
        lambda c: rewrite_manifest(
            c, lambda b: b["files"].update({"../x": {"bytes": 1, "crc32": "0"}}), reseal=True
        ),
        "wholeshard.json is malformed",
    ),
    "manifest with a malformed table": (
        lambda c: rewrite_manifest(c, lambda b: b.update(aliases=[]), reseal=True),
        "wholeshard.json is malformed",
    ),
    "manifest with the wrong size": (
        lambda c: rewrite_manifest(
            c, lambda b: b["files"]["trainer.pt"].update(bytes=1), reseal=True
        ),
        "were written (truncated",
    ),
}


@pytest.mark.parametrize("tamper", sorted(TAMPERING))
def test_export_refuses_a_checkpoint_that_does_not_verify(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], tamper: str
) -> None:
    ckpt = tmp_path / saved.name
    shutil.copytree(saved, ckpt)
    out = tmp_path / "out" / "model.safetensors"
    out.parent.mkdir()
    assert export(ckpt, out, capsys)[0] == 0  # the untouched copy exports
    out.unlink()

    change, message = TAMPERING[tamper]
    change(ckpt)
    code, err = export(ckpt, out, capsys)
    assert code == 1
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("wholeshard export: ") and message in err, err
    assert list(out.parent.iterdir()) == []  # nothing written, not even a temp file


def test_export_reads_no_pickle_before_verifying(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch
) -> None:
    """A damaged checkpoint is refused without DCP ever opening its `.metadata` pickle."""
    ckpt = tmp_path / saved.name
    shutil.copytree(saved, ckpt)
    flip_byte(_shard(ckpt), 10)

    def unpickle(*args, **kwargs):
        raise AssertionError("read DCP metadata before verifying the checkpoint")

    monkeypatch.setattr(torch.distributed.checkpoint.FileSystemReader, "read_metadata", unpickle)
    code, err = export(ckpt, tmp_path / "m.safetensors", capsys)
    assert code == 1 and "fails its checksum" in err


def test_export_to_an_unwritable_place_is_one_line(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = export(saved, tmp_path / "no" / "such" / "dir" / "m.safetensors", capsys)
    assert code == 1 and len(err.strip().splitlines()) == 1 and "No such file" in err, err


def test_export_keeps_an_existing_file_unless_overwrite(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "model.safetensors"
    out.write_bytes(b"the user's own file")
    code, err = export(saved, out, capsys)
    assert code == 1 and f"{out} already exists" in err and "--overwrite" in err, err
    with pytest.raises(FileExistsError, match="overwrite=True"):
        export_checkpoint(saved, out)
    assert out.read_bytes() == b"the user's own file"
    assert cli.main(["export", str(saved), str(out), "--overwrite"]) == 0
    export_checkpoint(saved, tmp_path / "fresh.safetensors")
    assert out.read_bytes() == (tmp_path / "fresh.safetensors").read_bytes()
    export_checkpoint(saved, out, overwrite=True)  # and from Python
    assert out.read_bytes() == (tmp_path / "fresh.safetensors").read_bytes()
