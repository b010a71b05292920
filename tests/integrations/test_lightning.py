"""Lightning's Trainer (`WholeshardStrategy`) and Fabric (`WholeshardFabricStrategy`) on a tiny
Llama at 2 gloo ranks, against wholeshard's own loop (bitwise: Lightning adds no arithmetic)
and the one-process torch Muon + AdamW reference (`support.TOL`).

The case is `lm_case`'s; a `DistributedSampler` deals the rows of a global batch interleaved
(`local_rows(step, interleaved=True)`). One launch trains every 2-rank run of both
(plain with a checkpoint at step `SAVE_AT`, clipped, accumulated, resumed); one more resumes
both at 1 rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from support import GLOBAL_BATCH, TOL, assert_matches, full_params, max_param_diff, rank_world, run

import wholeshard

L = pytest.importorskip("lightning")
import lm_case  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lm_case import ADAMW, CLIP, MUON, STEPS, dataset, llama, local_rows, reference  # noqa: E402

from wholeshard.integrations.lightning import (  # noqa: E402
    WholeshardFabricStrategy,
    WholeshardStrategy,
    layerwise_optimizer,
)

SAVE_AT = 2
VAL = 99  # the step whose batch is the validation set


def _sequential(data: list, rows: int) -> torch.utils.data.DataLoader:
    """`data` dealt as Lightning deals it, unshuffled (the own loop's order): rank r's rows are
    r, r + world, ..."""
    sampler = (
        torch.utils.data.DistributedSampler(data, shuffle=False) if rank_world()[1] > 1 else None
    )
    return torch.utils.data.DataLoader(data, batch_size=rows, sampler=sampler)


class LitLlama(L.LightningModule):
    """The Llama in a LightningModule; records what the tests compare."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.model = llama()
        self.rows = rows
        self.losses: list[float] = []
        self.norms: list[float] = []
        self.evals: list[float] = []

    def training_step(self, batch: dict, index: int) -> torch.Tensor:
        loss = self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        self.losses.append(loss.item())
        return loss

    def on_train_batch_end(self, *args: Any) -> None:
        norm = self.trainer.strategy.grad_norm
        if norm is not None:
            self.norms.append(norm.item())

    def validation_step(self, batch: dict, index: int) -> None:
        self.evals.append(
            self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss.item()
        )

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        """Epoch e trains on the global batches of steps `SAVE_AT * e`, ... (one loader an
        epoch: a checkpoint at an epoch's end resumes where it stopped)."""
        first = self.trainer.current_epoch * SAVE_AT * GLOBAL_BATCH
        return _sequential(dataset()[first : first + SAVE_AT * GLOBAL_BATCH], self.rows)

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = layerwise_optimizer(self, matrix=MUON, adamw=ADAMW)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


def trainer_run(
    out: Path,
    *,
    clip: float | None = None,
    micro: int = 1,
    resume: Path | None = None,
    top_k: bool = False,
) -> dict[str, Any]:
    """`Trainer.fit` for `STEPS` optimizer steps in epochs of `SAVE_AT`, validating after each;
    saves a checkpoint after the first (a callback calling `trainer.save_checkpoint`). With
    `top_k`, Lightning's `ModelCheckpoint` also saves every `SAVE_AT` steps into `out / "top"`,
    keeping the latest and `last.ckpt`."""
    _, world = rank_world()
    module = LitLlama(GLOBAL_BATCH // world // micro)
    top = ModelCheckpoint(
        out / "top", monitor="step", mode="max", every_n_train_steps=SAVE_AT, save_last=True
    )

    class SaveAt(L.Callback):
        def on_train_epoch_end(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step == SAVE_AT and resume is None:
                trainer.save_checkpoint(out / "ckpt")

    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=WholeshardStrategy(),
        max_steps=STEPS,
        accumulate_grad_batches=micro,
        gradient_clip_val=clip,
        reload_dataloaders_every_n_epochs=1,
        use_distributed_sampler=False,  # Lightning's shuffles the training data
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=top_k,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[SaveAt(), top] if top_k else [SaveAt()],
    )
    val = _sequential(dataset(VAL + 1)[VAL * GLOBAL_BATCH :], GLOBAL_BATCH // world)
    trainer.fit(module, val_dataloaders=val, ckpt_path=str(resume) if resume else None)
    ddp = trainer.strategy.data_parallel
    with ddp.full_params():
        params = {n.removeprefix("model."): p for n, p in full_params(module).items()}
        if trainer.is_global_zero:
            module.model.save_pretrained(out / "hf")  # the transformers model, current params
    evals, wrapped = list(module.evals), type(trainer.strategy.model).__name__
    if resume is None and clip is None and micro == 1:
        # After fit: validate the saved checkpoint (it reaches the wrapper's buffers), then save.
        trainer.validate(module, val, ckpt_path=out / "ckpt", verbose=False)
        trainer.save_checkpoint(out / "after-validate")
    return {
        "params": params,
        "losses": module.losses,
        "norms": module.norms,
        "evals": evals,
        "validated": module.evals[len(evals) :],
        "wrapped": wrapped,
        "ddp_inside": any(
            isinstance(m, torch.nn.parallel.DistributedDataParallel) for m in ddp.modules()
        ),
    }


def validate_fresh(ckpt: Path) -> list[float]:
    """`validate(ckpt_path=ckpt)` on a fresh Trainer and module: its validation losses."""
    _, world = rank_world()
    module = LitLlama(GLOBAL_BATCH // world)
    args = dict(logger=False, enable_progress_bar=False, enable_model_summary=False)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=WholeshardStrategy(), **args)
    val = _sequential(dataset(VAL + 1)[VAL * GLOBAL_BATCH :], GLOBAL_BATCH // world)
    trainer.validate(module, val, ckpt_path=ckpt, verbose=False)
    return module.evals


def fabric_run(
    out: Path, *, clip: float = math.inf, micro: int = 1, resume: Path | None = None
) -> dict[str, Any]:
    """A Fabric loop for `STEPS` optimizer steps; `fabric.save` at step `SAVE_AT`."""
    _, world = rank_world()
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=WholeshardFabricStrategy())
    fabric.launch()
    model = fabric.setup_module(llama())
    optimizer = fabric.setup_optimizers(layerwise_optimizer(model, matrix=MUON, adamw=ADAMW))
    rows = GLOBAL_BATCH // world // micro
    loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(dataset(), batch_size=rows))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    if resume is not None:
        fabric.load(resume, state)
    losses, norms = [], []
    for i, batch in enumerate(loader):
        if i < state["step"] * micro:
            continue  # the batches the saved run had trained on
        last = (i + 1) % micro == 0
        with fabric.no_backward_sync(model, enabled=not last):
            loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
            fabric.backward(loss / micro)
        losses.append(loss.item())
        if last:
            norms.append(fabric.clip_gradients(model, optimizer, max_norm=clip).item())
            optimizer.step()
            optimizer.zero_grad()
            state["step"] += 1
            if state["step"] == SAVE_AT and resume is None:
                fabric.save(out / "ckpt", state)
    ddp = model._forward_module
    with ddp.full_params():
        params = full_params(ddp.module)
    return {"params": params, "losses": losses, "norms": norms, "wrapped": type(ddp).__name__}


def own_loop(clip: float = math.inf) -> dict[str, Any]:
    """wholeshard's own loop on the same (interleaved) rows and settings."""
    rank, world = rank_world()
    ddp = wholeshard.DataParallel(llama())
    opt = wholeshard.LayerwiseOptimizer(ddp, matrix=MUON, adamw=ADAMW)
    val = torch.stack([d["input_ids"] for d in dataset(VAL + 1)[VAL * GLOBAL_BATCH :]])[rank::world]
    losses, norms, evals = [], [], []
    for step in range(STEPS):
        x = local_rows(step, interleaved=True)
        loss, norm = lm_case.own_step(ddp, opt, x, clip)
        losses.append(loss)
        norms.append(norm)
        if (step + 1) % SAVE_AT == 0:
            with torch.no_grad():
                evals.append(ddp(input_ids=val, labels=val).loss.item())
    with ddp.full_params():
        return {"params": full_params(ddp.module), "losses": losses, "norms": norms, "evals": evals}


def without_lightnings_clipping(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """`fn(...)` with the norm clipping of Lightning's base precision plugin, of Fabric's base
    strategy and torch's replaced by functions that clip nothing (`lm_case.clipping_replaced`):
    the strategies clip through their own code, so clipping is unchanged."""
    from lightning.fabric.strategies.strategy import Strategy as FabricStrategy
    from lightning.pytorch.plugins.precision import Precision

    places = [(Precision, "clip_grad_by_norm"), (FabricStrategy, "clip_gradients_norm")]
    with lm_case.clipping_replaced(*places):
        return fn(*args, **kwargs)


def _clips_its_own_way(self: Any, optimizer: Any, clip_val: float = 0.0, *args: Any) -> None:
    """`Precision.clip_gradients` of a Lightning release that clips the optimizer's params
    itself instead of calling `clip_grad_by_norm` (under wholeshard: each rank by its own norm)."""
    if clip_val > 0:
        torch.nn.utils.clip_grad_norm_(list(self.main_params(optimizer)), clip_val)


def _two_ranks(tmp: Path) -> dict[str, Any]:
    return {
        "own": own_loop(),
        "own_clipped": own_loop(CLIP),
        "plain": trainer_run(tmp / "plain"),
        "clipped": without_lightnings_clipping(trainer_run, tmp / "clipped", clip=CLIP, top_k=True),
        "accumulated": trainer_run(tmp / "acc", micro=2),
        "resumed": trainer_run(tmp / "resumed", resume=tmp / "plain" / "ckpt"),
        "validated": validate_fresh(tmp / "plain" / "ckpt"),
        "fabric": fabric_run(tmp / "fabric"),
        "fabric_clipped": without_lightnings_clipping(
            fabric_run, tmp / "fabric-clipped", clip=CLIP
        ),
        "fabric_accumulated": fabric_run(tmp / "fabric-acc", micro=2),
        "fabric_resumed": fabric_run(tmp / "fabric-resumed", resume=tmp / "fabric" / "ckpt"),
    }


def _one_rank(tmp: Path) -> dict[str, Any]:
    return {
        "resumed": trainer_run(tmp / "resumed-1", resume=tmp / "plain" / "ckpt"),
        "fabric_resumed": fabric_run(tmp / "fabric-resumed-1", resume=tmp / "fabric" / "ckpt"),
        "refusals": _refusals(tmp),
    }


class TorchOptimizer(LitLlama):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters())


def _refusals(tmp: Path) -> dict[str, str]:
    from lightning.pytorch.plugins.precision import MixedPrecision

    errors = lm_case.Refusals()
    error = errors.check

    def fit(module: Any = None, **kw: Any) -> None:
        args = dict(accelerator="cpu", devices=1, strategy=WholeshardStrategy(), max_steps=1)
        args |= dict(logger=False, enable_checkpointing=False, enable_progress_bar=False) | kw
        L.Trainer(**args).fit(module or LitLlama(GLOBAL_BATCH))

    error("torch optimizer", lambda: fit(TorchOptimizer(GLOBAL_BATCH)))
    scaled = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))  # a GPU's fp16 AMP
    error("fp16", lambda: WholeshardStrategy(precision_plugin=scaled))
    error("by value", lambda: fit(gradient_clip_val=1.0, gradient_clip_algorithm="value"))
    from unittest import mock

    from lightning.pytorch.plugins.precision import Precision

    with mock.patch.object(Precision, "clip_gradients", _clips_its_own_way):
        error("stopped clipping", lambda: fit(gradient_clip_val=CLIP))
    (tmp / "lightning.ckpt").write_bytes(b"")
    error(
        "foreign checkpoint",
        lambda: L.Trainer(
            accelerator="cpu", devices=1, strategy=WholeshardStrategy(), max_steps=1, logger=False
        ).fit(LitLlama(GLOBAL_BATCH), ckpt_path=tmp / "lightning.ckpt"),
    )
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=WholeshardFabricStrategy())
    fabric.launch()
    model = llama()
    error("joint setup", lambda: fabric.setup(model, torch.optim.AdamW(model.parameters())))
    return errors


