"""An Accelerate loop on a wholeshard model (`WholeshardAccelerator`) at 2 gloo ranks, against
wholeshard's own loop (bitwise: Accelerate adds no arithmetic) and the one-process torch Muon +
AdamW reference (`support.TOL`).

The case (model, dataset, settings, reference) is `lm_case`'s. One launch trains every 2-rank
run (plain with a save, clipped, accumulated, resumed); one more resumes at 1 rank.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from support import GLOBAL_BATCH, TOL, assert_matches, full_params, max_param_diff, rank_world, run

import wholeshard

accelerate = pytest.importorskip("accelerate")
import lm_case  # noqa: E402
from lm_case import ADAMW, CLIP, MUON, STEPS, dataset, llama, local_rows, reference  # noqa: E402

from wholeshard.integrations.accelerate import WholeshardAccelerator  # noqa: E402

SAVE_AT = 2


def fresh_state() -> None:
    """Forget Accelerate's per-process singletons, so that one process can build accelerators
    of different settings (each test run here is a fresh process for Accelerate)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def accelerate_run(
    out: Path, *, clip: float = math.inf, micro: int = 1, resume: Path | None = None
) -> dict[str, Any]:
    """The Accelerate loop of docs/integrations.md for `STEPS` optimizer steps of `micro`
    micro-batches each; saves its state after step `SAVE_AT` and the model at the end."""
    _, world = rank_world()
    fresh_state()
    accelerator = WholeshardAccelerator(cpu=True, gradient_accumulation_steps=micro)
    ddp = wholeshard.DataParallel(llama())
    opt = wholeshard.LayerwiseOptimizer(ddp, matrix=MUON, adamw=ADAMW)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    rows = GLOBAL_BATCH // world // micro
    loader = torch.utils.data.DataLoader(dataset(), batch_size=rows)
    model, opt, loader, sched = accelerator.prepare(ddp, opt, loader, sched)
    if resume is not None:
        accelerator.load_state(str(resume))
        loader = accelerator.skip_first_batches(loader, opt.optimizer.steps * micro)
    losses, local, norms, total = [], [], [], 0.0
    for x in loader:
        with accelerator.accumulate(model):
            loss = model(input_ids=x["input_ids"], labels=x["labels"]).loss
            accelerator.backward(loss)
            total += loss.item() / micro
            if accelerator.sync_gradients:
                norms.append(accelerator.clip_grad_norm_(model.parameters(), clip).item())
            opt.step()
            sched.step()
            opt.zero_grad()
        if accelerator.sync_gradients:
            local.append(total)
            losses.append(accelerator.reduce(torch.tensor(total), "mean").item())
            total = 0.0
            if opt.optimizer.steps == SAVE_AT and resume is None:
                accelerator.save_state(str(out / "state"))
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(
        out / "final",
        is_main_process=accelerator.is_main_process,
        save_function=accelerator.save,
        state_dict=accelerator.get_state_dict(model),
    )
    accelerator.save_model(model, out / "weights")  # the weights alone (every rank calls it)
    with ddp.full_params():
        params = full_params(ddp.module)
    return {
        "params": params,
        "losses": losses,  # the mean over ranks
        "local_losses": local,
        "norms": norms,
        "wrapped": type(model).__name__,
        "ddp_inside": any(
            isinstance(m, torch.nn.parallel.DistributedDataParallel) for m in model.modules()
        ),
        "unwrapped": type(unwrapped).__name__,
        "steps": opt.optimizer.steps,
        "lr_steps": sched.scheduler.last_epoch,
    }


def own_loop(clip: float = math.inf) -> dict[str, Any]:
    """wholeshard's own loop on the same batches and settings."""
    ddp = wholeshard.DataParallel(llama())
    opt = wholeshard.LayerwiseOptimizer(ddp, matrix=MUON, adamw=ADAMW)
    losses, norms = [], []
    for step in range(STEPS):
        x = local_rows(step)
        loss, norm = lm_case.own_step(ddp, opt, x, clip)
        losses.append(loss)
        norms.append(norm)
    with ddp.full_params():
        return {"params": full_params(ddp.module), "losses": losses, "norms": norms}


