"""Checkpoint faults: a save killed at any point, damaged files, a checkpoint of another model."""

from __future__ import annotations

import errno
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint.filesystem as dcp_fs
from support import ADAMW_KW, MUON_KW, VOCAB, Block, make_model, run, train_steps
from torch import nn

import wholeshard
from wholeshard.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from wholeshard.checkpoint import directory as checkpoint_dir
from wholeshard.distributed.launch import WorkerFailed


def setup(model: nn.Module | None = None, matrix_params=None):
    model = model if model is not None else make_model()
    ddp = wholeshard.DataParallel(model, matrix_params=matrix_params)
    return model, ddp, wholeshard.LayerwiseOptimizer(ddp, matrix=MUON_KW, adamw=ADAMW_KW)


def snapshot(model: nn.Module, opt) -> dict[str, torch.Tensor]:
    out = {f"param/{n}": p.detach().clone() for n, p in model.named_parameters()}
    for piece in opt.owned_pieces():
        out |= {f"{piece.name}/{k}": v.clone() for k, v in opt.piece_state(piece).items()}
    return out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- SIGKILL mid-save ------------------------------------------------------------------------------


_MARKER: list[Path] = []  # set in the worker: the file that proves the kill point was reached


def _die() -> None:
    _MARKER[0].write_text(str(os.getpid()))
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(point: str, marker: Path) -> None:
    """Make this process SIGKILL itself at `point` of the next save."""
    _MARKER.append(marker)
    if point == "dcp-write":  # after DCP wrote its first item: a partial shard file
        original = dcp_fs._write_item

        def write_then_die(*args, **kwargs):
            original(*args, **kwargs)
            _die()

        dcp_fs._write_item = write_then_die
    elif point == "manifest":  # half a manifest in the temp directory

        def half_manifest(path: Path, body: dict) -> None:
            path.write_text('{"body": {"format"')
            _die()

        checkpoint_dir.write_manifest = half_manifest
    elif point == "before-latest":  # renamed into place, `latest` not yet updated
        checkpoint_dir.write_latest = lambda root, name: _die()
    elif point == "latest-replace":  # the new `latest` written beside the old, not yet renamed
        original_replace = os.replace

        def replace(src, dst):
            if Path(dst).name == "latest":
                _die()
            original_replace(src, dst)

        os.replace = replace
    elif point == "prune":  # step-1 moved to the trash, being deleted
        original_rmtree = shutil.rmtree

        def rmtree(path, *args, **kwargs):
            if Path(path).name.startswith(".trash-"):
                _die()
            original_rmtree(path, *args, **kwargs)

        shutil.rmtree = rmtree
    else:
        raise ValueError(point)


def _killed_save(root: str, point: str, victim: int, marker: str) -> None:
    _, ddp, opt = setup()
    train_steps(ddp, opt, [0])
    save_checkpoint(root, ddp, opt, extra={"step": 1})
    train_steps(ddp, opt, [1])
    if dist.get_rank() == victim:
        _arm(point, Path(marker))
    save_checkpoint(root, ddp, opt, extra={"step": 2}, keep_last=1)


KILLS = [  # point, victim rank, what `latest` names afterwards
    ("dcp-write", 1, "step-1"),
    ("dcp-write", 0, "step-1"),
    ("manifest", 0, "step-1"),
    ("before-latest", 0, "step-1"),
    ("latest-replace", 0, "step-1"),
    ("prune", 0, "step-2"),
]


@pytest.mark.parametrize("point,victim,latest", KILLS, ids=[f"{p}-rank{v}" for p, v, _ in KILLS])
def test_save_killed_at_any_point_leaves_a_loadable_latest(
    tmp_path: Path, point: str, victim: int, latest: str
) -> None:
    marker = tmp_path.parent / f"{tmp_path.name}.killed"
    with pytest.raises(WorkerFailed):  # the victim, or the peer that lost it, is reported
        run(_killed_save, 2, str(tmp_path), point, victim, str(marker))
    assert marker.exists(), "the save never reached the kill point"
    assert (tmp_path / "latest").read_text() == f"{latest}\n"
    visible = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step-"))
    assert latest in visible
    if point in ("dcp-write", "manifest"):
        assert visible == ["step-1"], "an incomplete save is never visible as step-N"
    if point == "prune":
        assert visible == ["step-2"], "a checkpoint being pruned is never visible half-deleted"

    _, ddp, opt = setup()
    assert load_checkpoint(tmp_path, ddp, opt) == {"step": int(latest.removeprefix("step-"))}
    if "step-2" in visible:  # a save killed after its rename is complete, only not yet latest
        assert load_checkpoint(tmp_path / "step-2", ddp, opt) == {"step": 2}
    save_checkpoint(tmp_path, ddp, opt, extra={"step": 3})  # and the next save cleans up
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert (tmp_path / "latest").read_text() == "step-3\n"


