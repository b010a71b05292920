"""The AdamW baseline of the train job (`--optimizer adamw`): torch DDP + `torch.optim.AdamW`,
with the same non-finite policy as `LayerwiseOptimizer` on its averaged gradients."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..optim import first_nonfinite
from .env import DistEnv

ADAMW_BETAS = (0.9, 0.95)


def build_ddp_adamw(
    model: nn.Module, env: DistEnv, lr: float, weight_decay: float, bucket_size: int | None
) -> tuple[nn.Module, torch.optim.AdamW, Callable[[float], torch.Tensor]]:
    """(the module to call, the optimizer, the gradient clipper) of `model` under torch DDP."""
    wrapped: nn.Module = model
    if env.world > 1:
        kwargs = {}
        if bucket_size is not None:
            kwargs["bucket_cap_mb"] = bucket_size * 4 / 2**20  # fp32 grads
        ids = [env.device] if env.device.type == "cuda" else None
        wrapped = nn.parallel.DistributedDataParallel(model, device_ids=ids, **kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=ADAMW_BETAS, weight_decay=weight_decay)

    def clip(max_norm: float) -> torch.Tensor:
        return nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    return wrapped, opt, clip


def step_or_skip(model: nn.Module, opt: torch.optim.Optimizer, on_nonfinite: str) -> bool:
    """`opt.step()` unless an averaged gradient has an inf or nan: then skip (True) or raise
    FloatingPointError naming the param, as `on_nonfinite` says. Every rank holds the same
    averaged gradients under DDP, so every rank decides alike."""
    named = [(n, p.grad) for n, p in model.named_parameters() if p.grad is not None]
    bad = first_nonfinite([g for _, g in named])
    if bad is None:
        opt.step()
        return False
    if on_nonfinite == "skip":
        return True
    raise FloatingPointError(
        f"non-finite gradient: {named[bad][0]!r} is the first param whose averaged gradient has "
        f"an inf or nan"
    )
