"""Habits from other libraries: saving on rank 0 only, and counting steps outside the optimizer."""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from support import ADAMW_KW, MUON_KW, make_model, train_steps

import wholeshard
from wholeshard.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from wholeshard.checkpoint import directory as checkpoint_dir
from wholeshard.checkpoint._arrival import TIMEOUT_ENV
from wholeshard.distributed.launch import launch


def setup(seed: int = 0, group: dist.ProcessGroup | None = None):
    ddp = wholeshard.DataParallel(make_model(seed), process_group=group)
    return ddp, wholeshard.LayerwiseOptimizer(ddp, matrix=MUON_KW, adamw=ADAMW_KW)


def launch_long_timeout(fn, nproc: int, *args) -> list:
    """`fn(*args)` on `nproc` forked ranks whose collectives wait an hour, as gloo's 30 min
    default would: a rank left alone in a collective would hang the test into its timeout."""
    return launch(
        functools.partial(fn, *args),
        nproc,
        start_method="fork",
        timeout=60,
        collective_timeout_s=3600,
    )


# -- every rank must call save_checkpoint / load_checkpoint -----------------------------------


def _save_on_rank_0_only(root: str) -> dict:
    ddp, opt = setup()
    train_steps(ddp, opt, [0])
    out = {}
    if dist.get_rank() == 0:  # the torch DDP habit
        start = time.monotonic()
        with pytest.raises(CheckpointError) as alone:
            save_checkpoint(root, ddp, opt)
        out["seconds"] = time.monotonic() - start
        out["error"] = str(alone.value)
        out["left"] = os.listdir(root) if os.path.exists(root) else []
    dist.barrier()  # rank 1 waits here for rank 0 to give up
    if dist.get_rank() == 1:  # its first call is the one rank 0 gave up on
        with pytest.raises(CheckpointError) as late:
            save_checkpoint(root, ddp, opt)
        out["error"] = str(late.value)
    save_checkpoint(root, ddp, opt)  # both ranks: the next saves and loads pair up again
    ddp, opt = setup(seed=1)
    load_checkpoint(root, ddp, opt)
    out["steps"] = opt.steps
    return out


def test_save_on_rank_0_only_raises_the_clear_error_on_every_rank_that_calls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(TIMEOUT_ENV, "5")
    first, second = launch_long_timeout(_save_on_rank_0_only, 2, str(tmp_path / "ckpts"))
    assert first["seconds"] < 60, "rank 0 learned within the arrival timeout, not the group's"
    assert "called by only 1 of the 2 ranks" in first["error"]
    assert "global rank 1 did not" in first["error"]
    assert (
        "Every rank must call save_checkpoint and load_checkpoint, not only rank 0"
        in (first["error"])
    )
    assert TIMEOUT_ENV in first["error"]
    assert second["error"] == first["error"], "the rank that called late raises it too"
    assert first["left"] == [], "nothing was created for the save that did not happen"
    assert sorted(os.listdir(tmp_path / "ckpts")) == ["latest", "step-1"]
    assert first["steps"] == second["steps"] == 1


def _subgroup_saves(root: str) -> int | None:
    pair = dist.new_group([0, 1])  # every rank takes part in creating it
    if dist.get_rank() == 2:
        return None  # never calls a checkpoint function: it is not in the group
    ddp, opt = setup(group=pair)
    train_steps(ddp, opt, [0])
    for step in (7, 8):
        save_checkpoint(root, ddp, opt, extra={"step": step})
        load_checkpoint(root, ddp, opt)
    return opt.steps


def test_arrival_counts_the_ranks_of_a_subgroup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(TIMEOUT_ENV, "5")
    assert launch_long_timeout(_subgroup_saves, 3, str(tmp_path)) == [1, 1, None]


@pytest.mark.parametrize("value", ["soon", "0", "-3", "inf"])
def test_a_bad_arrival_timeout_is_refused(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from wholeshard.checkpoint._arrival import arrival_timeout

    monkeypatch.setenv(TIMEOUT_ENV, value)
    with pytest.raises(ValueError, match=f"{TIMEOUT_ENV}=.*seconds > 0"):
        arrival_timeout()


# -- the step is the optimizer's --------------------------------------------------------------


def test_the_step_comes_from_the_optimizer_and_is_restored(tmp_path: Path) -> None:
    ddp, opt = setup()
    train_steps(ddp, opt, range(3))
    assert save_checkpoint(tmp_path, ddp, opt).name == "step-3"
    ddp, opt = setup(seed=1)
    load_checkpoint(tmp_path, ddp, opt)
    assert opt.steps == 3
    train_steps(ddp, opt, [3])
    assert save_checkpoint(tmp_path, ddp, opt, extra={"step": 40}).name == "step-40"
    ddp, opt = setup(seed=1)
    load_checkpoint(tmp_path, ddp, opt)
    assert opt.steps == 4, "the optimizer's own count, not the caller's step"

    # A checkpoint written before the count was saved: extra["step"] stands in for it.
    ckpt = tmp_path / "step-40"
    trainer = torch.load(ckpt / checkpoint_dir.TRAINER, weights_only=True)
    del trainer["steps"]
    torch.save(trainer, ckpt / checkpoint_dir.TRAINER)
    body = checkpoint_dir.read_manifest(ckpt)
    body["files"] |= checkpoint_dir.digest(ckpt, [checkpoint_dir.TRAINER])
    checkpoint_dir.write_manifest(ckpt / checkpoint_dir.MANIFEST, body)
    ddp, opt = setup(seed=1)
    load_checkpoint(ckpt, ddp, opt)
    assert opt.steps == 40

    # An optimizer that counts no steps: the next free number.
    assert checkpoint_dir.choose_step(tmp_path, None, None) == 41
