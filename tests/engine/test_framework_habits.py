"""What training frameworks (transformers' Trainer, Accelerate, Lightning) do to a wrapped model:
each works as it does on a plain model or raises an error naming the fix, never a silent wrong
run (issue 36: what a newcomer hit following the frameworks' docs)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from support import (
    assert_bitwise_equal,
    full_params,
    local_loss,
    make_model,
    run,
    wrapped,
)
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import wholeshard


def _steps_zeroed_by(model_zero_grad: bool) -> dict:
    ddp, opt = wrapped()
    losses = []
    for step in range(3):
        loss = local_loss(ddp, step)
        loss.backward()
        opt.step()
        if model_zero_grad:
            ddp.zero_grad()  # what Trainer calls after the step, instead of opt.zero_grad()
        else:
            opt.zero_grad()
        losses.append(loss.item())
    state = opt.state_dict()["state"]
    opt_state = {n: {k: v for k, v in e.items() if torch.is_tensor(v)} for n, e in state.items()}
    return {"params": full_params(ddp.module), "losses": losses, "opt_state": opt_state}


def test_model_zero_grad_clears_the_gradient_buffer() -> None:
    assert_bitwise_equal(_steps_zeroed_by(True), _steps_zeroed_by(False))


@pytest.mark.parametrize("clipping", ["clip_grad_norm_", "clip_grad_value_"])
def test_torch_clipping_over_wrapped_params_raises_and_passes_the_rest_to_torch(
    clipping: str,
) -> None:
    """[Note: torch's clipping over wrapped params]: given a wrapped param, torch's clipping
    raises naming the fix (`clip_grad_value_` would fail inside torch, `clip_grad_norm_` clip
    nothing); given others, it is torch's own function, bit for bit."""
    from torch.nn.utils import clip_grad

    ddp, opt = wrapped()
    local_loss(ddp).backward()
    clip = getattr(torch.nn.utils, clipping)
    fix = rf"torch\.nn\.utils\.{clipping} would not clip .*LayerwiseOptimizer\.clip_grad_norm_"
    with pytest.raises(RuntimeError, match=fix):
        clip(ddp.parameters(), 1e-3)  # a generator, as frameworks pass
    with pytest.raises(RuntimeError, match=fix):
        getattr(clip_grad, clipping)(ddp.module.head.weight, 1e-3)  # one tensor, the module's name
    torch_clip = clip.__wrapped__  # torch's function, which the check calls
    assert torch_clip.__module__ == "torch.nn.utils.clip_grad"
    ours, theirs = nn.Linear(4, 4), nn.Linear(4, 4)  # params of no DataParallel
    theirs.load_state_dict(ours.state_dict())
    for m in (ours, theirs):
        m(torch.arange(8.0).view(2, 4)).sum().backward()
    raw = ours.weight.grad.clone()
    got, want = clip(ours.parameters(), 1e-3), torch_clip(theirs.parameters(), 1e-3)
    assert (got is None and want is None) or torch.equal(got, want)
    for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    assert not torch.equal(ours.weight.grad, raw)  # it clipped
    assert opt.clip_grad_norm_(1.0) > 0
    opt.step()
    model = ddp.release()  # given back: torch's clipping sees its gradients again
    local_loss(model).backward()
    clip(model.parameters(), 1.0)


def _ddp_around() -> dict[str, str]:
    ddp = wholeshard.DataParallel(make_model())
    outer = DistributedDataParallel(ddp)  # what accelerator.prepare(model) does by default
    try:
        local_loss(outer)
        around = "no error"
    except RuntimeError as e:
        around = str(e)
    try:
        wholeshard.DataParallel(DistributedDataParallel(make_model()))
        inside = "no error"
    except ValueError as e:
        inside = str(e)
    dist.barrier()
    return {"around": around, "inside": inside}


def test_torch_ddp_around_or_inside_a_wrapped_model_is_refused_on_every_rank() -> None:
    for out in run(_ddp_around, 2):
        assert "runs inside torch's DistributedDataParallel" in out["around"]
        assert "wrap it in wholeshard.DataParallel alone" in out["around"]
        assert "the model itself is a DistributedDataParallel" in out["inside"]


def test_a_transformers_model_is_reached_through_the_wrapper() -> None:
    transformers = pytest.importorskip("transformers")
    import hf_support

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_support.config("llama", seq=16))
    ddp = wholeshard.DataParallel(model)
    assert ddp.config is model.config  # not DataParallel's options: those are `dp_config`
    prompt = torch.tensor([[1, 2, 3]])
    want = model.generate(prompt, max_new_tokens=3, do_sample=False)
    assert torch.equal(ddp.generate(prompt, max_new_tokens=3, do_sample=False), want)
    args = transformers.TrainingArguments(output_dir="unused", report_to=[], use_cpu=True)
    assert transformers.Trainer(model=ddp, args=args).model is ddp  # reads ddp.config


def test_a_step_a_framework_set_up_to_clip_raises_unless_clip_grad_norm_clipped_it() -> None:
    """[Note: clipping the framework asked for]: with `expect_clipping(1.0, ...)` a step whose
    gradients `clip_grad_norm_` did not clip to 1.0 or below raises before any update."""
    ddp, opt = wrapped()
    opt.expect_clipping(1.0, "Trainer(gradient_clip_val=1.0)")
    before = full_params(ddp.module)
    asks = r"optimizer step 0: Trainer\(gradient_clip_val=1\.0\) asks to clip .* to norm 1\.0"
    for clips, got in [([], "did not clip"), ([math.inf], "did not clip"), ([2.0], "to 2.0")]:
        local_loss(ddp).backward()
        for max_norm in clips:
            opt.clip_grad_norm_(max_norm)
        with pytest.raises(RuntimeError, match=f"{asks}.*{got}.*Nothing was updated"):
            opt.step()
        opt.zero_grad()
    local_loss(ddp).backward()
    opt.clip_grad_norm_(1.0)
    opt.zero_grad()  # new gradients: not clipped
    local_loss(ddp).backward()
    with pytest.raises(RuntimeError, match=asks):
        opt.step()
    assert_bitwise_equal(
        {"params": full_params(ddp.module), "opt_state": {}, "losses": []},
        {"params": before, "opt_state": {}, "losses": []},
    )
    opt.zero_grad()
    local_loss(ddp).backward()
    opt.clip_grad_norm_(0.5)  # below the norm asked for: steps
    opt.step()
    assert opt.steps == 1
    opt.expect_clipping(None)  # no longer asked: an unclipped step steps
    opt.zero_grad()
    local_loss(ddp, 1).backward()
    opt.step()
    assert opt.steps == 2
