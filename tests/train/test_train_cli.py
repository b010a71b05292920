"""`wholeshard train` bad input: argparse-style errors naming the flag, exit 2, no workers."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from unittest import mock

import pytest

from wholeshard import DataParallelConfig
from wholeshard.cli import build_parser, main
from wholeshard.cli.flags import field_docs
from wholeshard.cli.train import config_from_args
from wholeshard.engine.config import ConfigError
from wholeshard.train import outputs, trainer
from wholeshard.train.config import SECTIONS, TrainConfig
from wholeshard.train.sections import (
    CheckpointConfig,
    DataConfig,
    ModelConfig,
    OptimConfig,
    OutputConfig,
)

pytestmark = pytest.mark.usefixtures("no_launch")


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    path = tmp_path / "text.txt"
    path.write_text("def f(x):\n    return x + 1\n" * 200)
    return path


def _error(capsys: pytest.CaptureFixture, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        main(["train", *argv])
    assert exc.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--steps", "0"], "--steps"),
        (["--steps", "ten"], "--steps"),
        (["--nproc", "-1"], "--nproc"),
        (["--lr", "0"], "--lr"),
        (["--lr", "nan"], "--lr"),
        (["--lr", "inf"], "--lr"),
        (["--clip-grad", "-1"], "--clip-grad"),
        (["--model", "huge"], "--model"),
        (["--optimizer", "sgd"], "--optimizer"),
        (["--param-dtype", "float16"], "--param-dtype"),
        (["--bucket-size", "0"], "--bucket-size"),
        (["--shard-group-size", "most"], "--shard-group-size"),
        (["--warmup", "50", "--steps", "10"], "--warmup"),
        (["--min-lr-ratio", "2"], "--min-lr-ratio"),
        (["--batch-size", "5", "--nproc", "2"], "--batch-size"),
        (["--no-such-flag"], "--no-such-flag"),
        (["--seed", "-1"], "--seed"),
        (["--keep-last", "0"], "--keep-last"),
        (["--weight-decay", "inf"], "--weight-decay"),
        (["--checkpoint-every", "-1"], "--checkpoint-every"),
        (["--fp8", "e5m2"], "--fp8"),
        (["--optimizer", "adamw", "--no-overlap-grad-reduce"], "--overlap-grad-reduce"),
        (["--optimizer", "adamw", "--resume", "latest"], "--resume"),
        (["--resume", "auto"], "--resume"),  # needs --out
    ],
)
def test_invalid_flag_values_exit_2_naming_the_flag(capsys, argv, flag) -> None:
    err = _error(capsys, argv)
    assert f"{flag}" in err and "usage:" in err


@pytest.mark.parametrize(
    "argv, flag, fix",
    [
        (["--nproc", "2", "--shard-group-size", "3"], "--shard-group-size", "one of [1, 2]"),
        (["--nproc", "8", "--tp", "2", "--shard-group-size", "8"], "--shard-group-size", "2, 4]"),
        (["--nproc", "3", "--tp", "2"], "--tp", "a multiple of 2"),
        (["--nproc", "4", "--tp", "2", "--batch-size", "5"], "--batch-size", "a multiple of 2"),
        (["--nproc", "4", "--node-size", "3"], "--node-size", "a divisor of 4"),
        (["--nproc", "8", "--shard-group-size", "4", "--node-size", "3"], "--node-size", "of 4"),
    ],
)
def test_values_the_world_decides_exit_2_before_any_worker(capsys, argv, flag, fix) -> None:
    """tp divides the world; the shard group size and the batch split over its dp ranks; the
    node size divides a shard group larger than a node."""
    line = _error(capsys, argv).strip().splitlines()[-1]
    assert line.startswith(f"wholeshard train: error: argument {flag}: ") and fix in line


def test_the_world_is_torchruns_under_torchrun(capsys, monkeypatch) -> None:
    """Under torchrun, WORLD_SIZE decides (not --nproc), in every process, before `train()`."""
    monkeypatch.setattr(trainer, "train", mock.Mock(side_effect=AssertionError("train ran")))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    err = _error(capsys, ["--nproc", "4", "--shard-group-size", "4"])
    assert "argument --shard-group-size: shard_group_size=4 does not divide the 2 " in err


def test_a_job_files_value_the_world_refuses_names_its_key(capsys, tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text("[parallel]\nshard_group_size = 3\n")
    err = _error(capsys, ["--config", str(job), "--nproc", "2"])
    assert f"argument --config: {job}: parallel.shard_group_size: " in err


def test_the_batch_splits_over_dp_ranks_not_the_world() -> None:
    """With tp, the batch is split over world / tp ranks: 6 sequences fit dp 2 x tp 2."""
    with pytest.raises(AssertionError, match="workers were started"):
        main(["train", "--nproc", "4", "--tp", "2", "--batch-size", "6"])
    cfg = TrainConfig(tp=2, data=DataConfig(batch_size=6))
    assert cfg.data_parallel_size(4) == 2
    with pytest.raises(ConfigError, match="batch_size=6 .* 4 data-parallel ranks") as e:
        cfg.data_parallel_size(8)
    assert e.value.field == "data.batch_size"


def test_missing_data_path(capsys, tmp_path: Path) -> None:
    err = _error(capsys, ["--data", str(tmp_path / "nope.txt"), "--out", str(tmp_path / "o")])
    assert "--data" in err and "no such file" in err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("kind", ["empty file", "empty dir", "too short"])
def test_empty_data(capsys, tmp_path: Path, kind: str) -> None:
    path = tmp_path / "data"
    if kind == "empty dir":
        path.mkdir()
    else:
        path.write_text("" if kind == "empty file" else "x = 1\n" * 10)
    err = _error(capsys, ["--data", str(path), "--out", str(tmp_path / "o")])
    assert "--data" in err
    assert ("no text" in err) if kind != "too short" else ("--seq-len" in err)


def test_existing_run_is_not_overwritten(capsys, tmp_path: Path, text_file: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / outputs.METRICS).write_text('{"step": 1}\n')
    err = _error(capsys, ["--data", str(text_file), "--out", str(out)])
    assert "--out" in err and "--overwrite" in err
    assert (out / outputs.METRICS).read_text() == '{"step": 1}\n'
    with pytest.raises(AssertionError, match="workers were started"):  # --overwrite passes checks
        main(["train", "--data", str(text_file), "--out", str(out), "--overwrite"])


def test_help_lists_the_flags(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["train", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--nproc", "--steps", "--batch-size", "--seq-len", "--model", "--optimizer",
                 "--lr", "--seed", "--out", "--data", "--eval-every", "--param-dtype",
                 "--bucket-size", "--clip-grad", "--json", "--overwrite"):  # fmt: skip
        assert flag in out


def _config(*argv: str) -> TrainConfig:
    return config_from_args(build_parser().parse_args(["train", *argv]))


def test_every_config_field_is_a_documented_flag() -> None:
    assert _config() == TrainConfig()
    sections = [TrainConfig, *SECTIONS.values()]
    for cls in sections:
        documented = field_docs(cls)
        for f in dataclasses.fields(cls):
            assert f.name in SECTIONS or documented.get(f.name), f"{cls.__name__}.{f.name}"
    cfg = _config(
        "--steps", "7", "--lr", "0.5", "--pos", "learned", "--tie", "--no-progress", "--overlap",
        "--data", "x.txt", "--keep-last", "2", "--seed", "3", "--shard-group-size", "1",
        "--pipelined-step",
    )  # fmt: skip
    assert cfg == TrainConfig(
        seed=3,
        model=ModelConfig(pos="learned", tie=True),
        data=DataConfig(path="x.txt"),
        optim=OptimConfig(steps=7, lr=0.5),
        parallel=DataParallelConfig(
            overlap_grad_reduce=True,
            overlap_param_gather=True,
            shard_group_size=1,
            pipelined_step=True,
        ),
        checkpoint=CheckpointConfig(keep_last=2),
        output=OutputConfig(progress=False),
    )
    assert _config("--no-tie", "--reshard-after-forward").model.tie is False
    assert _config("--node-size", "2").parallel == DataParallelConfig(node_size=2)


def test_node_size_passes_the_worlds_checks_where_it_fits() -> None:
    """Two levels of 2 in a shard group of 4; a group inside one node keeps one level."""
    assert _config("--node-size", "2").data_parallel_size(4) == 4
    assert _config("--node-size", "8").data_parallel_size(4) == 4
