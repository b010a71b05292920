"""Background saves (`save_checkpoint(..., blocking=False)`): the same files as a blocking save
while training steps on, one save in flight, errors at the next call, SIGKILL mid-write."""

from __future__ import annotations

import errno
import json
import math
import os
import signal
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.filesystem as dcp_fs
from support import run, train_steps
from test_checkpoint import MORE, SAVE_AT, assert_same, merge_states, owned_state, setup
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from wholeshard.checkpoint import (
    AsyncSave,
    CheckpointError,
    load_checkpoint,
    load_consolidated,
    save_checkpoint,
)
from wholeshard.distributed.launch import WorkerFailed

# -- the same files as a blocking save ---------------------------------------------------------


def _save_both_ways(blocking_root: str, background_root: str) -> dict:
    _, ddp, opt = setup()
    train_steps(ddp, opt, range(SAVE_AT))
    extra = {"step": SAVE_AT, "rng": torch.get_rng_state(), "data": [SAVE_AT, 7]}
    state = owned_state(opt)
    assert isinstance(save_checkpoint(blocking_root, ddp, opt, extra=extra), Path)
    handle = save_checkpoint(background_root, ddp, opt, extra=extra, blocking=False)
    assert isinstance(handle, AsyncSave) and handle.step == SAVE_AT
    train_steps(ddp, opt, range(SAVE_AT, SAVE_AT + MORE))  # params and state change meanwhile
    assert handle.wait() == Path(background_root) / f"step-{SAVE_AT}" and handle.done()
    return {"state": state, "staged_bytes": handle.staged_bytes, "moved_on": owned_state(opt)}


def _load_owned(root: str) -> dict:
    _, ddp, opt = setup(seed=7, muon_lr=1.0)
    assert load_checkpoint(root, ddp, opt)["data"] == [SAVE_AT, 7]
    return owned_state(opt)


def _written(ckpt: Path) -> tuple[dict, dict, dict]:
    """Size and crc32 of every file but DCP's `.metadata` (which records a random save id and
    the directory), and what `.metadata` says: every tensor's chunks and where they lie."""
    files = json.loads((ckpt / "wholeshard.json").read_text())["body"]["files"]
    metadata = dcp.FileSystemReader(ckpt).read_metadata()
    del files[".metadata"]
    return files, metadata.state_dict_metadata, metadata.storage_data


def _tensor_bytes(ckpt: Path) -> int:
    """The bytes of every tensor a checkpoint holds (each element is written once)."""
    entries = dcp.FileSystemReader(ckpt).read_metadata().state_dict_metadata.values()
    return sum(
        math.prod(md.size) * md.properties.dtype.itemsize
        for md in entries
        if isinstance(md, TensorStorageMetadata)
    )


@pytest.mark.core
def test_a_background_save_writes_the_files_a_blocking_one_does(tmp_path: Path) -> None:
    """The same state saved both ways, training stepping on during the background write: the
    same bytes in every file, the same tensors, loadable at another world size."""
    blocking, background = tmp_path / "blocking", tmp_path / "background"
    outs = run(_save_both_ways, 2, str(blocking), str(background))
    a, b = (_written(d / f"step-{SAVE_AT}") for d in (blocking, background))
    assert a == b, "every file the same bytes; DCP's index of them the same"
    for d in (blocking, background):
        assert (d / "latest").read_text() == f"step-{SAVE_AT}\n"
    tensors_a, _ = load_consolidated(blocking)
    tensors_b, _ = load_consolidated(background)
    assert_same(tensors_b, tensors_a, "consolidated tensors")
    saved = merge_states([out["state"] for out in outs])
    assert not torch.equal(  # (training did change what was being written)
        merge_states([out["moved_on"] for out in outs])["blocks.0.fc.weight"]["value"],
        saved["blocks.0.fc.weight"]["value"],
    )
    assert_same(merge_states(run(_load_owned, 3, str(background))), saved, "loaded at 3 ranks")
    staged = sum(out["staged_bytes"] for out in outs)  # each rank's copy of what it writes
    assert staged == _tensor_bytes(background / f"step-{SAVE_AT}") > 0


# -- a rank killed during the background write -------------------------------------------------


def _killed_in_background(root: str, victim: int, marker: str) -> None:
    _, ddp, opt = setup()
    train_steps(ddp, opt, [0])
    first = save_checkpoint(root, ddp, opt, extra={"step": 1}, blocking=False)
    train_steps(ddp, opt, [1])
    first.wait()  # (before the fault is armed)
    stepped = threading.Event()
    if dist.get_rank() == victim:
        write_item = dcp_fs._write_item

        def write_then_die(*args, **kwargs):
            """A slow write: the first item written, it goes on once training has, then dies."""
            result = write_item(*args, **kwargs)
            off_main = threading.current_thread() is not threading.main_thread()
            stepped.wait(timeout=60)
            Path(marker).write_text(f"off main thread {off_main}, stepped {stepped.is_set()}")
            os.kill(os.getpid(), signal.SIGKILL)
            return result

        dcp_fs._write_item = write_then_die
    handle = save_checkpoint(root, ddp, opt, extra={"step": 2}, keep_last=1, blocking=False)
    train_steps(ddp, opt, [2])  # training steps while the checkpoint is being written
    stepped.set()
    handle.wait()  # the victim dies in its write; the other rank loses its peer


