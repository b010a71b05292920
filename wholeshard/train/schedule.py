"""Learning-rate schedule: linear warm-up, then cosine or warmup-stable-decay (WSD)."""

from __future__ import annotations

import math

import torch

WSD_DECAY_FRACTION = 0.2  # WSD decays linearly over the last 20% of the steps


def lr_factor(
    step: int, steps: int, warmup: int, schedule: str = "cosine", min_ratio: float = 0.0
) -> float:
    """Multiplier of the peak learning rate for the update made at 0-based `step`."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "cosine":
        progress = min(1.0, (step - warmup) / max(1, steps - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    if schedule == "wsd":
        decay = max(1, round(WSD_DECAY_FRACTION * steps))
        start = max(warmup, steps - decay)
        if step < start:
            return 1.0
        progress = min(1.0, (step + 1 - start) / max(1, steps - start))
        return 1 - (1 - min_ratio) * progress
    raise ValueError(f"unknown schedule {schedule!r}")


def make_scheduler(
    optimizer: torch.optim.Optimizer,
    steps: int,
    warmup: int,
    schedule: str = "cosine",
    min_ratio: float = 0.0,
) -> torch.optim.lr_scheduler.LambdaLR:
    """A torch LambdaLR applying `lr_factor` to every param group's initial lr."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, steps, warmup, schedule, min_ratio)
    )