def _save_with_full_disk(root: str) -> str:
    _, ddp, opt = setup()
    train_steps(ddp, opt, [0])
    save_checkpoint(root, ddp, opt, extra={"step": 1})
    if dist.get_rank() == 1:

        def full(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")

        dcp_fs._write_item = full
    with pytest.raises(CheckpointError) as info:
        save_checkpoint(root, ddp, opt, extra={"step": 2})
    return str(info.value)


def test_write_error_raises_on_every_rank_and_keeps_latest(tmp_path: Path) -> None:
    errors = run(_save_with_full_disk, 2, str(tmp_path))
    assert all("No space left on device" in e and "step-2" in e for e in errors)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-1"]
    assert (tmp_path / "latest").read_text() == "step-1\n"


# -- damaged checkpoints and other models ---------------------------------------------------------


def _flip(path: Path, at: float) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGE = {  # how to damage a 2-rank checkpoint, what the error must name
    "intact": (lambda d: None, None),
    "truncated shard": (
        lambda d: os.truncate(d / "__1_0.distcp", (d / "__1_0.distcp").stat().st_size // 2),
        "__1_0.distcp has",
    ),
    "flipped byte in a shard": (lambda d: _flip(d / "__0_0.distcp", 0.6), "__0_0.distcp fails"),
    "missing shard": (lambda d: (d / "__1_0.distcp").unlink(), "__1_0.distcp is missing"),
    "flipped byte in DCP metadata": (lambda d: _flip(d / ".metadata", 0.5), ".metadata fails"),
    "flipped byte in manifest": (lambda d: _flip(d / "wholeshard.json", 0.5), "wholeshard.json"),
    "missing manifest": (lambda d: (d / "wholeshard.json").unlink(), "incomplete"),
    "missing trainer file": (lambda d: (d / "trainer.pt").unlink(), "trainer.pt is missing"),
}


def _other_head(model: nn.Module) -> nn.Module:
    model.head = nn.Linear(model.head.in_features, VOCAB + 1, bias=False)
    return model


def _wider(model: nn.Module) -> nn.Module:
    """`model` with six blocks twice as wide, in bfloat16: every tensor differs."""
    width = 2 * model.emb.embedding_dim
    model.emb = nn.Embedding(VOCAB, width)
    model.pos = nn.Parameter(torch.zeros(model.pos.shape[0], width))
    model.blocks = nn.ModuleList(Block(width) for _ in range(6))
    model.ln = nn.LayerNorm(width)
    model.head = nn.Linear(width, VOCAB, bias=False)
    return model.to(torch.bfloat16)


LOAD_IT = "Load it into the model it was saved from"
OTHER_MODELS = {  # name: (model, matrix_params, what the error must name)
    "extra layer": (
        lambda: make_model(layers=3),
        None,
        "11 tensors not in the checkpoint: blocks.2.fc.bias, blocks.2.fc.weight, "
        f"blocks.2.ln1.bias, blocks.2.ln1.weight and 7 more. {LOAD_IT}",
    ),
    "fewer layers": (lambda: make_model(layers=1), None, "not in the model: blocks.1."),
    "other shape": (
        lambda: _other_head(make_model()),
        None,
        "1 tensor of another shape (checkpoint -> model): head.weight (64, 32) -> (65, 32).",
    ),
    "other routing": (
        make_model,
        lambda name, p: p.ndim == 2 and name not in ("pos", "emb.weight"),  # the head to Muon
        "1 tensor of another optimizer (checkpoint -> model): head.weight adamw -> matrix. "
        f"{LOAD_IT} (the tensors its wholeshard.json lists), the same params routed to the "
        "matrix optimizer",
    ),
    "tied head": (lambda: make_model(tied=True), None, "not in the model: head.weight"),
    "wider": (  # the first differences of each kind, how many more, the fix; short, one line
        lambda: _wider(make_model()),
        None,
        "different model: 44 tensors not in the checkpoint: blocks.2.fc.bias, blocks.2.fc.weight "
        "and 42 more; 27 tensors of another shape (checkpoint -> model): blocks.0.fc.bias (128,) "
        "float32 -> (256,) bfloat16, blocks.0.fc.weight (128, 32) float32 -> (256, 64) bfloat16 "
        f"and 25 more. {LOAD_IT}",
    ),
}


def _load_each(roots: dict[str, str]) -> dict[str, tuple[str | None, bool]]:
    """For each case: the error (None if the load succeeded) and whether nothing changed."""
    out = {}
    for case, root in roots.items():
        if case in OTHER_MODELS:
            build, matrix_params, _ = OTHER_MODELS[case]
            model, ddp, opt = setup(build(), matrix_params)
        else:  # with optimizer state to lose
            model, ddp, opt = setup(make_model(seed=5))
            train_steps(ddp, opt, [0])
        before = snapshot(model, opt)
        try:
            load_checkpoint(root, ddp, opt)
            out[case] = (None, same(before, snapshot(model, opt)))
        except CheckpointError as e:
            out[case] = (str(e), same(before, snapshot(model, opt)))
    return out


def _save(root: str) -> None:
    _, ddp, opt = setup()
    train_steps(ddp, opt, [0])
    save_checkpoint(root, ddp, opt, extra={"step": 1})


def test_damaged_or_foreign_checkpoint_is_refused_on_every_rank_before_any_change(
    tmp_path: Path,
) -> None:
    run(_save, 2, str(tmp_path / "good"))
    good = tmp_path / "good" / "step-1"
    roots = {}
    for case, (damage, _) in DAMAGE.items():
        copy = tmp_path / case.replace(" ", "-")
        shutil.copytree(good, copy)
        damage(copy)
        roots[case] = str(copy)
    roots |= {case: str(good) for case in OTHER_MODELS}

    outs = run(_load_each, 2, roots)
    for case, (error, unchanged) in outs[0].items():
        expected = DAMAGE[case][1] if case in DAMAGE else OTHER_MODELS[case][2]
        assert [out[case][0] for out in outs] == [error] * 2, f"{case}: every rank, same error"
        if expected is None:
            assert error is None and not unchanged, f"{case}: the load should have worked"
        else:
            assert error is not None and expected in error, f"{case}: {error}"
            assert "\n" not in error and len(error) < 600, f"{case}: too long to read: {error}"
            assert all(out[case][1] for out in outs), f"{case}: a failed load changed state"
