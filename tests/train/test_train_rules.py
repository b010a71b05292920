"""`wholeshard train --matrix-optimizer RULE --ns-coefficients SCHEDULE`: each rule trains the
byte GPT in one process, and the choice reaches the optimizer."""

from __future__ import annotations

import json
import math
import typing
from pathlib import Path

import pytest
import torch
from support import train_config

from wholeshard.optim import LayerwiseOptimizer
from wholeshard.optim._offload import StateOffload
from wholeshard.optim.rules import MATRIX_RULES, matrix_kwargs, matrix_rule
from wholeshard.train import muon_path, newton_schulz, outputs
from wholeshard.train.config import ConfigError, TrainConfig
from wholeshard.train.newton_schulz import IMPLEMENTATIONS, implementation
from wholeshard.train.resume import newton_schulz_warning
from wholeshard.train.sections import OptimConfig
from wholeshard.train.trainer import train

TEXT = (Path(__file__).resolve().parents[2] / "wholeshard" / "train" / "trainer.py").read_bytes()


def _run(tmp_path: Path, name: str, **flags) -> tuple[dict, list[dict]]:
    data = tmp_path / "text.txt"
    data.write_bytes(TEXT * 2)
    out = tmp_path / name
    cfg = train_config(
        batch_size=4, seq_len=16, data=str(data), out=str(out), eval_every=2,
        eval_batches=1, progress=False, threads=1, param_dtype="float32", model="micro",
        **{"steps": 2, **flags},
    )  # fmt: skip
    summary = train(cfg)
    records = [json.loads(line) for line in (out / outputs.METRICS).read_text().splitlines()]
    return summary, records


def test_each_rule_trains_the_byte_gpt(tmp_path: Path) -> None:
    base, base_records = _run(tmp_path, "muon", newton_schulz="auto")
    assert base["matrix_optimizer"] == "muon"
    assert base["newton_schulz"] in IMPLEMENTATIONS  # auto: measured
    for flags in (
        dict(matrix_optimizer="normuon", ns_coefficients="polar_express"),
        dict(matrix_optimizer="muon", ns_coefficients="polar_express", ns_algorithm="gram"),
        dict(matrix_optimizer="soap"),
    ):
        summary, records = _run(tmp_path, "-".join(flags.values()), **flags)
        assert summary["matrix_optimizer"] == flags["matrix_optimizer"]
        assert summary["newton_schulz"] == (
            "torch_bf16" if flags["matrix_optimizer"] == "muon" else None
        )  # only torch's Muon runs Polar Express
        assert math.isfinite(summary["final_loss"])
        assert summary["final_val_loss"] < summary["first_val_loss"]
        assert records[1]["loss"] == base_records[1]["loss"]  # the same first forward ...
        assert records[-1]["loss"] != base_records[-1]["loss"]  # ... then the rule's updates


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_each_newton_schulz_trains_the_byte_gpt(tmp_path: Path, name: str) -> None:
    summary, _ = _run(tmp_path, name, newton_schulz=name)
    assert summary["newton_schulz"] == name
    assert math.isfinite(summary["final_loss"])
    assert summary["final_val_loss"] < summary["first_val_loss"]


def test_a_resume_with_another_newton_schulz_is_named() -> None:
    now = implementation("batched_fp32")
    warning = newton_schulz_warning("torch_bf16", now)
    assert "--newton-schulz torch_bf16 to continue it bit for bit" in warning
    assert newton_schulz_warning("batched_fp32", now) is None
    assert newton_schulz_warning(None, now) is None  # a checkpoint from before the choice
    assert newton_schulz_warning("torch_bf16", None) is None  # not muon


