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


SCHEDULE_FLAGS = {
    "steps": "--steps",
    "warmup": "--warmup",
    "schedule": "--schedule",
    "min_ratio": "--min-lr-ratio",
}
"""The `wholeshard train` flag of each `lr_factor` setting."""


def adopt_schedule(
    scheduler: torch.optim.lr_scheduler.LambdaLR, saved: dict | None, now: dict, step: int
) -> str | None:
    """After loading `scheduler` saved after `step` with settings `saved` (`lr_factor`'s keyword
    arguments; None: not recorded) into a run whose settings are `now`: if they differ, set the
    optimizer's learning rates to `now`'s for the next step (the run follows its own schedule
    from there) and return a warning naming both; else None."""
    changed = [k for k in SCHEDULE_FLAGS if saved is not None and saved.get(k) != now[k]]
    if not changed:
        return None

    def flags(settings: dict) -> str:
        return " ".join(f"{SCHEDULE_FLAGS[k]} {settings[k]}" for k in changed)

    factor = lr_factor(step, **now)
    for group, base in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, strict=True):
        group["lr"] = base * factor
    peak = scheduler.base_lrs[0]
    return (
        f"warning: the checkpoint was saved by a run with {flags(saved)}, this run has "
        f"{flags(now)}: the learning-rate schedule is recomputed for {flags(now)}, so step "
        f"{step + 1} runs at lr {peak * factor:.4g} where the saved schedule has "
        f"{peak * lr_factor(step, **saved):.4g}. To keep the saved schedule, resume with "
        f"{flags(saved)}"
    )