def test_what_the_strategies_refuse_names_the_fix(runs: dict) -> None:
    out = runs["one"]["refusals"]
    assert "the optimizer is a AdamW" in out["torch optimizer"]
    assert "layerwise_optimizer(module" in out["torch optimizer"]
    assert "precision='16-mixed'" in out["fp16"] and "'bf16-mixed'" in out["fp16"]
    assert "gradient_clip_algorithm='norm'" in out["by value"]
    # A Lightning whose precision plugin stopped calling `clip_grad_by_norm`: the step raises.
    stopped = out["stopped clipping"]
    assert stopped.startswith("RuntimeError: optimizer step 0: ")
    assert f"Trainer(gradient_clip_val={CLIP}) asks to clip" in stopped
    assert "Nothing was updated" in stopped
    assert (
        "FileNotFoundError" in out["foreign checkpoint"]
        and "wholeshard/" in out["foreign checkpoint"]
    )
    assert "fabric.setup_module(model)" in out["joint setup"]


def test_the_trained_model_saves_for_from_pretrained(runs: dict) -> None:
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(runs["tmp"] / "plain" / "hf")
    _assert_bitwise(full_params(model), runs["ranks"][0]["plain"]["params"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return lm_case.launch(tmp_path_factory.mktemp("lightning"), _two_ranks, _one_rank)


def _assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name, value in a.items():
        assert torch.equal(value, b[name]), name


@pytest.mark.parametrize("kind", ["plain", "fabric"])
def test_trains_as_wholeshards_own_loop_and_the_reference(runs: dict, kind: str) -> None:
    ref = reference(math.inf)
    for out in runs["ranks"]:
        got = out[kind]
        assert got["wrapped"] == "DataParallel"
        _assert_bitwise(got["params"], out["own"]["params"])
        assert got["losses"] == out["own"]["losses"]
        assert_matches({"params": got["params"], "losses": ref["losses"]}, ref)
    assert not runs["ranks"][0]["plain"]["ddp_inside"]
    # Validation during fit saw the current params: the own loop's evaluations, bitwise.
    for out in runs["ranks"]:
        assert out["plain"]["evals"] == out["own"]["evals"]
    for out in runs["ranks"]:
        assert out["fabric"]["norms"] == out["own"]["norms"]
        assert out["fabric"]["norms"] == pytest.approx(ref["norms"], rel=1e-3)


@pytest.mark.parametrize("kind", ["clipped", "fabric_clipped"])
def test_clipping_is_by_the_global_norm(runs: dict, kind: str) -> None:
    ref = reference(CLIP)
    for out in runs["ranks"]:
        got = out[kind]
        _assert_bitwise(got["params"], out["own_clipped"]["params"])
        assert got["norms"] == out["own_clipped"]["norms"]  # Trainer: strategy.grad_norm
        assert got["norms"] == pytest.approx(ref["norms"], rel=1e-3)
        assert_matches({"params": got["params"], "losses": ref["losses"]}, ref)
        assert max_param_diff(got["params"], out["own"]["params"]) > 3 * TOL[torch.float32]["atol"]


@pytest.mark.parametrize("kind", ["accumulated", "fabric_accumulated"])
def test_accumulation_of_two_half_batches_equals_one_batch(runs: dict, kind: str) -> None:
    for out in runs["ranks"]:
        assert (
            max_param_diff(out[kind]["params"], out["own"]["params"]) < TOL[torch.float32]["atol"]
        )


@pytest.mark.parametrize(("kind", "plain"), [("resumed", "plain"), ("fabric_resumed", "fabric")])
def test_a_checkpoint_resumes_at_two_ranks_bitwise_and_at_one_within_rounding(
    runs: dict, kind: str, plain: str
) -> None:
    for out in runs["ranks"]:
        _assert_bitwise(out[kind]["params"], out[plain]["params"])
        assert out[kind]["losses"] == out[plain]["losses"][SAVE_AT:]
    one = runs["one"][kind]
    assert (
        max_param_diff(one["params"], runs["ranks"][0][plain]["params"])
        < TOL[torch.float32]["atol"]
    )
    assert (runs["tmp"] / plain / "ckpt" / "wholeshard" / "latest").is_file()


def test_validate_with_ckpt_path_loads_the_checkpoints_params(runs: dict) -> None:
    """`validate(ckpt_path=)` after fit (into the wrapper) and on a fresh Trainer (into the
    bare module): the validation loss of the step-`SAVE_AT` params, the own loop's, bitwise."""
    for out in runs["ranks"]:
        saved = out["own"]["evals"][0]
        assert out["plain"]["validated"] == [saved]
        assert out["validated"] == [saved]
    # A checkpoint after validation is still the strategy's directory (the module stays wrapped).
    assert (runs["tmp"] / "plain" / "after-validate" / "wholeshard" / "latest").is_file()


def test_model_checkpoint_keeps_the_best_and_removes_the_rest_whole(runs: dict) -> None:
    """Lightning's `ModelCheckpoint` saves through the strategy and removes old checkpoints
    with `strategy.remove_checkpoint`: what it keeps are whole checkpoint directories."""
    top = runs["tmp"] / "clipped" / "top"
    kept = ["epoch=1-step=4.ckpt", "last.ckpt"]  # epoch=0-step=2.ckpt was removed
    assert sorted(p.name for p in top.iterdir()) == kept
    for name in kept:
        assert sorted(p.name for p in (top / name).iterdir()) == ["meta.pt", "wholeshard"]
        assert (top / name / "wholeshard" / "latest").read_text().strip() == f"step-{STEPS}"


def test_the_examples_train_and_save(tmp_path: Path) -> None:
    """examples/lightning_trainer.py and lightning_fabric.py, in 2 processes (started here:
    Lightning sees LOCAL_RANK and starts none)."""
    import runpy
    import sys

    def examples(out: Path) -> None:
        for name in ("lightning_trainer", "lightning_fabric"):
            sys.argv = [f"{name}.py", str(out / name)]
            runpy.run_path(str(Path(__file__).parents[2] / "examples" / f"{name}.py"))

    run(examples, 2, tmp_path)
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "lightning_trainer" / "final"
    )
    assert model.config.num_hidden_layers == 2
    assert (tmp_path / "lightning_trainer" / "last.ckpt" / "wholeshard" / "latest").is_file()
    assert (tmp_path / "lightning_fabric" / "ckpt" / "meta.pt").is_file()
