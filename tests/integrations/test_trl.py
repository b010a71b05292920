"""TRL's `SFTTrainer` with `WholeshardTrainerMixin` on the tiny Llama at 2 gloo ranks, against
the one-process torch Muon + AdamW reference (`support.TOL`): fp32 with `max_grad_norm`
(clipped by the global norm), and `SFTConfig`'s defaults (`bf16=True`: bf16 params, fp32
masters, against the bf16 reference within the bf16 bound).

The case (model, dataset, settings, reference) is `lm_case`'s, the `TrainingArguments` the
Trainer test's (`ARGS`). `SFTTrainer` computes its loss from the model's log-probabilities
(`fused_lm_head`), not the model's own loss: the same cross-entropy, other rounding, so it is
compared within the bound, not bitwise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from support import GLOBAL_BATCH, assert_matches, full_params, rank_world, reference_run, run

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
import hf_support  # noqa: E402
from lm_case import ADAMW, CLIP, MUON, STEPS, dataset, llama, reference  # noqa: E402
from test_transformers_trainer import ARGS  # noqa: E402

from wholeshard.integrations.transformers import WholeshardTrainerMixin  # noqa: E402


class WholeshardSFTTrainer(WholeshardTrainerMixin, trl.SFTTrainer):
    """The README's way: the mixin first."""


def sft_run(out: Path, **kw: Any) -> dict[str, Any]:
    """`STEPS` steps of `WholeshardSFTTrainer` on `dataset()` (already tokenized); `kw`:
    `SFTConfig` fields beside `ARGS`."""
    _, world = rank_world()
    args = dict(ARGS, output_dir=str(out), max_steps=STEPS)  # SFTConfig's gradient checkpointing
    args |= dict(per_device_train_batch_size=GLOBAL_BATCH // world) | kw
    rows = [{"input_ids": d["input_ids"].tolist()} for d in dataset()]
    tokenizer = transformers.AutoTokenizer.from_pretrained(out.parent / "tokenizer")
    trainer = WholeshardSFTTrainer(
        model=llama(),
        args=trl.SFTConfig(**args),
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tokenizer,
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    with trainer.ddp.full_params():
        params = full_params(trainer.model)
    return {
        "params": params,
        "losses": [h["loss"] for h in logs],
        "norms": [h["grad_norm"] for h in logs],
        "wrapped": type(trainer.model_wrapped).__name__,
        "bf16": trainer.args.bf16,
        "param_dtypes": sorted({str(p.dtype) for p in trainer.model.parameters()}),
        "masters": sorted(
            {str(o.master.dtype) for o in trainer.layerwise_optimizer.owned_pieces()}
        ),
    }


def _two_ranks(tmp: Path) -> dict[str, Any]:
    return {
        "clipped": sft_run(tmp / "clipped", bf16=False, max_grad_norm=CLIP),
        "defaults": sft_run(tmp / "defaults"),  # SFTConfig's bf16=True
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("trl")
    hf_support.train_tokenizer(tmp / "tokenizer")  # SFTTrainer needs a pad token
    return run(_two_ranks, 2, tmp)


def test_sft_trainer_with_the_mixin_clips_by_the_global_norm_like_the_reference(
    runs: list[dict[str, Any]],
) -> None:
    ref = reference(CLIP)
    for out in runs:
        clipped = out["clipped"]
        assert clipped["wrapped"] == "DataParallel"
        assert all(n > CLIP for n in clipped["norms"])
        assert clipped["norms"] == pytest.approx(ref["norms"], rel=1e-3)  # the global norm
        assert_matches(clipped, ref)
    for name, value in runs[0]["clipped"]["params"].items():
        assert torch.equal(runs[1]["clipped"]["params"][name], value), name


def test_sft_configs_default_bf16_trains_bf16_params_within_the_bf16_bound(
    runs: list[dict[str, Any]],
) -> None:
    ref = reference_run(STEPS, param_dtype=torch.bfloat16, make=llama, muon_kw=MUON, adamw_kw=ADAMW)
    for out in runs:
        got = out["defaults"]
        assert got["bf16"]  # SFTConfig's default
        assert got["param_dtypes"] == ["torch.bfloat16"] and got["masters"] == ["torch.float32"]
        assert_matches(got, ref, torch.bfloat16)
