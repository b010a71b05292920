"""Weights stored (in, out), like transformers' `Conv1D`, are stepped in (out, in) orientation.

Muon's `adjust_lr_fn="original"` scales by `max(1, rows / cols) ** 0.5`, so a wrong orientation
changes the update. The test feeds exact gradients (the gradient of `sum(W * G)` is `G`) to a
`Conv1D` layer and to the same layer stored as `nn.Linear`: the trained weights must be equal to
the bit after transposing, at every world size, in fp32 and bf16, and across a checkpoint.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from support import mp, run
from torch import nn

import wholeshard

transformers = pytest.importorskip("transformers")
from transformers.pytorch_utils import Conv1D  # noqa: E402

IN, OUT, STEPS = 32, 96, 4
MUON = dict(lr=0.02, weight_decay=0.01, adjust_lr_fn="original")


def make(conv: bool) -> nn.Module:
    torch.manual_seed(0)
    weight, bias = torch.randn(OUT, IN) * 0.1, torch.randn(OUT) * 0.1
    model = nn.Module()
    if conv:
        model.layer = Conv1D(OUT, IN)  # weight stored (IN, OUT)
        model.layer.weight.data.copy_(weight.T)
    else:
        model.layer = nn.Linear(IN, OUT)
        model.layer.weight.data.copy_(weight)
    model.layer.bias.data.copy_(bias)
    return model


def train(conv: bool, dtype: torch.dtype, ckpt: str | None = None) -> dict[str, torch.Tensor]:
    model = make(conv)
    ddp = wholeshard.DataParallel(model, mp_policy=mp(dtype))
    opt = wholeshard.LayerwiseOptimizer(ddp, matrix=MUON)
    routes = {r.name: r for r in ddp.routes}
    assert routes["layer.weight"].matrix and routes["layer.weight"].transposed == conv
    rank = dist.get_rank() if dist.is_initialized() else 0
    for step in range(STEPS):
        if ckpt is not None and step == STEPS // 2:
            wholeshard.save_checkpoint(ckpt, ddp, opt, extra={"step": step})
            ddp = wholeshard.DataParallel(make(conv), mp_policy=mp(dtype))
            model = ddp.module
            opt = wholeshard.LayerwiseOptimizer(ddp, matrix=MUON)
            wholeshard.load_checkpoint(ckpt, ddp, opt)
        g = torch.Generator().manual_seed(step)
        grad_w, grad_b = torch.randn(OUT, IN, generator=g), torch.randn(OUT, generator=g)
        grad_w = grad_w * (rank + 1)  # ranks differ; the mean is what counts
        w = model.layer.weight
        loss = (w * (grad_w.T if conv else grad_w).to(w.dtype)).sum()
        (loss + (model.layer.bias * grad_b.to(w.dtype)).sum()).backward()
        opt.step()
        opt.zero_grad()
    weight = model.layer.weight.detach().float()
    return {"weight": weight.T if conv else weight, "bias": model.layer.bias.detach().float()}


@pytest.mark.parametrize("nproc", [0, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv1d_steps_exactly_like_linear(nproc: int, dtype: torch.dtype) -> None:
    conv = run(train, nproc, True, dtype)[0]
    linear = run(train, nproc, False, dtype)[0]
    assert torch.equal(conv["weight"], linear["weight"])
    assert torch.equal(conv["bias"], linear["bias"])


def test_conv1d_checkpoint_keeps_the_storage_orientation(tmp_path) -> None:
    conv = run(train, 2, True, torch.bfloat16, str(tmp_path / "conv"))[0]
    linear = run(train, 2, False, torch.bfloat16, str(tmp_path / "linear"))[0]
    plain = run(train, 2, True, torch.bfloat16)[0]
    assert torch.equal(conv["weight"], plain["weight"])  # the round trip changes nothing
    assert torch.equal(conv["weight"], linear["weight"])
