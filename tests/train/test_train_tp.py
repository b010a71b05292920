"""`wholeshard train --tp N`: the byte GPT's blocks tensor parallel (torch's TP styles), Muon on
the logical matrices, the batch split over the data-parallel ranks only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support import run, train_config

import wholeshard
from wholeshard.engine.config import ConfigError
from wholeshard.train import outputs
from wholeshard.train.config import TrainConfig
from wholeshard.train.sections import ModelConfig, OptimConfig
from wholeshard.train.trainer import train


def _losses(tmp: str, tp: int, ckpt: bool, rule: str = "muon") -> list[float]:
    data = Path(tmp) / "text.txt"
    out = Path(tmp) / f"run-tp{tp}-{rule}"
    cfg = train_config(
        steps=4, batch_size=4, seq_len=16, data=str(data), out=str(out), eval_every=2,
        eval_batches=1, progress=False, threads=1, param_dtype="float32", model="micro", tp=tp,
        checkpoint_every=2 if ckpt else None, matrix_optimizer=rule,
    )  # fmt: skip
    train(cfg)
    lines = (out / outputs.METRICS).read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if "loss" in r]


def test_tp2_trains_like_dp_alone(tmp_path) -> None:
    """dp 2 x tp 2 on 4 ranks against dp 2 on 2: the same batches per data-parallel rank, the
    same Muon updates (duplicated Newton–Schulz), so the same losses up to rounding; the
    tensor-parallel run also writes checkpoints (step 2 and 4)."""
    text = (Path(wholeshard.__file__).parent / "train" / "trainer.py").read_bytes()
    (tmp_path / "text.txt").write_bytes(text)
    plain = run(_losses, 2, str(tmp_path), 1, False)[0]
    tp = run(_losses, 4, str(tmp_path), 2, True)[0]
    assert len(tp) == len(plain) == 4
    for a, b in zip(tp, plain, strict=True):
        assert a == pytest.approx(b, rel=2e-3), (tp, plain)
    assert (tmp_path / "run-tp2-muon" / "checkpoints" / "step-4").is_dir()


def test_tp2_with_normuon_trains_like_dp_alone(tmp_path) -> None:
    """Another rule steps replicas of the logical matrices: the same losses as dp 2 alone."""
    text = (Path(wholeshard.__file__).parent / "train" / "trainer.py").read_bytes()
    (tmp_path / "text.txt").write_bytes(text)
    plain = run(_losses, 2, str(tmp_path), 1, False, "normuon")[0]
    tp = run(_losses, 4, str(tmp_path), 2, False, "normuon")[0]
    assert tp == pytest.approx(plain, rel=2e-3), (tp, plain)


@pytest.mark.parametrize(
    "optim, tp, said",
    [
        (OptimConfig(name="adamw"), 2, "tp > 1 needs the byte GPT, --optimizer muon"),
        (OptimConfig(), 3, "tp=3 must divide 2 heads"),
        (OptimConfig(qk_clip=1.0), 2, "no --qk-clip"),
    ],
)
def test_tp_is_checked(optim: OptimConfig, tp: int, said: str) -> None:
    with pytest.raises(ConfigError, match=said):
        TrainConfig(tp=tp, model=ModelConfig(name="micro"), optim=optim)
