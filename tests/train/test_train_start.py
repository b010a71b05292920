"""Where `wholeshard train` starts: `--resume auto`, checkpoints its saves would replace (refused
before any step), `--overwrite`, and resuming with other schedule settings. One process, in
this one: `launch` runs the worker here."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from support import PINNED_NEWTON_SCHULZ

import wholeshard.distributed.launch
from wholeshard import cli
from wholeshard.checkpoint.directory import CheckpointError
from wholeshard.cli.train import config_from_args
from wholeshard.train import outputs
from wholeshard.train.env import torchrun_restart_warning
from wholeshard.train.lr_schedule import lr_factor
from wholeshard.train.trainer import train

SMALL = [
    "--model", "micro",
    "--batch-size", "4", "--seq-len", "16", "--eval-every", "2", "--eval-batches", "1",
    "--no-progress", "--param-dtype", "float32", "--threads", "1", "--nproc", "1",
    *PINNED_NEWTON_SCHULZ,
]  # fmt: skip


def _in_process(fn, nproc, args=(), collective_timeout_s=None):
    return [fn(*args)]


def _refuse(*args, **kwargs):
    raise AssertionError("workers were started")


@pytest.fixture(autouse=True)
def one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wholeshard.distributed.launch, "launch", _in_process)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(var, raising=False)


def _argv(text_file: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--data", str(text_file), "--out", str(out), *SMALL, *extra]


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / outputs.METRICS).read_text().splitlines()]


def _exit_2(capsys: pytest.CaptureFixture, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


@pytest.fixture(scope="module")
def saved(text_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 2-step run with checkpoints step-1 and step-2 (latest)."""
    out = tmp_path_factory.mktemp("saved") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(wholeshard.distributed.launch, "launch", _in_process)
        argv = _argv(text_file, out, "--steps", "2", "--checkpoint-every", "1")
        assert cli.main(argv) == 0
    return out


def _copy(saved: Path, to: Path, *, run_files: bool = True) -> Path:
    shutil.copytree(saved, to)
    if not run_files:
        for name in outputs.RUN_FILES:
            (to / name).unlink()
    return to


def test_resume_auto_starts_over_a_run_without_checkpoints(
    text_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / outputs.METRICS).write_text('{"step": 7}\n')  # a run that died before its first save
    assert cli.main(_argv(text_file, out, "--steps", "1", "--resume", "auto")) == 0
    err = capsys.readouterr().err
    want = f"--resume auto: no checkpoint in {out / 'checkpoints'}; starting at step 0, "
    assert want + f"replacing the run in {out}\n" in err
    assert [r["step"] for r in _records(out)] == [0, 1]


def test_resume_auto_at_the_last_step_keeps_the_summary(
    text_file: Path, tmp_path: Path, saved: Path, capsys: pytest.CaptureFixture
) -> None:
    """A relaunch after a crash between the last save and the summary finishes the run."""
    out = _copy(saved, tmp_path / "run")
    (out / outputs.SUMMARY).unlink()
    assert cli.main(_argv(text_file, out, "--steps", "2", "--resume", "auto")) == 0
    assert f"--resume auto: resumed from {out / 'checkpoints' / 'step-2'} at step 2" in (
        capsys.readouterr().err
    )
    got, want = (json.loads((d / outputs.SUMMARY).read_text()) for d in (out, saved))
    for key in ("final_loss", "final_val_loss", "first_val_loss"):
        assert got[key] == want[key], key
    assert _records(out) == _records(saved)


def test_a_fresh_run_refuses_checkpoints_before_any_step(
    text_file: Path, tmp_path: Path, saved: Path, capsys: pytest.CaptureFixture, monkeypatch
) -> None:
    out = _copy(saved, tmp_path / "run", run_files=False)
    argv = _argv(text_file, out, "--steps", "4", "--checkpoint-every", "2")
    with pytest.raises(CheckpointError, match="latest: step-2"):  # the Python API, every rank
        train(config_from_args(cli.build_parser().parse_args(argv)))
    monkeypatch.setattr(wholeshard.distributed.launch, "launch", _refuse)
    err = _exit_2(capsys, argv)
    assert f"argument --out: {out / 'checkpoints'} holds the checkpoints of an earlier run " in err
    assert "(latest: step-2; present: step-1, step-2)" in err
    for remedy in ("--resume auto", "--resume latest", "another --out", "--overwrite"):
        assert remedy in err
    err = _exit_2(capsys, [*argv, "--overwrite", "--resume", "auto"])
    assert "argument --overwrite: not allowed with --resume" in err
    with pytest.raises(AssertionError, match="workers were started"):  # passes the checks
        cli.main([*argv, "--overwrite"])
    assert list((out / "checkpoints").iterdir()) == [], "--overwrite deleted them"


def test_resuming_refuses_checkpoints_ahead_of_it(
    text_file: Path, tmp_path: Path, saved: Path, capsys: pytest.CaptureFixture, monkeypatch
) -> None:
    monkeypatch.setattr(wholeshard.distributed.launch, "launch", _refuse)
    other = _copy(saved, tmp_path / "other", run_files=False)
    step_1 = saved / "checkpoints" / "step-1"
    err = _exit_2(capsys, _argv(text_file, other, "--steps", "2", "--resume", str(step_1)))
    assert f"argument --resume: {other / 'checkpoints'} holds step-2, after step 1 " in err
    err = _exit_2(capsys, _argv(text_file, saved, "--steps", "1", "--resume", "latest"))
    assert "step-2 was saved at step 2, past --steps 1: nothing to train. Pass --steps 2" in err
    (other / "checkpoints" / "latest").write_text("step-1\n")  # step-2: a save killed before
    for resume in ("latest", "auto"):  # `latest` named it, which the resumed run's save replaces
        with pytest.raises(AssertionError, match="workers were started"):
            cli.main(_argv(text_file, other, "--steps", "2", "--resume", resume))


def test_resuming_with_more_steps_warns_and_follows_the_new_schedule(
    text_file: Path, tmp_path: Path, saved: Path, capsys: pytest.CaptureFixture
) -> None:
    out = _copy(saved, tmp_path / "run")
    assert cli.main(_argv(text_file, out, "--steps", "3", "--resume", "latest")) == 0
    err = capsys.readouterr().err
    assert (
        "wholeshard train: warning: the checkpoint was saved by a run with --steps 2, this run "
        "has --steps 3: the learning-rate schedule is recomputed for --steps 3, so step 3 runs "
        "at lr 0.005 where the saved schedule has 0. To keep the saved schedule, resume with "
        "--steps 2\n"
    ) in err
    lr = [r["lr"] for r in _records(out) if r["step"] == 3]
    assert lr == [0.01 * lr_factor(2, steps=3, warmup=1)]


def test_torchrun_restarts_with_its_shared_store_are_warned_of(monkeypatch) -> None:
    """torch 2.13's torchrun keeps the previous attempt's keys in the store it shares with the
    relaunched processes, which then may fail to connect (seen 2 times in 4 relaunches)."""
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in torchrun_restart_warning()
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # the opt-out
    assert torchrun_restart_warning() is None
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")
    assert torchrun_restart_warning() is None