def test_a_resumed_auto_run_keeps_the_checkpoints_choice(tmp_path: Path, monkeypatch) -> None:
    ckpt = dict(checkpoint_every=2)
    saved, _ = _run(tmp_path, "run", newton_schulz="batched_fp32", **ckpt)

    def measured(*args, **kwargs):
        raise AssertionError("auto measured where the checkpoint's choice holds")

    monkeypatch.setattr(newton_schulz, "step_seconds", measured)
    resumed, records = _run(tmp_path, "run", newton_schulz="auto", resume="auto", steps=4, **ckpt)
    assert (saved["newton_schulz"], resumed["newton_schulz"]) == ("batched_fp32",) * 2
    assert records[-1]["step"] == 4


def test_offload_state_reaches_the_optimizer_and_keeps_the_bits(
    tmp_path: Path, monkeypatch
) -> None:
    seen = []

    class Recording(LayerwiseOptimizer):
        def __init__(self, *args, offload_state: bool = False, **kwargs) -> None:
            seen.append(offload_state)
            super().__init__(*args, offload_state=offload_state, **kwargs)

    monkeypatch.setattr(muon_path, "LayerwiseOptimizer", Recording)
    monkeypatch.setattr(StateOffload, "force_copies", True)  # the copies a GPU makes
    _, offloaded = _run(tmp_path, "offloaded", offload_state=True)
    _, resident = _run(tmp_path, "resident")
    assert seen == [True, False]
    assert [r.get("loss") for r in offloaded] == [r.get("loss") for r in resident]


def test_rules_resolve_to_their_classes() -> None:
    assert matrix_rule("muon") is torch.optim.Muon
    assert matrix_rule("muon", "polar_express").__module__ == "wholeshard.optim.normuon"
    assert matrix_rule("normuon").__name__ == "NorMuon"
    assert matrix_rule("soap").__name__ == "SOAP"
    assert "ns_coefficients" not in matrix_kwargs("muon", 1e-2, 0.0)
    assert matrix_kwargs("normuon", 1e-2, 0.1, "polar_express") == dict(
        lr=1e-2, weight_decay=0.1, ns_coefficients="polar_express", ns_algorithm="standard"
    )
    assert matrix_rule("muon", "quintic", "gram").__name__ == "Muon"
    assert matrix_kwargs("muon", 1e-2, 0.0, "quintic", "gram")["ns_algorithm"] == "gram"
    with pytest.raises(ValueError, match="soap does not orthogonalize"):
        matrix_rule("soap", "quintic", "gram")
    hints = typing.get_type_hints(OptimConfig)
    assert MATRIX_RULES == typing.get_args(hints["matrix_optimizer"])


def test_bad_rule_combinations_are_named() -> None:
    with pytest.raises(ConfigError, match="ns_coefficients needs a Newton-Schulz rule") as e:
        TrainConfig(optim=OptimConfig(matrix_optimizer="soap", ns_coefficients="polar_express"))
    assert e.value.field == "optim.ns_coefficients"
    with pytest.raises(ConfigError, match="needs --optimizer muon") as e:
        TrainConfig(optim=OptimConfig(name="adamw", matrix_optimizer="normuon"))
    assert e.value.field == "optim.matrix_optimizer"
    with pytest.raises(ValueError, match="must be one of"):
        matrix_rule("lion")
    with pytest.raises(ConfigError, match="normuon has its own") as e:
        TrainConfig(optim=OptimConfig(matrix_optimizer="normuon", newton_schulz="batched_fp32"))
    assert e.value.field == "optim.newton_schulz"
    with pytest.raises(ConfigError, match="runs torch's quintic only"):
        TrainConfig(
            optim=OptimConfig(ns_coefficients="polar_express", newton_schulz="batched_bf16")
        )
    with pytest.raises(ConfigError, match="offload_state needs --optimizer muon") as e:
        TrainConfig(optim=OptimConfig(name="adamw", offload_state=True))
    assert e.value.field == "optim.offload_state"
    with pytest.raises(ConfigError, match="does not support tensor parallelism") as e:
        TrainConfig(tp=2, optim=OptimConfig(offload_state=True))
    assert e.value.field == "optim.offload_state"