def without_accelerates_clipping(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """`fn(...)` with Accelerate's norm helper and torch's clipping away (`lm_case`'s
    `clipping_replaced`): `WholeshardAccelerator` clips through its own code, unchanged."""
    with lm_case.clipping_replaced((accelerate.Accelerator, "_clip_grad_norm_dtensor_aware")):
        return fn(*args, **kwargs)


def _one_rank(tmp: Path) -> dict[str, Any]:
    resumed = accelerate_run(tmp / "resumed-1", resume=tmp / "plain" / "state")
    return {"resumed": resumed, "refusals": _refusals(tmp)}


def _two_ranks(tmp: Path) -> dict[str, Any]:
    return {
        "refusals": _refusals(tmp / f"rank{rank_world()[0]}"),
        "plain": accelerate_run(tmp / "plain"),
        "own": own_loop(),
        "clipped": without_accelerates_clipping(accelerate_run, tmp / "clipped", clip=CLIP),
        "own_clipped": own_loop(CLIP),
        "accumulated": accelerate_run(tmp / "acc", micro=2),
        "resumed": accelerate_run(tmp / "resumed", resume=tmp / "plain" / "state"),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    runs = lm_case.launch(tmp_path_factory.mktemp("accelerate"), _two_ranks, _one_rank)
    one = runs["one"]
    return runs | {"one": one["resumed"], "refusals": one["refusals"]}


def _assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name, value in a.items():
        assert torch.equal(value, b[name]), name


def test_the_loop_trains_as_wholeshards_own_loop_and_the_reference(runs: dict) -> None:
    ref = reference(math.inf)
    for out in runs["ranks"]:
        plain = out["plain"]
        assert plain["wrapped"] == "DataParallel" and not plain["ddp_inside"]
        assert plain["unwrapped"] == "LlamaForCausalLM"
        assert plain["steps"] == STEPS
        _assert_bitwise(plain["params"], out["own"]["params"])
        assert plain["local_losses"] == out["own"]["losses"]
        assert plain["norms"] == out["own"]["norms"]
        assert_matches(plain, ref)  # params within TOL
        assert plain["norms"] == pytest.approx(ref["norms"], rel=1e-3)  # the global norm


def test_clip_grad_norm_clips_by_the_global_norm(runs: dict) -> None:
    ref = reference(CLIP)
    for out in runs["ranks"]:
        clipped = out["clipped"]
        assert all(n > CLIP for n in clipped["norms"])
        _assert_bitwise(clipped["params"], out["own_clipped"]["params"])
        assert clipped["norms"] == out["own_clipped"]["norms"]
        assert clipped["norms"] == pytest.approx(ref["norms"], rel=1e-3)
        assert_matches(clipped, ref)
        assert (
            max_param_diff(clipped["params"], out["plain"]["params"])
            > 3 * TOL[torch.float32]["atol"]
        )


def test_accumulation_of_two_half_batches_equals_one_batch(runs: dict) -> None:
    for out in runs["ranks"]:
        acc, plain = out["accumulated"], out["plain"]
        assert acc["steps"] == STEPS
        assert max_param_diff(acc["params"], plain["params"]) < TOL[torch.float32]["atol"]
        assert acc["losses"] == pytest.approx(plain["losses"], rel=1e-5)


def test_saved_state_resumes_at_two_ranks_bitwise_and_at_one_within_rounding(runs: dict) -> None:
    for out in runs["ranks"]:
        resumed, plain = out["resumed"], out["plain"]
        _assert_bitwise(resumed["params"], plain["params"])
        assert resumed["losses"] == plain["losses"][SAVE_AT:]
        # The scheduler's state came back (Accelerate steps it once per process per step).
        assert resumed["lr_steps"] == plain["lr_steps"] == 2 * STEPS
    one, plain = runs["one"], runs["ranks"][0]["plain"]
    assert max_param_diff(one["params"], plain["params"]) < TOL[torch.float32]["atol"]
    assert one["losses"] == pytest.approx(plain["losses"][SAVE_AT:], rel=1e-4)
    state = runs["tmp"] / "plain" / "state"
    assert (state / "wholeshard" / "latest").is_file()
    assert not (state / "optimizer.bin").exists()  # no rank-0-only optimizer state


def _refusals(tmp: Path) -> dict[str, str]:
    import contextlib
    import io

    errors = lm_case.Refusals()
    error = errors.check

    fresh_state()
    accelerator = WholeshardAccelerator(cpu=True)
    ddp = wholeshard.DataParallel(llama())
    printed = io.StringIO()  # what a user sees on the terminal, no logging set up
    error("plain model", lambda: accelerator.prepare(llama()))
    error("torch optimizer", lambda: accelerator.prepare(ddp, torch.optim.AdamW(ddp.parameters())))
    other = wholeshard.LayerwiseOptimizer(wholeshard.DataParallel(llama()), matrix=MUON)
    error("optimizer alone", lambda: accelerator.prepare(other))
    with contextlib.redirect_stdout(printed):
        model, opt = accelerator.prepare(ddp, wholeshard.LayerwiseOptimizer(ddp, matrix=MUON))
    printed_here = {"printed": printed.getvalue(), "main": accelerator.is_main_process}
    x = local_rows(0)
    accelerator.backward(model(input_ids=x, labels=x).loss)
    some = list(model.parameters())[:3]
    error("clip some params", lambda: accelerator.clip_grad_norm_(some, 1.0))
    error("clip by value", lambda: accelerator.clip_grad_value_(model.parameters(), 1.0))
    other = torch.nn.Linear(2, 2)  # params no DataParallel wraps: Accelerate's own clipping
    other(torch.ones(1, 2)).sum().backward()
    error("others by value", lambda: accelerator.clip_grad_value_(other.parameters(), 0.5))
    assert other.weight.grad.max() == 0.5
    error("others by norm", lambda: accelerator.clip_grad_norm_(other.parameters(), 0.5))
    (tmp / "foreign").mkdir(parents=True)
    error("foreign state", lambda: accelerator.load_state(str(tmp / "foreign")))
    fresh_state()
    error("fp16", lambda: WholeshardAccelerator(cpu=True, mixed_precision="fp16"))
    fresh_state()
    not_multi_process = WholeshardAccelerator()  # on CPU without cpu=True: one process (1.16)
    error("world", lambda: not_multi_process.prepare(wholeshard.DataParallel(llama())))
    processes = {"processes": not_multi_process.num_processes}
    return errors | printed_here | processes | {"prepared": type(model).__name__}


def test_what_it_refuses_names_the_fix(runs: dict) -> None:
    out = runs["refusals"]
    for two in runs["ranks"]:  # every rank raises alike, or Accelerate found both processes
        world = two["refusals"]["world"]
        if two["refusals"]["processes"] == 2:  # accelerate 1.10 finds a multi-process CPU run
            assert world == "no error"
        else:
            assert "Accelerate is set up for 1 process(es) but torch.distributed has 2" in world
            assert "cpu=True" in world
    assert out["world"] == "no error"
    for two in runs["ranks"]:  # what goes where, printed at prepare by the main process alone
        refusals = two["refusals"]
        assert ("wholeshard routing: 14 matrices" in refusals["printed"]) == refusals["main"]
    assert "wholeshard routing: 14 matrices" in out["printed"]
    assert out["prepared"] == "DataParallel"
    assert "not a wholeshard.DataParallel: wrap it" in out["plain model"]
    assert "TypeError: the optimizer is a AdamW" in out["torch optimizer"]
    assert "DataParallel is not prepared: pass it to prepare()" in out["optimizer alone"]
    assert "LayerwiseOptimizer.clip_grad_norm_" in out["clip some params"]
    assert "3 params, 3 of them wrapped" in out["clip some params"]
    assert "ValueError" in out["clip by value"]
    assert "Clip by the global norm" in out["clip by value"]
    assert out["others by value"] == out["others by norm"] == "no error"
    assert "FileNotFoundError" in out["foreign state"] and "wholeshard/" in out["foreign state"]
    assert "mixed_precision='fp16'" in out["fp16"] and "use 'bf16'" in out["fp16"]


def test_the_example_trains_and_saves(tmp_path: Path) -> None:
    """examples/accelerate_loop.py, as `torchrun --nproc-per-node 2` runs it."""
    import runpy
    import sys

    def example(out: Path) -> None:
        fresh_state()
        sys.argv = ["accelerate_loop.py", str(out)]
        runpy.run_path(str(Path(__file__).parents[2] / "examples" / "accelerate_loop.py"))

    run(example, 2, tmp_path / "run")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final")
    assert model.config.num_hidden_layers == 2
    assert (tmp_path / "run" / "state" / "wholeshard" / "latest").is_file()


def test_the_saved_model_loads_with_from_pretrained(runs: dict) -> None:
    transformers = pytest.importorskip("transformers")
    saved = runs["tmp"] / "plain" / "final"
    model = transformers.AutoModelForCausalLM.from_pretrained(saved, local_files_only=True)
    _assert_bitwise(full_params(model), runs["ranks"][0]["plain"]["params"])


def test_save_model_writes_the_full_weights(runs: dict) -> None:
    """`accelerator.save_model(model, dir)`: the unwrapped model's full params, in
    `model.safetensors` (Accelerate's names: no wrapper prefix)."""
    from safetensors.torch import load_file

    weights = load_file(runs["tmp"] / "plain" / "weights" / "model.safetensors")
    _assert_bitwise(weights, runs["ranks"][0]["plain"]["params"])
