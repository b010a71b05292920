"""Frozen params under `param_dtype`: a frozen base with trainable LoRA-style adapters."""

from __future__ import annotations

import torch
from support import assert_overlap_equals_sync, make_model, mp
from torch import nn

import wholeshard


class Adapted(nn.Module):
    """A frozen `nn.Linear` plus a trainable low-rank update `b(a(x))`."""

    def __init__(self, base: nn.Linear, rank: int = 4) -> None:
        super().__init__()
        self.base = base
        self.a = nn.Linear(base.in_features, rank, bias=False)
        self.b = nn.Linear(rank, base.out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.b(self.a(x))


def make_adapted() -> nn.Module:
    model = make_model()
    model.requires_grad_(False)
    torch.manual_seed(1)
    for block in model.blocks:
        block.qkv, block.fc = Adapted(block.qkv), Adapted(block.fc)
    model.ln.requires_grad_(True)
    model.register_buffer("position_scale", torch.ones(8))  # buffers keep their dtype
    return model


def test_frozen_params_are_cast_kept_out_and_never_stepped() -> None:
    model = make_adapted()
    frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    before = {n: p.detach().to(torch.bfloat16).clone() for n, p in frozen.items()}
    ddp = wholeshard.DataParallel(model, mp_policy=mp(torch.bfloat16))
    routed = {r.name for r in ddp.routes}
    assert routed.isdisjoint(frozen)
    assert {n for n, p in model.named_parameters()} == routed | set(frozen)
    for name, p in model.named_parameters():
        assert p.dtype == torch.bfloat16, name
        if name in frozen:
            assert p is frozen[name]  # the same Parameter objects, cast in place
    x = torch.randint(0, 64, (2, 8))
    ddp(x).float().sum().backward()  # runs in bf16 throughout: no dtype mismatch
    wholeshard.LayerwiseOptimizer(ddp).step()
    for name, p in frozen.items():
        assert torch.equal(p, before[name]), name
    assert model.position_scale.dtype == torch.float32


def test_adapters_train_in_bf16_and_overlap_equals_sync() -> None:
    sync = assert_overlap_equals_sync(
        2, 4, dict(bucket_size=2000), make=make_adapted, param_dtype=torch.bfloat16
    )
    losses = sync[0]["losses"]
    assert losses[-1] < losses[0], losses
