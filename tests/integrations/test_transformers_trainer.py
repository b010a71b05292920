"""`WholeshardTrainer` on a tiny Llama at 2 gloo ranks, against wholeshard's own loop (bitwise:
the same arithmetic on the same batches) and the one-process torch Muon + AdamW reference
(`support.TOL`: only the gradient average's summation order differs).

The case (model, dataset, settings, reference) is `lm_case`'s. One launch trains every 2-rank
run (plain, clipped, accumulated, resumed); one more resumes at 1 rank.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from support import (
    GLOBAL_BATCH,
    SEQ,
    TOL,
    assert_matches,
    full_params,
    max_param_diff,
    rank_world,
)

import wholeshard

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from lm_case import ADAMW, CLIP, STEPS, Refusals, dataset, launch, llama, reference  # noqa: E402

from wholeshard.integrations.transformers import (  # noqa: E402
    WholeshardTrainer,
    WholeshardTrainerMixin,
    optimizer_kwargs,
)

ATOL = TOL[torch.float32]["atol"]
EVAL_STEPS = 2
VAL = 99  # the step whose batch is the evaluation set
ARGS = dict(  # AdamW's settings (and so Muon's: `optimizer_kwargs`) are the reference's
    learning_rate=ADAMW["lr"],
    weight_decay=ADAMW["weight_decay"],
    adam_beta1=ADAMW["betas"][0],
    adam_beta2=ADAMW["betas"][1],
    adam_epsilon=ADAMW["eps"],
    lr_scheduler_type="constant",
    train_sampling_strategy="sequential",
    max_grad_norm=0.0,
    logging_steps=1,
    report_to=[],
    use_cpu=True,
    disable_tqdm=True,
    save_strategy="no",
)


def trainer_run(
    out: Path, *, cls: type = WholeshardTrainer, resume: Path | None = None, **kw: Any
) -> dict[str, Any]:
    """Train `STEPS` steps with `cls` on `dataset()`; return what the tests compare. `kw`:
    `TrainingArguments`, or the trainer's own arguments where `cls` takes them."""
    _, world = rank_world()
    own = {k: kw.pop(k) for k in ("count_from", "eval_dataset", "data_parallel") if k in kw}
    args = dict(ARGS, output_dir=str(out), max_steps=STEPS)
    args |= dict(per_device_train_batch_size=GLOBAL_BATCH // world) | kw
    targs = transformers.TrainingArguments(**args)
    trainer = cls(model=llama(), args=targs, train_dataset=dataset(), **own)
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    evals = [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]
    if "eval_dataset" in own:  # predict() after training: the current params too
        evals.append(trainer.predict(own["eval_dataset"]).metrics["test_loss"])
    with trainer.ddp.full_params():
        params = full_params(trainer.model)
    optimizer = trainer.layerwise_optimizer
    return {
        "params": params,
        "losses": [h["loss"] for h in logs],  # a resumed run's: the saved steps', then its own
        "evals": evals,
        "norms": [h["grad_norm"] for h in logs],
        "ddp_inside": any(
            isinstance(m, torch.nn.parallel.DistributedDataParallel)
            for m in trainer.model_wrapped.modules()
        ),
        "wrapped": type(trainer.model_wrapped).__name__,
        "masters": sorted({str(o.master.dtype) for o in optimizer.owned_pieces()}),
        "param_dtypes": sorted({str(p.dtype) for p in trainer.model.parameters()}),
        "routing": trainer.wholeshard_routing,
        "forwards": getattr(trainer, "forwards", None),
        "best": trainer.state.best_model_checkpoint,
        "checkpointing": trainer.model.is_gradient_checkpointing,
    }


def assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name, value in a.items():
        assert torch.equal(value, b[name]), name


def own_loop(clip: float | None = None) -> dict[str, Any]:
    """wholeshard's own loop with the Trainer's arithmetic: its loss (the summed cross-entropy
    over the global token count, times the world size), its optimizer settings, and no KV cache
    (Trainer sets `model.config.use_cache = args.use_cache`, False by default: the cache's
    layout of keys and values changes the backward's rounding, not the loss)."""
    rank, world = rank_world()
    ddp = wholeshard.DataParallel(llama())
    kwargs = optimizer_kwargs(transformers.TrainingArguments(output_dir="unused", **_hyper()))
    opt = wholeshard.LayerwiseOptimizer(ddp, **kwargs)
    rows = torch.stack([d["input_ids"] for d in dataset()])
    n = GLOBAL_BATCH // world
    items = torch.tensor(float(GLOBAL_BATCH * SEQ))  # as Trainer counts: gathered as a float
    val = torch.stack([d["input_ids"] for d in validation()])[rank * n : (rank + 1) * n]
    norms, evals = [], []
    for step in range(STEPS):
        x = rows[step * GLOBAL_BATCH + rank * n : step * GLOBAL_BATCH + (rank + 1) * n]
        loss = ddp(input_ids=x, labels=x, num_items_in_batch=items, use_cache=False).loss * world
        loss.backward()
        norms.append(opt.clip_grad_norm_(clip if clip else math.inf).item())
        opt.step()
        ddp.zero_grad()
        if (step + 1) % EVAL_STEPS == 0:
            with torch.no_grad():  # the mean over ranks of each rank's mean loss
                loss = ddp(input_ids=val, labels=val, use_cache=False).loss
                torch.distributed.all_reduce(loss, op=torch.distributed.ReduceOp.AVG)
            evals.append(loss.item())
    with ddp.full_params():
        return {"params": full_params(ddp.module), "norms": norms, "evals": evals}


def validation() -> list[dict[str, torch.Tensor]]:
    """The evaluation set: one global batch no step trains on."""
    return dataset(VAL + 1)[VAL * GLOBAL_BATCH :]


def _hyper() -> dict[str, Any]:
    keys = ("learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon")
    return {k: ARGS[k] for k in keys}


class CountingTrainer(transformers.Trainer):
    """Another Trainer subclass, with an argument and an override of its own (as TRL's
    SFTTrainer has)."""

    def __init__(self, *args: Any, count_from: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.forwards = count_from

    def compute_loss(self, *args: Any, **kwargs: Any) -> Any:
        self.forwards += 1
        return super().compute_loss(*args, **kwargs)


class CountingWholeshard(WholeshardTrainerMixin, CountingTrainer):
    """The mixin on another Trainer subclass."""


class ClipsThroughAccelerate(WholeshardTrainer):
    """A `Trainer` release that clips with `accelerator.clip_grad_norm_(model.parameters())`
    instead of calling `_clip_grad_norm` (accelerate 1.16 returns 0 and clips nothing there:
    the wrapped params' `.grad` is None)."""

    def _clip_grad_norm(self, model: torch.nn.Module) -> Any:
        return self.accelerator.clip_grad_norm_(model.parameters(), self.args.max_grad_norm)


def _two_ranks(tmp: Path) -> dict[str, Any]:
    plain = trainer_run(tmp / "plain", save_strategy="steps", save_steps=2)
    runs = {
        "plain": plain,
        "own": own_loop(),
        "clipped": trainer_run(
            tmp / "clipped", cls=CountingWholeshard, max_grad_norm=CLIP, count_from=10
        ),
        "own_clipped": own_loop(CLIP),
        "accumulated": trainer_run(
            tmp / "acc",
            per_device_train_batch_size=GLOBAL_BATCH // 4,
            gradient_accumulation_steps=2,
            save_strategy="steps",
            save_steps=2,
            save_only_model=True,  # a checkpoint with no wholeshard part, to resume from
        ),
        "resumed": trainer_run(tmp / "resumed", resume=tmp / "plain" / "checkpoint-2"),
        "evaluated": trainer_run(
            tmp / "evaluated",
            eval_dataset=validation(),
            eval_strategy="steps",
            eval_steps=EVAL_STEPS,
            per_device_eval_batch_size=GLOBAL_BATCH // rank_world()[1],
            gradient_checkpointing=True,  # recomputes each layer's forward: the same bits
        ),
        "bf16": trainer_run(tmp / "bf16", bf16=True),
        "best": trainer_run(
            tmp / "best",
            eval_dataset=validation(),
            eval_on_start=True,
            eval_strategy="steps",
            eval_steps=1,
            save_strategy="steps",
            save_steps=1,
            save_total_limit=2,
            load_best_model_at_end=True,
            metric_for_best_model="eval_loss",
            per_device_eval_batch_size=GLOBAL_BATCH // rank_world()[1],
            data_parallel=dict(reshard_after_forward=True),  # Trainer's own loading would fail
        ),
        "stopped clipping": Refusals(),  # last: the run stops at its first step
    }
    runs["stopped clipping"].check(
        "max_grad_norm",
        lambda: trainer_run(tmp / "refused", cls=ClipsThroughAccelerate, max_grad_norm=CLIP),
    )
    return runs


def _one_rank(tmp: Path) -> dict[str, Any]:
    out = trainer_run(tmp / "resumed-1", resume=tmp / "plain" / "checkpoint-2")
    errors = Refusals()
    for name, kw in {
        "model only": dict(resume=tmp / "acc" / "checkpoint-2"),
        "model only, best": dict(
            save_only_model=True,
            load_best_model_at_end=True,
            eval_strategy="steps",
            save_strategy="steps",
            eval_dataset=validation(),
        ),
    }.items():
        errors.check(name, lambda kw=kw: trainer_run(tmp / "refused", **kw))
    return out | {"refusals": dict(errors)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return launch(tmp_path_factory.mktemp("trainer"), _two_ranks, _one_rank)


def test_trainer_trains_like_wholeshards_own_loop_and_the_reference(runs: dict) -> None:
    ref = reference()
    for out in runs["ranks"]:
        plain = out["plain"]
        assert plain["wrapped"] == "DataParallel" and not plain["ddp_inside"]
        # The same arithmetic as the own loop (`own_loop` says what that takes): the same bits.
        assert_bitwise(plain["params"], out["own"]["params"])
        assert plain["norms"] == out["own"]["norms"]  # the global norm
        assert_matches(plain, ref)  # params within TOL, losses within loss_rtol
        assert plain["norms"] == pytest.approx(reference(math.inf)["norms"], rel=1e-3)
        assert plain["routing"].matrices == 14  # 2 layers x q, k, v, o, gate, up, down
        assert plain["masters"] == ["torch.float32"]


def test_max_grad_norm_clips_by_the_global_norm(runs: dict) -> None:
    ref = reference(CLIP)
    for out in runs["ranks"]:
        clipped = out["clipped"]
        assert clipped["forwards"] == 10 + STEPS  # the other subclass's override ran
        assert all(n > CLIP for n in clipped["norms"])
        assert clipped["norms"] == out["own_clipped"]["norms"]
        assert_bitwise(clipped["params"], out["own_clipped"]["params"])
        assert clipped["norms"] == pytest.approx(ref["norms"], rel=1e-3)
        assert_matches(clipped, ref)
        # Clipping acts: 2.5e-2 away from the unclipped run (measured), 8 times the tolerance.
        assert max_param_diff(clipped["params"], out["plain"]["params"]) > 3 * ATOL


def test_a_trainer_that_stops_clipping_through_the_mixin_raises_on_every_rank(
    runs: dict,
) -> None:
    """`max_grad_norm` set, but the `Trainer` clips its own way (`ClipsThroughAccelerate`): the
    first step raises, naming the setting and the fix, instead of training unclipped. (An
    Accelerate release whose `clip_grad_norm_` calls torch's, as 1.10 does, meets
    `DataParallel`'s check of torch's function first: that error names the fix too.)"""
    for out in runs["ranks"]:
        error = out["stopped clipping"]["max_grad_norm"]
        assert "LayerwiseOptimizer.clip_grad_norm_" in error
        if error.startswith("RuntimeError: torch.nn.utils.clip_grad_norm_ would not clip "):
            continue  # refused before any step
        assert error.startswith("RuntimeError: optimizer step 0: ")
        assert f"TrainingArguments(max_grad_norm={CLIP}) asks to clip" in error
        assert "clip_grad_norm_ did not clip them" in error and "Nothing was updated" in error


def test_accumulation_of_two_half_batches_equals_one_batch(runs: dict) -> None:
    for out in runs["ranks"]:
        acc, plain = out["accumulated"], out["plain"]
        # Summation order alone (measured 1.3e-4 after 4 steps, Newton-Schulz amplified).
        assert max_param_diff(acc["params"], plain["params"]) < TOL[torch.float32]["atol"]
        assert acc["losses"] == pytest.approx(plain["losses"], rel=1e-5)


def test_a_checkpoint_resumes_at_two_ranks_bitwise_and_at_one_within_rounding(runs: dict) -> None:
    for out in runs["ranks"]:
        for name, value in out["plain"]["params"].items():
            assert torch.equal(out["resumed"]["params"][name], value), name
        assert out["resumed"]["losses"] == out["plain"]["losses"]
    one, plain = runs["one"], runs["ranks"][0]["plain"]
    assert max_param_diff(one["params"], plain["params"]) < TOL[torch.float32]["atol"]
    assert one["losses"] == pytest.approx(plain["losses"], rel=1e-4)


def test_the_saved_checkpoint_loads_with_from_pretrained(runs: dict) -> None:
    saved = runs["tmp"] / "plain" / "checkpoint-2"
    assert (saved / "wholeshard" / "latest").is_file()
    model = transformers.AutoModelForCausalLM.from_pretrained(saved, local_files_only=True)
    # `wholeshard export --format hf` rebuilds the same model from the wholeshard checkpoint.
    from wholeshard.checkpoint import export_hf

    export_hf(saved / "wholeshard", runs["tmp"] / "exported")
    exported = transformers.AutoModelForCausalLM.from_pretrained(runs["tmp"] / "exported")
    for name, value in full_params(model).items():
        assert torch.equal(full_params(exported)[name], value), name


def test_the_example_trains_and_saves(tmp_path: Path) -> None:
    """examples/hf_trainer.py, as `torchrun --nproc-per-node 2` runs it: each rank reads its own
    rows, so its 8 steps are one epoch of the 64 rows (half an epoch when every rank reads the
    same: transformers on CPU without `use_cpu=True`)."""
    import json
    import runpy
    import sys

    from support import run as launch_ranks

    def example(out: Path) -> None:
        sys.argv = ["hf_trainer.py", str(out)]
        runpy.run_path(str(Path(__file__).parents[2] / "examples" / "hf_trainer.py"))

    launch_ranks(example, 2, tmp_path / "run")
    final = tmp_path / "run" / "final"
    model = transformers.AutoModelForCausalLM.from_pretrained(final, local_files_only=True)
    assert model.config.num_hidden_layers == 2
    assert (tmp_path / "run" / "checkpoint-8" / "wholeshard" / "latest").is_file()
    state = json.loads((tmp_path / "run" / "checkpoint-8" / "trainer_state.json").read_text())
    assert state["epoch"] == 1.0


def test_evaluate_and_predict_during_training_see_the_current_params(runs: dict) -> None:
    """With `gradient_checkpointing=True`, too."""
    for out in runs["ranks"]:
        got, own = out["evaluated"], out["own"]
        assert got["checkpointing"] and not out["plain"]["checkpointing"]
        # Neither evaluating nor gradient checkpointing changed a training bit.
        assert_bitwise(got["params"], own["params"])
        # eval_loss after steps 2 and 4, then predict()'s test_loss after training: the own
        # loop's losses on the same rows with the same params (the Trainer averages per-row
        # gathered losses: equal to the mean of the ranks' means up to rounding).
        assert got["evals"] == pytest.approx([*own["evals"], own["evals"][-1]], rel=1e-6)


def test_bf16_trains_bf16_params_with_fp32_masters_within_the_bf16_bound(runs: dict) -> None:
    from lm_case import MUON
    from support import reference_run

    ref = reference_run(STEPS, param_dtype=torch.bfloat16, make=llama, muon_kw=MUON, adamw_kw=ADAMW)
    for out in runs["ranks"]:
        bf16 = out["bf16"]
        assert bf16["param_dtypes"] == ["torch.bfloat16"] and bf16["masters"] == ["torch.float32"]
        assert_matches(bf16, ref, torch.bfloat16)
        assert max_param_diff(bf16["params"], out["plain"]["params"]) > 0  # not fp32 training


def test_load_best_model_at_end_loads_the_best_checkpoint_into_the_wrapper(runs: dict) -> None:
    """`load_best_model_at_end` (fully sharded, where `Trainer`'s own loading cannot reach the
    shards), with `eval_on_start` and `save_total_limit=2`: the params after training are the
    best checkpoint's, and the rotation kept whole checkpoint directories."""
    for out in runs["ranks"]:
        best = out["best"]
        # eval_loss at steps 0 (eval_on_start) to 4, then predict() after training.
        evals = best["evals"][1 : STEPS + 1]
        step = 1 + evals.index(min(evals))
        assert step < STEPS  # measured: this validation set's loss rises after step 1
        assert best["best"] == str(runs["tmp"] / "best" / f"checkpoint-{step}")
        saved = transformers.AutoModelForCausalLM.from_pretrained(best["best"])
        assert_bitwise(best["params"], full_params(saved))
        assert best["evals"][-1] == pytest.approx(min(evals), rel=1e-6)
    kept = sorted(p.name for p in (runs["tmp"] / "best").glob("checkpoint-*"))
    assert kept == sorted({f"checkpoint-{step}", f"checkpoint-{STEPS}"})
    for name in kept:
        assert (runs["tmp"] / "best" / name / "wholeshard" / "latest").is_file()


def test_save_only_model_checkpoints_are_refused_where_a_wholeshard_part_is_needed(
    runs: dict,
) -> None:
    out = runs["one"]["refusals"]
    assert "FileNotFoundError" in out["model only"]
    assert "save_only_model=True" in out["model only"]
    assert (
        "does not support save_only_model=True with load_best_model_at_end"
        in (out["model only, best"])
    )
