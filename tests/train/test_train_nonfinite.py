"""`wholeshard train --on-nonfinite`: a non-finite gradient stops the job or skips the step on
every rank; a non-finite loss always stops it, before the update."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from train_faults import Poison, metrics, micro_argv, run_train


def train(text_file: Path, out: Path, poison: Poison, *extra: str) -> int:
    argv = micro_argv(text_file, out, 5, 5, "--no-progress", "--log-every", "100", *extra)
    return run_train(argv, poison)


@pytest.mark.parametrize("optimizer", ["muon", pytest.param("adamw", marks=pytest.mark.slow)])
def test_skip_logs_the_step_and_counts_it(
    text_file: Path, tmp_path: Path, optimizer: str, capsys
) -> None:
    out = tmp_path / "run"
    code = train(text_file, out, Poison(1, 3), "--on-nonfinite", "skip", "--optimizer", optimizer)
    assert code == 0, capsys.readouterr().err
    skipped = [r for r in metrics(out) if r.get("skipped")]
    assert [r["step"] for r in skipped] == [3]
    assert skipped[0]["grad_norm"] is None  # non-finite: JSON null
    summary = json.loads((out / "summary.json").read_text())
    assert summary["skipped_steps"] == 1
    assert math.isfinite(summary["final_val_loss"])


@pytest.mark.parametrize("optimizer", ["muon", pytest.param("adamw", marks=pytest.mark.slow)])
def test_error_stops_the_job_naming_param_and_step(
    text_file: Path, tmp_path: Path, optimizer: str, capsys
) -> None:
    code = train(text_file, tmp_path / "run", Poison(1, 3), "--optimizer", optimizer)
    err = capsys.readouterr().err
    assert code == 1
    assert "at step 3" in err and "'blocks.0.attn.o.weight'" in err, err


def test_a_nonfinite_loss_stops_the_job_before_the_update(
    text_file: Path, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "run"
    code = train(
        text_file, out, Poison(0, 4, "loss"), "--on-nonfinite", "skip",
        "--checkpoint-every", "2", "--keep-last", "5",
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 1
    assert "non-finite loss" in err and "at step 4" in err, err
    saved = sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step"))
    assert saved == ["step-2"], saved  # nothing written at step 4