@pytest.mark.parametrize("victim", [0, 1])
def test_a_rank_killed_during_a_background_write_leaves_the_last_checkpoint(
    tmp_path: Path, victim: int
) -> None:
    marker = tmp_path.parent / f"{tmp_path.name}.killed"
    with pytest.raises(WorkerFailed):
        run(_killed_in_background, 2, str(tmp_path), victim, str(marker))
    assert marker.read_text() == "off main thread True, stepped True"
    assert (tmp_path / "latest").read_text() == "step-1\n"
    left = sorted(p.name for p in tmp_path.iterdir())
    if victim == 0:  # rank 0 would have removed the partial save, had it lived
        assert left == [".tmp-step-2", "latest", "step-1"]
    assert left in ([".tmp-step-2", "latest", "step-1"], ["latest", "step-1"])
    _, ddp, opt = setup()
    if ".tmp-step-2" in left:
        with pytest.raises(CheckpointError, match="never completed"):  # a partial one: refused
            load_checkpoint(tmp_path / ".tmp-step-2", ddp, opt)
    assert load_checkpoint(tmp_path, ddp, opt) == {"step": 1}
    save_checkpoint(tmp_path, ddp, opt, extra={"step": 3}, blocking=False).wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-1", "step-3"]


# -- an error in the background write --------------------------------------------------------


def _background_error(root: str) -> list[str]:
    _, ddp, opt = setup()
    train_steps(ddp, opt, [0])
    save_checkpoint(root, ddp, opt, extra={"step": 1})
    write_item, full = dcp_fs._write_item, [True]

    def once_full(*args, **kwargs):  # the next write on rank 1 fails
        if full and dist.get_rank() == 1:
            full.clear()
            raise OSError(errno.ENOSPC, "No space left on device")
        return write_item(*args, **kwargs)

    dcp_fs._write_item = once_full
    handle = save_checkpoint(root, ddp, opt, extra={"step": 2}, blocking=False)
    train_steps(ddp, opt, [1])
    errors = []
    with pytest.raises(CheckpointError) as info:  # at the next call, on every rank
        save_checkpoint(root, ddp, opt, extra={"step": 3}, blocking=False)
    errors.append(str(info.value))
    with pytest.raises(CheckpointError) as info:
        handle.wait()  # and as often as asked
    errors.append(str(info.value))
    assert handle.done() and (Path(root) / "latest").read_text() == "step-1\n"
    assert save_checkpoint(root, ddp, opt, extra={"step": 3}, blocking=False).wait().is_dir()
    return errors


def test_an_error_in_the_background_write_is_raised_on_every_rank_at_the_next_call(
    tmp_path: Path,
) -> None:
    for errors in run(_background_error, 2, str(tmp_path)):
        for error in errors:
            assert "background save of checkpoint" in error and "step-2" in error
            assert "No space left on device" in error
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-1", "step-3"]


# -- one save in flight ----------------------------------------------------------------------


def test_a_save_or_load_waits_for_the_save_in_flight(tmp_path: Path, monkeypatch) -> None:
    """In one process: a held background write; the next save waits for it (its start would
    remove the temp directory being written), and so does a load (it reads `latest`)."""
    _, ddp, opt = setup()
    train_steps(ddp, opt, [0])
    release, writing = threading.Event(), threading.Event()
    write_item = dcp_fs._write_item

    def held(*args, **kwargs):
        writing.set()
        assert release.wait(timeout=60), "the test never released the write"
        return write_item(*args, **kwargs)

    monkeypatch.setattr(dcp_fs, "_write_item", held)
    first = save_checkpoint(tmp_path, ddp, opt, extra={"step": 1}, blocking=False)
    assert writing.wait(timeout=60) and not first.done()
    saved = []
    second = threading.Thread(
        target=lambda: saved.append(save_checkpoint(tmp_path, ddp, opt, extra={"step": 2}))
    )
    second.start()
    second.join(timeout=0.5)  # (blocked for good, were it not for the release below)
    assert second.is_alive() and not first.done(), "the second save waits for the first"
    release.set()
    second.join()
    assert first.done() and first.wait() == tmp_path / "step-1"
    assert saved == [tmp_path / "step-2"] and (tmp_path / "step-1" / "wholeshard.json").is_file()
    monkeypatch.setattr(dcp_fs, "_write_item", write_item)
    train_steps(ddp, opt, [1])
    saving = save_checkpoint(tmp_path, ddp, opt, extra={"step": 3, "x": 1}, blocking=False)
    assert load_checkpoint(tmp_path, ddp, opt) == {"step": 3, "x": 1} and saving.done()
